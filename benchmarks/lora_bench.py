"""LoRA vs full fine-tuning in Treadle's trainer on CPU, one process, side by side on the
same batches: trainable parameters, optimizer step time, publication (time and bytes)
and checkpoint (time and bytes).

    .venv/bin/python benchmarks/lora_bench.py [--steps 5] [--rank 16] [--threads N]

Models: the tiny Qwen3 test model (hidden 64, 2 layers, vocab of its BPE tokenizer) and,
when present, the reverse-text example's model (outputs/reverse-text/model: hidden 256,
4 layers, vocab 346). Batches: samples of 40..60 tokens packed into 1024-token
micro-batches (the reverse-text shape), 4 micro-batches a step. LoRA: rank --rank,
alpha 2 x rank, on q k v o gate up down. Numbers are medians over the steps after a
warm-up step; train_s = forward + backward + optimizer, step_s = the whole step
including publication.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from testkit.trainer import TINY, make_batch, store_batch, vocab_size_of  # noqa: E402
from treadle.services.objectstore import LocalObjectStore  # noqa: E402
from treadle.services.tiny_model import build_tiny_model  # noqa: E402
from treadle.trainer.lora import parameter_counts  # noqa: E402
from treadle.trainer.spec import TrainerSection  # noqa: E402
from treadle.trainer.trainer import Trainer  # noqa: E402


def measure(model: Path, lora: dict[str, Any], steps: int, root: Path) -> dict[str, float]:
    store = LocalObjectStore(root / "store")
    section = TrainerSection(model=model, device="cpu", optim={"lr": 1e-4}, lora=lora)
    trainer = Trainer(section, store, checkpoint_dir=root / "ckpt")
    vocab = vocab_size_of(model)
    trainable, total = parameter_counts(trainer.policy.model)
    lengths = tuple(40 + (7 * i) % 21 for i in range(80))  # ~4 x 1024 tokens
    train_s, publish_s, step_s = [], [], []
    published = 0
    for step in range(1, steps + 2):
        batch = make_batch(step, vocab_size=vocab, lengths=lengths, seq_len=1024)
        result = trainer.train_step(store_batch(store, batch))
        if step > 1:
            train_s.append(result.metrics["train_s"])
            publish_s.append(result.metrics["publish_s"])
            step_s.append(result.metrics["step_time_s"])
        assert result.weights is not None
        published = sum(f.size_bytes for f in store.read_manifest(result.weights).files)
    started = time.monotonic()
    ref = trainer.save_checkpoint()
    save_s = time.monotonic() - started
    assert ref is not None
    ckpt_bytes = sum(f.size_bytes for f in store.read_manifest(ref).files)
    return {
        "trainable": trainable,
        "total": total,
        "train_s": statistics.median(train_s),
        "publish_s": statistics.median(publish_s),
        "step_s": statistics.median(step_s),
        "tokens": result.metrics["tokens"],
        "published_bytes": published,
        "checkpoint_s": save_s,
        "checkpoint_bytes": ckpt_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    models = {"tiny": build_tiny_model(tmp / "tiny", tokenizer="bpe", spec=TINY)}
    reverse = ROOT / "outputs" / "reverse-text" / "model"
    if (reverse / "config.json").is_file():
        models["reverse-text"] = reverse
    else:
        print(f"({reverse} not found: run examples/reverse-text first to include it)")
    lora = {"enabled": True, "rank": args.rank, "alpha": 2.0 * args.rank}
    print(f"torch threads {torch.get_num_threads()}; {args.steps} steps after a warm-up")
    header = (f"{'model':<13} {'mode':<8} {'trainable':>12} {'of total':>9} {'tokens':>6} "
              f"{'train_s':>8} {'publish_s':>9} {'step_s':>7} {'published':>10} "
              f"{'ckpt_s':>7} {'ckpt':>10}")  # fmt: skip
    print(header)
    for name, model in models.items():
        rows = {}
        for mode, cfg in (("full", {}), (f"lora{args.rank}", lora)):
            rows[mode] = r = measure(model, cfg, args.steps, tmp / name / mode)
            print(f"{name:<13} {mode:<8} {r['trainable']:>12,d} {100 * r['trainable'] / r['total']:>8.2f}% "
                  f"{r['tokens']:>6.0f} {r['train_s']:>8.3f} {r['publish_s']:>9.3f} {r['step_s']:>7.3f} "
                  f"{r['published_bytes'] / 1e6:>8.2f}MB {r['checkpoint_s']:>7.3f} "
                  f"{r['checkpoint_bytes'] / 1e6:>8.2f}MB")  # fmt: skip
        full, low = rows["full"], rows[f"lora{args.rank}"]
        print(f"{name:<13} lora/full: train {low['train_s'] / full['train_s']:.2f}x, "
              f"step {low['step_s'] / full['step_s']:.2f}x, "
              f"published bytes {low['published_bytes'] / full['published_bytes']:.3f}x, "
              f"checkpoint bytes {low['checkpoint_bytes'] / full['checkpoint_bytes']:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
