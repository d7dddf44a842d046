"""Several runs' LoRA adapters trained on one shared base (trainer/tenancy.py): each run's
result is bit-identical to the same run trained alone, whatever the other runs do;
checkpoints resume per run; the model goes to the run that has used least trainer time;
a run that does not fit the base is refused naming the setting."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from testkit.trainer import make_batch, store_batch, tiny_qwen3
from treadle.services.errors import ConfigError, QuotaExceededError
from treadle.services.objectstore import LocalObjectStore
from treadle.trainer.lora import peft_state_dict
from treadle.trainer.spec import TrainerSection
from treadle.trainer.tenancy import FairShare, Quota, RunTrainer, SharedBase
from treadle.trainer.trainer import Trainer

LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("model") / "qwen3")


def section(model: Path, **kw: Any) -> TrainerSection:
    kw.setdefault("optim", {"lr": 1e-2})
    kw.setdefault("lora", LORA)
    return TrainerSection(model=model, **kw)


# two runs that differ in everything a run may choose: seed, optimizer, loss
RUNS: dict[str, dict[str, Any]] = {
    "alpha": {"seed": 1, "optim": {"lr": 1e-2}},
    "beta": {"seed": 2, "optim": {"lr": 3e-3, "weight_decay": 0.1}, "loss": {"kind": "ppo"}},
}


def step(trainer: Trainer, n: int, seed: int) -> dict[str, float]:
    vocab = trainer.policy.hf.vocab_size
    ready = store_batch(trainer.store, make_batch(n, vocab_size=vocab, seed=seed))
    return trainer.train_step(ready).metrics


def adapter_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The run's adapter as published (PEFT names), read in its own turn."""
    plan = trainer.policy.lora
    assert plan is not None
    if isinstance(trainer, RunTrainer):
        with trainer.base.holding(trainer.run):
            return {k: v.clone() for k, v in peft_state_dict(plan, trainer.policy.model).items()}
    return {k: v.clone() for k, v in peft_state_dict(plan, trainer.policy.model).items()}


