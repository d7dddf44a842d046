"""Treadle (`treadle rl`) vs TRL's GRPOTrainer on the reverse-text example, side by side.

    .venv/bin/python benchmarks/vs_trl.py [--budget-s 753] [--seeds 3] [--steps N] [--model DIR]
    .venv/bin/python benchmarks/vs_trl.py --budget-s 60 --seeds 1        # a short smoke run
    .venv/bin/python benchmarks/vs_trl.py --startup 3        # launch to first trained step

Both sides start from the same model (default: the SFT-warm-started reverse-text model,
produced as `make demo` does when absent), train on the same task file with the same
reward (treadle.env_runner.envs.reverse_text.reward on the completion parsed by the same
renderer), group size, completions per step, temperature, learning rate, optimizer
(AdamW, betas 0.9/0.999, eps 1e-8, no weight decay, grad clip 1.0, constant lr), no KL
term, token-level mean loss and group-normalized advantages. The settings of both sides
are printed before the runs.

Modes: ``--budget-s S`` (default): each side trains for S seconds of RL after its startup
(Treadle: from launch until the first metrics row; TRL: model load and trainer setup),
then stops; ``--steps N``: each side runs exactly N steps (learning per step, apart
from speed). ``--autocast``: both sides in mixed precision, bfloat16 matmuls with float32
weights (Treadle's ``trainer.autocast = "bfloat16"``, TRL's ``bf16=True``); generation
stays as each side does it. TRL is a benchmark-only dependency (pip install trl).

``--startup N``: no training run; instead N rounds of launching each side as a fresh
process that trains, timing launch to the end of its first step (Treadle: a two-step
`treadle rl` to its trainer's first metrics row; TRL: a new Python process importing TRL,
loading the model, setting up GRPOTrainer and training one step) -- the wait a user sees
before anything is learned. The ``startup_s`` of the training modes is narrower: TRL's
runs in this process, which has imported torch and transformers already for the
evaluator, and neither side's includes its first step.

Reports per side and seed: startup s, steps, s/step, completions/s, trained tokens/s
(prompt + completion tokens), held-out greedy and sampled (T=1, 4 samples per task)
reward before/after (the evaluator of benchmarks/learning_reverse_text.py); then mean and
spread (min..max) over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reverse-text"
sys.path.insert(0, str(ROOT / "benchmarks"))

from budgeted import (  # noqa: E402
    final_model,
    overrides,
    rl_run_overrides,
    run_budgeted,
    treadle_exe,
)
from learning_reverse_text import evaluate  # noqa: E402


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": str(args.model),
        "tasks": str(args.tasks),
        "group_size": args.group_size,
        "completions_per_step": args.completions_per_step,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "lr": args.lr,
        "optimizer": "AdamW betas (0.9, 0.999) eps 1e-8 weight_decay 0, grad clip 1.0, constant lr",
        "loss": "policy gradient, token-level mean over the step, no KL, group-normalized adv.",
        "mode": f"{args.steps} steps" if args.steps else f"{args.budget_s:.0f} s of RL",
        "precision": "bfloat16 matmuls, float32 weights" if args.autocast else "float32",
        "threads": os.cpu_count(),
        "treadle_settings": args.treadle_set,
    }


# --- Treadle -------------------------------------------------------------------------------
def treadle_settings(
    args: argparse.Namespace, name: str, seed: int, steps: int, *, checkpoint_every: int
) -> dict[str, Any]:
    """The `treadle rl` settings of a run of the comparison (rl.toml's are the rest)."""
    return rl_run_overrides(name, args.model, seed, steps) | {
        "orchestrator.tasks": str(args.tasks),
        "orchestrator.group_size": args.group_size,
        "orchestrator.groups_per_step": args.completions_per_step // args.group_size,
        "orchestrator.sampling.temperature": args.temperature,
        "orchestrator.sampling.max_tokens": args.max_tokens,
        "trainer.optim.lr": args.lr,
        "trainer.checkpoint_every": checkpoint_every,
        "trainer.autocast": "bfloat16" if args.autocast else "off",
    }


def treadle_run(
    args: argparse.Namespace, seed: int, out: Path, side: str = "treadle"
) -> dict[str, Any]:
    name = f"bench-vs-trl-{side}-s{seed}"
    run_dir = ROOT / "outputs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    steps = args.steps or 100_000
    ov = treadle_settings(args, name, seed, steps, checkpoint_every=args.steps and steps)
    if side == "treadle-alone":  # every model call its own request (no n-sample requests)
        ov["env_runner.group_call_window_s"] = 0
    for item in args.treadle_set:  # the user's own settings, last
        key, _, value = item.partition("=")
        ov[key] = value
    argv = [treadle_exe(), "rl", "@", str(EXAMPLE / "rl.toml"), *overrides(ov)]
    log = out / f"{side}-s{seed}.log"
    run = run_budgeted(argv, run_dir, log, None if args.steps else args.budget_s)
    if run.first_metrics is None:
        sys.exit(f"treadle rl produced no metrics; see {log}")
    trainer = run.trainer_rows
    return {
        "startup_s": run.first_metrics - run.launched,
        "rl_s": run.ended - run.first_metrics,
        "steps": run.steps,
        "tokens": sum(float(r["tokens"]) for r in trainer),
        "trainer_step_s": statistics.mean(float(r["train_s"]) for r in trainer) if trainer else 0,
        "model": final_model(run_dir, args.model, run.steps),
    }


# --- TRL -----------------------------------------------------------------------------------
def trl_run(args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import treadle_native
    from treadle.env_runner.envs import reverse_text

    torch.set_num_threads(os.cpu_count() or 1)
    renderer = treadle_native.Renderer("qwen3", args.model)
    rows = [json.loads(x) for x in args.tasks.read_text().splitlines() if x.strip()]
    data = Dataset.from_list([{"prompt": reverse_text.prompt(r), "text": r["text"]} for r in rows])

    def reward(completion_ids: list[list[int]], text: list[str], **_: Any) -> list[float | None]:
        out_: list[float | None] = []
        for ids, t in zip(completion_ids, text, strict=True):
            try:
                content = renderer.parse(np.asarray(ids, dtype="uint32")).content
            except treadle_native.TokenIdError:
                content = ""
            out_.append(float(reverse_text.reward({"text": t}, content)))
        return out_

    steps = args.steps or 100_000
    cfg = GRPOConfig(
        output_dir=str(out / f"trl-s{seed}"),
        use_cpu=True,
        bf16=args.autocast,
        seed=seed,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",  # token-level mean over the step, as Treadle's pg loss
        scale_rewards="group",
        num_generations=args.group_size,
        per_device_train_batch_size=args.completions_per_step,
        gradient_accumulation_steps=1,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        max_completion_length=args.max_tokens,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
    )
    tok = AutoTokenizer.from_pretrained(args.model)
    first = reverse_text.prompt(rows[0])  # both sides must see the same prompt tokens
    ours = [int(x) for x in renderer.render(first, add_generation_prompt=True).token_ids]
    theirs = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    if ours != theirs:
        sys.exit(f"prompt tokens differ: Treadle's renderer {ours} vs the chat template {theirs}")
    print("prompt tokens: identical on both sides", flush=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    budget = None if args.steps else args.budget_s
    tokens = [0.0]

    class Stop(TrainerCallback):
        started = 0.0
        first_step_end = 0.0  # wall clock, for --startup

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            Stop.started = time.monotonic()

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
        ) -> None:
            if logs and "num_tokens" in logs:
                tokens[0] = float(logs["num_tokens"])

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if not Stop.first_step_end:
                Stop.first_step_end = time.time()
            if budget is not None and time.monotonic() - Stop.started >= budget:
                control.should_training_stop = True
            return control

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Stop()],
    )
    startup = time.monotonic() - t0
    trainer.train()
    rl_s = time.monotonic() - Stop.started
    dest = out / f"trl-s{seed}" / "final_model"
    trainer.save_model(str(dest))
    tok.save_pretrained(str(dest))
    for name in ("generation_config.json", "chat_template.jinja"):
        if (args.model / name).exists():
            shutil.copy(args.model / name, dest / name)
    return {
        "startup_s": startup,
        "first_step_end": Stop.first_step_end,
        "rl_s": rl_s,
        "steps": trainer.state.global_step,
        "tokens": tokens[0],
        "model": dest,
    }


