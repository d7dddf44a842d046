"""Algorithms as plug-ins (built-ins through the same API, import paths, checks at config
time and at run time) and online difficulty filtering."""

from __future__ import annotations

import asyncio
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from treadle.orchestrator.algorithms import (
    BUILTIN,
    Algorithm,
    AlgorithmError,
    Algorithms,
    Group,
    algorithm,
    resolve,
)
from treadle.orchestrator.batching import build_batch
from treadle.orchestrator.filtering import OUTSIDE_PASS_RATE, ZERO_VARIANCE, refusal
from treadle.orchestrator.samples import rollout_samples
from treadle.orchestrator.spec import FilterSection, OrchestratorConfig, OrchestratorSection
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array, to_token_array
from treadle.services.config import load_config
from treadle.services.errors import ConfigError

OK = rollout_pb2.RolloutStatus.Kind.KIND_OK


def rollout(rid: str, reward: float, branches: int = 1, sampled: int = 2) -> rollout_pb2.Rollout:
    """A prompt node of 3 tokens and ``branches`` sampled children of ``sampled`` tokens."""
    r = rollout_pb2.Rollout(rollout_id=rid, group_id="g", reward=reward)
    r.status.kind = OK
    for parent, k, is_sampled in [(-1, 3, False)] + [(0, sampled, True)] * branches:
        n = r.nodes.add(node_id=len(r.nodes), parent_id=parent)
        n.token_ids.CopyFrom(to_token_array(np.arange(k, dtype=np.int32) + 5))
        n.sampled_mask.CopyFrom(to_token_array(np.full(k, int(is_sampled), np.uint8)))
        n.logprobs.CopyFrom(to_token_array(np.full(k, -0.5 if is_sampled else 0.0, np.float32)))
        n.policy_versions.CopyFrom(to_token_array(np.full(k, 0 if is_sampled else -1, np.int32)))
    return r


def score(algos: Algorithms, rollouts: list[rollout_pb2.Rollout], env: str = "e") -> Any:
    return asyncio.run(algos.score(env, "g", "{}", rollouts, max_policy_version=0, vocab_size=None))


def run_algorithm(name: str, rewards: list[float], **args: Any) -> list[np.ndarray]:
    algos = Algorithms({"e": resolve(name, args, "orchestrator.algorithm")})
    scored = score(algos, [rollout(f"r{i}", x) for i, x in enumerate(rewards)])
    assert not scored.refused
    return [s.advantages for s in scored.samples]


def previous_chain(rewards: np.ndarray, method: str, normalize: bool = False) -> np.ndarray:
    """The advantage `if` chain the built-ins replace (reference for equality)."""
    r = np.asarray(rewards, dtype=np.float64)
    if method == "sft":
        return np.ones(r.size, dtype=np.float32)
    if method == "grpo":
        adv = r - r.mean()
        if normalize:
            adv = adv / (r.std() + 1e-6)
        return adv.astype(np.float32)
    return (r - (r.sum() - r) / (r.size - 1)).astype(np.float32)


@pytest.mark.parametrize(
    ("name", "args"),
    [("grpo", {}), ("grpo", {"normalize": True}), ("rloo", {}), ("sft", {})],
)
def test_algorithm_builtins_equal_the_previous_chain(name: str, args: dict[str, Any]) -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        rewards = rng.random(int(rng.integers(2, 9))).round(int(rng.integers(1, 4)))
        out = run_algorithm(name, rewards.tolist(), **args)
        expected = previous_chain(rewards, name, normalize=bool(args))
        for adv, want in zip(out, expected, strict=True):
            assert adv.dtype == np.float32
            # the prompt's 3 tokens get 0, the 2 sampled tokens the rollout's advantage
            np.testing.assert_array_equal(adv, np.array([0, 0, 0, want, want], np.float32))


def test_algorithm_builtin_values_by_hand() -> None:
    assert [a[-1] for a in run_algorithm("grpo", [1.0, 0.0, 0.5, 0.5])] == [0.5, -0.5, 0, 0]
    assert [a[-1] for a in run_algorithm("rloo", [1.0, 0.0, 0.5])] == [0.75, -0.75, 0]
    assert [a[-1] for a in run_algorithm("sft", [0.3, 0.9])] == [1, 1]
    normalized = [a[-1] for a in run_algorithm("grpo", [1.0, 0.0], normalize=True)]
    np.testing.assert_allclose(normalized, [1.0, -1.0], atol=1e-4)


def test_algorithm_per_token_batch_equals_the_per_sample_one() -> None:
    """Per-token advantages pack to the same micro-batches as per-sample ones did."""
    rollouts = [rollout("a", 1.0, branches=2), rollout("b", 0.0), rollout("c", 0.25)]
    algos = Algorithms({"e": resolve("grpo", {}, "orchestrator.algorithm")})
    per_token = score(algos, rollouts).samples
    per_sample = [s for r in rollouts for s in rollout_samples(r)]  # a has two branches
    adv = previous_chain(np.array([1.0, 0.0, 0.25]), "grpo")
    for s, a in zip(per_sample, adv[[0, 0, 1, 2]], strict=True):
        s.advantage = float(a)
    kw: dict[str, Any] = {"seq_len": 16, "num_ranks": 2, "pad_token_id": 0}
    new = build_batch(1, per_token, **kw).batch
    old = build_batch(1, per_sample, **kw).batch
    assert new == old


