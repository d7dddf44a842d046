"""Asynchrony pays: steps per minute at max_async_level 0 vs 1 vs 2, side by side.

    .venv/bin/python benchmarks/async_speedup.py [--steps 12] [--median-s 0.1] [--sigma 1.0] [--concurrency 128]

Runs `treadle rl` three times on the reverse-text example (same model, data, group
shape) with an environment whose latency is log-normal (benchmarks/slow_env.py), only
max_async_level changing. From each run's metrics.jsonl: steps per minute between the
first and last trainer step, and the trainer idle fraction (time waiting for a batch /
(waiting + stepping)), and the mean wait per step (at level 0: the rollout time the step
could not hide). Reported side by side with the ratio to level 0. The goal is
>= 1.8x steps/min at level 1 when rollout time is close to train step time; the env
latency defaults are chosen for that on a 2-core CPU — check the printed rollout and
step times and adjust --median-s if they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reverse-text"


def run_level(level: int, steps: int, concurrency: int, env: dict[str, str]) -> dict[str, float]:
    name = f"async-level{level}"
    out = ROOT / "outputs" / name
    if out.exists():
        import shutil

        shutil.rmtree(out)
    argv = [
        str(Path(sys.executable).parent / "treadle"), "rl", "@", str(EXAMPLE / "rl.toml"),
        "--run.name", name,
        "--orchestrator.max_async_level", str(level),
        "--orchestrator.max_off_policy_steps", str(max(2, level)),
        "--orchestrator.max_steps", str(steps), "--trainer.max_steps", str(steps),
        "--orchestrator.env", "slow_reverse_text",
        "--env_runner.envs", '["slow_reverse_text"]',
        "--env_runner.environments", '{slow_reverse_text = "slow_env:ENVIRONMENT"}',
        "--env_runner.max_concurrency", str(concurrency),
        "--trainer.checkpoint_every", "0",
    ]  # fmt: skip
    print(f"$ {' '.join(argv)}", flush=True)
    proc = subprocess.run(argv, cwd=ROOT, env=env)
    if proc.returncode != 0:
        sys.exit(f"level {level} failed with exit code {proc.returncode}")
    rows = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    trainer = sorted((r for r in rows if r["service"] == "trainer"), key=lambda r: r["step"])
    first, last = trainer[0], trainer[-1]
    minutes = (last["time"] - first["time"]) / 60
    waiting = sum(r.get("wait_s", 0.0) for r in trainer[1:])
    stepping = sum(r.get("step_time_s", 0.0) for r in trainer[1:])
    return {
        "steps_per_min": (len(trainer) - 1) / minutes if minutes > 0 else float("nan"),
        "trainer_idle_fraction": waiting / (waiting + stepping)
        if waiting + stepping > 0
        else float("nan"),
        "train_step_s": stepping / max(1, len(trainer) - 1),
        "wait_s": waiting / max(1, len(trainer) - 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--median-s", type=float, default=0.1)
    p.add_argument(
        "--concurrency",
        type=int,
        default=128,
        help="rollouts an env runner runs at once (128 = a whole step of the example)",
    )
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--levels", type=int, nargs="*", default=[0, 1, 2])
    args = p.parse_args()
    if not (ROOT / "outputs" / "reverse-text-sft" / "final_model").exists():
        sys.exit(
            "run the reverse-text SFT first (see examples/README.md): the RL config starts from its model"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    env["SLOW_ENV_MEDIAN_S"] = str(args.median_s)
    env["SLOW_ENV_SIGMA"] = str(args.sigma)
    results = {level: run_level(level, args.steps, args.concurrency, env) for level in args.levels}
    base = results[args.levels[0]]["steps_per_min"]
    print(
        f"\nenv latency: log-normal, median {args.median_s}s, sigma {args.sigma}; "
        f"{args.steps} steps per run; {args.concurrency} rollouts at once"
    )
    print(
        f"{'max_async_level':>16} {'steps/min':>10} {'vs level ' + str(args.levels[0]):>12} {'trainer idle':>13} {'train step s':>13} {'wait s':>7}"
    )
    for level, r in results.items():
        print(
            f"{level:>16} {r['steps_per_min']:>10.2f} {r['steps_per_min'] / base:>11.2f}x {r['trainer_idle_fraction']:>12.0%} {r['train_step_s']:>13.2f} {r['wait_s']:>7.2f}"
        )


if __name__ == "__main__":
    main()
