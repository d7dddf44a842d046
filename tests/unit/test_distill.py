"""On-policy distillation: the reverse-KL advantage, its config checks, the teacher's
calls (batched, retried, refused) and the startup tokenizer check -- against fake
teacher servers (no HTTP; the HTTP path runs against real vLLM in
tests/integration/test_inference_service.py and a fake vLLM in test_rl_loop.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from treadle.orchestrator.algorithms import Algorithms, resolve
from treadle.orchestrator.spec import OrchestratorSection, TeacherSection
from treadle.orchestrator.teacher import Teacher, calls_of
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_token_array
from treadle.services.errors import ConfigError
from treadle.services.inference_client import (
    InferenceRequestError,
    InferenceResponseError,
    InferenceUnavailableError,
    PromptTopK,
)

OK = rollout_pb2.RolloutStatus.Kind.KIND_OK
STUDENT_LP = -0.5


def rollout(rid: str, reward: float, turns: int = 1) -> rollout_pb2.Rollout:
    """A chain: a 3-token prompt, then per turn 2 sampled tokens and 2 env tokens."""
    r = rollout_pb2.Rollout(rollout_id=rid, group_id="g", reward=reward)
    r.status.kind = OK
    nodes = [(3, False)] + [(2, True), (2, False)] * turns
    for i, (k, sampled) in enumerate(nodes):
        n = r.nodes.add(node_id=i, parent_id=i - 1)
        n.token_ids.CopyFrom(to_token_array(np.arange(k, dtype=np.int32) + 10 * i + 5))
        n.sampled_mask.CopyFrom(to_token_array(np.full(k, int(sampled), np.uint8)))
        lp = STUDENT_LP if sampled else 0.0
        n.logprobs.CopyFrom(to_token_array(np.full(k, lp, np.float32)))
        n.policy_versions.CopyFrom(to_token_array(np.full(k, 0 if sampled else -1, np.int32)))
    return r


class FakeTeacher:
    """A teacher server: logprob of token t is -t / 100; scripted failures first."""

    def __init__(
        self,
        url: str = "http://teacher:1",
        *,
        fail: Sequence[Exception] = (),
        vocab: int = 1000,
        offset: int = 0,
        short: bool = False,
    ):
        self.base_url = url
        self.fail = list(fail)
        self.vocab = vocab
        self.offset = offset  # a tokenizer whose ids are shifted: another vocabulary
        self.short = short  # answers one logprob too few
        self.requests: list[list[int]] = []  # every sequence asked about
        self.calls = 0  # requests (one per call: several sequences)
        self.closed = False

    async def prompt_topk_many(
        self, sequences: Any, top_k: int, *, timeout_s: float | None = None
    ) -> list[PromptTopK]:
        seqs = [[int(t) for t in s] for s in sequences]
        self.requests += seqs
        self.calls += 1
        if self.fail:
            raise self.fail.pop(0)
        return [await self.answer(ids, top_k) for ids in seqs]

    async def answer(self, ids: list[int], top_k: int) -> PromptTopK:
        """``logprobs``; at each position the top ``top_k``: ids t, t+1, ... (t the
        position's token) with logprobs -1, -2, ..."""
        tids = np.asarray(ids[1:], np.int32)[:, None] + np.arange(top_k, dtype=np.int32)
        tlps = np.tile(-np.arange(1, top_k + 1, dtype=np.float32), (len(ids) - 1, 1))
        return PromptTopK(await self.logprobs(ids), tids, tlps)

    async def logprobs(self, ids: list[int]) -> np.ndarray:
        out = -np.asarray(ids[1:], dtype=np.float32) / 100
        return out[:-1] if self.short else out

    async def tokenize(self, text: str, timeout_s: float = 30.0) -> list[int]:
        return [ord(c) % 500 + self.offset for c in text]

    async def detokenize(self, token_ids: Sequence[int], timeout_s: float = 30.0) -> str:
        if any(t >= self.vocab for t in token_ids):
            raise InferenceRequestError("HTTP 400: out of vocabulary", 400)
        return "".join(chr(65 + (t + self.offset) % 50) for t in token_ids)

    async def accepts_token_id(self, token_id: int, timeout_s: float = 30.0) -> bool:
        return token_id < self.vocab

    async def aclose(self) -> None:
        self.closed = True


def teacher(*servers: FakeTeacher, **cfg: Any) -> Teacher:
    section = TeacherSection(urls=[s.base_url for s in servers], **cfg)
    return Teacher(section, servers)


def scored(name: str, t: Teacher, rewards: Sequence[float], turns: int = 1, **args: Any) -> Any:
    algos = Algorithms(
        {"e": resolve(name, args, "orchestrator.algorithm")}, {"teacher_logprobs": t}
    )
    rollouts = [rollout(f"r{i}", x, turns) for i, x in enumerate(rewards)]
    return asyncio.run(algos.score("e", "g", "{}", rollouts, max_policy_version=0, vocab_size=None))


def test_distill_advantage_is_teacher_minus_student_logprob_on_sampled_tokens_only() -> None:
    t = teacher(FakeTeacher())
    out = scored("distill", t, [0.0, 1.0], turns=2, distill_weight=2.0)
    assert not out.refused
    for smp in out.samples:
        on = smp.loss_mask == 1
        assert on.sum() == 4  # two turns of two sampled tokens each
        expected = 2.0 * (-smp.token_ids[on] / 100 - STUDENT_LP)
        np.testing.assert_allclose(smp.advantages[on], expected, rtol=1e-6)
        assert (smp.advantages[~on] == 0).all()
    metrics = t.take_metrics()
    # KL estimate: student - teacher per sampled token, averaged
    ids = np.concatenate([s.token_ids[s.loss_mask == 1] for s in out.samples])
    assert metrics["teacher_kl_mean"] == pytest.approx(float(np.mean(STUDENT_LP + ids / 100)))
    assert metrics["teacher_num_tokens"] == 8
    assert metrics["num_teacher_errors"] == 0
    assert t.take_metrics()["teacher_num_tokens"] == 0  # reset per step


def test_distill_mixed_with_grpo_adds_the_reward_advantage() -> None:
    mixed = scored("grpo+distill", teacher(FakeTeacher()), [0.0, 1.0], distill_weight=0.5)
    alone = scored("distill", teacher(FakeTeacher()), [0.0, 1.0], distill_weight=0.5)
    for m, a, reward_adv in zip(mixed.samples, alone.samples, [-0.5, 0.5], strict=True):
        on = m.loss_mask == 1
        np.testing.assert_allclose(m.advantages[on], a.advantages[on] + reward_adv, rtol=1e-6)
        assert (m.advantages[~on] == 0).all()


def test_distill_centered_subtracts_the_groups_mean_over_sampled_tokens() -> None:
    plain = scored("distill", teacher(FakeTeacher()), [0.0, 1.0], turns=2, distill_weight=2.0)
    out = scored(
        "distill", teacher(FakeTeacher()), [0.0, 1.0], turns=2, distill_weight=2.0, center=True
    )
    mean = np.mean(np.concatenate([s.advantages[s.loss_mask == 1] for s in plain.samples]))
    assert abs(mean) > 0.1  # an offset for centering to remove
    got = np.concatenate([s.advantages[s.loss_mask == 1] for s in out.samples])
    assert got.mean() == pytest.approx(0.0, abs=1e-6)
    for p, c in zip(plain.samples, out.samples, strict=True):
        on = c.loss_mask == 1
        np.testing.assert_allclose(c.advantages[on], p.advantages[on] - mean, rtol=1e-5)
        assert (c.advantages[~on] == 0).all()  # prompt and tool tokens stay 0
    mixed = scored(
        "grpo+distill", teacher(FakeTeacher()), [0.0, 1.0], turns=2, distill_weight=2.0,
        center=True,
    )  # fmt: skip
    for m, c, reward_adv in zip(mixed.samples, out.samples, [-0.5, 0.5], strict=True):
        on = m.loss_mask == 1
        np.testing.assert_allclose(m.advantages[on], c.advantages[on] + reward_adv, rtol=1e-5)


def test_teacher_calls_are_cut_by_sequences_and_tokens() -> None:
    assert calls_of([5, 5, 5, 5, 5], max_sequences=2, max_tokens=100) == [[0, 1], [2, 3], [4]]
    assert calls_of([5, 5, 5, 5], max_sequences=10, max_tokens=12) == [[0, 1], [2, 3]]
    assert calls_of([50, 5], max_sequences=10, max_tokens=12) == [[0], [1]]  # too long: alone
    fake = FakeTeacher()
    t = teacher(fake, max_sequences_per_call=2)
    out = scored("distill", t, [0.0] * 5)
    assert len(out.samples) == 5
    assert len(fake.requests) == 5
    assert fake.calls == 3  # one request a call
    assert t.take_metrics()["num_teacher_calls"] == 3
    # the teacher sees each sample's whole sequence, token for token
    assert sorted(map(tuple, fake.requests)) == sorted(tuple(s.token_ids) for s in out.samples)


def test_teacher_failure_is_retried_then_the_group_is_refused() -> None:
    down = InferenceUnavailableError("no answer within 1.0s")
    a, b = FakeTeacher("http://a:1", fail=[down]), FakeTeacher("http://b:1")
    t = teacher(a, b, max_retries=1)
    out = scored("distill", t, [0.0, 1.0])
    assert not out.refused  # the retry went to the other endpoint
    assert (a.calls, b.calls) == (1, 1)
    assert len(b.requests) == 2

    always = FakeTeacher(fail=[down] * 10)
    t = teacher(always, max_retries=2)
    out = scored("distill", t, [0.0, 1.0])
    assert out.samples == []
    assert "no usable answer for group g after 3 attempts" in out.refused
    assert t.take_metrics()["num_teacher_errors"] == 1
    assert t.errors_total == 1


def test_teacher_refusal_is_not_retried_and_names_the_teacher() -> None:
    refused = InferenceRequestError("HTTP 400: prompt too long for max_model_len", 400)
    fake = FakeTeacher(fail=[refused, refused, refused])
    out = scored("distill", teacher(fake, model="big"), [0.0, 1.0])
    assert out.samples == []
    assert "teacher http://teacher:1 (model 'big') refused the group g" in out.refused
    assert "prompt too long" in out.refused


@pytest.mark.parametrize(
    ("fake", "why"),
    [
        (FakeTeacher(short=True), "gave 5 logprobs for a sequence of 7 tokens"),
        (FakeTeacher(fail=[InferenceResponseError("garbled")] * 9), "after 3 attempts: garbled"),
    ],
)
def test_teacher_answer_of_the_wrong_shape_refuses_the_group(fake: FakeTeacher, why: str) -> None:
    out = scored("grpo+distill", teacher(fake), [0.0, 1.0])
    assert out.samples == []
    assert why in out.refused


def test_teacher_nan_logprob_refuses_the_group() -> None:
    class NanTeacher(FakeTeacher):
        async def logprobs(self, ids: list[int]) -> np.ndarray:
            return np.full(len(ids) - 1, np.nan, dtype=np.float32)

    out = scored("distill", teacher(NanTeacher()), [0.0])
    assert out.samples == []
    assert "non-finite values" in out.refused


def check(t: Teacher, student: FakeTeacher | None, vocab_size: int | None = 1000) -> None:
    asyncio.run(t.check_tokenizer(student, vocab_size, "the student's inference http://student:1"))


def test_tokenizer_check_passes_for_the_same_tokenizer_even_with_a_larger_teacher_vocab() -> None:
    check(teacher(FakeTeacher(vocab=1000)), FakeTeacher("http://student:1", vocab=1000))
    # a teacher whose embeddings are padded further holds every id the student samples
    check(teacher(FakeTeacher(vocab=1200)), FakeTeacher("http://student:1", vocab=1000))


@pytest.mark.parametrize(
    ("fake", "what"),
    [
        (FakeTeacher(offset=1), "token ids of 'The quick brown fox"),  # another tokenizer
        (FakeTeacher(vocab=900), "text of token id"),  # a smaller vocabulary
    ],
)
def test_tokenizer_check_mismatch_names_teacher_and_student(fake: FakeTeacher, what: str) -> None:
    with pytest.raises(ConfigError) as e:
        check(teacher(fake, model="qwen-big"), FakeTeacher("http://student:1"))
    msg = str(e.value)
    assert "teacher http://teacher:1 (model 'qwen-big')" in msg
    assert "the student's inference http://student:1" in msg
    assert what in msg


def test_tokenizer_check_vocab_bound_mismatch() -> None:
    class SameText(FakeTeacher):  # tokenizes alike, but its model stops at id 998
        async def accepts_token_id(self, token_id: int, timeout_s: float = 30.0) -> bool:
            return token_id < 999

    with pytest.raises(ConfigError, match=r"token id 999 \(the student's last"):
        check(teacher(SameText()), FakeTeacher("http://student:1"))


def test_tokenizer_check_needs_the_student_unless_turned_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(ConfigError, match=r"set orchestrator\.teacher\.student_url"):
        check(teacher(FakeTeacher()), None)
    check(teacher(FakeTeacher(offset=3), check_tokenizer=False), None)  # trusted, and said so
    assert "check_tokenizer = false: the run trusts" in caplog.text


@pytest.mark.parametrize(
    ("section", "match"),
    [
        (
            {"algorithm": "distill"},
            r"needs a teacher: set orchestrator.teacher.checkpoint .* orchestrator.teacher.urls",
        ),
        (
            {"algorithm": "distill", "algorithm_args": {"distill_weight": 0}},
            r"orchestrator.algorithm = 'distill': distill_weight = 0 must be a finite number > 0",
        ),
        (
            {"algorithm": "grpo+distill", "algorithm_args": {"distill_weight": -1.0}},
            r"distill_weight = -1.0 must be",
        ),
        (
            {"algorithm": "distill", "algorithm_args": {"distill_weight": float("nan")}},
            r"distill_weight = nan must be",
        ),
        (
            {"algorithm": "distill", "algorithm_args": {"distill_weight": "big"}},
            r"distill_weight = 'big' is not a number",
        ),
        (
            {"algorithm": "distill", "algorithm_args": {"center": "yes"}},
            r"center = 'yes' is not true or false",
        ),
        (
            {"algorithm": "distill", "algorithm_args": {"weight": 1.0}},
            r"cannot be called as distill\(group, weight=...\)",
        ),
        ({"teacher": {"urls": ["teacher:8000"]}}, r"teacher.urls: 'teacher:8000' is not an http"),
        (
            {"envs": {"reverse_text": {"algorithm": "grpo+distill"}}, "group_size": 1},
            r"orchestrator.envs.reverse_text.algorithm = 'grpo\+distill'",
        ),
    ],
)
def test_distill_config_errors_name_the_setting(section: dict[str, Any], match: str) -> None:
    teacher_cfg = {"teacher": {"urls": "http://t:1"}} if "teacher" not in section else {}
    if section.get("algorithm") == "distill" and "algorithm_args" not in section:
        teacher_cfg = {}  # the missing endpoint case
    with pytest.raises(ValueError, match=match):
        OrchestratorSection.model_validate({**teacher_cfg, **section})


def test_distill_config_per_environment(caplog: pytest.LogCaptureFixture) -> None:
    cfg = OrchestratorSection.model_validate(
        {
            "envs": {
                "reverse_text": {"algorithm": "distill", "algorithm_args": {"distill_weight": 0.5}}
            },
            "teacher": {"urls": ["http://t:1", "http://t:2"], "student_url": "http://s:1"},
        }
    )
    algo = cfg.resolve_algorithms()["reverse_text"]
    assert algo.signals == ("teacher_logprobs",)
    assert algo.args == {"distill_weight": 0.5}
    OrchestratorSection.model_validate({"teacher": {"urls": "http://t:1"}})  # grpo: unused
    assert "no algorithm of this run asks for a teacher" in caplog.text


@pytest.mark.parametrize(
    "teacher_url",
    ["http://127.0.0.1:8101", "http://localhost:8101/", "http://LocalHost:8101"],
)
def test_a_teacher_that_is_the_student_s_own_server_is_refused(teacher_url: str) -> None:
    """The teacher at the student's URL moves with the policy: its logprobs are the
    student's and every distillation advantage is 0, a run that trains nothing."""
    student = "http://127.0.0.1:8101"
    with pytest.raises(ValueError, match=r"is the student's own inference server"):
        OrchestratorSection.model_validate(
            {"algorithm": "distill", "teacher": {"urls": teacher_url, "student_url": student}}
        )
    for fine in (
        {"urls": "http://127.0.0.1:8102", "student_url": student},  # another server
        {"urls": teacher_url, "student_url": student, "self_distill": True},
        {"urls": teacher_url, "student_url": student, "model": "base"},  # another model there
    ):  # fmt: skip
        OrchestratorSection.model_validate({"algorithm": "distill", "teacher": fine})


def test_launcher_wires_the_student_inference_for_the_teacher_check() -> None:
    from treadle.orchestrator.spec import SPEC
    from treadle.services.host import load_service_config
    from treadle.services.launcher import _wiring

    ports = {"inference_urls": ["http://127.0.0.1:8101"], "inference_grpcs": ["127.0.0.1:50101"]}
    cfg, _ = load_service_config(SPEC, _wiring(SPEC, "rl", ports))
    assert cfg.orchestrator.teacher.student_url == "http://127.0.0.1:8101"  # type: ignore[attr-defined]


def test_teacher_is_not_asked_for_a_sample_without_sampled_tokens() -> None:
    r = rollout("r0", 0.0)
    n = r.nodes.add(node_id=len(r.nodes), parent_id=0)  # a second branch: no sampled token
    n.token_ids.CopyFrom(to_token_array(np.array([40], np.int32)))
    n.sampled_mask.CopyFrom(to_token_array(np.zeros(1, np.uint8)))
    n.logprobs.CopyFrom(to_token_array(np.zeros(1, np.float32)))
    n.policy_versions.CopyFrom(to_token_array(np.full(1, -1, np.int32)))
    fake = FakeTeacher()
    algos = Algorithms({"e": resolve("distill", {}, "a")}, {"teacher_logprobs": teacher(fake)})
    out = asyncio.run(algos.score("e", "g", "{}", [r], max_policy_version=0, vocab_size=None))
    assert not out.refused
    assert len(out.samples) == 2
    assert len(fake.requests) == 1
    assert [int(s.loss_mask.sum()) for s in out.samples] == [2, 0]
    assert (out.samples[1].advantages == 0).all()


def ahead(
    t: Teacher, first: list[rollout_pb2.Rollout], then: list[rollout_pb2.Rollout]
) -> tuple[Any, bool]:
    """Fetch the signals of ``first`` ahead, then score ``then`` (the group as it is when its
    batch is cut); whether the fetch was already done before ``score``."""
    algos = Algorithms({"e": resolve("distill", {}, "orchestrator.algorithm")},
                       {"teacher_logprobs": t})  # fmt: skip

    async def go() -> tuple[Any, bool]:
        fetch = algos.prefetch("e", "g", "{}", first, max_policy_version=0, vocab_size=None)
        assert fetch is not None
        await asyncio.wait({fetch})
        out = await algos.score("e", "g", "{}", then, max_policy_version=0, vocab_size=None)
        assert not algos._ahead  # taken
        return out, fetch.done()

    return asyncio.run(go())


def test_signals_fetched_ahead_are_used_once_by_score() -> None:
    fake = FakeTeacher()
    t = teacher(fake)
    rollouts = [rollout(f"r{i}", float(i)) for i in range(3)]
    out, _ = ahead(t, rollouts, rollouts)
    assert len(fake.requests) == 3  # the teacher was asked once per sample, ahead
    fresh = scored("distill", teacher(FakeTeacher()), [0.0, 1.0, 2.0])
    for a, b in zip(out.samples, fresh.samples, strict=True):
        np.testing.assert_array_equal(a.advantages, b.advantages)


def test_signals_fetched_ahead_for_other_samples_are_fetched_again() -> None:
    """A rollout of the group failed its group reward after the fetch: score asks again for
    the samples it trains, never uses the stale set."""
    fake = FakeTeacher()
    t = teacher(fake)
    rollouts = [rollout(f"r{i}", float(i)) for i in range(3)]
    out, _ = ahead(t, rollouts, rollouts[:2])
    assert len(fake.requests) == 3 + 2
    assert [s.rollout_id for s in out.samples] == ["r0", "r1"]
    assert t.take_metrics(["g"])["teacher_num_tokens"] == 2 * 2  # the second fetch's


def test_a_teacher_failure_ahead_refuses_the_group_at_score() -> None:
    down = InferenceUnavailableError("no answer within 1.0s")
    t = teacher(FakeTeacher(fail=[down] * 10), max_retries=1)
    rollouts = [rollout("r0", 0.0), rollout("r1", 1.0)]
    out, _ = ahead(t, rollouts, rollouts)
    assert out.samples == []
    assert "no usable answer for group g after 2 attempts" in out.refused


def test_score_checks_the_versions_again_after_a_fetch_ahead() -> None:
    """Versions are checked against what is published when the batch is cut: a rollout
    claiming version 0 passes a fetch ahead at version 0; the batch's check is its own."""
    fake = FakeTeacher()
    t = teacher(fake)
    algos = Algorithms({"e": resolve("distill", {}, "orchestrator.algorithm")},
                       {"teacher_logprobs": t})  # fmt: skip
    rollouts = [rollout("r0", 0.0), rollout("r1", 1.0)]

    async def go() -> Any:
        fetch = algos.prefetch("e", "g", "{}", rollouts, max_policy_version=0, vocab_size=None)
        assert fetch is not None
        await fetch
        return await algos.score("e", "g", "{}", rollouts, max_policy_version=-1, vocab_size=None)

    out = asyncio.run(go())
    assert out.samples == []
    assert out.num_errors == 2  # both outside the published versions at score: dropped


def test_fetch_ahead_forgotten_is_cancelled_and_kl_is_per_step_groups() -> None:
    class Slow(FakeTeacher):
        async def logprobs(self, ids: list[int]) -> np.ndarray:
            await asyncio.sleep(30)
            return await super().logprobs(ids)

    t = teacher(Slow())
    algos = Algorithms({"e": resolve("distill", {}, "orchestrator.algorithm")},
                       {"teacher_logprobs": t})  # fmt: skip

    async def go() -> asyncio.Task[Any]:
        fetch = algos.prefetch("e", "g", "{}", [rollout("r0", 0.0)], max_policy_version=0,
                               vocab_size=None)  # fmt: skip
        assert fetch is not None
        await asyncio.sleep(0.05)
        algos.forget("g")
        await asyncio.wait({fetch}, timeout=5)
        return fetch

    assert asyncio.run(go()).cancelled()
    # KL is reported with the step whose groups it measured, not when it was fetched
    t2 = teacher(FakeTeacher())
    algos2 = Algorithms({"e": resolve("distill", {}, "orchestrator.algorithm")},
                        {"teacher_logprobs": t2})  # fmt: skip

    async def two() -> None:
        for gid in ("a", "b"):
            fetch = algos2.prefetch("e", gid, "{}", [rollout("r" + gid, 0.0)],
                                    max_policy_version=0, vocab_size=None)  # fmt: skip
            assert fetch is not None
            await fetch

    asyncio.run(two())
    first = t2.take_metrics(["a"])
    assert first["teacher_num_tokens"] == 2
    assert first["num_teacher_calls"] == 2  # calls are counted when made
    later = t2.take_metrics(["b"])
    assert later["teacher_num_tokens"] == 2
    assert later["num_teacher_calls"] == 0
    assert t2.take_metrics(["b"])["teacher_num_tokens"] == 0