def test_algorithm_plugin_by_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_algos.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def last_token(group, *, bonus=1.0):
                out = []
                for s in group.samples:
                    a = np.zeros(s.num_tokens, np.float32)
                    a[-1] = bonus * group.rewards[0]
                    out.append(a)
                return out
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    section = OrchestratorSection(
        algorithm="my_algos:last_token", algorithm_args={"bonus": 2.0}, group_size=1
    )
    algos = Algorithms(section.resolve_algorithms())
    scored = score(algos, [rollout("a", 0.5), rollout("b", 0.0)], env="reverse_text")
    assert [s.advantages.tolist() for s in scored.samples] == [[0, 0, 0, 0, 1.0]] * 2


def test_algorithm_per_environment_override() -> None:
    section = OrchestratorSection(
        env="countdown", algorithm="grpo", envs={"countdown": {"algorithm": "rloo"}}
    )
    assert section.resolve_algorithms()["countdown"].name == "rloo"
    with pytest.raises(ValueError, match=r"orchestrator.envs.other: this run's environment"):
        OrchestratorSection(env="countdown", envs={"other": {"algorithm": "rloo"}})


@pytest.mark.parametrize(
    ("algo", "args", "match"),
    [
        ("no_such_pkg.algos:fn", {}, r"orchestrator.algorithm = 'no_such_pkg.algos:fn': cannot import 'no_such_pkg.algos'"),
        ("json:no_such_fn", {}, r"orchestrator.algorithm = 'json:no_such_fn': 'json' has no 'no_such_fn'"),
        ("math:pi", {}, r"orchestrator.algorithm = 'math:pi' is a float, not a function"),
        ("ppo", {}, r"orchestrator.algorithm = 'ppo' is neither a built-in algorithm"),
        ("grpo", {"temperature": 2}, r"orchestrator.algorithm: grpo.*cannot be called as grpo\(group, temperature=...\)"),
        ("json:dumps", {}, None),  # callable with one positional: accepted (checked at run time)
        ("operator:add", {}, r"orchestrator.algorithm: .*cannot be called as operator:add\(group\)"),
    ],
)  # fmt: skip
def test_algorithm_bad_setting_fails_at_config_time_naming_it(
    algo: str, args: dict[str, Any], match: str | None
) -> None:
    argv = ["--orchestrator.algorithm", algo]
    for k, v in args.items():
        argv += [f"--orchestrator.algorithm_args.{k}", str(v)]
    if match is None:
        load_config(OrchestratorConfig, argv)
        return
    with pytest.raises(ConfigError, match=match):
        load_config(OrchestratorConfig, argv)


def test_algorithm_group_size_below_its_minimum_is_a_config_error() -> None:
    with pytest.raises(
        ValueError, match=r"'rloo'.*at least 2 rollouts; orchestrator.group_size is 1"
    ):
        OrchestratorSection(algorithm="rloo", group_size=1)
    OrchestratorSection(algorithm="sft", group_size=1)


def test_algorithm_renamed_keys_say_what_replaces_them() -> None:
    with pytest.raises(
        ValueError, match=r"orchestrator.normalize_advantage was replaced.*algorithm_args"
    ):
        OrchestratorSection.model_validate({"normalize_advantage": True})


def _fixed(values: Any) -> Any:
    def fn(group: Group) -> Any:
        return values(group) if callable(values) else values

    return fn


@pytest.mark.parametrize(
    ("output", "match"),
    [
        (lambda g: [np.zeros(5)] * (g.num_samples - 1), r"returned 1 arrays for 2 samples"),
        (lambda g: [np.zeros(4)] * g.num_samples, r"sample 0 \(rollout a, leaf 1\) has shape \(4,\); the sample has 5 tokens"),
        (lambda g: [np.array([0, 0, 0, np.nan, 1.0])] * g.num_samples, r"holds 1 non-finite values \(NaN/inf\) on loss tokens"),
        (lambda g: np.zeros((g.num_samples, 5)), r"returned ndarray: expected a list of 2 per-token arrays"),
        (lambda g: [["x"] * 5] * g.num_samples, r"is not an array of numbers"),
        (lambda g: 1 / 0, r"raised on group g: ZeroDivisionError"),
    ],
)  # fmt: skip
def test_algorithm_unusable_output_refuses_the_group_with_a_clear_error(
    output: Any, match: str, caplog: pytest.LogCaptureFixture
) -> None:
    algo = _algo(_fixed(output))
    scored = score(Algorithms({"e": algo}), [rollout("a", 1.0), rollout("b", 0.0)])
    assert scored.samples == []
    assert re.search(match, scored.refused), scored.refused
    group, _ = Algorithms({"e": algo}).build_group(
        "e",
        "g",
        "{}",
        [rollout("a", 1.0), rollout("b", 0.0)],
        max_policy_version=0,
        vocab_size=None,
    )
    with pytest.raises(AlgorithmError, match=match):
        algo.advantages(group)
    assert "orchestrator.algorithm = 'my:algo'" in scored.refused
    assert "group g refused" in caplog.text


