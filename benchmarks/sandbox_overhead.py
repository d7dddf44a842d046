"""What the bubblewrap sandbox adds to starting a program, measured side by side in one run.

    .venv/bin/python benchmarks/sandbox_overhead.py [--n 30]

Runs ``true`` and ``python -c pass`` (the interpreter the sandbox runs,
:func:`python_executable`) ``--n`` times each, directly (an asyncio subprocess, as the
sandbox starts bwrap) and inside a :class:`Sandbox` with the python_code environment's
limits, alternating direct and sandboxed runs so both see the same machine load. Prints
the median and p90 wall time of each and the sandbox's overhead (median difference) and
ratio. Wall time is from spawning to reaping the process, output drained; a fresh work
directory per sandboxed run is included, as a rollout pays for it too. As root the sandbox
also creates and removes its cgroups (memory, pids, cpuacct), writes the user namespace's
uid/gid maps and starts the program through ``setpriv``; as another user it counts the
user's tasks in /proc instead; either way the work dir is settled after the run: all part
of the overhead measured.

Then grades one correct python_code answer ``--n`` times (:func:`run_tests`: the candidate
and the judge in two sandboxes side by side) and prints its median and p90.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from treadle.env_runner.envs.python_code import run_tests, sandbox_limits
from treadle.env_runner.runtimes.sandbox import (
    Sandbox,
    bwrap_path,
    python_executable,
    python_runtime,
)


async def direct(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited with {proc.returncode}")
    return time.perf_counter() - t0


async def sandboxed(argv: list[str], root: Path, i: int) -> float:
    sandbox = Sandbox(root / f"w{i}", sandbox_limits(10.0), ro_paths=python_runtime())
    t0 = time.perf_counter()
    result = await sandbox.run(argv)
    elapsed = time.perf_counter() - t0
    if not result.ok:
        raise RuntimeError(
            f"{argv} in the sandbox: {result.status} {result.message} {result.stderr[-500:]!r}"
        )
    return elapsed


def p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


ADD_TASK = {"id": "add", "prompt": "Write add(a, b).", "entry_point": "add", "timeout_s": 10,
            "tests": "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 4"}  # fmt: skip


async def grades(n: int) -> list[float]:
    """Wall time of grading one correct python_code answer, ``n`` times."""
    out = []
    for _ in range(n + 1):
        t0 = time.perf_counter()
        grade = await run_tests(ADD_TASK, "def add(a, b):\n    return a + b\n")
        out.append(time.perf_counter() - t0)
        if not grade.passed:
            raise RuntimeError(f"a correct answer graded {grade.outcome}: {grade.stderr_tail}")
    return out[1:]  # the first warms the page cache


async def measure(n: int) -> list[tuple[str, list[float], list[float]]]:
    true = shutil.which("true") or "/usr/bin/true"
    cases = [("true", [true]), ("python -c pass", [python_executable(), "-c", "pass"])]
    root = Path(tempfile.mkdtemp(prefix="treadle-sandbox-bench-"))
    out = []
    try:
        for label, argv in cases:
            await direct(argv)  # warm the page cache for both
            await sandboxed(argv, root, -1)
            d: list[float] = []
            s: list[float] = []
            for i in range(n):
                d.append(await direct(argv))
                s.append(await sandboxed(argv, root, i))
            out.append((label, d, s))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=30, help="runs of each program each way (default 30)")
    args = p.parse_args()
    if args.n < 1:
        p.error("--n must be at least 1")
    print(
        f"bwrap: {bwrap_path()}  python: {python_executable()}  uid: {os.geteuid()}  cpus: {os.cpu_count()}"
    )
    print(f"n = {args.n} runs each, milliseconds\n")
    header = f"{'program':<16} {'direct p50':>10} {'p90':>8} {'sandbox p50':>12} {'p90':>8} {'overhead':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for label, d, s in asyncio.run(measure(args.n)):
        dm, sm = statistics.median(d), statistics.median(s)
        print(
            f"{label:<16} {dm * 1e3:>10.1f} {p90(d) * 1e3:>8.1f} {sm * 1e3:>12.1f} {p90(s) * 1e3:>8.1f}"
            f" {(sm - dm) * 1e3:>+9.1f} {sm / dm:>5.1f}x"
        )
    g = asyncio.run(grades(args.n))
    print(f"\npython_code grade (candidate + judge): p50 {statistics.median(g) * 1e3:.1f}"
          f"  p90 {p90(g) * 1e3:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
