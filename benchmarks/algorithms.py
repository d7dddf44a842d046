"""Each built-in reward algorithm on the reverse-text recipe, over seeds: mean and spread.

    .venv/bin/python benchmarks/algorithms.py [--algorithms grpo,rloo] [--seeds 3]
        [--steps 80] [--model DIR]

From the SFT warm start (made as `make demo` makes it when missing), for each algorithm
and seed: `treadle rl @ examples/reverse-text/rl.toml` (the default recipe: its group
size, batch, temperature, lr and loss) with ``orchestrator.algorithm`` set, both seeds
set, and exactly ``--steps`` steps (equal steps: what is learned per step, whatever else
the machine does meanwhile); then the held-out greedy and sampled (T=1, 4 per task)
reward of its final model, by the evaluator of benchmarks/learning_reverse_text.py.

Reports each run, then per algorithm the mean, the sample standard deviation and the
min..max of the changes, and whether the default recipe (rl.toml's own algorithm) lowered
held-out greedy reward on any seed. Algorithms that need a teacher (distill,
grpo+distill) are benchmarked by benchmarks/distillation.py; ``sft`` imitates every
rollout it is given (rejection sampling with a teacher: benchmarks/distillation.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reverse-text"
sys.path.insert(0, str(ROOT / "benchmarks"))

from budgeted import final_model, overrides, rl_run_overrides, run_budgeted, treadle_exe  # noqa: E402
from learning_reverse_text import evaluate  # noqa: E402
from vs_trl import ensure_sft_model  # noqa: E402

# the reward algorithms, and what each needs besides the recipe (rl.toml sets grpo's own)
ARGS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "rloo": {},
}


def run_one(algorithm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    name = f"bench-algo-{algorithm}-s{seed}"
    run_dir = ROOT / "outputs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    ov = rl_run_overrides(name, args.model, seed, args.steps) | {
        "orchestrator.algorithm": algorithm,
        "trainer.checkpoint_every": args.steps,
    }
    for key, value in ARGS[algorithm].items():
        ov[f"orchestrator.algorithm_args.{key}"] = value
    recipe = tomllib.loads((EXAMPLE / "rl.toml").read_text())
    default_args = recipe["orchestrator"].get("algorithm_args", {})
    argv = [treadle_exe(), "rl", "@", str(EXAMPLE / "rl.toml"), *overrides(ov)]
    if algorithm != recipe["orchestrator"]["algorithm"] and default_args:
        # the recipe's arguments are grpo's: another algorithm gets a run file without them
        doc = (
            (EXAMPLE / "rl.toml")
            .read_text()
            .replace("algorithm_args = " + _inline(default_args) + "\n", "")
        )
        if "algorithm_args" in doc:
            sys.exit("examples/reverse-text/rl.toml spells algorithm_args otherwise: update "
                     "benchmarks/algorithms.py")  # fmt: skip
        own = args.out / f"rl-{algorithm}.toml"
        own.write_text(doc.replace('"outputs/', f'"{ROOT}/outputs/'))
        argv[3] = str(own)
    log = args.out / f"{name}.log"
    run = run_budgeted(argv, run_dir, log, None)
    if run.steps < args.steps:
        sys.exit(f"{name} trained {run.steps} of {args.steps} steps; see {log}")
    return {
        "algorithm": algorithm,
        "seed": seed,
        "steps": run.steps,
        "rl_s": round(run.ended - (run.first_metrics or run.launched), 1),
        "model": final_model(run_dir, args.model, run.steps),
    }


def _inline(table: dict[str, Any]) -> str:
    """rl.toml's spelling of an inline table ({ normalize = true })."""
    parts = [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    return "{ " + ", ".join(parts) + " }"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--algorithms", default="grpo,rloo")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=80, help="steps per run (rl.toml's: 80)")
    p.add_argument("--model", type=Path, help="starting model (default: the SFT warm start)")
    p.add_argument(
        "--eval-tasks", type=Path, default=ROOT / "outputs" / "reverse-text" / "data" / "eval.jsonl"
    )
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-algorithms")
    args = p.parse_args()
    algorithms = args.algorithms.split(",")
    unknown = sorted(set(algorithms) - set(ARGS))
    if unknown:
        sys.exit(f"--algorithms: {unknown} are not reward algorithms here ({', '.join(ARGS)})")
    args.model = (args.model or ensure_sft_model()).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    recipe = tomllib.loads((EXAMPLE / "rl.toml").read_text())["orchestrator"]

    def ev(model: Path) -> tuple[float, float]:
        greedy = evaluate(model, args.eval_tasks)
        sampled = evaluate(model, args.eval_tasks, temperature=1.0, samples=args.eval_samples)
        return greedy, sampled

    greedy0, sampled0 = ev(args.model)
    print(f"held-out before RL: greedy {greedy0:.3f}, sampled {sampled0:.3f}", flush=True)
    runs: list[dict[str, Any]] = []
    for algorithm in algorithms:
        for seed in range(args.seeds):
            r = run_one(algorithm, seed, args)
            g, s = ev(r.pop("model"))
            r |= {"greedy_after": g, "sampled_after": s,
                  "greedy_change": g - greedy0, "sampled_change": s - sampled0}  # fmt: skip
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in r.items()}), flush=True)  # fmt: skip
            runs.append(r)
    print(f"\n{args.steps} steps from greedy {greedy0:.3f} / sampled {sampled0:.3f}; "
          "mean ± std [min..max] over seeds")  # fmt: skip
    summary: dict[str, Any] = {}
    for algorithm in algorithms:
        mine = [r for r in runs if r["algorithm"] == algorithm]
        row = {}
        for key in ("greedy_change", "sampled_change"):
            vals = [r[key] for r in mine]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            row[key] = {"mean": statistics.mean(vals), "std": sd, "min": min(vals),
                        "max": max(vals)}  # fmt: skip
            print(f"  {algorithm:>6} {key:>15}: {row[key]['mean']:+.3f} ± {sd:.3f} "
                  f"[{min(vals):+.3f}..{max(vals):+.3f}]")  # fmt: skip
        summary[algorithm] = row
    default = recipe["algorithm"]
    if default in algorithms:
        fell = [r["seed"] for r in runs if r["algorithm"] == default and r["greedy_change"] < 0]
        print(f"\ndefault recipe ({default}): greedy reward lowered on seeds {fell}" if fell
              else f"\ndefault recipe ({default}): greedy reward not lowered on any seed")  # fmt: skip
    results = {"before": {"greedy": greedy0, "sampled": sampled0}, "runs": runs,
               "summary": summary}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