def _algo(fn: Any, signals: Sequence[str] = ()) -> Algorithm:
    """``fn`` as if set by orchestrator.algorithm = "my:algo"."""
    return Algorithm("my:algo", "orchestrator.algorithm", fn, {}, tuple(signals), 1)


def test_algorithm_nan_off_the_loss_mask_is_ignored() -> None:
    algos = Algorithms({"e": _algo(_fixed(lambda g: [np.array([np.nan, 0, 0, 1.0, 2.0])] * 2))})
    scored = score(algos, [rollout("a", 1.0), rollout("b", 0.0)])
    assert not scored.refused
    assert scored.samples[0].advantages.tolist() == [0, 0, 0, 1.0, 2.0]


def test_algorithm_signals_need_a_provider_and_are_checked() -> None:
    @algorithm(signals=["teacher_logprobs"])
    def distill(group: Group) -> list[np.ndarray]:
        return [
            -(s.logprobs - t) * s.loss_mask
            for s, t in zip(group.samples, group.signals["teacher_logprobs"], strict=True)
        ]

    algo = _algo(distill, signals=distill.signals)  # type: ignore[attr-defined]
    with pytest.raises(
        ConfigError,
        match=r"asks for the per-token signals \['teacher_logprobs'\], which nothing in this run provides",
    ):
        Algorithms({"e": algo})

    async def teacher(group: Group) -> Sequence[np.ndarray]:
        return [np.where(s.loss_mask == 1, -0.25, 0.0) for s in group.samples]

    scored = score(Algorithms({"e": algo}, {"teacher_logprobs": teacher}), [rollout("a", 1.0)])
    # -(lp - lp_teacher) = -(-0.5 + 0.25) on the sampled tokens
    assert scored.samples[0].advantages.tolist() == [0, 0, 0, 0.25, 0.25]

    async def short(group: Group) -> Sequence[np.ndarray]:
        return [np.zeros(2) for _ in group.samples]

    scored = score(Algorithms({"e": algo}, {"teacher_logprobs": short}), [rollout("a", 1.0)])
    assert "the teacher_logprobs provider on group g: sample 0" in scored.refused


def test_algorithm_unknown_signal_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sig_algos.py").write_text(
        "def f(group):\n    return []\nf.signals = ['critic_values']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"asks for unknown per-token signals \['critic_values'\]"
    ):
        resolve("sig_algos:f", {}, "orchestrator.algorithm")


def test_algorithm_groups_below_min_rollouts_are_counted_not_trained() -> None:
    algos = Algorithms({"e": resolve("grpo", {}, "orchestrator.algorithm")})
    scored = score(algos, [rollout("a", 1.0)])
    assert scored.too_few
    assert scored.samples == []
    assert set(BUILTIN) >= {"grpo", "rloo", "sft"}


@pytest.mark.parametrize(
    ("rewards", "cfg", "expected"),
    [
        ([1.0, 1.0, 1.0], {}, ZERO_VARIANCE),
        ([0.0, 0.0], {}, ZERO_VARIANCE),
        ([0.0, 1.0], {}, ""),
        ([0.3, 0.3], {"zero_variance": False}, ""),
        ([1.0, 1.0, 1.0, 0.0], {"max_pass_rate": 0.5}, OUTSIDE_PASS_RATE),
        ([1.0, 0.0, 0.0, 0.0], {"min_pass_rate": 0.3}, OUTSIDE_PASS_RATE),
        ([1.0, 1.0, 0.0, 0.0], {"min_pass_rate": 0.5, "max_pass_rate": 0.5}, ""),
        ([0.6, 0.4], {"pass_reward": 0.5, "max_pass_rate": 0.4}, OUTSIDE_PASS_RATE),
        ([], {}, ""),
    ],
)
def test_filter_refusal(rewards: list[float], cfg: dict[str, Any], expected: str) -> None:
    assert refusal(np.array(rewards), FilterSection(**cfg)) == expected


def test_filter_band_must_not_be_empty() -> None:
    with pytest.raises(ValueError, match=r"min_pass_rate = 0\.8 is above max_pass_rate = 0\.2"):
        FilterSection(min_pass_rate=0.8, max_pass_rate=0.2)


def test_batch_advantages_travel_per_token() -> None:
    algos = Algorithms(
        {"e": _algo(_fixed(lambda g: [np.arange(5, dtype=np.float32)] * g.num_samples))}
    )
    samples = score(algos, [rollout("a", 1.0), rollout("b", 0.0)]).samples
    mb = build_batch(1, samples, seq_len=16, num_ranks=1, pad_token_id=0).batch.micro_batches[0]
    adv = to_array(mb.advantages)
    assert adv[:10].tolist() == [0, 0, 0, 3, 4] * 2
