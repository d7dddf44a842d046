"""Does RL improve the reverse-text model? SFT warm-start, eval, RL, eval — one script.

    .venv/bin/python benchmarks/learning_reverse_text.py [--rl-steps 60] [--skip-sft]

Steps (each on the real stack, as a user would run it):
  1. examples/reverse-text/prepare.py            tiny model + data (kept if present)
  2. treadle sft @ examples/reverse-text/sft.toml  warm start (skipped with --skip-sft if done)
  3. eval of the SFT model on the held-out tasks  (greedy, transformers on CPU)
  4. treadle rl @ examples/reverse-text/rl.toml    --rl-steps steps, metrics.jsonl recorded
  5. eval of the RL model on the same tasks

Each eval reports the greedy held-out reward and the reward of the policy RL trains:
``--eval-samples`` completions per task at the RL sampling temperature (1.0), untruncated.

Reports: held-out mean reward (greedy and sampled) before/after RL and the lifts, RL wall time and steps, the
max trainer/inference mismatch KL seen, and the reward curve (a table of the training
reward every few steps, from metrics.jsonl). Goal on a 2-core CPU machine: lift >= 0.15
within 15 minutes with mismatch KL < 0.01 throughout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reverse-text"


def run(argv: list[str], what: str) -> float:
    print(f"$ {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"{what} failed with exit code {proc.returncode}")
    return time.monotonic() - t0


def evaluate(
    model_dir: Path,
    tasks: Path,
    *,
    temperature: float = 0.0,
    samples: int = 1,
    max_tokens: int = 24,
    batch: int = 100,
    seed: int = 0,
) -> float:
    """Held-out mean reward of ``model_dir`` (transformers on CPU, independent of the
    stack under test): greedy at ``temperature`` 0, else ``samples`` completions per task
    drawn from softmax(logits / temperature) with nothing truncated (no top-k/top-p),
    the distribution RL trains."""
    import torch
    from transformers import AutoModelForCausalLM

    import treadle_native
    from treadle.env_runner.envs import reverse_text

    renderer = treadle_native.Renderer("qwen3", model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stop = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    stop_ids = torch.tensor(stop if isinstance(stop, list) else [stop])
    rows = [json.loads(line) for line in tasks.read_text().splitlines() if line.strip()]
    rows = [r for r in rows for _ in range(samples)]
    gen = torch.Generator().manual_seed(seed)
    rewards: list[float] = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        prompts = [
            renderer.render(reverse_text.prompt(r), add_generation_prompt=True).token_ids
            for r in chunk
        ]
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.from_numpy(p.astype("int64"))
            mask[i, width - len(p) :] = 1
        out = []
        done = torch.zeros(len(prompts), dtype=torch.bool)
        past = None
        step_ids = ids
        with torch.no_grad():
            for _ in range(max_tokens):
                positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
                res = model(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=past,
                    use_cache=True,
                )
                past = res.past_key_values
                logits = res.logits[:, -1].float()
                if temperature > 0:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
                else:
                    nxt = logits.argmax(-1)
                out.append(nxt)
                done |= torch.isin(nxt, stop_ids)
                if bool(done.all()):
                    break
                step_ids = nxt[:, None]
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        seqs = torch.stack(out, dim=1)
        for row, seq in zip(chunk, seqs, strict=True):
            try:
                content = renderer.parse(seq.numpy().astype("uint32")).content
            except treadle_native.TokenIdError:  # an id the tokenizer does not know: no answer
                content = ""
            rewards.append(float(reverse_text.reward(row, content)))
    return sum(rewards) / len(rewards)


def curve(metrics: Path, every: int) -> tuple[list[tuple[int, float]], float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    reward = {
        int(r["step"]): r["reward_mean"]
        for r in rows
        if r["service"] == "orchestrator" and "reward_mean" in r
    }
    kl = [r["mismatch_kl"] for r in rows if r["service"] == "trainer" and "mismatch_kl" in r]
    # mean training reward over each window of ``every`` steps (one step is 32 samples: noisy)
    steps = sorted(reward)
    points = []
    for start in range(0, len(steps), every):
        window = steps[start : start + every]
        points.append((window[-1], sum(reward[s] for s in window) / len(window)))
    return points, max(kl) if kl else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rl-steps", type=int, default=60)
    p.add_argument(
        "--skip-sft", action="store_true", help="reuse outputs/reverse-text-sft/final_model"
    )
    p.add_argument("--every", type=int, default=10, help="curve resolution in steps")
    p.add_argument(
        "--eval-temperature",
        type=float,
        default=1.0,
        help="sampled eval at this temperature (the RL config's) besides greedy",
    )
    p.add_argument("--eval-samples", type=int, default=4, help="samples per held-out task")
    p.add_argument(
        "--eval-only",
        type=Path,
        help="only evaluate this model folder (greedy and sampled) and exit",
    )
    p.add_argument(
        "--rl-arg",
        action="append",
        default=[],
        help="extra flag for treadle rl, e.g. --rl-arg=--trainer.optim.lr=5e-4 (repeatable)",
    )
    args = p.parse_args()
    if args.eval_only:
        tasks = ROOT / "outputs" / "reverse-text" / "data" / "eval.jsonl"
        greedy = evaluate(args.eval_only, tasks)
        sampled = evaluate(
            args.eval_only, tasks, temperature=args.eval_temperature, samples=args.eval_samples
        )
        print(
            json.dumps({"greedy": round(greedy, 4), f"T{args.eval_temperature}": round(sampled, 4)})
        )
        return
    treadle = str(Path(sys.executable).parent / "treadle")
    run([sys.executable, str(EXAMPLE / "prepare.py")], "prepare")
    sft_model = ROOT / "outputs" / "reverse-text-sft" / "final_model"
    if not (args.skip_sft and sft_model.exists()):
        sft_s = run([treadle, "sft", "@", str(EXAMPLE / "sft.toml")], "SFT")
        print(f"SFT took {sft_s:.0f}s")
    eval_tasks = ROOT / "outputs" / "reverse-text" / "data" / "eval.jsonl"
    temp, n = args.eval_temperature, args.eval_samples

    def both(model: Path) -> tuple[float, float]:
        return evaluate(model, eval_tasks), evaluate(model, eval_tasks, temperature=temp, samples=n)

    before, before_t = both(sft_model)
    print(f"held-out reward after SFT: greedy {before:.3f}, T={temp} {before_t:.3f}")
    run_name = "bench-learning-rl"  # a fresh run each time (the example's own run resumes)
    rl_dir = ROOT / "outputs" / run_name
    if rl_dir.exists():
        shutil.rmtree(rl_dir)
    extra = [part for arg in args.rl_arg for part in arg.split("=", 1)]
    overrides = [
        "--run.name",
        run_name,
        *extra,
        "--trainer.max_steps",
        str(args.rl_steps),
        "--orchestrator.max_steps",
        str(args.rl_steps),
    ]
    rl_s = run([treadle, "rl", "@", str(EXAMPLE / "rl.toml"), *overrides], "RL")
    after, after_t = both(rl_dir / "final_model")
    points, max_kl = curve(rl_dir / "metrics.jsonl", args.every)
    print(f"\nstep  train reward (mean of the last {args.every} steps)")
    for step, r in points:
        print(f"{step:>4}  {r:.3f}")
    result: dict[str, Any] = {
        "heldout_greedy_before_rl": round(before, 4),
        "heldout_greedy_after_rl": round(after, 4),
        "lift_greedy": round(after - before, 4),
        f"heldout_T{temp}_before_rl": round(before_t, 4),
        f"heldout_T{temp}_after_rl": round(after_t, 4),
        f"lift_T{temp}": round(after_t - before_t, 4),
        "rl_wall_s": round(rl_s, 1),
        "rl_steps": args.rl_steps,
        "max_mismatch_kl": max_kl,
    }
    print("\n" + json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