def optimizer_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    if isinstance(trainer, RunTrainer):
        with trainer.base.holding(trainer.run):
            state = trainer.optimizers.state_dict()
    else:
        state = trainer.optimizers.state_dict()
    return {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_tenancy_interleaved_runs_equal_each_run_trained_alone(
    model_dir: Path, tmp_path: Path
) -> None:
    base = SharedBase(section(model_dir))
    shared = {
        run: base.add_run(
            run,
            section(model_dir, **kw),
            LocalObjectStore(tmp_path / run / "store"),
            checkpoint_dir=tmp_path / run / "ckpt",
        )
        for run, kw in RUNS.items()
    }
    # interleaved: alpha 1, beta 1, alpha 2, alpha 3, beta 2 (each run its own batches)
    metrics: dict[str, list[dict[str, float]]] = {r: [] for r in RUNS}
    for run, n in [("alpha", 1), ("beta", 1), ("alpha", 2), ("alpha", 3), ("beta", 2)]:
        metrics[run].append(step(shared[run], n, seed=RUNS[run]["seed"]))
    for run, kw in RUNS.items():
        alone = Trainer(
            section(model_dir, **kw),
            LocalObjectStore(tmp_path / "alone" / run / "store"),
            checkpoint_dir=tmp_path / "alone" / run / "ckpt",
        )
        mine = [step(alone, n, seed=kw["seed"]) for n in range(1, len(metrics[run]) + 1)]
        assert [m["loss"] for m in mine] == [m["loss"] for m in metrics[run]]
        assert [m["grad_norm"] for m in mine] == [m["grad_norm"] for m in metrics[run]]
        assert_same(adapter_of(alone), adapter_of(shared[run]))
        assert_same(optimizer_state(alone), optimizer_state(shared[run]))
        # what each published is its own adapter, with its own probe
        theirs = shared[run].store.read_manifest(f"policies/v{len(mine):06d}").metadata
        ours = alone.store.read_manifest(f"policies/v{len(mine):06d}").metadata
        assert theirs["probe"] == ours["probe"]
    assert shared["alpha"].step == 3
    assert shared["beta"].step == 2
    # the two adapters really differ, and there is one base model for both
    assert any(
        not torch.equal(v, adapter_of(shared["beta"])[k])
        for k, v in adapter_of(shared["alpha"]).items()
    )
    assert shared["alpha"].policy is shared["beta"].policy


def test_tenancy_dropout_of_a_run_does_not_depend_on_the_other_runs(
    model_dir: Path, tmp_path: Path
) -> None:
    lora = LORA | {"dropout": 0.3}
    results = []
    for other_seed in (5, 9):  # the other run trains different batches with another seed
        root = tmp_path / f"other{other_seed}"
        base = SharedBase(section(model_dir, lora=lora))
        a = base.add_run(
            "a", section(model_dir, lora=lora, seed=1), LocalObjectStore(root / "a"),
            checkpoint_dir=root / "a-ckpt",
        )  # fmt: skip
        b = base.add_run(
            "b", section(model_dir, lora=lora, seed=other_seed), LocalObjectStore(root / "b"),
            checkpoint_dir=root / "b-ckpt",
        )  # fmt: skip
        for n in (1, 2):
            step(b, n, seed=other_seed)
            torch.rand(3)  # draws outside any run's turn do not reach a run either
            step(a, n, seed=1)
        results.append(adapter_of(a))
    assert_same(results[0], results[1])


def test_tenancy_run_resumes_from_its_own_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    def make(base: SharedBase, run: str) -> RunTrainer:
        kw = RUNS[run]
        return base.add_run(
            run, section(model_dir, **kw), LocalObjectStore(tmp_path / run / "store"),
            checkpoint_dir=tmp_path / run / "ckpt",
        )  # fmt: skip

    first = SharedBase(section(model_dir))
    a, b = make(first, "alpha"), make(first, "beta")
    for n in (1, 2):
        step(a, n, seed=1)
        step(b, n, seed=2)
    a.save_checkpoint()
    step(b, 3, seed=2)
    b.save_checkpoint()
    expected = step(a, 3, seed=1)  # not checkpointed: redone after the restart
    after = adapter_of(a)

    second = SharedBase(section(model_dir))  # a restarted trainer, runs added again
    b2, a2 = make(second, "beta"), make(second, "alpha")
    assert a2.resume() == 2
    assert b2.resume() == 3
    assert step(a2, 3, seed=1)["loss"] == expected["loss"]
    assert_same(adapter_of(a2), after)
    assert_same(adapter_of(b2), adapter_of(b))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"lora": LORA | {"rank": 8}}, "trainer.lora.rank"),
        ({"lora": LORA | {"target_modules": ["q_proj"]}}, "trainer.lora.target_modules"),
        ({"lora": {"enabled": False}}, "trainer.lora.enabled"),
        ({"dtype": "bfloat16"}, "trainer.dtype"),
        ({"loss": {"kl_coef": 0.1}}, "trainer.loss.kl_coef"),
    ],
)
def test_tenancy_refuses_a_run_that_does_not_fit_the_base(
    model_dir: Path, tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    base = SharedBase(section(model_dir))
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        base.add_run(
            "x", section(model_dir, **change), LocalObjectStore(tmp_path / "s"),
            checkpoint_dir=tmp_path / "c",
        )  # fmt: skip
    assert base.runs == {}
    # a refused run leaves nothing behind: the same name can be added once it fits
    base.add_run(
        "x", section(model_dir), LocalObjectStore(tmp_path / "s"), checkpoint_dir=tmp_path / "c"
    )
    with pytest.raises(ConfigError, match="already"):
        base.add_run(
            "x", section(model_dir), LocalObjectStore(tmp_path / "s"),
            checkpoint_dir=tmp_path / "c",
        )  # fmt: skip


def test_tenancy_refuses_another_base_model(model_dir: Path, tmp_path: Path) -> None:
    other = tiny_qwen3(tmp_path / "other", seed=3)
    base = SharedBase(section(model_dir))
    with pytest.raises(ConfigError, match=r"trainer\.model"):
        base.add_run(
            "x", section(other), LocalObjectStore(tmp_path / "s"), checkpoint_dir=tmp_path / "c"
        )
    with pytest.raises(ConfigError, match=r"trainer\.lora\.enabled"):
        SharedBase(section(model_dir, lora={"enabled": False}))


# --- the scheduler -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_for(cond: Any) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def contend(share: FairShare, holder: str, waiters: list[str]) -> list[str]:
    """``holder`` holds a turn while ``waiters`` queue up (in this order); then it lets go.
    Returns the order in which the waiters got their turns."""
    order: list[str] = []
    release = threading.Event()

    def hold() -> None:
        with share.turn(holder):
            release.wait()

    def wait(run: str) -> None:
        with share.turn(run):
            order.append(run)

    threads = [threading.Thread(target=hold)]
    threads[0].start()
    wait_for(lambda: share._holder is not None)
    for run in waiters:
        threads.append(threading.Thread(target=wait, args=(run,)))
        threads[-1].start()
        wait_for(lambda r=run: r in share.waiting())
    release.set()
    for t in threads:
        t.join(10)
    return order


def spend(share: FairShare, clock: Clock, run: str, seconds: float) -> None:
    with share.turn(run):
        clock.now += seconds


def test_fair_share_next_turn_goes_to_the_run_that_used_least_time() -> None:
    clock = Clock()
    share = FairShare(clock)
    for run in ("a", "b", "c"):
        share.register(run)
    spend(share, clock, "a", 5.0)
    spend(share, clock, "b", 1.0)
    spend(share, clock, "c", 3.0)
    # asked in the order a, c, b: served b (1 s), c (3 s), a (5 s)
    assert contend(share, "a", ["a", "c", "b"]) == ["b", "c", "a"]
    assert share.used_s == {"a": 5.0, "b": 1.0, "c": 3.0}
    assert share.turns == {"a": 3, "b": 2, "c": 2}


def test_fair_share_weights_and_late_runs() -> None:
    clock = Clock()
    share = FairShare(clock)
    share.register("big", weight=3.0)
    share.register("small")
    spend(share, clock, "big", 2.0)  # 2/3 weighted
    spend(share, clock, "small", 1.0)  # 1 weighted
    assert contend(share, "small", ["small", "big"]) == ["big", "small"]
    # a run that joins late starts level with the least-served run, not at zero
    share.register("late")
    spend(share, clock, "big", 1.0)  # big: 1.0 weighted, small 1.0, late starts at 2/3
    assert contend(share, "big", ["small", "big", "late"]) == ["late", "small", "big"]
    assert share.used_s["late"] == 0.0  # the starting level is not billed
    with pytest.raises(ValueError, match="already registered"):
        share.register("late")
    with pytest.raises(ValueError, match="not registered"):
        spend(share, clock, "nobody", 1.0)


def test_fair_share_one_holder_at_a_time_and_reentrant() -> None:
    share = FairShare()
    for run in ("a", "b"):
        share.register(run)
    inside = []
    overlap = []

    def work(run: str) -> None:
        for _ in range(50):
            with share.turn(run), share.turn(run):  # nested in its own turn: no deadlock
                inside.append(run)
                if len(inside) > 1:
                    overlap.append(list(inside))
                time.sleep(0.0005)
                inside.remove(run)

    threads = [threading.Thread(target=work, args=(r,)) for r in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert overlap == []
    assert share.turns == {"a": 50, "b": 50}


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = threading.active_count()
    yield
    wait_for(lambda: threading.active_count() <= before)


def test_tenancy_a_run_at_its_quota_stops_and_the_others_go_on(
    model_dir: Path, tmp_path: Path
) -> None:
    base = SharedBase(section(model_dir))

    def add(run: str, quota: Quota | None) -> RunTrainer:
        return base.add_run(run, section(model_dir, seed=1), LocalObjectStore(tmp_path / run),
                            checkpoint_dir=tmp_path / run / "ckpt", quota=quota)  # fmt: skip

    # tokens: the first step fits (nothing used), the second does not (one batch is more)
    by_tokens = add("tokens", Quota(trained_tokens=10))
    # time: 1000 trainer seconds were billed before this process
    by_time = add("time", Quota(trainer_s=1000.0, prior_trainer_s=1000.0))
    free = add("free", None)
    step(by_tokens, 1, seed=1)
    assert by_tokens.trained_tokens > 10
    with pytest.raises(QuotaExceededError, match=r"run 'tokens' has used \d+ trained tokens of "
                       r"its quota of 10 .* \(through step 1; its checkpoint is kept\)"):  # fmt: skip
        step(by_tokens, 2, seed=1)
    with pytest.raises(QuotaExceededError, match="run 'time' has used 1000 trainer seconds"):
        step(by_time, 1, seed=1)
    assert (by_tokens.step, by_time.step) == (1, 0)  # nothing trained past the quota
    for n in (1, 2, 3):
        step(free, n, seed=1)
    assert free.step == 3
