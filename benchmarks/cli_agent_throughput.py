"""CLI-agent harness throughput: rollouts/s of a CommandHarness per dialect and runtime.

    .venv/bin/python benchmarks/cli_agent_throughput.py [--n 200] [--concurrency 8]
        [--runtimes local,sandbox] [--dialects openai_chat,openai_responses,anthropic]

(also run by ``benchmarks/env_runner_throughput.py``, part ``cli_agent``.)

What runs, all on this machine, in this process but the agents:

    run_rollout ×N (``--concurrency`` at once) ── CommandHarness ── agent program (a separate
        │   process per rollout, in the runtime)                        │ one model call in the
        │                                                               ▼ row's dialect, then exit
        └─ InterceptionServer (per-rollout endpoint) ── ModelSession ── instant model

The agent is a small standard-library program (``testkit.one_call_agent``): it reads the rollout's messages, makes one
call to ``OPENAI_BASE_URL``/``ANTHROPIC_BASE_URL`` in the row's dialect (with the rollout's
key), writes the answer to a file and exits; the reward reads that file. The instant
model returns fixed qwen3 ids at once. So a row measures what a CLI-agent rollout costs
the runner beyond the agent's own work: the work dir, the process start (in the sandbox:
bubblewrap and the relay), the interception round trip in that dialect, the rollout's
recording and reward. rollouts/s = N / wall time; latency is per rollout (median, p99);
CPU ms/rollout is the whole machine's busy time over the row (run it on an idle machine). Every rollout's status is checked.
A real agent (Node, litellm) costs its own start-up on top (seconds), which this leaves out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from interception_overhead import InstantModel  # noqa: E402  (benchmarks/, beside this file)

from testkit.one_call_agent import answered, put_agent  # noqa: E402

TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "qwen3"
ANSWER = "olleh<|im_end|>"


async def measure(
    dialects: list[str], runtimes: list[str], n: int, concurrency: int
) -> list[dict[str, Any]]:
    """One row per runtime x dialect."""
    from tokenizers import Tokenizer

    import treadle_native
    from treadle.env_runner.environments import Environment
    from treadle.env_runner.harnesses.command import CommandHarness
    from treadle.env_runner.interception import InterceptionServer
    from treadle.env_runner.rollout import RolloutContext
    from treadle.env_runner.rubric import Rubric
    from treadle.env_runner.runtimes.base import SandboxLimits
    from treadle.env_runner.runtimes.local import LocalRuntime
    from treadle.env_runner.runtimes.sandbox import SandboxRuntime

    renderer = treadle_native.Renderer("qwen3", TOKENIZER)
    ids = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).encode(ANSWER).ids
    model = InstantModel(ids)
    root = Path(tempfile.mkdtemp(prefix="clib-", dir="/tmp"))  # short: unix socket paths
    limits = SandboxLimits(wall_s=60, cpu_s=60, memory_bytes=1 << 30)
    made = {"local": lambda: LocalRuntime(), "sandbox": lambda: SandboxRuntime(limits)}

    rows = []
    try:
        async with InterceptionServer() as server:
            for runtime_name in runtimes:
                for dialect in dialects:
                    runtime = made[runtime_name]()
                    harness = CommandHarness(
                        [runtime.python(), "-I", "{workdir}/agent.py", dialect],
                        setup=put_agent, workdir_root=root, timeout_s=60,
                    )  # fmt: skip
                    env = Environment("agent", prompt=lambda t: "Reverse: hello", harness=harness,
                                      rubric=Rubric(rewards=[answered]), runtime=runtime)  # fmt: skip
                    rc = RolloutContext(renderer, model, "bench", services={"interception": server})
                    row = await _row(env, rc, f"{runtime_name}-{dialect}", n, concurrency)
                    rows.append({"runtime": runtime_name, "dialect": dialect, **row})
                    await asyncio.to_thread(_empty, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _empty(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()


async def _row(env: Any, rc: Any, name: str, n: int, concurrency: int) -> dict[str, Any]:
    """``n`` rollouts of ``env``, ``concurrency`` at once (after a warm-up of 8)."""
    from treadle.env_runner.rollout import run_rollout
    from treadle.proto.v1 import rollout_pb2

    Kind = rollout_pb2.RolloutStatus.Kind
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    statuses: dict[str, int] = {}

    async def one(i: int) -> None:
        async with gate:
            req = rollout_pb2.RolloutRequested(
                rollout_id=f"{name}-{i}", group_id="g", env="agent", task_id="t",
                task_json="{}", sampling=rollout_pb2.SamplingParams(max_tokens=16, temperature=1.0),
            )  # fmt: skip
            t0 = time.perf_counter()
            r = await run_rollout(req, env, rc)
            latencies.append(time.perf_counter() - t0)
            ok = r.status.kind == Kind.KIND_OK and r.reward == 1.0
            key = "ok" if ok else f"{Kind.Name(r.status.kind)}: {r.status.message[:120]}"
            statuses[key] = statuses.get(key, 0) + 1

    await asyncio.gather(*(one(-1 - i) for i in range(min(8, n))))  # warm-up
    latencies.clear()
    statuses.clear()
    cpu0 = _machine_cpu_s()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    return {"n": n, "rollouts_per_s": n / wall, "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": float(np.percentile(latencies, 99)) * 1e3,
            "cpu_ms_per_rollout": (_machine_cpu_s() - cpu0) / n * 1e3, "statuses": statuses}  # fmt: skip


def _machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine (/proc/stat): the runner, the agents and what
    bubblewrap reaps inside its namespaces alike (so: run it on an otherwise idle machine)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def print_rows(rows: list[dict[str, Any]], concurrency: int) -> None:
    print(f"\nCLI-agent harness, instant model, concurrency {concurrency} "
          f"(rollouts/s; latency per rollout; machine CPU per rollout)")  # fmt: skip
    print(f"{'runtime':>8} {'dialect':>17} {'n':>5} {'rollouts/s':>11} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'CPU ms':>7}  statuses")  # fmt: skip
    for r in rows:
        print(f"{r['runtime']:>8} {r['dialect']:>17} {r['n']:>5} {r['rollouts_per_s']:>11.1f} "
              f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['cpu_ms_per_rollout']:>7.1f}  "
              f"{json.dumps(r['statuses'])}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--n", type=int, default=200, help="rollouts per row")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--runtimes", default="local,sandbox")
    p.add_argument("--dialects", default="openai_chat,openai_responses,anthropic")
    args = p.parse_args()
    if not (TOKENIZER / "tokenizer.json").is_file():
        sys.exit(f"{TOKENIZER} has no tokenizer.json (is ../shared beside the checkout?)")
    runtimes = [x for x in args.runtimes.split(",") if x]
    dialects = [x for x in args.dialects.split(",") if x]
    bad = set(runtimes) - {"local", "sandbox"} or set(dialects) - {
        "openai_chat",
        "openai_responses",
        "anthropic",
    }
    if bad:
        sys.exit(f"unknown runtimes or dialects: {sorted(bad)}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print_rows(asyncio.run(measure(dialects, runtimes, args.n, args.concurrency)), args.concurrency)


if __name__ == "__main__":
    main()
