"""How `treadle rl` should share a CPU machine's cores between generation and training.

Runs `treadle rl` in the reverse-text shape (as `bus_cost.py`: 16 groups x 8 rollouts per
step, 24 sampled tokens) under each CPU schedule, side by side in one run, and reports
steps/min, s/step, completions/s and CPU seconds per step by service:

    split    vLLM and the trainer get half of the CPUs each and overlap (today's default;
             split-helpers-<generation|training|all>: the orchestrator and env runners
             on vLLM's CPUs, the trainer's, or any, the default)
    shared   both use every CPU (OpenMP threads = all cores) and still overlap
    turns    both use every CPU, and generation waits while the trainer steps
             (max_async_level 0: each step's rollouts come from the policy just published)

plus the same with the async level varied where it matters (`--modes`). The order of the
modes is reversed on odd repeats, so drift in the machine's speed hits every mode alike.

    python benchmarks/cpu_schedule.py --steps 12 --repeats 2
    python benchmarks/cpu_schedule.py --modes split,turns --steps 20
    python benchmarks/cpu_schedule.py --modes split,turns --set trainer.autocast=bfloat16

The first step of each run is left out (vLLM warm-up). Results are only comparable within
one run of this script, on a machine doing nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bus_cost import prepare, run

COMPLETIONS_PER_STEP = 16 * 8  # examples/reverse-text/rl.toml: groups_per_step x group_size

MODES: dict[str, tuple[str, ...]] = {
    "split": ("--launcher.split_cpus", "true"),
    "shared": ("--launcher.split_cpus", "false"),
    "turns": ("--launcher.split_cpus", "false", "--orchestrator.max_async_level", "0"),
    "split-sync": ("--launcher.split_cpus", "true", "--orchestrator.max_async_level", "0"),
    # where the orchestrator and env runners run under split (default: any CPU)
    "split-helpers-generation": (
        "--launcher.split_cpus",
        "true",
        "--launcher.helper_cpus",
        "generation",
    ),
    "split-helpers-training": (
        "--launcher.split_cpus",
        "true",
        "--launcher.helper_cpus",
        "training",
    ),
    "split-helpers-all": ("--launcher.split_cpus", "true", "--launcher.helper_cpus", "all"),
    # split, with every rollout of a step running at once (rl.toml: 32 at a time)
    "split-wide": ("--launcher.split_cpus", "true", "--env_runner.max_concurrency", "128"),
}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--modes", default="split,shared,turns",
                   help=f"comma-separated: {', '.join(MODES)}")  # fmt: skip
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of every run (repeatable), e.g. trainer.autocast=bfloat16")  # fmt: skip
    args = p.parse_args()
    if bad := [s for s in args.set if "=" not in s]:
        sys.exit(f"--set takes KEY=VALUE, got {bad}")
    common = tuple(x for s in args.set for x in (f"--{s.partition('=')[0]}", s.partition("=")[2]))
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        sys.exit(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    for var in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        if var in os.environ:
            sys.exit(f"{var} is set: the launcher then leaves the CPUs alone; unset it")
    model = prepare()
    print(f"{os.cpu_count()} CPUs; {args.steps} steps per run; modes {modes}; settings "
          f"{args.set or 'rl.toml'}", flush=True)  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for i in range(args.repeats):
        for mode in modes if i % 2 == 0 else list(reversed(modes)):
            r = run(f"cpu-schedule-{mode}{i}", args.steps, model, None, MODES[mode] + common)
            print(f"{mode}: {r['steps_per_min']:.2f} steps/min, {r['step_s']:.2f} s/step",
                  flush=True)  # fmt: skip
            results[mode].append(r)
    print(f"\n{'mode':12s}{'steps/min':>11s}{'s/step':>9s}{'compl./s':>10s}   runs (steps/min)")
    base = None
    for mode, rs in results.items():
        spm = sum(r["steps_per_min"] for r in rs) / len(rs)
        base = spm if base is None else base
        print(f"{mode:12s}{spm:11.2f}{60 / spm:9.2f}{spm * COMPLETIONS_PER_STEP / 60:10.1f}   "
              f"{[round(r['steps_per_min'], 2) for r in rs]}  ({spm / base:.2f}x {modes[0]})")  # fmt: skip
    names = sorted({k for rs in results.values() for r in rs for k in r.get("cpu_s_per_step", {})})
    if names:
        print("\nCPU seconds per step, by service (mean over repeats):")
        print(f"{'service':22s}" + "".join(f"{m:>12s}" for m in modes))
        for k in names:
            cells = [
                sum(r.get("cpu_s_per_step", {}).get(k, 0.0) for r in results[m]) / len(results[m])
                for m in modes
            ]
            print(f"{k:22s}" + "".join(f"{v:12.2f}" for v in cells))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
