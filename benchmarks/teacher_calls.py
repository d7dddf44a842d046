"""What a distillation teacher's prompt logprobs cost, by how they are asked for, side by
side on one teacher vLLM.

    .venv/bin/python benchmarks/teacher_calls.py [--model DIR] [--sequences 128] [--repeats 3]

The teacher scores a step's sampled sequences (reverse-text: 128 of 40-80 tokens). Two
ways, the same sequences, each timed ``--repeats`` times after one warm-up:

- ``token route``: one request per sequence on vLLM's token route
  (/inference/v1/generate, ``prompt_logprobs: 0``, ``max_tokens: 1``), up to
  ``--in-flight`` at once (``InferenceClient.prompt_logprobs``; what ``Teacher`` sends to a
  server without /v1/completions);
- ``completions``: one /v1/completions request per ``--per-request`` sequences, the prompts
  given as token ids (``prompt_logprobs: 0``, ``max_tokens: 1``;
  ``InferenceClient.prompt_logprobs_many``, what ``Teacher`` sends: one request a call, a
  call being a group's sequences up to ``max_sequences_per_call``).

Each way is timed asking for the sampled token only (top-0) and for the ``--top-k`` most
likely tokens at each position too (what ``distill-topk`` asks). Both ways must give the
same logprobs (checked at top-k: the largest difference is printed). The teacher
is the benchmark's vLLM (benchmarks/distillation.py's ``Teacher``: served as 'teacher', the
token route on), on the CPUs vLLM picks. Model: ``--model``, default the SFT warm start.

    .venv/bin/python benchmarks/teacher_calls.py --paced 40 [--gap-s 0.28] [--per-call 8]

``--paced N``: what a teacher costs its CPU when asked as the distillation loop asks it --
one call of ``--per-call`` sequences every ``--gap-s`` seconds (reverse-text: a group of 8
completes about every 0.28 s) -- with vLLM's model worker in its engine process (how the
inference service and ``Teacher`` start vLLM on CPU, ``cpu_process_settings``) and in a
process of its own (vLLM's default), each teacher alone on the CPUs `treadle rl` gives the
trainer. Reports the CPU seconds its processes used per call (user + system, every
process of the server), the calls' latency, and the CPU it uses idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from distillation import Teacher  # noqa: E402
from vs_trl import ensure_sft_model  # noqa: E402

from treadle.services.inference_client import InferenceClient  # noqa: E402


def sequences(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, int(rng.integers(40, 81))).tolist() for _ in range(n)]


async def token_route(
    url: str, seqs: list[list[int]], in_flight: int, top_k: int = 0
) -> list[np.ndarray]:
    client = InferenceClient(url, model="teacher", timeout_s=300, max_retries=0)
    client.completions = False  # one token-route request a sequence
    slots = asyncio.Semaphore(in_flight)

    async def one(ids: list[int]) -> np.ndarray:
        async with slots:
            (got,) = await client.prompt_topk_many([ids], top_k)
            return np.concatenate([got.logprobs[:, None], got.top_logprobs], axis=1)

    try:
        return list(await asyncio.gather(*(one(s) for s in seqs)))
    finally:
        await client.aclose()


async def completions(
    url: str, seqs: list[list[int]], per_request: int, top_k: int = 0
) -> list[np.ndarray]:
    client = InferenceClient(url, model="teacher", timeout_s=300, max_retries=0)
    try:
        parts = [seqs[i : i + per_request] for i in range(0, len(seqs), per_request)]
        got = await asyncio.gather(*(client.prompt_topk_many(p, top_k) for p in parts))
        if not client.completions:
            raise SystemExit(f"the teacher at {url} has no /v1/completions")
    finally:
        await client.aclose()
    return [np.concatenate([x.logprobs[:, None], x.top_logprobs], axis=1)
            for part in got for x in part]  # fmt: skip


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its descendants."""
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


async def paced(url: str, calls: int, per_call: int, gap_s: float, vocab: int) -> list[float]:
    """``calls`` calls of ``per_call`` sequences, one started every ``gap_s``: latencies."""
    client = InferenceClient(url, model="teacher", timeout_s=300, max_retries=0)
    latencies: list[float] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        await client.prompt_logprobs_many(sequences(per_call, vocab, seed=i))
        latencies.append(time.perf_counter() - t0)

    try:
        tasks = []
        for i in range(calls):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(gap_s)
        await asyncio.gather(*tasks)
    finally:
        await client.aclose()
    return latencies


