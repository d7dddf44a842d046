"""On-policy distillation vs SFT on teacher samples vs RL alone, at equal wall-clock time,
side by side on the reverse-text example.

    .venv/bin/python benchmarks/distillation.py [--budget-s 300] [--seeds 1] [--teacher DIR]
    .venv/bin/python benchmarks/distillation.py --budget-s 60 --methods distill   # a smoke run

Student: the SFT warm start (outputs/reverse-text-sft/final_model, made as `make demo`
makes it when absent); every method starts from it. Teacher: ``--teacher``, default the
RL-trained reverse-text model (outputs/reverse-text-rl/final_model, trained with
`treadle rl @ examples/reverse-text/rl.toml` when absent). For the methods that use it,
the teacher is served by its own vLLM (the OpenAI API and the token route), started before
the method's clock and stopped after it, so its startup is no method's cost and it takes
no CPU from the method that does not use it. Beside distillation it runs where the teacher
`treadle rl` serves for ``[orchestrator.teacher] checkpoint`` does by default
(``[launcher] teacher_cpus``): on the student's generation CPUs (``--teacher-cpus
generation``); ``training`` puts it on the trainer's CPUs, ``all`` runs it unbound (one
thread, wherever the kernel finds a free CPU), ``vllm`` leaves the placement to vLLM
(started as the inference service starts it -- its model worker in its engine process --
vLLM binds no thread: the kernel places them); several, comma-separated (``--teacher-cpus
training,generation``), run each distillation method once per placement, side by side,
reported as ``method@placement``. For sft-rs (sampling, then training) vLLM places it.

Methods, each for ``--budget-s`` seconds of wall clock from its launch (its own startup,
and for sft-rs the sampling, inside the budget):
- ``distill``: `treadle rl` with ``algorithm = "distill"``: each sampled token's advantage
  is the teacher's logprob minus the student's (no reward), rl.toml's settings otherwise;
- ``sft-rs``: `treadle sft` from the environment: the teacher samples ``--rs-tasks``
  training tasks 8 times, those with reward >= ``--rs-min-reward`` are kept (default: the
  exact reversals; at most 2 per task), then SFT on them (examples/reverse-text/
  sft-from-rl.toml's settings, but from the student at a constant ``--sft-lr``: that file's
  3e-3 schedule is for a fresh model; and until the budget ends, not that file's 300 steps);
- ``rl``: `treadle rl` with GRPO on the reward (rl.toml);
- ``distill-at-batch``: ``distill`` with ``orchestrator.teacher.score_ahead = false``: the
  teacher scores a step's groups when its batch is cut instead of as each group completes
  (how distillation ran before score_ahead; not in the default methods);
- ``distill-centered``: ``distill`` with ``algorithm_args = { center = true }``: the
  advantage minus its mean over the group's sampled tokens (not in the default methods);
- ``grpo+distill``: `treadle rl` with ``algorithm = "grpo+distill"``: GRPO's reward
  advantage (rl.toml's ``normalize = true``) plus the distillation advantage, per token
  (not in the default methods);
- ``distill-topk``: `treadle rl` with ``algorithm = "distill-topk"``: the teacher's
  ``--top-k`` most likely tokens at each sampled token travel with the batch and the
  trainer minimizes KL(teacher's renormalized top-k || student) there (no reward);
- ``grpo+distill-topk``: GRPO's reward advantage and the same top-k term;
- ``distill-topk-sharp``, ``grpo+distill-topk-sharp``: those two with the target at
  ``--teacher-temperature`` (``algorithm_args.teacher_temperature``, default 0.5): the
  teacher's top-k sharpened before the student is taught it;
- ``grpo+distill-topk-sharp+demos``: the two in one run -- `treadle rl` with
  ``[sft_data]`` set (sft-rs's sampling, by a teacher of its own, inside the budget: the
  command samples before it starts the stack), then ``grpo+distill-topk-sharp`` with the
  kept samples as demonstrations: ``--demos-per-step`` of them in every batch
  (``[orchestrator.demos]``), trained by cross-entropy at ``--demos-weight`` beside the
  sampled tokens' terms, in the same step;
- ``grpo+distill-topk-sharp+updates``: ``grpo+distill-topk-sharp`` with
  ``--updates-per-step`` optimizer updates a step (``trainer.optim.updates_per_step``: the
  batch's micro-batches in that many mini-batches), so one batch's sampling and teacher
  calls buy several updates;
- ``sft-rs-then-distill``: the two in one budget -- ``sft-rs`` for ``--rs-phase-s`` seconds
  (default half the budget), its last policy exported, then ``grpo+distill-topk-sharp`` from
  it for what is left (the export and the second stack's startup inside the budget; each
  phase's teacher started before the clock).

Each method's run stays in outputs/bench-distill-<method>-s<seed> (metrics.jsonl, logs,
final_model) without its object store: every step's published policy would take gigabytes.

Reports held-out greedy and sampled (T=1, 4 samples per task) reward of the student
before, of the teacher, and of each method's last policy (the evaluator of
benchmarks/learning_reverse_text.py), per seed, then mean and [min..max] over seeds.
The issue's goal: distillation beats both at equal time.
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
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reverse-text"
sys.path.insert(0, str(ROOT / "benchmarks"))

from budgeted import (  # noqa: E402
    BudgetedRun,
    final_model,
    overrides,
    rl_run_overrides,
    run_budgeted,
    treadle_exe,
)
from learning_reverse_text import evaluate  # noqa: E402
from vs_trl import ensure_sft_model  # noqa: E402

from treadle.inference.engine import cpu_process_settings  # noqa: E402
from treadle.services.host import CPUS_ENV  # noqa: E402
from treadle.services.launcher import cpu_split_env, teacher_cpu_env  # noqa: E402
from treadle.services.ports import free_port  # noqa: E402

METHODS = (
    "distill", "sft-rs", "rl", "distill-at-batch", "grpo+distill", "distill-centered",
    "distill-topk", "grpo+distill-topk", "distill-topk-sharp", "grpo+distill-topk-sharp",
    "sft-rs-then-distill", "grpo+distill-topk-sharp+demos", "grpo+distill-topk-sharp+updates",
)  # fmt: skip
DEFAULT_METHODS = ("distill", "sft-rs", "rl")
PLACEMENTS = ("training", "generation", "all", "vllm")


def ensure_teacher() -> Path:
    model = ROOT / "outputs" / "reverse-text-rl" / "final_model"
    if not (model / "config.json").exists():
        ensure_sft_model()
        subprocess.run([treadle_exe(), "rl", "@", str(EXAMPLE / "rl.toml")], cwd=ROOT, check=True)
    return model


class Teacher:
    """The teacher's own vLLM: OpenAI API at /v1 and the token route, served as 'teacher';
    its Qwen3-style think block is split off the chat answer (``--reasoning-parser``), or
    the environment would score "<think>...</think>" as part of it."""

    def __init__(
        self,
        model: Path,
        log: Path,
        *,
        cpus: str = "vllm",
        inprocess_worker: bool = True,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.model, self.log, self.port, self.cpus = model, log, free_port(), cpus
        self.inprocess_worker = inprocess_worker
        self.extra_args = extra_args  # more vLLM flags (prefix_blocks.py: --block-size)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Teacher:
        argv = [sys.executable, "-m", "treadle.inference.vllm_entry",
                "--model", str(self.model), "--served-model-name", "teacher",
                "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "512",
                "--dtype", "float32", "--enforce-eager", "--enable-scale-out",
                "--reasoning-parser", "qwen3", "--disable-log-stats",
                *self.extra_args]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip
        # started like the inference service starts vLLM on CPU: its model worker in the
        # engine process, which does not busy-wait between calls (cpu_process_settings;
        # ``inprocess_worker=False``: vLLM's own worker process, for teacher_calls.py)
        cpu_argv, cpu_env = cpu_process_settings(inprocess_worker=self.inprocess_worker)
        argv += cpu_argv
        env |= cpu_env
        # ``cpus``: on the CPUs `treadle rl` gives training or generation (the student's
        # vLLM), with their thread settings; or unbound, one thread the kernel places
        cpus = sorted(os.sched_getaffinity(0))
        split = cpu_split_env("rl", ["inference", "trainer"], cpus, os.environ)
        anywhere = {CPUS_ENV: ",".join(map(str, cpus)), "OMP_NUM_THREADS": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # fmt: skip
        pinned = {"training": teacher_cpu_env(split, "training"),
                  "generation": teacher_cpu_env(split, "generation"),
                  "all": anywhere, "vllm": {}}[self.cpus]  # fmt: skip
        env |= {k: v for k, v in pinned.items() if k != CPUS_ENV}
        where = {int(c) for c in pinned[CPUS_ENV].split(",")} if CPUS_ENV in pinned else None
        if where:
            print(f"teacher on CPUs {sorted(where)} (the {self.cpus} CPUs)", flush=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, where)) if where else None,
            )  # fmt: skip
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"the teacher's vLLM exited {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        print(f"teacher serving on {self.url}", flush=True)
                        return self
            except OSError:
                pass
            time.sleep(1)
        sys.exit(f"the teacher's vLLM did not answer in 300 s; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def distill_run_file(out: Path, algorithm: str = "distill", *, center: bool = False) -> Path:
    """rl.toml with ``algorithm`` ("distill": its default arguments, as flags merge into
    rl.toml's algorithm_args, whose ``normalize`` distill does not take; "grpo+distill":
    rl.toml's)."""
    import tomli_w

    doc = tomllib.loads((EXAMPLE / "rl.toml").read_text())
    doc["orchestrator"]["algorithm"] = algorithm
    if algorithm in ("distill", "distill-topk"):
        doc["orchestrator"]["algorithm_args"] = {}
    if center:
        doc["orchestrator"]["algorithm_args"]["center"] = True
    # rl.toml's relative paths are the repository root's
    path = out / f"{algorithm}{'-centered' if center else ''}.toml"
    path.write_text(tomli_w.dumps(doc))
    return path


def rl_overrides(
    args: argparse.Namespace, name: str, seed: int, student: Path | None = None
) -> dict[str, Any]:
    ov = rl_run_overrides(name, student or args.student, seed, 100_000)
    ov["trainer.checkpoint_every"] = 0
    if args.rl_lr is not None:
        ov["trainer.optim.lr"] = args.rl_lr
    return ov


def distill_argv(
    args: argparse.Namespace, method: str, name: str, seed: int, teacher_url: str,
    student: Path | None = None,
) -> list[str]:  # fmt: skip
    """`treadle rl` of a distill method, from ``student`` (default ``--student``)."""
    ov = rl_overrides(args, name, seed, student) | {
        "orchestrator.teacher.urls": teacher_url,
        "orchestrator.teacher.model": "teacher",
        "orchestrator.teacher.score_ahead": "false" if method == "distill-at-batch" else "true",
    }
    ov |= dict(kv.split("=", 1) for kv in args.distill_set)
    if method.endswith("+updates"):
        ov["trainer.optim.updates_per_step"] = args.updates_per_step
        method = method.removesuffix("+updates")
    if method.endswith("-sharp"):
        ov["orchestrator.algorithm_args.teacher_temperature"] = args.teacher_temperature
    if method.removesuffix("-sharp") in ("distill-topk", "grpo+distill-topk"):
        algorithm = method.removesuffix("-sharp")
        ov["orchestrator.teacher.top_k"] = args.top_k
    elif method == "grpo+distill":
        algorithm = method
    else:
        algorithm = "distill"
    run_file = distill_run_file(args.out, algorithm, center=method.endswith("-centered"))
    return [treadle_exe(), "rl", "@", str(run_file), *overrides(ov)]


def sft_data_overrides(args: argparse.Namespace, teacher_url: str) -> dict[str, Any]:
    """sft-rs's sampling: examples/reverse-text/sft-from-rl.toml's [sft_data], from the
    teacher at ``teacher_url``, ``--rs-tasks`` tasks, kept at ``--rs-min-reward``."""

    def flat(prefix: str, table: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in table.items():
            out |= flat(f"{prefix}.{key}", value) if isinstance(value, dict) else {f"{prefix}.{key}": value}  # fmt: skip
        return out

    doc = tomllib.loads((EXAMPLE / "sft-from-rl.toml").read_text())
    return flat("sft_data", doc["sft_data"]) | {
        "sft_data.num_tasks": args.rs_tasks,
        "sft_data.min_reward": args.rs_min_reward,
        "sft_data.base_url": f"{teacher_url}/v1",
        "sft_data.model": "teacher",
    }


def demos_argv(
    args: argparse.Namespace, name: str, seed: int, teacher_url: str, sampler_url: str
) -> list[str]:
    """`treadle rl` of grpo+distill-topk-sharp (teacher at ``teacher_url``) whose batches
    carry demonstrations rejection-sampled first from the teacher at ``sampler_url``."""
    ov = sft_data_overrides(args, sampler_url) | {
        "orchestrator.tokenizer": str(args.student),
        "orchestrator.demos.samples_per_step": args.demos_per_step,
        "orchestrator.demos.weight": args.demos_weight,
    }
    return [*distill_argv(args, "grpo+distill-topk-sharp", name, seed, teacher_url), *overrides(ov)]


def sft_rs_argv(args: argparse.Namespace, name: str, seed: int, teacher_url: str) -> list[str]:
    """`treadle sft` from the environment, sampled by the teacher (module doc)."""
    ov = sft_data_overrides(args, teacher_url) | {
        "run.name": name,
        "trainer.model": str(args.student),
        "orchestrator.tokenizer": str(args.student),
        "trainer.seed": seed,
        # from the warm start, not a fresh model: the RL learning rate, constant
        "trainer.optim.lr": args.sft_lr,
        "trainer.optim.decay": "constant",
        "trainer.optim.warmup_steps": 0,
        # the budget ends it, as it ends the other methods (not the file's 300)
        "trainer.max_steps": 100_000,
        "orchestrator.max_steps": 100_000,
    }
    return [treadle_exe(), "sft", "@", str(EXAMPLE / "sft-from-rl.toml"), *overrides(ov)]


def run_method(
    args: argparse.Namespace, method: str, seed: int, teacher_cpus: str = "generation"
) -> dict[str, Any]:
    name = f"bench-distill-{method.replace('+', '-')}-s{seed}"  # a run name: no '+'
    run_dir = ROOT / "outputs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    log = args.out / f"{method}-s{seed}.log"
    log_t = args.out / f"teacher-{method}-s{seed}.log"
    runs: list[BudgetedRun] = []
    base = args.student  # the model the last run started from
    if method == "rl":
        argv = [treadle_exe(), "rl", "@", str(EXAMPLE / "rl.toml"),
                *overrides(rl_overrides(args, name, seed))]  # fmt: skip
        runs.append(run_budgeted(argv, run_dir, log, args.budget_s, clock="launch"))
    elif method == "sft-rs":
        with Teacher(args.teacher, log_t, cpus="vllm") as teacher:
            argv = sft_rs_argv(args, name, seed, teacher.url)
            runs.append(run_budgeted(argv, run_dir, log, args.budget_s, clock="launch"))
    elif method == "grpo+distill-topk-sharp+demos":
        # the sampling teacher where sft-rs's runs, the distillation one where the distill
        # methods run theirs (both started before the clock; an idle one takes no CPU)
        with Teacher(args.teacher, log_t.with_suffix(".rs.log"), cpus="vllm") as sampler, \
                Teacher(args.teacher, log_t, cpus=teacher_cpus) as teacher:  # fmt: skip
            argv = demos_argv(args, name, seed, teacher.url, sampler.url)
            runs.append(run_budgeted(argv, run_dir, log, args.budget_s, clock="launch"))
    elif method == "sft-rs-then-distill":
        # both teachers started before the clock: sft-rs's sampling one where vLLM places
        # it, distillation's where the distill methods run theirs (an idle one takes no CPU)
        rs_dir = ROOT / "outputs" / f"{name}-rs"
        shutil.rmtree(rs_dir, ignore_errors=True)
        with Teacher(args.teacher, log_t.with_suffix(".rs.log"), cpus="vllm") as sampler, \
                Teacher(args.teacher, log_t, cpus=teacher_cpus) as teacher:  # fmt: skip
            t0 = time.monotonic()
            argv = sft_rs_argv(args, f"{name}-rs", seed, sampler.url)
            rs_log = log.with_suffix(".rs.log")
            runs.append(run_budgeted(argv, rs_dir, rs_log, args.rs_phase_s, clock="launch"))
            if runs[0].steps == 0:
                sys.exit(f"{method}: sft-rs trained no step in {args.rs_phase_s:.0f} s; see {rs_log}")  # fmt: skip
            base = final_model(rs_dir, args.student, runs[0].steps)  # inside the clock
            left = args.budget_s - (time.monotonic() - t0)
            if left < 30:
                sys.exit(f"{method}: {left:.0f} s left for distillation after sft-rs; "
                         "lower --rs-phase-s")  # fmt: skip
            argv = distill_argv(args, "grpo+distill-topk-sharp", name, seed, teacher.url, base)
            runs.append(run_budgeted(argv, run_dir, log, left, clock="launch"))
    else:
        with Teacher(args.teacher, log_t, cpus=teacher_cpus) as teacher:
            argv = distill_argv(args, method, name, seed, teacher.url)
            runs.append(run_budgeted(argv, run_dir, log, args.budget_s, clock="launch"))
    last = runs[-1]
    if last.steps == 0:
        sys.exit(f"{method} trained no step in its budget; see {log}")
    rows = [r for run in runs for r in run.trainer_rows]
    built = [float(r["batch_build_s"]) for run in runs for r in run.rows
             if r.get("service") == "orchestrator" and "batch_build_s" in r]  # fmt: skip

    def mean(vals: list[float]) -> float:
        return statistics.mean(vals) if vals else 0.0

    out = {
        "wall_s": last.ended - runs[0].launched,
        "startup_s": (runs[0].first_metrics or runs[0].ended) - runs[0].launched,
        "steps": sum(run.steps for run in runs),
        "tokens": sum(float(r["tokens"]) for r in rows),
        # where a step's time goes: the trainer's step, its wait for a batch, the build
        "step_time_s": mean([float(r["step_time_s"]) for r in rows if "step_time_s" in r]),
        "trainer_wait_s": mean([float(r["wait_s"]) for r in rows if "wait_s" in r]),
        "batch_build_s": mean(built),
        "model": final_model(run_dir, base, last.steps),
    }
    if len(runs) > 1:
        out["sft_rs_steps"] = runs[0].steps
    # the last model is out: every step's published policy goes (an sft-rs run's ~900 of
    # 13 MB filled 12 GB); metrics, logs and the final model stay
    for d in (run_dir, ROOT / "outputs" / f"{name}-rs"):
        shutil.rmtree(d / "store", ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--teacher", type=Path, help="teacher model (default: the RL-trained one)")
    p.add_argument("--student", type=Path, help="student model (default: the SFT warm start)")
    p.add_argument("--budget-s", type=float, default=300.0, help="wall-clock seconds per method")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, first-seed+1, ...")
    p.add_argument("--teacher-cpus", default="generation",
                   help="distill: where the teacher runs, comma-separated to run each distill "
                        f"method once per placement, side by side: {', '.join(PLACEMENTS)} "
                        "(module doc)")  # fmt: skip
    p.add_argument("--top-k", type=int, default=8,
                   help="distill-topk, grpo+distill-topk: orchestrator.teacher.top_k")  # fmt: skip
    p.add_argument("--teacher-temperature", type=float, default=0.5,
                   help="the -sharp methods: algorithm_args.teacher_temperature")  # fmt: skip
    p.add_argument("--distill-set", action="append", default=[], metavar="KEY=VALUE",
                   help="the distill methods: a `treadle rl` setting of their own, e.g. "
                   "orchestrator.groups_per_step=8 (repeatable; rl keeps rl.toml's)")  # fmt: skip
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated: " + ", ".join(METHODS))  # fmt: skip
    p.add_argument("--rs-tasks", type=int, default=300, help="sft-rs: tasks sampled")
    p.add_argument("--rs-min-reward", type=float, default=1.0, help="sft-rs: samples kept")
    p.add_argument("--sft-lr", type=float, default=3e-4, help="sft-rs: learning rate")
    p.add_argument("--rs-phase-s", type=float,
                   help="sft-rs-then-distill: seconds of sft-rs (default: half the budget)")  # fmt: skip
    p.add_argument("--demos-per-step", type=int, default=32,
                   help="+demos: orchestrator.demos.samples_per_step")  # fmt: skip
    p.add_argument("--demos-weight", type=float, default=1.0,
                   help="+demos: orchestrator.demos.weight")  # fmt: skip
    p.add_argument("--updates-per-step", type=int, default=4,
                   help="+updates: trainer.optim.updates_per_step")  # fmt: skip
    p.add_argument("--rl-lr", type=float, help="rl and the distill methods: learning rate (default: rl.toml's)")  # fmt: skip
    p.add_argument(
        "--eval-tasks", type=Path, default=ROOT / "outputs" / "reverse-text" / "data" / "eval.jsonl"
    )
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-distillation")
    args = p.parse_args()
    methods = args.methods.split(",")
    if unknown := [m for m in methods if m not in METHODS]:
        sys.exit(f"unknown method(s) {unknown}: use {', '.join(METHODS)}")
    placements = args.teacher_cpus.split(",")
    if bad := [c for c in placements if c not in PLACEMENTS]:
        sys.exit(f"unknown --teacher-cpus {bad}: use {', '.join(PLACEMENTS)}")
    # (method, teacher placement) in the order run; a distill method once per placement,
    # named method@placement when there are several
    plan = [(m, c) for m in methods for c in (placements if "distill" in m else ["vllm"])]
    args.student = (args.student or ensure_sft_model()).resolve()
    args.teacher = (args.teacher or ensure_teacher()).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rs_phase_s is None:
        args.rs_phase_s = args.budget_s / 2

    def ev(model: Path) -> tuple[float, float]:
        g = evaluate(model, args.eval_tasks)
        s = evaluate(model, args.eval_tasks, temperature=1.0, samples=args.eval_samples)
        return g, s

    greedy0, sampled0 = ev(args.student)
    greedy_t, sampled_t = ev(args.teacher)
    print(f"held-out student before: greedy {greedy0:.3f}, sampled {sampled0:.3f}; "
          f"teacher: greedy {greedy_t:.3f}, sampled {sampled_t:.3f}", flush=True)  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for method, cpus in plan:
            r = run_method(args, method, seed, cpus)
            if "distill" in method and len(placements) > 1:
                method = f"{method}@{cpus}"
            g, s = ev(r.pop("model"))
            r |= {"seed": seed, "greedy_after": g, "sampled_after": s,
                  "greedy_lift": g - greedy0, "sampled_lift": s - sampled0}  # fmt: skip
            print(f"{method} seed {seed}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)  # fmt: skip
            results.setdefault(method, []).append(r)
    print(f"\n{args.budget_s:.0f} s per method; mean [min..max] over {args.seeds} seed(s)")
    print(f"{'method':>8} {'steps':>7} {'trainer s/step':>16} {'greedy after':>16} {'sampled after':>16} {'greedy lift':>12} {'sampled lift':>13}")  # fmt: skip
    for method, runs in results.items():

        def agg(k: str, runs: list[dict[str, Any]] = runs) -> str:
            vals = [float(r[k]) for r in runs]
            return f"{statistics.mean(vals):.3f} [{min(vals):.2f}..{max(vals):.2f}]"

        print(f"{method:>8} {agg('steps'):>7} {agg('step_time_s'):>16} {agg('greedy_after'):>16} {agg('sampled_after'):>16} "
              f"{agg('greedy_lift'):>12} {agg('sampled_lift'):>13}")  # fmt: skip
    summary = {"student": {"greedy": greedy0, "sampled": sampled0},
               "teacher": {"greedy": greedy_t, "sampled": sampled_t}, "runs": results}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
