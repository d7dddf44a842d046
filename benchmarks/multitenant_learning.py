"""Does a run learn as much on a shared hosted deployment as alone? Held-out reward of
each of ``--runs`` LoRA runs trained together on one hosted deployment vs the same run
trained alone on its own `treadle rl` stack.

    .venv/bin/python benchmarks/multitenant_learning.py [--model DIR] [--steps 50] [--runs 3]

Model: ``--model``, default the SFT-warm-started reverse-text model
(outputs/reverse-text-sft/final_model, made as `make demo` makes it when absent; how well
it starts varies by machine, and from a weak start 80 steps may not move held-out reward:
the README's table starts from a stronger one). A random model does not learn,
and one base serves every hosted run, so every run here is reverse-text: run rt<i> has
seed i, counted from ``--first-seed`` (its own task order, sampling and adapter
initialization), and trains on outputs/reverse-text/data/train.jsonl; all are scored on
the held-out eval.jsonl.

Every run: GRPO (normalized) on ``--group-size`` x ``--groups-per-step`` completions a
step, 24 tokens each, LoRA rank ``--rank`` (alpha 2r) at ``--lr``, async level 1, each
env runner up to 128 rollouts at once.

- hosted: ``tests/testkit/platform.py``'s deployment (one nats-server, one inference
  serving each run's adapter by its key, one trainer with every run's adapter, per run an
  orchestrator and an env runner), every run at once;
- alone: each run by itself, one after another, as a `treadle rl` stack with the same
  settings (``benchmarks/multitenant.py``'s stack file: LoRA rank, group size, groups a
  step, async level 1, learning rate, seed, tasks).

Each run's last policy (a PEFT adapter) is exported from its store, merged into the base
(W + alpha/r · B·A) and checked against the probe the trainer published with it (the
merged model's logprobs of the probe tokens must match the trainer's), then scored by
``benchmarks/learning_reverse_text.py``'s evaluator: greedy, and sampled at T=1 with
``--eval-samples`` completions per task. Reports, per run and on average, the change of
held-out reward from the base on each side and hosted minus alone; the spread of the alone
changes over the runs (seeds) is the noise the difference is read against.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from learning_reverse_text import evaluate  # noqa: E402
from multitenant import stack_config  # noqa: E402
from vs_trl import ensure_sft_model  # noqa: E402

from testkit.inference import reference_logprobs  # noqa: E402
from testkit.lora import merged_copy  # noqa: E402
from testkit.platform import Deployment, RunPlan, Settings  # noqa: E402
from treadle.services.export import export_model, policy_prefix  # noqa: E402
from treadle.services.objectstore import LocalObjectStore  # noqa: E402

DATA = ROOT / "outputs" / "reverse-text" / "data"
PROBE_TOLERANCE = 1e-3  # mean |logprob difference| of the merged model on the probe


def merged_model(adapter: Path, base: Path, dest: Path) -> Path:
    """``base`` with the PEFT adapter folded in (testkit's merge), plus ``base``'s other
    files (tokenizer, generation config), so the evaluator loads it as it loads ``base``."""
    merged_copy(base, adapter, dest)
    for f in base.iterdir():
        if f.is_file() and not (dest / f.name).exists():
            shutil.copy(f, dest / f.name)
    return dest


def probe_gap(model_dir: Path, probe: dict[str, Any]) -> float:
    """Mean |logprob difference| between ``model_dir`` (transformers, float32) and the
    trainer's reference logprobs of the probe tokens."""
    got = reference_logprobs(model_dir, probe["token_ids"])
    return statistics.fmean(abs(x - y) for x, y in zip(got, probe["logprobs"], strict=True))


def score_run(
    store_root: Path, version: int, base: Path, work: Path, samples: int
) -> dict[str, Any]:
    """Export policy ``version`` from the store, merge it, check the probe, evaluate."""
    adapter = work / "adapter"
    manifest = export_model(LocalObjectStore(store_root), policy_prefix(version), base, adapter)
    meta = manifest.metadata
    if meta.get("format") != "peft-lora":
        raise SystemExit(
            f"{store_root}: policy v{version} is {meta.get('format')!r}, not an adapter"
        )
    merged = merged_model(adapter, base, work / "merged")
    gap = probe_gap(merged, meta["probe"])
    if gap > PROBE_TOLERANCE:
        raise SystemExit(f"{merged}: merged model misses the trainer's probe by {gap:.2e} "
                         f"(> {PROBE_TOLERANCE}): the merge is wrong")  # fmt: skip
    tasks = DATA / "eval.jsonl"
    return {
        "greedy": evaluate(merged, tasks),
        "sampled": evaluate(merged, tasks, temperature=1.0, samples=samples),
        "probe_gap": gap,
    }


def hosted(
    root: Path, model: Path, plans: list[RunPlan], s: Settings
) -> tuple[dict[str, Path], float]:
    dep = Deployment(root, model, plans, s)
    t0 = time.monotonic()
    dep.start()
    try:
        dep.wait_trained(timeout_s=7200)
    finally:
        dep.stop()
    return {p.name: dep.store_root(p.name) for p in plans}, time.monotonic() - t0


def alone(root: Path, model: Path, plan: RunPlan, s: Settings) -> tuple[Path, float]:
    cfg = stack_config(root, model, plan, s)
    t0 = time.monotonic()
    with open(root / f"{plan.name}.log", "wb") as log:
        code = subprocess.run(
            [sys.executable, "-m", "treadle.services.cli", "rl", "@", str(cfg)],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        ).returncode  # fmt: skip
    if code:
        raise SystemExit(f"{plan.name} alone failed ({code}): {root / f'{plan.name}.log'}")
    return root / "out" / plan.name / "store", time.monotonic() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="base model (default: the SFT warm start)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, first-seed+1, ...")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=16)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--sides", default="hosted,alone", help="comma-separated: hosted, alone")
    p.add_argument("--out", type=Path, help="work folder (default: a new temporary one)")
    args = p.parse_args()
    for flag in ("runs", "steps", "eval_samples", "group_size", "groups_per_step", "rank"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.group_size < 2:
        p.error("--group-size must be at least 2: GRPO compares the completions of a group")
    sides = args.sides.split(",")
    if unknown := set(sides) - {"hosted", "alone"}:
        p.error(f"--sides: unknown {sorted(unknown)}")
    model = (args.model or ensure_sft_model()).resolve()
    if not (model / "config.json").is_file() or not (model / "model.safetensors").is_file():
        p.error(f"--model {model}: not a model folder (config.json and model.safetensors)")
    work = (args.out or Path(tempfile.mkdtemp(prefix="multitenant-learning-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    s = Settings(rank=args.rank, group_size=args.group_size, groups_per_step=args.groups_per_step,
                 algorithm_args={"normalize": True}, max_concurrency=128)  # fmt: skip
    seeds = range(args.first_seed, args.first_seed + args.runs)
    plans = [RunPlan(f"rt{i}", "reverse_text", seed=i, steps=args.steps, lr=args.lr,
                     tasks=DATA / "train.jsonl") for i in seeds]  # fmt: skip
    print(f"{args.runs} reverse-text runs x {args.steps} steps, LoRA rank {args.rank}, "
          f"lr {args.lr}, {args.group_size}x{args.groups_per_step} completions a step; "
          f"base {model}; work in {work}", flush=True)  # fmt: skip
    before = {"greedy": evaluate(model, DATA / "eval.jsonl"),
              "sampled": evaluate(model, DATA / "eval.jsonl", temperature=1.0, samples=args.eval_samples)}  # fmt: skip
    print(f"base: greedy {before['greedy']:.3f}, sampled {before['sampled']:.3f}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    if "hosted" in sides:
        stores, wall = hosted(work / "hosted", model, plans, s)
        print(f"hosted: {len(plans)} runs trained together in {wall:.0f} s", flush=True)
        results["hosted"] = {
            name: score_run(store, args.steps, model, work / "hosted" / "eval" / name, args.eval_samples)
            for name, store in stores.items()
        }  # fmt: skip
    if "alone" in sides:
        results["alone"] = {}
        for plan in plans:
            store, wall = alone(work / "alone", model, plan, s)
            print(f"alone: {plan.name} trained in {wall:.0f} s", flush=True)
            results["alone"][plan.name] = score_run(
                store, args.steps, model, work / "alone" / "eval" / plan.name, args.eval_samples
            )
    (work / "results.json").write_text(json.dumps({"before": before, **results}, indent=2))

    print(f"\nheld-out reward change from the base (greedy {before['greedy']:.3f}, "
          f"sampled {before['sampled']:.3f}); probe gap = merged model vs trainer")  # fmt: skip
    print(f"{'run':<5} {'side':<7} {'greedy':>8} {'sampled':>8} {'probe gap':>10}")
    for side, runs in results.items():
        for name, r in runs.items():
            print(f"{name:<5} {side:<7} {r['greedy'] - before['greedy']:>+8.3f} "
                  f"{r['sampled'] - before['sampled']:>+8.3f} {r['probe_gap']:>10.1e}")  # fmt: skip
    for kind in ("greedy", "sampled"):
        per_side = {
            side: [r[kind] - before[kind] for r in runs.values()] for side, runs in results.items()
        }
        line = "  ".join(f"{side} {statistics.mean(v):+.3f}"
                         + (f" ± {statistics.stdev(v):.3f}" if len(v) > 1 else "")
                         for side, v in per_side.items())  # fmt: skip
        if len(per_side) == 2:
            diffs = [
                results["hosted"][n][kind] - results["alone"][n][kind] for n in results["alone"]
            ]
            line += f"  hosted - alone {statistics.mean(diffs):+.3f} (per run: " + ", ".join(
                f"{d:+.3f}" for d in diffs) + ")"  # fmt: skip
        print(f"{kind}: mean change {line}")


if __name__ == "__main__":
    main()