def paced_main(args: argparse.Namespace, model: Path, vocab: int) -> None:
    rows = []
    for label, inprocess in (("worker in process", True), ("worker of its own", False)):
        log = args.out / f"teacher-{'inprocess' if inprocess else 'own'}.log"
        with Teacher(model, log, cpus="training", inprocess_worker=inprocess) as teacher:
            assert teacher.proc is not None
            asyncio.run(paced(teacher.url, 5, args.per_call, 0.1, vocab))  # warm-up
            time.sleep(2)  # past vLLM's 1-s busy wait after a step
            c0 = tree_cpu_s(teacher.proc.pid)
            time.sleep(5)
            idle = (tree_cpu_s(teacher.proc.pid) - c0) / 5
            c0 = tree_cpu_s(teacher.proc.pid)
            lat = asyncio.run(paced(teacher.url, args.paced, args.per_call, args.gap_s, vocab))
            per_call = (tree_cpu_s(teacher.proc.pid) - c0) / args.paced
            rows.append((label, per_call, statistics.median(lat), max(lat), idle))
    print(f"\n{args.paced} calls of {args.per_call} sequences, one every {args.gap_s} s, "
          "the teacher alone on the trainer's CPUs:")  # fmt: skip
    for label, per_call, p50, worst, idle in rows:
        print(f"{label:>18}: {per_call:.3f} CPU-s a call ({per_call / args.gap_s:.0%} of a "
              f"CPU at this pace), latency p50 {p50:.3f} s, max {worst:.3f} s; "
              f"idle {idle:.3f} CPU-s/s")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path)
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--in-flight", type=int, default=64, help="token route: requests at once")
    p.add_argument("--per-request", type=int, default=64, help="completions: prompts a request")
    p.add_argument("--top-k", type=int, default=8,
                   help="each way also asked for the top k at each position (top-k distillation)")  # fmt: skip
    p.add_argument(
        "--paced",
        type=int,
        default=0,
        metavar="N",
        help="N calls at the loop's pace, worker in process vs its own (above)",
    )
    p.add_argument("--gap-s", type=float, default=0.28, help="--paced: seconds between calls")
    p.add_argument("--per-call", type=int, default=8, help="--paced: sequences a call")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-teacher-calls")
    args = p.parse_args()
    model = (args.model or ensure_sft_model()).resolve()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.paced:
        paced_main(args, model, vocab)
        return
    seqs = sequences(args.sequences, vocab)
    ways = {
        f"{way} top-{k}": (lambda url, way=way, k=k: token_route(url, seqs, args.in_flight, k)
                           if way == "token route" else completions(url, seqs, args.per_request, k))
        for k in sorted({0, args.top_k}) for way in ("token route", "completions")
    }  # fmt: skip
    times: dict[str, list[float]] = {w: [] for w in ways}
    answers: dict[str, list[np.ndarray]] = {}
    with Teacher(model, args.out / "teacher.log") as teacher:
        for way, call in ways.items():
            answers[way] = asyncio.run(call(teacher.url))  # warm-up
        for _ in range(args.repeats):  # interleaved: drift hits both alike
            for way, call in ways.items():
                t0 = time.perf_counter()
                asyncio.run(call(teacher.url))
                times[way].append(time.perf_counter() - t0)
    k = args.top_k
    diff = max(float(np.max(np.abs(a - b))) for a, b in
               zip(answers[f"token route top-{k}"], answers[f"completions top-{k}"],
                   strict=True))  # fmt: skip
    tokens = sum(len(s) for s in seqs)
    print(f"\n{args.sequences} sequences, {tokens} tokens; {args.repeats} repeats; "
          f"largest logprob difference between the two: {diff:.2e}")  # fmt: skip
    base = statistics.median(times["token route top-0"])
    for way, ts in times.items():
        med = statistics.median(ts)
        print(f"{way:>20}: median {med:.3f} s [{min(ts):.3f}..{max(ts):.3f}], "
              f"{tokens / med:,.0f} tokens/s, {base / med:.2f}x the token route's top-0")  # fmt: skip


if __name__ == "__main__":
    main()
