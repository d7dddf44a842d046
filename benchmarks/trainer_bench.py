"""Trainer on CPU, one process: tokens/s of a training step, checkpoint save/load and
weight publication times on the tiny Qwen3 model (Treadle's test model shape).

    .venv/bin/python benchmarks/trainer_bench.py [--steps 5] [--seq-len 1024] [--micro-batches 4]
    .venv/bin/python benchmarks/trainer_bench.py --vs-hf [--threads N] [--profile] [--autocast]

Numbers are wall-clock medians over the steps after a warm-up step.

--vs-hf: Treadle's trainer step against transformers' own model on the same batch, in
the reverse-text example's shape (its model: hidden 256, 4 layers, vocab 320; 128
samples of 40..60 tokens packed into seq_len micro-batches), same tokens, dtype
(float32), threads and optimizer (AdamW, grad clip 1.0). Treadle's step is timed per
phase (decode + unpack, tensors, forward, logprob gathering, loss, backward, metrics,
optimizer, publication); transformers' as forward, logprobs + loss, backward,
optimizer. Reports tokens/s and tokens/s per thread of each. --profile prints the torch
profiler's top operators of one Treadle step. --autocast: every side in mixed precision,
bfloat16 matmuls (Treadle's ``trainer.autocast = "bfloat16"``, transformers under the
same torch autocast).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import clip_grad_norm_

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from testkit.trainer import make_batch, store_batch, vocab_size_of
from treadle.services.objectstore import LocalObjectStore
from treadle.services.tiny_model import build_tiny_model
from treadle.trainer.spec import TrainerSection
from treadle.trainer.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--vs-hf", action="store_true", help="side by side with transformers")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--profile", action="store_true", help="with --vs-hf: torch profiler")
    parser.add_argument("--autocast", action="store_true", help="with --vs-hf: bfloat16 matmuls")
    parser.add_argument(
        "--group-size",
        type=int,
        default=8,
        help="with --vs-hf: samples per prompt (1: every sample its own prompt)",
    )
    parser.add_argument(
        "--no-share",
        action="store_true",
        help="with --vs-hf: trainer.share_prompts = false (every copy computed)",
    )
    args = parser.parse_args()
    if args.vs_hf:
        vs_hf(args)
        return
    root = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    model = build_tiny_model(root / "model", tokenizer="bpe")
    store = LocalObjectStore(root / "store")
    trainer = Trainer(TrainerSection(model=model), store, checkpoint_dir=root / "ckpt")
    vocab = vocab_size_of(model)
    # samples of 100..400 tokens filling about micro_batches * seq_len tokens
    lengths = tuple([100, 400, 250, 300, 150, 200] * (args.micro_batches * args.seq_len // 1400))
    tokens_per_s, publish_s = [], []
    for step in range(1, args.steps + 2):
        ready = store_batch(
            store, make_batch(step, vocab_size=vocab, lengths=lengths, seq_len=args.seq_len)
        )
        m = trainer.train_step(ready).metrics
        if step > 1:
            tokens_per_s.append(m["tokens_per_s"])
            publish_s.append(m["publish_s"])
    started = time.monotonic()
    trainer.save_checkpoint()
    save_s = time.monotonic() - started
    fresh = Trainer(TrainerSection(model=model), store, checkpoint_dir=root / "ckpt2")
    started = time.monotonic()
    fresh.resume()
    load_s = time.monotonic() - started
    params = sum(p.numel() for p in trainer.policy.model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters, vocab {vocab}; seq_len {args.seq_len}, "
          f"{len(lengths)} samples, {m['tokens']:.0f} tokens per step")  # fmt: skip
    print(f"train step: {statistics.median(tokens_per_s):.0f} tokens/s (median of {args.steps})")
    print(f"weight publication: {statistics.median(publish_s) * 1000:.0f} ms")
    print(
        f"checkpoint save (DCP + upload): {save_s * 1000:.0f} ms; load (fetch + DCP): {load_s * 1000:.0f} ms"
    )


def _timed(times: dict[str, float], name: str, started: float) -> float:
    now = time.perf_counter()
    times[name] = times.get(name, 0.0) + now - started
    return now


def treadle_phases(trainer: Trainer, ready: Any, data: bytes) -> tuple[dict[str, float], int]:
    """One Treadle update as Trainer._optimize does it, timed per phase (same calls)."""
    from treadle.trainer.batch import check_batch
    from treadle.trainer.losses import token_losses
    from treadle.trainer.models.attention import attention_masks
    from treadle.trainer.policy import TokenScores
    from treadle.trainer.prefix import regroup, share_prefixes
    from treadle.trainer.trainer import StepStats, _decode_batch

    times: dict[str, float] = {}
    t = time.perf_counter()
    batch = _decode_batch(data, "bench")
    mbs = check_batch(batch, step=int(ready.step), num_ranks=1, vocab_size=trainer.policy.hf.vocab_size)  # type: ignore[arg-type]  # fmt: skip
    t = _timed(times, "decode+unpack", t)
    policy, model = trainer.policy, trainer.policy.model
    model.train()
    trainer.optimizers.zero_grad()
    n_loss = sum(m.num_loss_tokens for m in mbs)
    stats = StepStats()
    t = time.perf_counter()
    share = policy.attention == "sdpa" and trainer.section.share_prompts
    if share:  # as _backward: a prompt's samples in one micro-batch
        mbs = regroup(mbs)
    for mb in mbs:
        if policy.attention == "sdpa":  # as _backward: the padding is not computed
            mb = mb.trimmed()
        shared = share_prefixes(mb) if share else None
        ids = torch.from_numpy(mb.input_ids_L.astype("int64"))[None]
        pos = torch.from_numpy(mb.position_ids_L.astype("int64"))[None]
        layout = None
        if shared is not None:  # each shared prompt once
            src = torch.from_numpy(shared.from_packed_C)
            ids_all, ids, pos = ids, ids.index_select(1, src), pos.index_select(1, src)
            layout = shared.layout(ids.device)
        mask = torch.from_numpy(mb.loss_mask_L.astype(bool))[None]
        adv = torch.from_numpy(mb.advantages_L.copy())[None]
        blp = torch.from_numpy(mb.behaviour_logprobs_L.copy())[None]
        ver = torch.from_numpy(mb.policy_versions_L.astype("int64"))[None]
        t = _timed(times, "tensors", t)
        with trainer._autocast():
            masks = layout if layout is not None else attention_masks(model, policy.attention, pos)
            logits = model(ids, pos, masks)
            t = _timed(times, "forward", t)
            # the rest of Policy.token_logprobs (with_entropy=True, temperature 1)
            pred = logits[:, :-1].float()
            lse = torch.logsumexp(pred, dim=-1)
            picked = pred.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            zero = torch.zeros_like(lse[:, :1])
            logprobs = torch.cat([zero, picked - lse], dim=1)
            with torch.no_grad():
                p = torch.softmax(pred.detach(), dim=-1)
                entropy = torch.cat([zero, lse.detach() - (p * pred.detach()).sum(-1)], dim=1)
            if shared is not None:  # back at every packed token
                got = shared.expand(TokenScores(logprobs, entropy, None))
                logprobs, entropy, ids = got.logprobs_BL, got.entropy_BL, ids_all
            t = _timed(times, "logprobs+entropy", t)
            terms = token_losses(trainer.section.loss, logprobs, blp, adv, mask)
        t = _timed(times, "loss", t)
        (terms.loss_sum / n_loss).backward()
        t = _timed(times, "backward", t)
        with torch.no_grad():
            trainer._accumulate(stats, mb, terms, logprobs, blp, entropy, mask, ver, int(ready.step), int(ready.step) - 1)  # fmt: skip
        t = _timed(times, "metrics", t)
    params = [p for p in model.parameters() if p.grad is not None]
    float(clip_grad_norm_(params, trainer.section.optim.grad_clip, foreach=True))
    trainer.optimizers.step()
    trainer.optimizers.zero_grad()
    _timed(times, "optimizer", t)
    return times, int(stats.sums["tokens"])


def hf_step(model: Any, opt: Any, mbs: list[Any], autocast: bool = False) -> dict[str, float]:
    """transformers' own forward + backward + AdamW on the same packed micro-batches
    (input_ids and position_ids per micro-batch, logprobs of the loss tokens)."""
    times: dict[str, float] = {}
    model.train()
    opt.zero_grad()
    n_loss = sum(m.num_loss_tokens for m in mbs)
    t = time.perf_counter()
    for mb in mbs:
        ids = torch.from_numpy(mb.input_ids_L.astype("int64"))[None]
        pos = torch.from_numpy(mb.position_ids_L.astype("int64"))[None]
        mask = torch.from_numpy(mb.loss_mask_L.astype(bool))[None]
        adv = torch.from_numpy(mb.advantages_L.copy())[None]
        t = _timed(times, "tensors", t)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            t = _timed(times, "forward", t)
            loss = _pg_loss(logits, ids, adv, mask, n_loss)
        t = _timed(times, "logprobs+loss", t)
        loss.backward()
        t = _timed(times, "backward", t)
    return _optimizer_step(model, opt, times, t)


def _pg_loss(
    logits: torch.Tensor, ids: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, denom: Any
) -> torch.Tensor:
    """The policy-gradient loss both transformers variants compute: sampled-token logprobs
    times advantages over the loss tokens, divided by ``denom``."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return -(picked * adv[:, 1:] * mask[:, 1:]).sum() / denom


