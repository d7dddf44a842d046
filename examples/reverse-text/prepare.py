"""Prepare the reverse-text example: a tiny Qwen3-architecture model and its data.

    python examples/reverse-text/prepare.py [--out outputs/reverse-text] [--force]

Writes (idempotent: existing files are kept unless --force):
  <out>/model/                 random-init Qwen3-architecture HF checkpoint (head_dim 64) with a
                               near character-level byte BPE and Qwen3's chat template
  <out>/data/train.jsonl       RL tasks   {"id", "text"}
  <out>/data/eval.jsonl        held-out tasks (no string also in train)
  <out>/data/sft.jsonl         SFT conversations (a messages JSONL, what `treadle sft` reads):
                               the environment's own prompt for a string -> its reversal

Everything is derived from --seed, so two runs produce the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

from treadle.env_runner.envs import reverse_text
from treadle.services.tiny_model import TinyModelSpec, build_tiny_model


def strings(rng: random.Random, n: int, min_len: int, max_len: int, exclude: set[str]) -> list[str]:
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        s = "".join(
            rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len))
        )
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("outputs/reverse-text"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=4000, help="RL task strings")
    p.add_argument("--eval", type=int, default=200, help="held-out strings")
    p.add_argument("--sft", type=int, default=4000, help="SFT conversations")
    p.add_argument("--min-len", type=int, default=3)
    p.add_argument("--max-len", type=int, default=6)
    p.add_argument("--force", action="store_true")
    args = p.parse_args()

    model = args.out / "model"
    if args.force or not (model / "model.safetensors").exists():
        spec = TinyModelSpec(
            hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768
        )
        # vocab exactly the tokenizer's: the model cannot sample ids the tokenizer does not know
        build_tiny_model(
            model, tokenizer="bpe", spec=spec, seed=args.seed, bpe_vocab_size=320, vocab_multiple=1
        )
        print(f"wrote {model}")
    data = args.out / "data"
    if args.force or not (data / "sft.jsonl").exists():
        rng = random.Random(args.seed)
        held_out = strings(rng, args.eval, args.min_len, args.max_len, set())
        train = strings(rng, args.train, args.min_len, args.max_len, set(held_out))
        sft = strings(rng, args.sft, args.min_len, args.max_len, set(held_out))
        write_jsonl(
            data / "eval.jsonl", [{"id": f"eval-{i}", "text": s} for i, s in enumerate(held_out)]
        )
        write_jsonl(
            data / "train.jsonl", [{"id": f"train-{i}", "text": s} for i, s in enumerate(train)]
        )
        write_jsonl(
            data / "sft.jsonl",
            [
                {
                    "id": f"sft-{i}",
                    # the conversation an RL rollout of this task starts with, answered right
                    "messages": [
                        *reverse_text.prompt({"text": s}),
                        {"role": "assistant", "content": s[::-1]},
                    ],
                }
                for i, s in enumerate(sft)
            ],
        )
        print(f"wrote {data}/{{train,eval,sft}}.jsonl")


if __name__ == "__main__":
    main()
