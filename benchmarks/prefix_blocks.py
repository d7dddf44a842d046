"""What vLLM's KV cache block size costs a GRPO step on CPU, side by side on one vLLM build.

    .venv/bin/python benchmarks/prefix_blocks.py [--blocks 128 32] [--rounds 12] [--repeats 2]

Prefix caching shares whole KV blocks only. A reverse-text step asks for 16 prompts of
37-41 tokens, 8 samples of each (one request with ``n = 8``, as the env runner sends a
group's first calls), 24 tokens at most: with vLLM's CPU default of 128-token blocks no
prompt fills a block, and every sample computes its prompt again; with 32-token blocks
the first 32 tokens of a prompt are computed once for its 8 samples (what the inference
service now starts vLLM with on CPU: ``[inference] block_size``).

Each block size gets a fresh vLLM on the CPUs `treadle rl` gives generation (with its
thread settings), the SFT warm start (``--model``), a warm-up round, then ``--rounds``
rounds of one step's requests at once, each round new prompts from the task file. Reports
seconds per round (median, min..max) and the CPU seconds vLLM's processes used per round.
The order of the block sizes is reversed on odd repeats. Both serve the same model; the
tokens differ only by sampling (temperature 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from distillation import Teacher  # noqa: E402
from teacher_calls import tree_cpu_s  # noqa: E402
from vs_trl import ensure_sft_model  # noqa: E402

from treadle.env_runner.envs.reverse_text import prompt  # noqa: E402

TASKS = ROOT / "outputs" / "reverse-text" / "data" / "train.jsonl"


def step_prompts(model: Path, count: int) -> list[list[int]]:
    """``count`` reverse-text chat prompts as token ids (the model's chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines()[:count]]
    out = []
    for task in tasks:
        ids = tok.apply_chat_template(prompt(task), add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


async def one_round(url: str, prompts: list[list[int]], n: int, max_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(ids: list[int]) -> None:
            body = {"model": "teacher", "token_ids": ids,
                    "sampling_params": {"n": n, "max_tokens": max_tokens, "temperature": 1.0,
                                        "logprobs": 0, "detokenize": False}}  # fmt: skip
            resp = await client.post("/inference/v1/generate", json=body)
            resp.raise_for_status()
            if len(resp.json()["choices"]) != n:
                raise RuntimeError(f"asked for {n} samples, got {len(resp.json()['choices'])}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(ids) for ids in prompts))
        return time.perf_counter() - t0


def measure(args: argparse.Namespace, model: Path, block: int, prompts: list[list[int]]) -> dict:
    log = args.out / f"vllm-block{block}.log"
    per = args.groups
    with Teacher(model, log, cpus="generation", extra_args=("--block-size", str(block))) as vllm:
        assert vllm.proc is not None
        asyncio.run(one_round(vllm.url, prompts[:per], args.group_size, args.max_tokens))
        cpu0 = tree_cpu_s(vllm.proc.pid)
        times = []
        for r in range(1, args.rounds + 1):
            ids = prompts[r * per : (r + 1) * per]
            times.append(asyncio.run(one_round(vllm.url, ids, args.group_size, args.max_tokens)))
        cpu = (tree_cpu_s(vllm.proc.pid) - cpu0) / args.rounds
    return {"block": block, "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times), "cpu_s": cpu}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="default: the SFT warm start (built if missing)")
    p.add_argument("--blocks", type=int, nargs="+", default=[128, 32])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--groups", type=int, default=16, help="prompts per round")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (n)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-prefix-blocks")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or ensure_sft_model()
    prompts = step_prompts(model, args.groups * (args.rounds + 1))
    lengths = sorted(map(len, prompts))
    print(f"{len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens, {args.group_size} "
          f"samples each, {args.max_tokens} tokens at most", flush=True)  # fmt: skip
    results = []
    for rep in range(args.repeats):
        for block in args.blocks if rep % 2 == 0 else list(reversed(args.blocks)):
            got = measure(args, model, block, prompts)
            results.append(got)
            print(f"block {block:4d}: {got['median_s']:.3f} s a round [{got['min_s']:.3f}.."
                  f"{got['max_s']:.3f}], vLLM CPU {got['cpu_s']:.3f} s a round", flush=True)  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
