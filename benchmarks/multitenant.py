"""Three runs on one hosted deployment vs the same three runs as three separate stacks,
side by side on this machine: memory, and steps/min per run and in total.

    .venv/bin/python benchmarks/multitenant.py [--steps 8] [--rank 8]

Runs: reverse_text, arithmetic and countdown (built-in environments, their own task
sets), each LoRA rank ``--rank`` on the same tiny random Qwen3 (hidden 128, 2 layers),
group size 4, 2 groups per step, 24 sampled tokens per completion, ``--steps`` steps.

- hosted: one nats-server with every run's own users, one inference (vLLM serving each
  run's adapter by its key), one trainer (every run's adapter on one base), and per run
  an orchestrator and an env runner (``tests/testkit/platform.py``);
- separate: three ``treadle rl`` stacks started together, each with its own embedded
  nats-server, vLLM, trainer, orchestrator and env runner (LoRA too; CPUs not split
  between services, as in the hosted deployment).

Startup: from launch to the first trained step of any run. Memory: the proportional set size (PSS: shared pages divided among the processes that
map them) of every process of the deployment, summed, sampled each second; the peak is
reported. Steps/min of a run: its steps after the first divided by the time from its
first to its last trained step (the trainer's own records: the usage ledger's step
times for the hosted runs, metrics.jsonl for the stacks), so startup is not counted;
startup is reported apart. A random model does not learn: held-out reward is not
measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import psutil  # noqa: E402

from testkit.chaos import build_model  # noqa: E402
from testkit.hosted import nats_cfg, write_config  # noqa: E402
from testkit.platform import Deployment, RunPlan, Settings, write_env_tasks  # noqa: E402

RUNS = (("rt", "reverse_text"), ("ar", "arithmetic"), ("cd", "countdown"))


def pss_of(pids: list[int]) -> int:
    """Summed PSS of ``pids`` and all their descendants, bytes."""
    seen: set[int] = set()
    total = 0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            tree = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in tree:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                with open(f"/proc/{p.pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            total += int(line.split()[1]) * 1024
                            break
            except OSError:
                continue
    return total


class Sampler:
    """Samples the summed PSS of a set of process trees each second (peak kept)."""

    def __init__(self, pids: Any):
        self.pids = pids  # a callable returning the pids now
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, pss_of(self.pids()))
            self._stop.wait(1.0)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def rate(times: dict[int, float], steps: int) -> float:
    """Steps/min from the first to the last step's time."""
    span = times[steps] - times[1]
    return 60.0 * (steps - 1) / span if span > 0 else float("nan")


def hosted(root: Path, model: Path, steps: int, rank: int) -> dict[str, Any]:
    plans = [RunPlan(name, env, seed=i, steps=steps) for i, (name, env) in enumerate(RUNS)]
    dep = Deployment(root, model, plans, Settings(rank=rank))
    launched = time.time()

    def pids() -> list[int]:
        found = [p.pid for p in dep.procs.values() if p.pid is not None]
        server = dep.server.process if dep.server is not None else None
        return found + ([server.pid] if server is not None else [])

    with Sampler(pids) as sampler:
        dep.start()
        try:
            dep.wait_trained()
            times = {p.name: hosted_step_times(dep, p.name) for p in plans}
        finally:
            dep.stop()
    return {"peak": sampler.peak, "startup_s": min(t[1] for t in times.values()) - launched,
            "rates": {name: rate(times[name], steps) for name in times}}  # fmt: skip


def hosted_step_times(dep: Deployment, run: str) -> dict[int, float]:
    """When the hosted trainer finished each step of ``run`` (its usage records)."""
    import asyncio

    from treadle.services import usage
    from treadle.services.bus import Bus

    async def main() -> dict[int, float]:
        assert dep.server is not None
        cfg = nats_cfg(dep.server, dep.creds[run], "admin")
        bus = await Bus.connect(cfg, run, role="admin")
        try:
            ledger = await usage.read_usage(bus)
        finally:
            await bus.close()
        return {int(u.split("/")[1]): r.time.ToDatetime().timestamp()
                for u, r in ledger.units.items() if u.startswith("step/")}  # fmt: skip

    return asyncio.run(main())


