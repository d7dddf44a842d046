"""``treadle sft-data @ run.toml``: an SFT dataset from an environment, by rejection sampling.

    [sft_data]
    env = "countdown"                       # as [eval]: built-in, registered, or "module:attr"
    num_tasks = 500                         # first N tasks (default: all)
    samples_per_task = 8                    # k samples per task ...
    min_reward = 1.0                        # ... kept when reward >= min_reward
    max_per_task = 2                        # at most this many per task (default: all kept)
    base_url = "http://127.0.0.1:8000/v1"   # the source model: any OpenAI-compatible endpoint
    model = "teacher"                       #   ... or backend = "tokens" (Treadle's inference)

``treadle sft @ run.toml`` with ``[sft_data] env`` set runs this first and then trains on
the dataset it wrote (``orchestrator.tasks`` is set to it).

Sampling is ``treadle eval``'s engine (evaluate.py): N tasks × k samples through the
environment's harness and rubric, with its progress line, every sample appended to
``<out>/results.jsonl`` as it finishes (``<out>`` = ``sft_data.output_dir``, default
``outputs/<run>/sft_data``). A rerun skips the samples already there; raising num_tasks or
samples_per_task samples only what is new, and changing min_reward or max_per_task only
filters again.

The filter keeps a sample when its status is ``ok`` (errors and truncated ones never) and
its reward is at least ``min_reward``; of a task's kept samples the ``max_per_task``
highest rewards stay (ties: lower sample index). ``<out>/dataset.jsonl`` gets one row per
kept sample, ``{"id", "task_id", "index", "reward", "messages", "tools"?}``, in the
format the SFT feed reads (orchestrator chat_data): the conversation as the
environment's harness built it (system prompt, user turns, the source's assistant turns
with tool calls, tool results; messages after the last assistant turn dropped) and the
tool schemas the source was shown, so the student's chat template renders it. The
source's token ids (backend "tokens") are not kept: the student may have another
tokenizer, and SFT learns the text. Reasoning the source returned separately
(``reasoning_content``) is not in the conversation either.

``<out>/sft_data.json`` and the terminal get the summary: tasks, samples, statuses, kept
(in all and per task), the threshold and mean rewards. A filter that keeps nothing is an
error that says the best reward seen, never an empty dataset.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from treadle.env_runner.evaluate import EvalConfig, EvalSampling, EvalSection, evaluate
from treadle.env_runner.spec import EnvRunnerSection
from treadle.services.config import load_config, to_toml
from treadle.services.errors import ConfigError, TreadleError
from treadle.services.sections import ServiceConfig, StrictModel

SECTION = "sft_data"


class SFTDataSection(StrictModel):
    """[sft_data]: an SFT dataset rejection-sampled from an environment (``treadle
    sft-data``; ``treadle sft`` runs it first when env is set)."""

    env: str = ""
    """Environment: a built-in name, a name from env_runner.environments, or "module:attr".
    Empty: no sampling (``treadle sft`` trains on orchestrator.tasks)."""
    tasks: Path | None = None
    """JSONL task file (default: the environment's built-in task set)."""
    num_tasks: int | None = Field(None, ge=1)
    """Sample the first N tasks (default: all)."""
    samples_per_task: int = Field(4, ge=1)
    """k samples per task."""
    min_reward: float = 1.0
    """A sample is kept when its reward is >= this (and its status is ok)."""
    max_per_task: int | None = Field(None, ge=1)
    """Keep at most this many samples per task, highest reward first (default: all kept)."""
    backend: Literal["openai", "tokens"] = "openai"
    """The source model: openai: any OpenAI-compatible chat endpoint (base_url); tokens:
    Treadle's inference token route (env_runner.inference_url, env_runner.tokenizer)."""
    base_url: str | None = None
    """OpenAI-compatible base URL of the source model, e.g. http://127.0.0.1:8000/v1."""
    model: str = "default"
    """Model name sent to the endpoint."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the endpoint's API key (unset: no key sent)."""
    max_concurrency: int = Field(16, ge=1)
    """Samples at once."""
    timeout_s: float = Field(0.0, ge=0)
    """Wall-clock budget per sample (0 = the environment's default)."""
    output_dir: Path | None = None
    """Where samples and the dataset go (default: <run.output_dir>/<run.name>/sft_data)."""
    resume: bool = True
    """Skip samples already in results.jsonl (same env, tasks, model, sampling); false
    samples everything again."""
    sampling: EvalSampling = Field(default_factory=lambda: EvalSampling(temperature=1.0))
    """[sft_data.sampling]: as [eval.sampling], but temperature 1.0 unless set (k greedy
    samples of a task would be one sample k times)."""

    @model_validator(mode="after")
    def _checks(self) -> SFTDataSection:
        if self.backend == "openai" and self.env and not self.base_url:
            raise ValueError(
                'backend "openai" needs sft_data.base_url (the source model\'s endpoint, e.g. '
                'http://127.0.0.1:8000/v1), or backend = "tokens" with env_runner.inference_url'
            )
        return self


class SFTDataConfig(ServiceConfig):
    """What ``treadle sft-data`` reads: shared sections, [sft_data] and [env_runner]."""

    sft_data: SFTDataSection = Field(default_factory=SFTDataSection)
    env_runner: EnvRunnerSection = Field(default_factory=EnvRunnerSection)


def output_dir(cfg: SFTDataConfig) -> Path:
    return cfg.sft_data.output_dir or cfg.run.run_dir / "sft_data"


def dataset_path(cfg: SFTDataConfig) -> Path:
    """Where the dataset is written (``treadle sft`` points orchestrator.tasks at it)."""
    return output_dir(cfg) / "dataset.jsonl"


def eval_config(cfg: SFTDataConfig) -> EvalConfig:
    """The ``treadle eval`` run that draws the samples."""
    s = cfg.sft_data
    shared = {name: getattr(cfg, name) for name in ServiceConfig.model_fields}
    section = EvalSection(
        env=s.env, tasks=s.tasks, num_tasks=s.num_tasks, rollouts_per_task=s.samples_per_task,
        backend=s.backend, base_url=s.base_url, model=s.model, api_key_env=s.api_key_env,
        max_concurrency=s.max_concurrency, pass_threshold=s.min_reward, timeout_s=s.timeout_s,
        output_dir=output_dir(cfg), resume=s.resume, sampling=s.sampling,
    )  # fmt: skip
    return EvalConfig(**shared, eval=section, env_runner=cfg.env_runner)


# --- the filter -----------------------------------------------------------------------------
def select(
    rows: Sequence[dict[str, Any]], min_reward: float, max_per_task: int | None
) -> list[dict[str, Any]]:
    """The samples kept (see the module doc), tasks in the order they first appear."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_task[r["task_id"]].append(r)
    kept: list[dict[str, Any]] = []
    for group in by_task.values():
        ok = [r for r in group if keeps(r, min_reward)]
        ok.sort(key=lambda r: (-r["reward"], r["index"]))
        kept += ok[:max_per_task] if max_per_task is not None else ok
    return kept


def keeps(row: dict[str, Any], min_reward: float) -> bool:
    """A sample passes the filter: status ok, reward >= min_reward (NaN never), and an
    assistant turn to learn from."""
    return (
        row["status"] == "ok"
        and row["reward"] >= min_reward
        and any(m.get("role") == "assistant" for m in row["messages"])
    )


def dataset_row(row: dict[str, Any]) -> dict[str, Any]:
    """A kept sample as an SFT row (the conversation up to its last assistant turn)."""
    messages = row["messages"]
    last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    out = {
        "id": f"{row['task_id']}/{row['index']}",
        "task_id": row["task_id"],
        "index": row["index"],
        "reward": row["reward"],
        "messages": messages[: last + 1],
    }
    if row.get("tools"):
        out["tools"] = row["tools"]
    return out


def summarize(
    rows: Sequence[dict[str, Any]], kept: Sequence[dict[str, Any]], cfg: SFTDataSection
) -> dict[str, Any]:
    tasks = list(dict.fromkeys(r["task_id"] for r in rows))
    per_task = Counter(r["task_id"] for r in kept)
    statuses = Counter(
        r["status"] if r["status"] != "error" else f"error:{r['error_kind']}" for r in rows
    )
    scored = [r["reward"] for r in rows if r["status"] == "ok"]
    return {
        "env": cfg.env,
        "model": cfg.model,
        "num_tasks": len(tasks),
        "samples_per_task": cfg.samples_per_task,
        "num_samples": len(rows),
        "statuses": dict(statuses),
        "min_reward": cfg.min_reward,
        "max_per_task": cfg.max_per_task,
        "num_kept": len(kept),
        "num_tasks_kept": len(per_task),
        # tasks by how many of their samples were kept: {"0": 3, "1": 5, ...}
        "kept_per_task": {
            str(n): c for n, c in sorted(Counter(per_task[t] for t in tasks).items())
        },
        "best_reward": max(scored) if scored else None,
        "mean_reward": sum(scored) / len(scored) if scored else None,
        "mean_reward_kept": sum(r["reward"] for r in kept) / len(kept) if kept else None,
    }


def summary_text(summary: dict[str, Any]) -> str:
    s = summary
    cap = f", at most {s['max_per_task']} per task" if s["max_per_task"] else ""
    lines = [
        f"[sft_data] {s['env']} · {s['model']}: {s['num_tasks']} tasks x "
        f"{s['samples_per_task']} samples = {s['num_samples']}",
        "  statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(s["statuses"].items())),
        f"  kept: {s['num_kept']} samples with reward >= {s['min_reward']:g}{cap}, "
        f"from {s['num_tasks_kept']}/{s['num_tasks']} tasks",
        "  tasks by samples kept: " + ", ".join(f"{n}: {c}" for n, c in s["kept_per_task"].items()),
    ]
    if s["mean_reward"] is not None:
        kept = s["mean_reward_kept"]
        lines.append(
            f"  mean reward: all ok samples {s['mean_reward']:.3f}"
            + (f", kept {kept:.3f}" if kept is not None else "")
        )
    if "dataset" in s:
        lines.append(f"[sft_data] dataset: {s['dataset']} ({s['num_kept']} conversations)")
    return "\n".join(lines)


class NothingKeptError(TreadleError):
    """Rejection sampling kept no sample: there is nothing to train on."""


def nothing_kept(summary: dict[str, Any], results: Path, rows: Sequence[dict[str, Any]]) -> str:
    s = summary
    if not s["statuses"].get("ok"):
        first = next((r["message"] for r in rows if r["message"]), "")
        return (
            f"no sample of {s['num_samples']} finished ok "
            f"({', '.join(f'{k} {v}' for k, v in sorted(s['statuses'].items()))})"
            + (f"; the first said: {first}" if first else "")
            + f"; see {results}"
        )
    return (
        f"no sample reached sft_data.min_reward = {s['min_reward']:g} (best reward "
        f"{s['best_reward']:.3f} over {s['statuses']['ok']} ok samples of {s['num_tasks']} "
        f"tasks): lower min_reward, draw more samples_per_task, or use a stronger source "
        f"model; samples are kept in {results}, so a rerun only filters again"
    )


# --- the run --------------------------------------------------------------------------------
async def build(cfg: SFTDataConfig, stream: Any = sys.stderr) -> dict[str, Any]:
    """Sample, filter and write the dataset ``cfg`` describes; returns the summary (with
    ``dataset``: its path). Raises NothingKeptError when the filter keeps nothing."""
    s = cfg.sft_data
    if not s.env:
        raise ConfigError("sft_data.env is required (the environment to sample SFT data from)")
    ecfg = eval_config(cfg)
    rows: list[dict[str, Any]] = []
    await evaluate(ecfg, stream, section=SECTION, rows_out=rows)
    out = output_dir(cfg)
    kept = select(rows, s.min_reward, s.max_per_task)
    summary = summarize(rows, kept, s)
    if not kept:
        (out / "sft_data.json").write_text(json.dumps(summary, indent=1))
        path = dataset_path(cfg)
        path.unlink(missing_ok=True)  # never leave an older dataset to be trained on
        raise NothingKeptError(nothing_kept(summary, out / "results.jsonl", rows))
    path = dataset_path(cfg)
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for r in kept:
            fh.write(json.dumps(dataset_row(r), ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    summary["dataset"] = str(path)
    (out / "sft_data.json").write_text(json.dumps(summary, indent=1))
    return summary


def load(argv: Sequence[str] | Any) -> SFTDataConfig:
    from treadle.services.registry import known_sections

    return load_config(SFTDataConfig, argv, known_sections=known_sections())


def main(argv: Sequence[str]) -> int:
    """``treadle sft-data`` (the CLI parses flags; see the module doc)."""
    from treadle.services.config import split_argv

    sources = split_argv(argv)
    cfg = load(sources)
    if sources.dry_run:
        print(to_toml(cfg, only=["run", SECTION, "env_runner"]), end="")
        return 0
    summary = asyncio.run(build(cfg))
    print(summary_text(summary))
    return 0
