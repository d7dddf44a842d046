"""Demonstrations in RL batches ([orchestrator.demos], demos.py): one-hot teacher rows make
the trainer's top-k term the cross-entropy, the policy-gradient kinds skip tokens that were
not sampled, and a trainer step on demonstrations in an RL batch is the SFT step on them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from testkit.paths import shared_tokenizer
from treadle.orchestrator.algorithms import TopK
from treadle.orchestrator.batching import build_batch
from treadle.orchestrator.demos import ONE_HOT_FLOOR, Demos, one_hot_topk
from treadle.orchestrator.samples import Sample
from treadle.orchestrator.spec import DemosSection, OrchestratorSection
from treadle.services.codecs import to_array
from treadle.services.errors import ConfigError
from treadle.services.rendering import open_renderer
from treadle.trainer.batch import decode_micro_batch
from treadle.trainer.losses import TeacherTopK, token_losses
from treadle.trainer.spec import LossSection


def conversations(path: Path, n: int, *, bad_at: int | None = None) -> Path:
    rows = []
    for i in range(n):
        text = f"word{i} and more"
        rows.append({"id": f"c{i}", "messages": [
            {"role": "user", "content": f"Reverse: {text}"},
            {"role": "assistant", "content": text[::-1]},
        ]})  # fmt: skip
    if bad_at is not None:  # a tool call whose arguments are not JSON
        rows[bad_at]["messages"].append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- the loss --------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 4])
def test_a_one_hot_row_makes_the_top_k_term_the_cross_entropy(k: int) -> None:
    torch.manual_seed(0)
    B, L, V = 1, 7, 13
    token_ids = np.array([3, 5, 7, 2, 11, 4, 9], np.int32)
    mask = np.array([0, 0, 1, 1, 1, 1, 0], np.uint8)
    top = one_hot_topk(token_ids, mask, k)
    assert top.k == k
    assert (top.ids[mask == 1] == token_ids[mask == 1, None]).all()
    assert (top.logprobs[mask == 1, 0] == 0).all()
    assert (top.logprobs[mask == 1, 1:] == ONE_HOT_FLOOR).all()
    assert (top.ids[mask == 0] == 0).all()
    assert (top.logprobs[mask == 0] == 0).all()

    logits = torch.randn(B, L, V, requires_grad=True)
    full = torch.log_softmax(logits, -1)
    ids_BLK = torch.from_numpy(top.ids.astype(np.int64))[None]
    student_BLK = full.gather(-1, ids_BLK)
    token_lp = student_BLK[..., 0]
    mask_BL = torch.from_numpy(mask)[None]
    weight_BL = torch.from_numpy(np.where(mask == 1, 0.5, 0).astype(np.float32))[None]
    zero = torch.zeros(B, L)
    unsampled = torch.zeros(B, L, dtype=torch.bool)
    terms = token_losses(
        LossSection(), token_lp, zero, zero, mask_BL, sampled_BL=unsampled,
        teacher=TeacherTopK(student_BLK, torch.from_numpy(top.logprobs)[None], weight_BL),
    )  # fmt: skip
    on = mask_BL.bool()
    nll = -token_lp[on].sum()
    assert float(terms.loss_sum.detach()) == pytest.approx(0.5 * float(nll.detach()), rel=1e-6)
    assert float(terms.teacher_kl_sum) == pytest.approx(float(nll.detach()), rel=1e-6)
    assert float(terms.num_policy) == 0
    assert float(terms.num_masked) == 0
    assert float(terms.ratio_sum) == 0  # no importance ratio: not sampled
    (grad,) = torch.autograd.grad(terms.loss_sum, logits, retain_graph=True)
    (want,) = torch.autograd.grad(0.5 * nll, logits)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)


def test_policy_gradient_kinds_skip_tokens_that_were_not_sampled() -> None:
    """A loss token with no behaviour logprob (policy version -1) is out of the pg term, the
    sequence mask, the KL penalty and the ratio statistics; sampled ones are as before; the
    sft kind trains every loss token."""
    torch.manual_seed(1)
    L = 8
    lp = -torch.rand(1, L) * 2
    blp = lp.detach() + torch.tensor([[0, 0, 0.1, -0.2, 3.0, 0.0, 0.0, 0.05]])
    adv = torch.full((1, L), 0.7)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])
    sampled = torch.tensor([[False, True, True, True, True, False, False, False]])
    ref = lp.detach() - 0.3
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    for kind in ("pg", "tis", "ppo"):
        cfg = LossSection(kind=kind, kl_coef=0.1, sequence_mask="mean", sequence_mask_ratio=30.0)
        mixed = token_losses(cfg, lp, blp, adv, mask, doc_ids_BL=docs,
                             reference_logprobs_BL=ref, sampled_BL=sampled)  # fmt: skip
        alone = token_losses(cfg, lp, blp, adv, mask * sampled, doc_ids_BL=docs,
                             reference_logprobs_BL=ref)  # fmt: skip
        for name in ("loss_sum", "num_masked", "ratio_sum", "kl_ref_sum", "num_seq_masked"):
            assert float(getattr(mixed, name)) == pytest.approx(float(getattr(alone, name))), (kind, name)  # fmt: skip
        assert float(mixed.num_policy) == 4
    sft = token_losses(LossSection(kind="sft"), lp, blp, adv, mask, sampled_BL=sampled)
    assert float(sft.loss_sum) == pytest.approx(float(-lp[mask.bool()].sum()))
    assert float(sft.num_policy) == 7


# --- the orchestrator ------------------------------------------------------------------------
def demos(tmp_path: Path, n: int = 5, tokenizer: Path | None = None, **section: Any) -> Demos:
    data = conversations(tmp_path / "demos.jsonl", n)
    renderer = open_renderer(
        "auto", tokenizer or shared_tokenizer("qwen3"), what="orchestrator.renderer"
    )
    return Demos(DemosSection(data=data, **section), renderer, seed=0)


def test_demos_are_rendered_conversations_with_one_hot_rows_in_a_seeded_cycle(
    tmp_path: Path,
) -> None:
    d = demos(tmp_path, samples_per_step=3, weight=0.25)
    taken = [s for _ in range(4) for s in d.take(4)]  # 12 of 5: epochs 0, 1 and 2
    first = [s.rollout_id for s in taken[:5]]
    assert sorted(first) == [f"demo-c{i}-e0" for i in range(5)]  # each once an epoch
    assert sorted(s.rollout_id for s in taken[5:10]) == [f"demo-c{i}-e1" for i in range(5)]
    for s in taken:
        assert (s.policy_versions == -1).all()
        assert s.advantages is not None
        assert (s.advantages == 0).all()
        assert s.teacher_weight == 0.25
        assert s.teacher_topk is not None
        assert s.teacher_topk.k == 4
        on = s.loss_mask == 1
        assert 0 < on.sum() < s.num_tokens  # what the assistant says, not the prompt
        assert (s.teacher_topk.ids[on, 0] == s.token_ids[on]).all()
    tok = open_renderer("auto", shared_tokenizer("qwen3"), what="x")
    one = taken[0]
    again = tok.render(json.loads((tmp_path / "demos.jsonl").read_text().splitlines()[
        int(one.rollout_id.split("-")[1][1:])])["messages"])  # fmt: skip
    np.testing.assert_array_equal(one.token_ids, again.token_ids)
    # a restart continues from the saved cursor: the same next demonstrations
    cursor = d.cursor
    following = [s.rollout_id for s in d.take(1)]
    resumed = demos(tmp_path, samples_per_step=3, weight=0.25)
    resumed.seek(cursor)
    assert [s.rollout_id for s in resumed.take(1)] == following
    # a batch published after the last save and adopted at a restart: its demonstrations
    # count as taken, whatever the order of its ids (other samples' ids are ignored)
    for upto in (2, 5, 7):  # the second batch of an epoch, one ending epoch 1, one into 2
        adopted = demos(tmp_path, samples_per_step=3, weight=0.25)
        adopted.seek([0, 1])  # the saved cursor: one taken before the save
        batch = [s.rollout_id for s in taken[1:upto]]
        adopted.advance_past(["r-0001", *sorted(batch), "demo-gone-e0"])
        assert adopted.take(1)[0].rollout_id == taken[upto].rollout_id, upto


def test_a_demonstration_the_template_cannot_render_stops_before_the_run(tmp_path: Path) -> None:
    data = conversations(tmp_path / "demos.jsonl", 4, bad_at=2)
    renderer = open_renderer("auto", shared_tokenizer("qwen3"), what="orchestrator.renderer")
    with pytest.raises(ConfigError, match=r"demos.jsonl:3: the chat template cannot render it"):
        Demos(DemosSection(data=data), renderer, seed=0)
    good = conversations(tmp_path / "good.jsonl", 4)
    with pytest.raises(ConfigError, match=r"good.jsonl:1: token id \d+ is outside the policy's "
                       r"vocabulary \(1000 ids\)"):  # fmt: skip
        Demos(DemosSection(data=good), renderer, seed=0, vocab_size=1000)
    (tmp_path / "none.jsonl").write_text(json.dumps({"id": "a", "text": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"none.jsonl:1.*messages"):
        Demos(DemosSection(data=tmp_path / "none.jsonl"), renderer, seed=0)


def test_demos_settings_are_checked(tmp_path: Path) -> None:
    data = str(conversations(tmp_path / "d.jsonl", 2))
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "t", "text": "x"}) + "\n")
    with pytest.raises(
        ValueError, match=r"orchestrator\.demos\.data needs orchestrator\.tokenizer"
    ):
        OrchestratorSection.model_validate({"tasks": tasks, "demos": {"data": data}})
    with pytest.raises(ValueError, match="demonstrations go into RL batches"):
        OrchestratorSection.model_validate(
            {"mode": "sft", "tasks": tasks, "tokenizer": "x", "demos": {"data": data}}
        )
    for bad in ({"samples_per_step": 0}, {"weight": 0}, {"weight": math.nan}):
        with pytest.raises(ValueError, match=r"samples_per_step|weight"):
            DemosSection.model_validate({"data": data, **bad})


def rl_sample(rid: str, n: int, prompt: int, version: int, k: int) -> Sample:
    rng = np.random.default_rng(len(rid) + n)
    mask = np.zeros(n, np.uint8)
    mask[prompt:] = 1
    smp = Sample(rid, 1, rng.integers(3, 90, n).astype(np.int32), mask,
                 np.where(mask == 1, -1.0, 0).astype(np.float32),
                 np.where(mask == 1, version, -1).astype(np.int32))  # fmt: skip
    smp.teacher_topk = TopK((rng.integers(0, 90, (n, k)) * mask[:, None]).astype(np.int32),
                            (-rng.random((n, k)) * mask[:, None]).astype(np.float32))  # fmt: skip
    smp.teacher_weight = 1.0
    return smp


def test_a_batch_with_demonstrations_keeps_the_sampled_tokens_policy_versions(
    tmp_path: Path,
) -> None:
    d = demos(tmp_path, samples_per_step=2)
    samples = [rl_sample("a", 20, 8, 4, 3), rl_sample("b", 16, 5, 5, 3), *d.take(3)]
    built = build_batch(6, samples, seq_len=64, num_ranks=1, pad_token_id=0)
    assert (built.ready.min_policy_version, built.ready.max_policy_version) == (4, 5)
    vocab = int(max(s.token_ids.max() for s in samples)) + 1
    seen_demo = 0
    for mb in built.batch.micro_batches:
        dec = decode_micro_batch(mb, vocab_size=vocab)  # the trainer's checks pass
        assert dec.teacher_ids_LK is not None
        assert dec.teacher_logprobs_LK is not None
        ver, mask = dec.policy_versions_L, dec.loss_mask_L == 1
        demo = mask & (ver == -1)
        seen_demo += int(demo.sum())
        assert (dec.teacher_ids_LK[demo, 0] == dec.input_ids_L[demo]).all()
        assert (dec.teacher_logprobs_LK[demo, 1:] == ONE_HOT_FLOOR).all()
        assert (to_array(mb.advantages)[demo] == 0).all()
    assert seen_demo == sum(int(s.loss_mask.sum()) for s in samples[2:])


# --- the trainer -----------------------------------------------------------------------------
def test_a_trainer_step_on_demonstrations_in_an_rl_batch_is_the_sft_step(tmp_path: Path) -> None:
    """The same conversations, once as an SFT batch to a trainer with loss kind 'sft', once
    as demonstrations (weight 1) in an RL batch to a 'pg' trainer: equal loss, equal
    weights after the step."""
    from testkit.trainer import store_batch, tiny_qwen3
    from treadle.services.objectstore import LocalObjectStore
    from treadle.trainer.spec import TrainerSection
    from treadle.trainer.trainer import Trainer

    model_dir = tiny_qwen3(tmp_path / "qwen3")
    d = demos(tmp_path, tokenizer=model_dir, samples_per_step=4)  # its own vocabulary
    as_demos = d.take(1)
    as_sft = [  # as the SFT feed builds them (sft.py)
        Sample(s.rollout_id, 0, s.token_ids, s.loss_mask, s.logprobs, s.policy_versions,
               advantage=1.0)
        for s in as_demos
    ]  # fmt: skip
    results, before = {}, None
    for kind, samples in (("sft", as_sft), ("pg", as_demos)):
        section = TrainerSection.model_validate({
            "model": model_dir, "seed": 0, "loss": {"kind": kind},
            "optim": {"lr": 1e-2, "warmup_steps": 0},
        })  # fmt: skip
        trainer = Trainer(section, LocalObjectStore(tmp_path / f"store-{kind}"),
                          checkpoint_dir=tmp_path / f"ck-{kind}")  # fmt: skip
        if before is None:
            before = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}
        built = build_batch(1, samples, seq_len=128, num_ranks=1, pad_token_id=0)
        m = trainer.train_step(store_batch(trainer.store, built.batch)).metrics
        results[kind] = (m, {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()})  # fmt: skip
    (m_sft, w_sft), (m_pg, w_pg) = results["sft"], results["pg"]
    assert m_pg["loss"] == pytest.approx(m_sft["loss"], rel=1e-5)
    assert m_pg["teacher_topk_kl"] == pytest.approx(m_sft["loss"], rel=1e-5)
    assert m_pg["demo_tokens"] == m_pg["loss_tokens"]  # every loss token a demonstration
    assert m_sft["loss"] > 0.5  # a random model: the comparison is not of two zeros
    assert m_pg["update_skipped"] == 0
    assert m_sft["update_skipped"] == 0
    assert before is not None
    assert any(not torch.equal(before[n], p) for n, p in w_sft.items())  # the step moved them
    for name, p in w_sft.items():
        torch.testing.assert_close(w_pg[name], p, rtol=1e-5, atol=1e-6, msg=name)