def _optimizer_step(model: Any, opt: Any, times: dict[str, float], t: float) -> dict[str, float]:
    clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
    opt.step()
    opt.zero_grad()
    _timed(times, "optimizer", t)
    return times


def padded(mbs: list[Any]) -> tuple[torch.Tensor, ...]:
    """The samples of ``mbs`` unpacked into one right-padded [S, longest] batch (how TRL
    trains): input ids, attention mask, loss mask, advantages."""
    import numpy as np

    docs = []
    for mb in mbs:
        starts = [*np.flatnonzero(mb.position_ids_L == 0), len(mb.position_ids_L)]
        for a, b in itertools.pairwise(starts):
            if b - a > 1:  # padding is documents of one token
                docs.append((mb.input_ids_L[a:b], mb.loss_mask_L[a:b], mb.advantages_L[a:b]))
    width = max(len(d[0]) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    att = torch.zeros(len(docs), width, dtype=torch.long)
    loss = torch.zeros(len(docs), width, dtype=torch.bool)
    adv = torch.zeros(len(docs), width, dtype=torch.float32)
    for i, (t, m, a) in enumerate(docs):
        n = len(t)
        ids[i, :n] = torch.from_numpy(t.astype("int64"))
        att[i, :n] = 1
        loss[i, :n] = torch.from_numpy(m.astype(bool))
        adv[i, :n] = torch.from_numpy(a.copy())
    return ids, att, loss, adv


def hf_padded_step(
    model: Any, opt: Any, batch: tuple[torch.Tensor, ...], autocast: bool = False
) -> dict[str, float]:
    """transformers on the unpacked samples as one padded batch, forward + backward + AdamW."""
    ids, att, mask, adv = batch
    times: dict[str, float] = {}
    model.train()
    opt.zero_grad()
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
        t = _timed(times, "forward", t)
        loss = _pg_loss(logits, ids, adv, mask, mask.sum())
    t = _timed(times, "logprobs+loss", t)
    loss.backward()
    t = _timed(times, "backward", t)
    return _optimizer_step(model, opt, times, t)


def bench_samples(group_size: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(lengths, prompt lengths) of the 128 samples. Groups of ``group_size`` samples of
    one prompt have reverse-text's shape: a chat prompt of 38-44 tokens and a sampled
    answer of 6-12 (its prompt is 41 tokens for a 7-character text, its answer about 8);
    a group size of 1 keeps the earlier batch: 40-60 tokens, the second half sampled."""
    if group_size < 2:
        return tuple([40, 45, 50, 55, 60] * 26)[:128], None
    prompts = tuple(38 + (i // group_size) % 7 for i in range(128))
    answers = tuple(6 + (3 * i + i // group_size) % 7 for i in range(128))
    return tuple(p + a for p, a in zip(prompts, answers, strict=True)), prompts


def vs_hf(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from treadle.services.tiny_model import TinyModelSpec
    from treadle.trainer.batch import check_batch
    from treadle.trainer.spec import LossSection, OptimSection

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    root = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    spec = TinyModelSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768)  # fmt: skip
    model = build_tiny_model(root / "model", tokenizer="bpe", spec=spec, bpe_vocab_size=320, vocab_multiple=1)  # fmt: skip
    store = LocalObjectStore(root / "store")
    section = TrainerSection(model=model, loss=LossSection(kind="pg"), optim=OptimSection(lr=3e-4),
                             autocast="bfloat16" if args.autocast else "off",
                             share_prompts=not args.no_share)  # fmt: skip
    trainer = Trainer(section, store, checkpoint_dir=root / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # fmt: skip
    vocab = vocab_size_of(model)
    lengths, prompts = bench_samples(args.group_size)
    print(f"threads {threads}; dtype {trainer.policy.dtype}, autocast {section.autocast}; {len(lengths)} samples, {sum(lengths)} tokens, seq_len {args.seq_len}; groups of {args.group_size} samples of one prompt, share_prompts {section.share_prompts}")  # fmt: skip
    hf2 = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    opt2 = torch.optim.AdamW(hf2.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # fmt: skip
    rows: dict[str, list[dict[str, float]]] = {"treadle": [], "treadle_step": [], "hf": [], "hf_padded": []}  # fmt: skip
    tokens = 0
    for step in range(1, args.steps + 2):
        batch = make_batch(step, vocab_size=vocab, lengths=lengths, seq_len=args.seq_len,
                           prompts=prompts, group_size=args.group_size)  # fmt: skip
        ready = store_batch(store, batch)
        data = batch.SerializeToString()
        mbs = check_batch(batch, step=step, num_ranks=1, vocab_size=trainer.policy.hf.vocab_size)
        h = hf_step(hf, opt, mbs, args.autocast)
        h2 = hf_padded_step(hf2, opt2, padded(mbs), args.autocast)
        t = time.perf_counter()
        m = trainer.train_step(ready, data).metrics  # the real step, publication included
        whole = {"train_s": m["train_s"], "publish_s": m["publish_s"], "step": time.perf_counter() - t}  # fmt: skip
        trainer.step = step
        ph, tokens = treadle_phases(trainer, ready, data)
        trainer.step = step  # phases trained once more: not a step of the schedule
        if step > 1:
            rows["hf"].append(h)
            rows["hf_padded"].append(h2)
            rows["treadle"].append(ph)
            rows["treadle_step"].append(whole)
    positions = len(mbs) * args.seq_len

    def med(side: str) -> dict[str, float]:
        keys = rows[side][0].keys()
        return {k: statistics.median(r[k] for r in rows[side]) for k in keys}

    print(f"{len(mbs)} micro-batches ({positions} positions, {tokens} real tokens)")
    print(f"hf: the same packed micro-batches; hf_padded: the {padded(mbs)[0].shape[0]} samples as one "
          f"right-padded batch {tuple(padded(mbs)[0].shape)} (TRL's layout)")  # fmt: skip
    for side in ("treadle", "hf", "hf_padded"):
        m = med(side)
        total = sum(m.values())
        print(f"\n{side}: {total * 1000:.0f} ms per update; {tokens / total:.0f} tokens/s, "
              f"{tokens / total / threads:.0f} tokens/s per thread")  # fmt: skip
        for k, v in m.items():
            print(f"  {k:>18}: {v * 1000:8.1f} ms  {100 * v / total:5.1f} %")
    w = med("treadle_step")
    print(f"\ntreadle Trainer.train_step: {w['step'] * 1000:.0f} ms (train {w['train_s'] * 1000:.0f} ms, "
          f"publish {w['publish_s'] * 1000:.0f} ms); {tokens / w['train_s']:.0f} tokens/s")  # fmt: skip
    for side in ("hf", "hf_padded"):
        total = sum(med(side).values())
        print(f"ratio treadle/{side} tokens/s (Trainer.train_step's train_s): {total / w['train_s']:.2f}")  # fmt: skip
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        batch = make_batch(99, vocab_size=vocab, lengths=lengths, seq_len=args.seq_len,
                           prompts=prompts, group_size=args.group_size)  # fmt: skip
        ready = store_batch(store, batch)
        trainer.step = 98
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(ready, batch.SerializeToString())
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
