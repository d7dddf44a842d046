"""Trainer on CPU, one process: tokens/s of a training step, checkpoint save/load and
weight publication times on the tiny Qwen3 model (Treadle's test model shape).

    .venv/bin/python benchmarks/trainer_bench.py [--steps 5] [--seq-len 1024] [--micro-batches 4]

Numbers are wall-clock medians over the steps after a warm-up step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