def stack_config(root: Path, model: Path, plan: RunPlan, s: Settings) -> Path:
    """``plan`` as its own `treadle rl` stack's file, with the hosted deployment's settings."""
    name = plan.name
    tasks = plan.tasks or write_env_tasks(plan.env, root / name / "tasks.jsonl")
    return write_config(root / name / "rl.toml", {
        "run": {"name": name, "output_dir": root / "out"},
        "launcher": {"split_cpus": False, "health_timeout_s": 900},
        "inference": {"model": model, "max_model_len": s.max_model_len, "dtype": "float32"},
        "trainer": {"model": model, "max_steps": plan.steps, "seed": plan.seed,
                    "checkpoint_every": plan.steps},
        "trainer.lora": {"enabled": True, "rank": s.rank, "alpha": 2.0 * s.rank},
        "trainer.optim": {"lr": plan.lr},
        "orchestrator": {
            "env": plan.env, "tasks": tasks, "max_steps": plan.steps,
            "group_size": s.group_size, "groups_per_step": s.groups_per_step,
            "max_groups_in_flight": 2 * s.groups_per_step, "max_async_level": 1,
            "seq_len": s.seq_len, "seed": plan.seed, "algorithm_args": s.algorithm_args,
        },
        "orchestrator.sampling": {"max_tokens": s.max_tokens},
        "env_runner": {"envs": [plan.env], "tokenizer": model, "max_concurrency": s.max_concurrency},
    })  # fmt: skip


def separate(root: Path, model: Path, steps: int, rank: int) -> dict[str, Any]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    launched = time.time()
    with Sampler(lambda: [p.pid for p in procs.values()]) as sampler:
        for i, (name, env) in enumerate(RUNS):
            cfg = stack_config(
                root, model, RunPlan(name, env, seed=i, steps=steps), Settings(rank=rank)
            )
            log = open(root / f"{name}.log", "wb")  # noqa: SIM115
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "treadle.services.cli", "rl", "@", str(cfg)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        codes = {name: p.wait(timeout=3600) for name, p in procs.items()}
    if any(codes.values()):
        raise SystemExit(f"a separate stack failed: {codes} (logs under {root})")
    rates, first = {}, []
    for name, _ in RUNS:
        times = {}
        for line in (root / "out" / name / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("service") == "trainer" and rec.get("step", 0) >= 1:
                times.setdefault(int(rec["step"]), float(rec["time"]))
        rates[name] = rate(times, steps)
        first.append(times[1])
    return {"peak": sampler.peak, "rates": rates, "startup_s": min(first) - launched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="multitenant-"))
    model = build_model(tmp / "model")
    print(f"{len(RUNS)} runs x {args.steps} steps, LoRA rank {args.rank}, {os.cpu_count()} CPUs; "
          f"work in {tmp}", flush=True)  # fmt: skip
    results = {"hosted": hosted(tmp / "hosted", model, args.steps, args.rank)}
    print("hosted done", flush=True)
    results["separate"] = separate(tmp / "separate", model, args.steps, args.rank)
    print(f"\n{'deployment':<10} {'peak PSS':>10} {'to step 1':>10} "
          + " ".join(f"{n + ' steps/min':>14}" for n, _ in RUNS) + f" {'total':>8}")  # fmt: skip
    for mode, r in results.items():
        total = sum(r["rates"].values())
        r["total"] = total
        print(f"{mode:<10} {r['peak'] / 2**30:>8.2f}GiB {r['startup_s']:>9.0f}s "
              + " ".join(f"{r['rates'][n]:>14.1f}" for n, _ in RUNS) + f" {total:>8.1f}")  # fmt: skip
    h, s = results["hosted"], results["separate"]
    print(f"hosted / separate: memory {h['peak'] / s['peak']:.2f}x (goal < 0.5), total steps/min "
          f"{h['total'] / s['total']:.2f}x (goal >= 0.8)")  # fmt: skip


if __name__ == "__main__":
    main()