# --- --startup: launch to the first trained step, each side a fresh process --------------
def trl_first_step(args: argparse.Namespace, out: Path) -> float:
    """Seconds from launching a fresh Python process that trains one TRL step (what a
    user's TRL script does: imports, model load, trainer setup, the step) to that step's
    end."""
    argv = [sys.executable, __file__, "--trl-child", "--steps", "1", "--seeds", "1",
            "--model", str(args.model), "--tasks", str(args.tasks), "--out", str(out),
            "--group-size", str(args.group_size), "--lr", str(args.lr),
            "--completions-per-step", str(args.completions_per_step),
            "--temperature", str(args.temperature), "--max-tokens", str(args.max_tokens),
            *(["--autocast"] if args.autocast else [])]  # fmt: skip
    launched = time.time()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    marks = [x for x in proc.stdout.splitlines() if x.startswith("FIRST_STEP_END ")]
    if proc.returncode != 0 or not marks:
        sys.exit(
            f"the TRL child failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    return float(marks[-1].split()[1]) - launched


def treadle_first_step(args: argparse.Namespace, out: Path, rep: int) -> float:
    """Seconds from launching `treadle rl` to its trainer's first step's metrics row
    (written when the step is trained). The run is two steps long: the only step of a
    one-step run is also its last, whose final checkpoint is written before its row."""
    name = f"bench-vs-trl-startup-{rep}"
    run_dir = ROOT / "outputs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    ov = treadle_settings(args, name, 0, 2, checkpoint_every=0)
    for item in args.treadle_set:
        key, _, value = item.partition("=")
        ov[key] = value
    argv = [treadle_exe(), "rl", "@", str(EXAMPLE / "rl.toml"), *overrides(ov)]
    launched = time.time()
    run = run_budgeted(argv, run_dir, out / f"startup-treadle-{rep}.log", None)
    if not run.trainer_rows:
        sys.exit(f"treadle rl trained no step; see {out / f'startup-treadle-{rep}.log'}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return float(run.trainer_rows[0]["time"]) - launched


def startup(args: argparse.Namespace) -> None:
    """``--startup N``: N rounds, each side once per round (the order alternating)."""
    out = args.out / "startup"
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, list[float]] = {"treadle": [], "trl": []}
    for rep in range(args.startup):
        for side in ("treadle", "trl") if rep % 2 == 0 else ("trl", "treadle"):
            s = (
                treadle_first_step(args, out, rep)
                if side == "treadle"
                else trl_first_step(args, out)
            )
            got[side].append(s)
            print(f"round {rep} {side}: launch to first trained step {s:.1f} s", flush=True)
    for side, vals in got.items():
        print(f"{side}: {statistics.mean(vals):.1f} s [{min(vals):.1f}..{max(vals):.1f}] over "
              f"{len(vals)} launches")  # fmt: skip
    (out / "results.json").write_text(json.dumps(got, indent=2))


def summarize(side: str, runs: list[dict[str, Any]]) -> None:
    keys = ["startup_s", "steps", "s_per_step", "completions_per_s", "tokens_per_s",
            "greedy_after", "sampled_after", "greedy_lift", "sampled_lift"]  # fmt: skip
    print(f"\n{side}: mean [min..max] over {len(runs)} seed(s)")
    for k in keys:
        vals = [float(r[k]) for r in runs]
        print(f"  {k:>18}: {statistics.mean(vals):9.3f}  [{min(vals):.3f}..{max(vals):.3f}]")


def ensure_sft_model() -> Path:
    model = ROOT / "outputs" / "reverse-text-sft" / "final_model"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(EXAMPLE / "prepare.py")], cwd=ROOT, check=True)
        treadle = str(Path(sys.executable).parent / "treadle")
        subprocess.run([treadle, "sft", "@", str(EXAMPLE / "sft.toml")], cwd=ROOT, check=True)
    return model


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, help="starting model (default: the SFT warm start)")
    p.add_argument(
        "--tasks", type=Path, default=ROOT / "outputs" / "reverse-text" / "data" / "train.jsonl"
    )
    p.add_argument(
        "--eval-tasks", type=Path, default=ROOT / "outputs" / "reverse-text" / "data" / "eval.jsonl"
    )
    p.add_argument("--budget-s", type=float, default=753.0, help="seconds of RL per side")
    p.add_argument("--steps", type=int, default=0, help="equal-steps mode: N steps per side")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--completions-per-step", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--autocast", action="store_true", help="both sides: bfloat16 matmuls")
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument(
        "--sides",
        default="treadle,trl",
        help="comma-separated: treadle, trl, treadle-alone (Treadle with each model call "
        "its own request: env_runner.group_call_window_s = 0)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-vs-trl")
    p.add_argument(
        "--treadle-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the Treadle runs (repeatable), e.g. env_runner.max_concurrency=64",
    )
    p.add_argument(
        "--startup",
        type=int,
        default=0,
        metavar="N",
        help="instead of training: N rounds of launch-to-first-trained-step, each side a "
        "fresh process",
    )
    p.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:  # one TRL run in this fresh process (--startup)
        r = trl_run(args, 0, args.out)
        print(f"FIRST_STEP_END {r['first_step_end']}", flush=True)
        return
    if bad := [s for s in args.treadle_set if "=" not in s]:
        sys.exit(f"--treadle-set takes KEY=VALUE, got {bad}")
    unknown = set(args.sides.split(",")) - {"treadle", "treadle-alone", "trl"}
    if unknown:
        sys.exit(f"--sides: unknown side(s) {sorted(unknown)}; known: treadle, treadle-alone, trl")
    if args.completions_per_step % args.group_size:
        sys.exit("--completions-per-step must be a multiple of --group-size")
    args.model = (args.model or ensure_sft_model()).resolve()
    args.tasks = args.tasks.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    print("settings (both sides):\n" + json.dumps(settings(args), indent=2), flush=True)
    if args.startup:
        startup(args)
        return

    def ev(model: Path) -> tuple[float, float]:
        g = evaluate(model, args.eval_tasks, max_tokens=args.max_tokens)
        s = evaluate(
            model,
            args.eval_tasks,
            temperature=args.temperature,
            samples=args.eval_samples,
            max_tokens=args.max_tokens,
        )
        return g, s

    greedy0, sampled0 = ev(args.model)
    print(f"held-out before RL: greedy {greedy0:.3f}, sampled {sampled0:.3f}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {}
    for side in args.sides.split(","):
        for seed in range(args.seeds):
            if side == "trl":
                r = trl_run(args, seed, args.out)
            else:
                r = treadle_run(args, seed, args.out, side)
            g, s = ev(r.pop("model"))
            steps = max(r["steps"], 1)
            r |= {
                "seed": seed,
                "s_per_step": r["rl_s"] / steps,
                "completions_per_s": r["steps"] * args.completions_per_step / r["rl_s"],
                "tokens_per_s": r["tokens"] / r["rl_s"],
                "greedy_before": greedy0,
                "sampled_before": sampled0,
                "greedy_after": g,
                "sampled_after": s,
                "greedy_lift": g - greedy0,
                "sampled_lift": s - sampled0,
            }
            print(f"{side} seed {seed}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)  # fmt: skip
            results.setdefault(side, []).append(r)
    for side, runs in results.items():
        summarize(side, runs)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
