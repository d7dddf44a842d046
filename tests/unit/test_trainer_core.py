"""The training core on CPU: steps, publication layout and probe, checkpoints and exact
resume, and every bad-input decision (bad batch, bad checksum, NaN, torn checkpoint)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from testkit.trainer import make_batch, store_batch, tiny_qwen3, vocab_size_of
from treadle.proto.v1 import batch_pb2
from treadle.services.codecs import to_array, to_token_array
from treadle.services.objectstore import MANIFEST_NAME, LocalObjectStore
from treadle.trainer.errors import BatchPayloadError, TopologyError
from treadle.trainer.models.hf import load_safetensors
from treadle.trainer.spec import TrainerSection
from treadle.trainer.trainer import Trainer, fixed_probe


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("model") / "qwen3")


def make_trainer(model_dir: Path, root: Path, name: str = "a", **kw: object) -> Trainer:
    section = TrainerSection(model=model_dir, optim={"lr": 1e-3, "warmup_steps": 2}, **kw)  # type: ignore[arg-type]
    return Trainer(section, LocalObjectStore(root / "store"), checkpoint_dir=root / name / "ckpt")


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.policy.hf_state_dict().items()}


def run_steps(trainer: Trainer, steps: range, vocab: int) -> list[dict[str, float]]:
    out = []
    for step in steps:
        ready = store_batch(trainer.store, make_batch(step, vocab_size=vocab))
        out.append(trainer.train_step(ready).metrics)
    return out


def test_core_step_trains_and_publishes_hf_weights_with_a_probe(
    model_dir: Path, tmp_path: Path
) -> None:
    trainer = make_trainer(model_dir, tmp_path)
    before = weights(trainer)
    ready = store_batch(trainer.store, make_batch(1, vocab_size=vocab_size_of(model_dir)))
    result = trainer.train_step(ready)
    assert result.skipped_reason == ""
    assert result.update_skipped_reason == ""
    assert trainer.step == 1
    m = result.metrics
    for key in ("loss", "grad_norm", "entropy", "mismatch_kl", "masked_fraction", "ratio_mean",
                "lr", "tokens", "tokens_per_s", "step_time_s", "policy_lag_mean"):  # fmt: skip
        assert key in m, key
        assert math.isfinite(m[key]), key
    assert m["policy_lag_mean"] == m["policy_lag_max"] == 1.0  # versions step - 1
    assert m["on_policy_tokens"] == m["loss_tokens"] > 0
    assert m["mismatch_kl"] >= 0.0
    assert m["lr"] == pytest.approx(1e-3 / 2)  # warmup step 1 of 2
    # layout: policies/v000001/{config.json, model.safetensors, MANIFEST.json}
    assert result.weights is not None
    assert result.weights.uri.endswith("policies/v000001/" + MANIFEST_NAME)
    manifest = trainer.store.read_manifest(result.weights)
    assert {f.path for f in manifest.files} == {"config.json", "model.safetensors"}
    meta = manifest.metadata
    assert meta["policy_version"] == 1
    assert meta["format"] == "hf-safetensors"
    fetched = trainer.store.fetch_dir(result.weights, tmp_path / "v1")
    assert fetched.prefix == "policies/v000001"
    published = load_safetensors(tmp_path / "v1")
    assert published.keys() == before.keys()
    assert any(not torch.equal(published[k], before[k]) for k in before)  # it trained
    # the probe: logprobs of the NEW weights, as transformers computes them
    from transformers import AutoModelForCausalLM

    ids = meta["probe"]["token_ids"]
    assert len(ids) == 16
    assert len(meta["probe"]["logprobs"]) == 15
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert meta["probe"]["logprobs"] == pytest.approx(ref.tolist(), abs=1e-5)


def test_core_sft_on_one_batch_lowers_the_loss(model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(model_dir, tmp_path, loss={"kind": "sft"})
    vocab = vocab_size_of(model_dir)
    losses = []
    for step in range(1, 6):
        batch = make_batch(1, vocab_size=vocab)
        batch.step = step
        losses.append(trainer.train_step(store_batch(trainer.store, batch)).metrics["loss"])
    assert losses[-1] < losses[0] - 0.5


def test_core_resume_is_bit_identical_to_an_uninterrupted_run(
    model_dir: Path, tmp_path: Path
) -> None:
    vocab = vocab_size_of(model_dir)
    straight = make_trainer(model_dir, tmp_path / "one")
    run_steps(straight, range(1, 5), vocab)

    first = make_trainer(model_dir, tmp_path / "two")
    run_steps(first, range(1, 3), vocab)
    ref = first.save_checkpoint()
    assert ref is not None
    assert ref.uri.endswith("checkpoints/trainer/step000002/" + MANIFEST_NAME)
    meta = first.store.read_manifest(ref).metadata
    assert meta["step"] == 2
    assert meta["format"] == "torch-dcp/1"
    run_steps(first, range(3, 4), vocab)  # progress lost with the "crash"
    del first
    resumed = make_trainer(model_dir, tmp_path / "two", name="b")
    assert resumed.resume() == 2
    assert resumed.step == 2
    assert resumed.last_checkpoint_step == 2
    run_steps(resumed, range(3, 5), vocab)

    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = straight.optimizers.state_dict(), resumed.optimizers.state_dict()
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k


def test_core_checkpoint_without_manifest_falls_back_to_the_previous_one(
    model_dir: Path, tmp_path: Path
) -> None:
    trainer = make_trainer(model_dir, tmp_path)
    run_steps(trainer, range(1, 2), vocab_size_of(model_dir))
    trainer.save_checkpoint()
    run_steps(trainer, range(2, 3), vocab_size_of(model_dir))
    trainer.save_checkpoint()
    trainer.store.delete(f"checkpoints/trainer/step000002/{MANIFEST_NAME}")  # torn upload
    resumed = make_trainer(model_dir, tmp_path, name="b")
    assert resumed.resume() == 1


def test_core_no_checkpoint_starts_from_the_model(model_dir: Path, tmp_path: Path) -> None:
    assert make_trainer(model_dir, tmp_path).resume() == 0


def test_core_bad_batch_skips_the_step_and_publishes_unchanged_weights(
    model_dir: Path, tmp_path: Path
) -> None:
    trainer = make_trainer(model_dir, tmp_path)
    before = weights(trainer)
    batch = make_batch(1, vocab_size=vocab_size_of(model_dir))
    mb = batch.micro_batches[0]
    mb.loss_mask.CopyFrom(to_token_array(np.ones(mb.num_tokens - 3, dtype=np.uint8)))
    result = trainer.train_step(store_batch(trainer.store, batch))
    assert "disagree in length" in result.skipped_reason
    assert result.metrics["step_skipped"] == 1.0
    assert trainer.step == 1
    assert result.weights is not None
    trainer.store.fetch_dir(result.weights, tmp_path / "v1")
    published = load_safetensors(tmp_path / "v1")
    for k in before:
        assert torch.equal(published[k], before[k]), k
    meta = trainer.store.read_manifest(result.weights).metadata
    assert meta["probe"]["token_ids"] == fixed_probe(vocab_size_of(model_dir), 16)


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        ("ids", "outside the vocabulary"),
        ("positions", "do not restart at 0"),
        ("mask_at_start", "first token"),
        ("payload", "are not a valid treadle.proto.v1.Batch"),
    ],
)
def test_core_bad_batch_reasons(model_dir: Path, tmp_path: Path, corrupt: str, reason: str) -> None:
    trainer = make_trainer(model_dir, tmp_path)
    vocab = vocab_size_of(model_dir)
    batch = make_batch(1, vocab_size=vocab)
    mb = batch.micro_batches[0]
    ids = np.frombuffer(mb.input_ids.data, np.int32).copy()
    if corrupt == "ids":
        ids[3] = vocab + 5
        mb.input_ids.CopyFrom(to_token_array(ids))
    elif corrupt == "positions":
        pos = np.frombuffer(mb.position_ids.data, np.int32).copy()
        pos[2] = 7
        mb.position_ids.CopyFrom(to_token_array(pos))
    elif corrupt == "mask_at_start":
        mask = np.frombuffer(mb.loss_mask.data, np.uint8).copy()
        mask[0] = 1
        mb.loss_mask.CopyFrom(to_token_array(mask))
    ready = store_batch(trainer.store, batch)
    if corrupt == "payload":
        junk = b"\xff\xff\xff not a protobuf"
        ready.data.CopyFrom(trainer.store.put_bytes("batches/junk", junk))
    result = trainer.train_step(ready)
    assert reason in result.skipped_reason


def test_core_wrong_checksum_is_a_payload_error(model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(model_dir, tmp_path)
    ready = store_batch(trainer.store, make_batch(1, vocab_size=vocab_size_of(model_dir)))
    ready.data.sha256 = "0" * 64
    with pytest.raises(BatchPayloadError, match="sha256"):
        trainer.train_step(ready)
    assert trainer.step == 0


def test_core_batch_for_another_rank_count_is_refused(model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(model_dir, tmp_path)
    batch = make_batch(1, vocab_size=vocab_size_of(model_dir), num_ranks=2)
    with pytest.raises(TopologyError, match="packed for 2 ranks"):
        trainer.train_step(store_batch(trainer.store, batch, num_ranks=2))


def test_core_nan_loss_skips_the_update_and_never_reaches_a_checkpoint(
    model_dir: Path, tmp_path: Path
) -> None:
    trainer = make_trainer(model_dir, tmp_path)
    before = weights(trainer)
    batch = make_batch(1, vocab_size=vocab_size_of(model_dir))
    mb = batch.micro_batches[0]
    adv = np.frombuffer(mb.advantages.data, np.float32).copy()
    mask = np.frombuffer(mb.loss_mask.data, np.uint8)
    adv[int(np.flatnonzero(mask)[0])] = np.nan
    mb.advantages.CopyFrom(to_token_array(adv))
    result = trainer.train_step(store_batch(trainer.store, batch))
    assert "loss is nan" in result.update_skipped_reason
    assert result.metrics["update_skipped"] == 1.0
    after = weights(trainer)
    for k in before:
        assert torch.equal(after[k], before[k]), k
    trainer.save_checkpoint()
    resumed = make_trainer(model_dir, tmp_path, name="b")
    assert resumed.resume() == 1
    for k, v in weights(resumed).items():
        assert torch.isfinite(v).all(), k
    # and the next step trains normally
    ok = resumed.train_step(
        store_batch(resumed.store, make_batch(2, vocab_size=vocab_size_of(model_dir)))
    )
    assert ok.update_skipped_reason == ""


def test_core_mismatch_kl_counts_only_on_policy_tokens(model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(model_dir, tmp_path)
    vocab = vocab_size_of(model_dir)
    run_steps(trainer, range(1, 3), vocab)
    stale = make_batch(3, vocab_size=vocab, policy_version=0)  # trained weights are v2
    m = trainer.train_step(store_batch(trainer.store, stale)).metrics
    assert "mismatch_kl" not in m
    assert m["on_policy_tokens"] == 0
    assert m["policy_lag_mean"] == m["policy_lag_min"] == m["policy_lag_max"] == 3.0


def test_core_mismatch_kl_is_the_k3_estimate(model_dir: Path, tmp_path: Path) -> None:
    """Behaviour logprobs = the trainer's own logprobs: the KL estimate is 0 (up to float)."""
    trainer = make_trainer(model_dir, tmp_path)
    batch = make_batch(1, vocab_size=vocab_size_of(model_dir))
    for mb in batch.micro_batches:
        ids = torch.from_numpy(np.frombuffer(mb.input_ids.data, np.int32).astype("int64"))[None]
        pos = torch.from_numpy(np.frombuffer(mb.position_ids.data, np.int32).astype("int64"))[None]
        mask = np.frombuffer(mb.loss_mask.data, np.uint8)
        with torch.no_grad():
            lp, _ = trainer.policy.token_logprobs(ids, pos, with_entropy=False)
        own = np.where(mask == 1, lp[0].numpy(), 0.0).astype(np.float32)
        mb.behaviour_logprobs.CopyFrom(to_token_array(own))
    m = trainer.train_step(store_batch(trainer.store, batch)).metrics
    assert m["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["masked_fraction"] == 0.0


def test_core_scores_tokens_at_the_batchs_sampling_temperature(
    model_dir: Path, tmp_path: Path
) -> None:
    """Inference returns logprobs of the tempered distribution it sampled from: with the
    batch's temperature the trainer reproduces them (KL 0); scored untempered, they differ."""
    kl = {}
    for told in (0.5, 0.0):  # 0.0: BatchReady without a temperature (untempered)
        trainer = make_trainer(model_dir, tmp_path, name=f"t{told}")
        batch = make_batch(1, vocab_size=vocab_size_of(model_dir))
        for mb in batch.micro_batches:
            ids = torch.from_numpy(np.frombuffer(mb.input_ids.data, np.int32).astype("int64"))
            pos = torch.from_numpy(np.frombuffer(mb.position_ids.data, np.int32).astype("int64"))
            mask = np.frombuffer(mb.loss_mask.data, np.uint8)
            with torch.no_grad():
                lp, _ = trainer.policy.token_logprobs(
                    ids[None], pos[None], with_entropy=False, temperature=0.5
                )
            tempered = np.where(mask == 1, lp[0].numpy(), 0.0).astype(np.float32)
            mb.behaviour_logprobs.CopyFrom(to_token_array(tempered))
        ready = store_batch(trainer.store, batch)
        ready.temperature = told
        kl[told] = trainer.train_step(ready).metrics["mismatch_kl"]
    assert kl[0.5] == pytest.approx(0.0, abs=1e-6)
    assert kl[0.0] > 1e-3, kl


def test_core_micro_batch_fields_use_the_proto_contract() -> None:
    batch = make_batch(1, vocab_size=500, num_ranks=2)
    assert {mb.rank for mb in batch.micro_batches} == {0, 1}
    assert isinstance(batch, batch_pb2.Batch)


def grads_at_update(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Filled, at the trainer's next optimizer update, with the gradients it applies."""
    grads: dict[str, torch.Tensor] = {}
    real_step = trainer.optimizers.step

    def step(*a: object, **kw: object) -> None:
        for k, p in trainer.policy.model.named_parameters():
            if p.grad is not None:
                grads[k] = p.grad.detach().clone()
        real_step(*a, **kw)

    trainer.optimizers.step = step  # type: ignore[method-assign]
    return grads


@pytest.mark.parametrize("sequence_mask", ["off", "geometric"])
def test_core_padding_after_the_last_document_is_not_computed_and_changes_nothing(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sequence_mask: str
) -> None:
    """sdpa takes any length, so each micro-batch is cut after its last document: the
    model sees fewer positions, and loss, metrics, gradients and weights are those of the
    whole padded micro-batch (computed here with the cut turned off)."""
    from treadle.trainer.batch import PackedMicroBatch, decode_micro_batch
    from treadle.trainer.policy import Policy

    vocab = vocab_size_of(model_dir)
    # 91 tokens in micro-batches of 48, each with padding after its last document
    batch = make_batch(1, vocab_size=vocab, lengths=(23, 17, 30, 9, 12), seq_len=48)
    used = [decode_micro_batch(mb, vocab).num_tokens_used for mb in batch.micro_batches]
    assert len(used) >= 2
    assert sum(used) == 91
    assert all(n < 48 for n in used)
    seen: list[int] = []
    real = Policy.scores

    def spy(self: Policy, ids_BL: torch.Tensor, *a: object, **kw: object) -> object:
        seen.append(int(ids_BL.shape[1]))
        return real(self, ids_BL, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Policy, "scores", spy)
    loss = {"sequence_mask": sequence_mask}  # its document ids come from the cut arrays
    results, grads = [], []
    for name, cut in (("cut", True), ("whole", False)):
        if not cut:
            monkeypatch.setattr(PackedMicroBatch, "trimmed", lambda self: self)
        trainer = make_trainer(model_dir, tmp_path / name, loss=loss)
        grads.append(grads_at_update(trainer))
        seen.clear()
        results.append((trainer.train_step(store_batch(trainer.store, batch)).metrics,
                        weights(trainer), list(seen)))  # fmt: skip
    (m_cut, w_cut, seen_cut), (m_whole, w_whole, seen_whole) = results
    # the micro-batches' forwards (the publication's probe follows them)
    assert seen_whole[: len(used)] == [48] * len(used)
    assert seen_cut[: len(used)] == used  # each micro-batch's documents, no padding
    for key in ("loss", "grad_norm", "entropy", "ratio_mean", "mismatch_kl", "tokens",
                "loss_tokens", "masked_fraction"):  # fmt: skip
        assert m_cut[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-7), key
    assert grads[0]
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-7)
    for k in w_cut:
        torch.testing.assert_close(w_cut[k], w_whole[k], rtol=1e-5, atol=1e-6)


def test_core_bfloat16_autocast_runs_the_matmuls_in_bfloat16_and_keeps_the_rest_float32(
    model_dir: Path, tmp_path: Path
) -> None:
    vocab = vocab_size_of(model_dir)
    batch = make_batch(1, vocab_size=vocab)
    plain = make_trainer(model_dir, tmp_path / "plain")
    mixed = make_trainer(model_dir, tmp_path / "mixed", autocast="bfloat16")
    seen: list[torch.dtype] = []
    linear = next(m for m in mixed.policy.model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    grads = grads_at_update(mixed)
    m32 = plain.train_step(store_batch(plain.store, batch)).metrics
    result = mixed.train_step(store_batch(mixed.store, batch))
    m16 = result.metrics
    # the step's forwards in bfloat16; the publication's probe after them in float32
    assert seen[0] == torch.bfloat16
    assert seen[-1] == torch.float32
    assert grads
    assert {g.dtype for g in grads.values()} == {torch.float32}
    assert {p.dtype for p in mixed.policy.model.parameters()} == {torch.float32}
    state = mixed.optimizers.state_dict()  # flat: "state.<param>.exp_avg", ...
    moments = {k: v for k, v in state.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments
    assert {v.dtype for v in moments.values()} == {torch.float32}
    # the same step at bfloat16's precision: close, not equal
    assert m16["entropy"] == pytest.approx(m32["entropy"], rel=1e-2)
    assert m16["loss"] == pytest.approx(m32["loss"], abs=2e-2)
    assert m16["loss"] != m32["loss"]
    # the probe inference checks is the float32 model's, as transformers computes it
    from transformers import AutoModelForCausalLM

    assert result.weights is not None
    meta = mixed.store.read_manifest(result.weights).metadata
    mixed.store.fetch_dir(result.weights, tmp_path / "v1")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32).eval()
    ids = meta["probe"]["token_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert meta["probe"]["logprobs"] == pytest.approx(ref.tolist(), abs=1e-5)


# --- several optimizer updates a step (optim.updates_per_step) -------------------------------
def constant_lr_trainer(model_dir: Path, root: Path, name: str, updates: int) -> Trainer:
    section = TrainerSection(
        model=model_dir, seed=0,
        optim={"lr": 1e-2, "warmup_steps": 0, "updates_per_step": updates},  # type: ignore[arg-type]
    )  # fmt: skip
    return Trainer(
        section, LocalObjectStore(root / name / "store"), checkpoint_dir=root / name / "ck"
    )


def test_core_mini_batches_split_each_ranks_micro_batches_in_order() -> None:
    from types import SimpleNamespace

    from treadle.trainer.trainer import mini_batches

    def mbs(per_rank: int, ranks: int) -> list:  # type: ignore[type-arg]
        return [SimpleNamespace(rank=r, index=i) for r in range(ranks) for i in range(per_rank)]

    def shape(parts: list) -> list:  # type: ignore[type-arg]
        return [[(m.rank, m.index) for m in p] for p in parts]

    assert shape(mini_batches(mbs(5, 1), 2)) == [[(0, 0), (0, 1), (0, 2)], [(0, 3), (0, 4)]]
    assert shape(mini_batches(mbs(3, 2), 2)) == [
        [(0, 0), (0, 1), (1, 0), (1, 1)], [(0, 2), (1, 2)],
    ]  # fmt: skip
    assert shape(mini_batches(mbs(2, 1), 8)) == [[(0, 0)], [(0, 1)]]  # at most one a micro-batch
    assert shape(mini_batches(mbs(3, 1), 1)) == [[(0, 0), (0, 1), (0, 2)]]


def split_batch(batch: batch_pb2.Batch, parts: list[list[int]]) -> list[batch_pb2.Batch]:
    """``batch``'s micro-batches as one batch per part (steps 1, 2, ...)."""
    out = []
    for step, indices in enumerate(parts, start=1):
        b = batch_pb2.Batch(step=step)
        for n, i in enumerate(indices):
            mb = b.micro_batches.add()
            mb.CopyFrom(batch.micro_batches[i])
            mb.index = n
        out.append(b)
    return out


def test_core_updates_per_step_is_one_update_per_mini_batch(
    model_dir: Path, tmp_path: Path
) -> None:
    """One step of 2 updates over a batch of 3 micro-batches equals two steps of one update,
    on micro-batches [0, 1] then [2] (constant lr, loss kind pg: the second update's ratio is
    to the behaviour logprobs); one version is published; mismatch KL over the first only."""
    vocab = vocab_size_of(model_dir)
    batch = make_batch(1, vocab_size=vocab, seq_len=32)
    assert len(batch.micro_batches) == 3
    two = constant_lr_trainer(model_dir, tmp_path, "two", updates=2)
    before = weights(two)
    m = two.train_step(store_batch(two.store, batch)).metrics
    assert m["optimizer_updates"] == 2
    assert m["update_skipped"] == 0
    assert two.step == 1
    assert m["on_policy_tokens"] == loss_tokens(batch, (0, 1)) < m["loss_tokens"]

    one = constant_lr_trainer(model_dir, tmp_path, "one", updates=1)
    losses = []
    for part in split_batch(batch, [[0, 1], [2]]):
        r = one.train_step(store_batch(one.store, part)).metrics
        assert "optimizer_updates" not in r
        losses.append(r["loss"] * r["loss_tokens"])
    assert m["loss"] * m["loss_tokens"] == pytest.approx(sum(losses), rel=1e-5)
    after, expected = weights(two), weights(one)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for k in expected:
        torch.testing.assert_close(after[k], expected[k], rtol=1e-5, atol=1e-6, msg=k)

    # one update of a single-update step differs: the mini-batches are real updates
    single = constant_lr_trainer(model_dir, tmp_path, "single", updates=1)
    single.train_step(store_batch(single.store, batch))
    assert any(not torch.allclose(weights(single)[k], after[k], atol=1e-6) for k in after)


def loss_tokens(batch: batch_pb2.Batch, indices: tuple[int, ...]) -> int:
    return sum(int(np.frombuffer(batch.micro_batches[i].loss_mask.data, np.uint8).sum())
               for i in indices)  # fmt: skip


@pytest.mark.parametrize(
    ("nan_in", "reason", "updated", "unmoved"),
    [(2, "update 2/2: loss is nan", [0, 1], (0, 1)),
     (0, "update 1/2: loss is nan", [2], (0, 1, 2))],
)  # fmt: skip
def test_core_a_non_finite_mini_batch_skips_only_its_own_update(
    model_dir: Path, tmp_path: Path, nan_in: int, reason: str, updated: list[int],
    unmoved: tuple[int, ...],
) -> None:  # fmt: skip
    """NaN in one mini-batch: its update is skipped, the other's is made; mismatch KL
    counts every token scored before the first update that was made."""
    vocab = vocab_size_of(model_dir)
    batch = make_batch(1, vocab_size=vocab, seq_len=32)
    mb = batch.micro_batches[nan_in]
    adv = np.frombuffer(mb.advantages.data, np.float32).copy()
    adv[int(np.flatnonzero(np.frombuffer(mb.loss_mask.data, np.uint8))[0])] = np.nan
    mb.advantages.CopyFrom(to_token_array(adv))
    two = constant_lr_trainer(model_dir, tmp_path, "two", updates=2)
    result = two.train_step(store_batch(two.store, batch))
    assert result.update_skipped_reason == reason
    assert result.metrics["update_skipped"] == 1.0
    assert result.metrics["optimizer_updates"] == 2
    assert result.metrics["on_policy_tokens"] == loss_tokens(batch, unmoved)
    one = constant_lr_trainer(model_dir, tmp_path, "one", updates=1)
    one.train_step(store_batch(one.store, split_batch(batch, [updated])[0]))
    for k, v in weights(one).items():  # only the finite mini-batch's update was made
        torch.testing.assert_close(weights(two)[k], v, rtol=1e-5, atol=1e-6, msg=k)


def with_teacher_rows(batch: batch_pb2.Batch, vocab: int, k: int = 3) -> batch_pb2.Batch:
    """``batch`` with top-k teacher rows on every loss token (weight 0.5)."""
    rng = np.random.default_rng(7)
    for mb in batch.micro_batches:
        mask = to_array(mb.loss_mask)
        n = mb.num_tokens
        logits = rng.normal(size=(n, k))
        lps = (logits - np.log(np.exp(logits).sum(1, keepdims=True)) - 0.5) * mask[:, None]
        mb.teacher_top_k = k
        mb.teacher_topk_ids.CopyFrom(to_token_array(rng.integers(0, vocab, (n, k), dtype=np.int32)))
        mb.teacher_topk_logprobs.CopyFrom(to_token_array(lps.astype(np.float32)))
        mb.teacher_weight.CopyFrom(to_token_array((0.5 * mask).astype(np.float32)))
    return batch


# 6 prompts x 4 samples (equal prompt halves within a group, different completions);
# first-fit-decreasing packing spreads each prompt's samples over the micro-batches
GROUPED = (20, 21, 20, 21, 30, 31, 30, 31, 16, 17, 16, 17, 26, 27, 26, 27, 22, 23, 22, 23,
           18, 19, 18, 19)  # fmt: skip
# each group computes its prompt (the tokens before the one preceding the first sampled
# token: half its length - 1) once instead of 4 times
GROUPED_SAVED = 3 * (9 + 14 + 7 + 12 + 10 + 8)


@pytest.mark.parametrize(
    ("loss", "teacher"),
    [
        ({}, False),
        ({"sequence_mask": "geometric"}, False),
        ({}, True),
        ({"kl_coef": 0.1}, False),  # the reference's forward on the compact row too
    ],
    ids=["plain", "sequence-mask", "teacher-top-k", "kl-to-reference"],
)
def test_core_a_shared_prompt_is_computed_once_and_changes_nothing(
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    loss: dict[str, object],
    teacher: bool,
) -> None:
    """A step's samples of one prompt: the prompt is computed once per group
    (``trainer.share_prompts``), and loss, metrics, gradients and weights are those of
    computing every copy."""
    from treadle.trainer.batch import decode_micro_batch
    from treadle.trainer.policy import Policy

    vocab = vocab_size_of(model_dir)
    batch = make_batch(1, vocab_size=vocab, lengths=GROUPED, seq_len=96, group_size=4)
    if teacher:
        batch = with_teacher_rows(batch, vocab)
    mbs = [decode_micro_batch(mb, vocab) for mb in batch.micro_batches]
    firsts = [{int(mb.input_ids_L[s]) for s in mb.cu_seqlens_D1[:-1]} for mb in mbs]
    spans = [sum(first in f for f in firsts) for first in set().union(*firsts)]
    assert len(spans) == 6
    assert sum(n >= 2 for n in spans) >= 4
    seen: list[tuple[Policy, int]] = []
    real = Policy.scores

    def spy(self: Policy, ids_BL: torch.Tensor, *a: object, **kw: object) -> object:
        seen.append((self, int(ids_BL.shape[1])))
        return real(self, ids_BL, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Policy, "scores", spy)
    results, grads = [], []
    for name, share in (("shared", True), ("every-copy", False)):
        trainer = make_trainer(
            model_dir, tmp_path / name, loss=loss, share_prompts=share,
        )  # fmt: skip
        grads.append(grads_at_update(trainer))
        seen.clear()
        metrics = trainer.train_step(store_batch(trainer.store, batch)).metrics
        # the micro-batches' forwards (the publication's probe follows them), the
        # reference's with the KL penalty
        own = [n for who, n in seen if who is trainer.policy][: len(mbs)]
        ref = [n for who, n in seen if who is trainer.reference]
        results.append((metrics, weights(trainer), own, ref))
    (m_shared, w_shared, seen_shared, ref_shared), (m_all, w_all, seen_all, ref_all) = results
    assert len(seen_shared) == len(seen_all) == len(mbs)  # as many micro-batches
    assert sum(seen_all) == sum(GROUPED)
    assert sum(seen_shared) == sum(GROUPED) - GROUPED_SAVED
    if loss.get("kl_coef"):
        assert sum(ref_all) == sum(GROUPED)
        assert sum(ref_shared) == sum(GROUPED) - GROUPED_SAVED
    keys = ["loss", "grad_norm", "entropy", "ratio_mean", "mismatch_kl", "tokens",
            "loss_tokens", "masked_fraction"]  # fmt: skip
    if teacher:
        keys.append("teacher_topk_kl")
    if loss.get("kl_coef"):  # the reference is the starting policy: 0 where it is right
        keys.append("kl_ref")
        assert m_shared["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    for key in keys:
        assert m_shared[key] == pytest.approx(m_all[key], rel=1e-5, abs=1e-7), key
    assert grads[0].keys() == grads[1].keys()
    assert grads[0]
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-7)
    # AdamW's first update is about lr * g / |g| (lr 5e-4 here): where g is near AdamW's
    # epsilon, summation order moves it more than the gradients (checked above) differ
    for k in w_shared:
        torch.testing.assert_close(w_shared[k], w_all[k], rtol=1e-5, atol=2e-5)
