"""``treadle eval @ eval.toml``: score a model on an environment.

    [eval]
    env = "countdown"                       # built-in, env_runner.environments name, or "module:attr"
    num_tasks = 50                          # first N tasks of the task set (default: all)
    rollouts_per_task = 4                   # k: pass@1 .. pass@k are reported
    base_url = "http://127.0.0.1:8000/v1"   # any OpenAI-compatible endpoint ...
    model = "my-model"
    # backend = "tokens"                    # ... or Treadle's inference token route
                                            #     (env_runner.inference_url + env_runner.tokenizer)

N tasks × k rollouts run concurrently (``max_concurrency``) through the same harnesses
and rubrics that train models. Every rollout is appended to
``outputs/<run>/eval/results.jsonl`` as soon as it finishes (its conversation and tool
schemas, rewards, metrics, status, timing and trace id); the summary (mean reward and
mean of every reward component and metric, pass@k, statuses) goes to ``summary.json``
and the terminal. A rerun with the same config skips the rollouts already in
results.jsonl (resumable; a changed pass_threshold only judges them again), except those
that failed because the endpoint did (status error, error_kind inference).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import math
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from google.protobuf.json_format import MessageToDict
from opentelemetry.sdk.trace import SpanProcessor
from pydantic import Field, model_validator

from treadle.env_runner.environments import Environment, load_environment
from treadle.env_runner.group import group_state
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import RewardError, RolloutState, Score
from treadle.env_runner.spec import EnvRunnerSection
from treadle.env_runner.tasksets import TaskSet
from treadle.proto.v1 import rollout_pb2
from treadle.services.config import load_config, to_toml
from treadle.services.errors import ConfigError
from treadle.services.passk import ks_for, pass_at_k
from treadle.services.sections import ServiceConfig, StrictModel

log = logging.getLogger(__name__)
Kind = rollout_pb2.RolloutStatus.Kind


class EvalSampling(StrictModel):
    """[eval.sampling]"""

    temperature: float = Field(0.0, ge=0)
    """0 = greedy. Use > 0 with rollouts_per_task > 1 for a meaningful pass@k."""
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(256, ge=1)
    """Sampled tokens per model call."""
    max_total_tokens: int = Field(0, ge=0)
    """Tokens of a whole conversation (0 = no limit)."""
    seed: int | None = None
    """Base seed; rollout i of a task uses seed + i (None: nondeterministic)."""


class EvalSection(StrictModel):
    """[eval]: what to evaluate, against which model, and where results go."""

    env: str = ""
    """Environment: a built-in name, a name from env_runner.environments, or "module:attr"."""
    tasks: Path | None = None
    """JSONL task file (default: the environment's built-in task set)."""
    num_tasks: int | None = Field(None, ge=1)
    """Evaluate the first N tasks (default: all)."""
    rollouts_per_task: int = Field(1, ge=1)
    """k rollouts per task; pass@1 .. pass@k are reported."""
    backend: Literal["openai", "tokens"] = "openai"
    """openai: any OpenAI-compatible chat endpoint (base_url); tokens: Treadle's inference
    token route (env_runner.inference_url, env_runner.tokenizer), recorded token-exactly."""
    base_url: str | None = None
    """OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (backend = "openai")."""
    model: str = "default"
    """Model name sent to the endpoint."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the endpoint's API key (unset: no key sent)."""
    max_concurrency: int = Field(16, ge=1)
    """Rollouts at once."""
    pass_threshold: float = 1.0
    """A rollout passes when its reward is >= this."""
    timeout_s: float = Field(0.0, ge=0)
    """Wall-clock budget per rollout (0 = the environment's default)."""
    output_dir: Path | None = None
    """Where results go (default: <run.output_dir>/<run.name>/eval)."""
    resume: bool = True
    """Skip rollouts already in results.jsonl (same config); false starts over."""
    sampling: EvalSampling = Field(default_factory=EvalSampling)

    @model_validator(mode="after")
    def _checks(self) -> EvalSection:
        if self.backend == "openai" and self.env and not self.base_url:
            raise ValueError('backend "openai" needs eval.base_url (e.g. http://127.0.0.1:8000/v1)')
        return self


class EvalConfig(ServiceConfig):
    """What ``treadle eval`` reads: shared sections, [eval] and [env_runner]."""

    eval: EvalSection = Field(default_factory=EvalSection)
    env_runner: EnvRunnerSection = Field(default_factory=EnvRunnerSection)


# --- results --------------------------------------------------------------------------------
def rollout_id(fingerprint: str, task_id: str, index: int) -> str:
    return hashlib.sha256(f"{fingerprint}/{task_id}/{index}".encode()).hexdigest()[:32]


def result_row(rollout: rollout_pb2.Rollout, index: int, state: RolloutState | None,
               passed: bool, spans: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    status = rollout.status
    return {
        "task_id": rollout.task_id,
        "index": index,
        "rollout_id": rollout.rollout_id,
        "reward": rollout.reward,
        "passed": passed,
        "rewards": {r.name: r.value for r in rollout.rewards},
        "weights": {r.name: r.weight for r in rollout.rewards},
        "metrics": dict(rollout.metrics),
        "status": rollout_pb2.RolloutStatus.Kind.Name(status.kind).removeprefix("KIND_").lower(),
        "truncation": rollout_pb2.RolloutStatus.Truncation.Name(status.truncation).removeprefix("TRUNCATION_").lower()
        if status.truncation else None,
        "error_kind": rollout_pb2.RolloutStatus.ErrorKind.Name(status.error_kind).removeprefix("ERROR_KIND_").lower()
        if status.error_kind else None,
        "message": status.message,
        "messages": state.messages if state is not None else [],
        "tools": state.tools if state is not None else [],
        "nodes": [_node_dict(n) for n in rollout.nodes],
        "trace_id": rollout.trace_id,
        "trace": spans or [],
        "timing": MessageToDict(rollout.timing, preserving_proto_field_name=True),
    }  # fmt: skip


def _node_dict(n: rollout_pb2.MessageNode) -> dict[str, Any]:
    d: dict[str, Any] = {"id": n.node_id, "parent": n.parent_id,
                         "role": rollout_pb2.Role.Name(n.role).removeprefix("ROLE_").lower(), "content": n.content}  # fmt: skip
    if n.reasoning_content:
        d["reasoning"] = n.reasoning_content
    if n.tool_calls:
        d["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments_json,
                            "status": rollout_pb2.ToolCall.Status.Name(c.status).removeprefix("STATUS_").lower()}
                           for c in n.tool_calls]  # fmt: skip
    if n.token_ids.data:
        d["num_tokens"] = len(n.token_ids.data) // 4
    return d


def summarize(rows: Sequence[dict[str, Any]], k: int) -> dict[str, Any]:
    """Mean reward, mean of every reward component and metric, pass@k, statuses."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_task[r["task_id"]].append(r)
    n_rows = len(rows)
    means: dict[str, float] = {}
    if n_rows:
        means["reward"] = sum(r["reward"] for r in rows) / n_rows
        keys = sorted({key for r in rows for key in r["rewards"]})
        for key in keys:
            vals = [r["rewards"][key] for r in rows if key in r["rewards"]]
            means[f"reward/{key}"] = sum(vals) / len(vals)
        for key in sorted({key for r in rows for key in r["metrics"]}):
            vals = [r["metrics"][key] for r in rows if key in r["metrics"]]
            means[f"metric/{key}"] = sum(vals) / len(vals)
    passes: dict[str, float] = {}
    complete = [group for group in by_task.values() if len(group) >= k]
    for kk in ks_for(k):
        if complete:
            passes[f"pass@{kk}"] = sum(
                pass_at_k(len(g), sum(r["passed"] for r in g), kk) for g in complete
            ) / len(complete)
    statuses = Counter(
        r["status"] if r["status"] != "error" else f"error:{r['error_kind']}" for r in rows
    )
    return {"num_tasks": len(by_task), "num_rollouts": n_rows, "rollouts_per_task": k,
            "means": means, "pass": passes, "statuses": dict(statuses)}  # fmt: skip


def summary_table(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['num_tasks']} tasks x {summary['rollouts_per_task']} rollouts = {summary['num_rollouts']}"
    ]
    width = max([len(k) for k in [*summary["means"], *summary["pass"]]] + [6])
    for key, value in summary["pass"].items():
        lines.append(f"  {key:<{width}}  {value:.3f}")
    for key, value in summary["means"].items():
        lines.append(f"  {key:<{width}}  {value:.3f}")
    lines.append(
        "  statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(summary["statuses"].items()))
    )
    return "\n".join(lines)


# --- traces -------------------------------------------------------------------------------
class SpanCollector(SpanProcessor):
    """A span processor keeping finished spans by trace id until the rollout's row takes
    them (``pop``): each result row carries its rollout's trace."""

    def __init__(self) -> None:
        self.by_trace: dict[str, list[Any]] = defaultdict(list)
        self.active = 0
        """Evaluations running in this process; spans are kept only while one runs."""

    def on_end(self, span: Any) -> None:
        if self.active:
            self.by_trace[format(span.context.trace_id, "032x")].append(span)

    def pop(self, trace_id: str) -> list[dict[str, Any]]:
        spans = sorted(self.by_trace.pop(trace_id, []), key=lambda s: s.start_time or 0)
        if not spans:
            return []
        t0 = spans[0].start_time or 0
        return [{"name": s.name, "span_id": format(s.context.span_id, "016x"),
                 "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
                 "start_ms": round(((s.start_time or 0) - t0) / 1e6, 3),
                 "duration_ms": round(((s.end_time or 0) - (s.start_time or 0)) / 1e6, 3),
                 "attributes": dict(s.attributes or {}),
                 **({"events": [{"name": e.name, "attributes": dict(e.attributes or {})}
                                for e in s.events]} if s.events else {})}
                for s in spans]  # fmt: skip


_COLLECTOR: SpanCollector | None = None


def span_collector(cfg: EvalConfig) -> SpanCollector:
    """The process's collector, installed once (with the configured exporters, if any)."""
    global _COLLECTOR
    if _COLLECTOR is None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        from treadle.services.telemetry import setup_telemetry

        _COLLECTOR = SpanCollector()
        provider = trace.get_tracer_provider()
        if isinstance(provider, TracerProvider):
            provider.add_span_processor(_COLLECTOR)
        else:
            setup_telemetry("eval", cfg.telemetry, extra_processors=[_COLLECTOR])
    return _COLLECTOR


# --- progress -------------------------------------------------------------------------------
class Bar:
    """One live line on a terminal (a line every 10% otherwise)."""

    def __init__(self, total: int, done: int, stream: Any = sys.stderr, label: str = "eval"):
        self.total, self.done, self.stream, self.label = total, done, stream, label
        self.started = time.monotonic()
        self.start_done = done
        self.reward_sum = 0.0
        self.passed = 0
        self.errors = 0
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self._last_decile = -1

    def update(self, row: dict[str, Any]) -> None:
        self.done += 1
        self.reward_sum += row["reward"]
        self.passed += bool(row["passed"])
        self.errors += row["status"] == "error"
        new = self.done - self.start_done
        elapsed = time.monotonic() - self.started
        rate = new / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        eta_s = f"{eta:.0f}s" if math.isfinite(eta) else "?"
        line = (f"[{self.label}] |{'#' * filled}{'.' * (width - filled)}| {self.done}/{self.total}  "
                f"reward {self.reward_sum / new:.3f}  pass {self.passed / new:.3f}  errors {self.errors}  "
                f"{rate:.2f} rollouts/s  eta {eta_s}")  # fmt: skip
        if self.tty:
            self.stream.write("\r" + line)
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        else:
            decile = int(10 * self.done / max(self.total, 1))
            if decile != self._last_decile:
                self._last_decile = decile
                print(line, file=self.stream, flush=True)


# --- the run --------------------------------------------------------------------------------
def fingerprint(cfg: EvalConfig, env: Environment, *, legacy: bool = False) -> str:
    """What must match for a resume: environment, tasks, model and sampling (not
    pass_threshold: resumed rows are judged again). ``legacy``: the fingerprint results
    written before that change carry (pass_threshold included), still accepted."""
    e = cfg.eval
    keep: dict[str, Any] = {"env": e.env, "tasks": str(e.tasks), "backend": e.backend, "base_url": e.base_url,
            "model": e.model, "sampling": e.sampling.model_dump(),
            "inference_url": (cfg.env_runner.inference_urls or cfg.env_runner.inference_url)
            if e.backend == "tokens" else None}  # fmt: skip
    if legacy:
        keep["pass_threshold"] = e.pass_threshold
    if specs := cfg.env_runner.group_rewards.get(e.env):  # unset: older results still match
        keep["group_rewards"] = specs
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def load_tasks(cfg: EvalConfig, env: Environment) -> list[dict[str, Any]]:
    e = cfg.eval
    ts = TaskSet.from_jsonl(e.tasks, required=env.required) if e.tasks else env.task_set()
    tasks = ts.head(e.num_tasks)
    if not tasks:
        raise ConfigError("no tasks to evaluate")
    return tasks


async def evaluate(
    cfg: EvalConfig,
    stream: Any = sys.stderr,
    *,
    section: str = "eval",
    rows_out: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run the evaluation ``cfg`` describes; returns the summary (see the module doc).
    ``section`` names the config section in messages and tags the progress lines
    (``treadle sft-data`` samples through here as [sft_data]); ``rows_out``, when given,
    receives the result rows of this config's tasks x rollouts (resumed ones included),
    task by task."""
    e = cfg.eval
    if not e.env:
        raise ConfigError("eval.env is required (e.g. --eval.env countdown)")
    r = cfg.env_runner
    env = load_environment(e.env, r.environments, r.group_rewards, r.runtimes)
    tasks = load_tasks(cfg, env)
    out = e.output_dir or cfg.run.run_dir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    results, meta_path = out / "results.jsonl", out / "meta.json"
    fp = fingerprint(cfg, env)
    done_rows: dict[tuple[str, int], dict[str, Any]] = {}
    if e.resume and results.exists():
        if meta_path.exists() and json.loads(meta_path.read_text())["fingerprint"] not in (
            fp,
            fingerprint(cfg, env, legacy=True),
        ):
            raise ConfigError(
                f"{results} holds results of a different {section} config (env, tasks, model or "
                f"sampling changed): use another run.name, {section}.output_dir, or "
                f"--{section}.resume false"
            )
        for line in results.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash: that rollout runs again
                if row["status"] == "error" and row["error_kind"] == "inference":
                    continue  # the endpoint failed, not the model: that rollout runs again
                row["passed"] = row["reward"] >= e.pass_threshold
                done_rows[(row["task_id"], row["index"])] = row
    elif results.exists():
        results.unlink()
    meta_path.write_text(json.dumps({"fingerprint": fp, "config": to_toml(cfg)}, indent=1))

    collector = span_collector(cfg)
    rc = await _context(cfg)
    from treadle.env_runner.service import start_services, stop_services

    await start_services(rc, [env])
    k = e.rollouts_per_task
    todo = [(t, i) for t in tasks for i in range(k) if (t["id"], i) not in done_rows]
    total = len(tasks) * k
    bar = Bar(total, total - len(todo), stream, section)
    if env.rubric.group_rewards and k == 1:
        print(f"[{section}] group rewards ({', '.join(g.name for g in env.rubric.group_rewards)}) "
              f"need {section}.rollouts_per_task > 1: not applied", file=stream)  # fmt: skip
    if done_rows:
        print(f"[{section}] resuming: {len(done_rows)} rollouts already in {results}", file=stream)
    sem = asyncio.Semaphore(e.max_concurrency)
    lock = asyncio.Lock()
    group_left = Counter(t["id"] for t, _ in todo)
    group_parts: dict[str, list[tuple[rollout_pb2.Rollout, int, RolloutState | None]]] = (
        defaultdict(list)
    )
    fh = results.open("a", encoding="utf-8")

    async def write(rows: list[dict[str, Any]]) -> None:
        async with lock:
            for row in rows:
                row["trace"] = collector.pop(row["trace_id"])
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
                done_rows[(row["task_id"], row["index"])] = row
                bar.update(row)
            fh.flush()

    async def one(task: dict[str, Any], index: int) -> None:
        s = e.sampling
        req = rollout_pb2.RolloutRequested(
            rollout_id=rollout_id(fp, task["id"], index), group_id=rollout_id(fp, task["id"], -1),
            group_index=index, group_size=k, env=env.name, task_id=task["id"],
            task_json=json.dumps(task, ensure_ascii=False), timeout_s=e.timeout_s,
            sampling=rollout_pb2.SamplingParams(
                temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens,
                max_total_tokens=s.max_total_tokens, seed=None if s.seed is None else s.seed + index),
            labels={"split": "eval"},
        )  # fmt: skip
        states: list[RolloutState] = []
        async with sem:
            rollout = await run_rollout(req, env, rc, states)
        state = states[0] if states else None
        if not env.rubric.group_rewards or k == 1:
            await write([result_row(rollout, index, state, rollout.reward >= e.pass_threshold)])
            return
        group_parts[task["id"]].append((rollout, index, state))
        group_left[task["id"]] -= 1
        if group_left[task["id"]] == 0:
            await write(await _score_group(env, group_parts.pop(task["id"]), e.pass_threshold))

    collector.active += 1
    try:
        await asyncio.gather(*(one(t, i) for t, i in todo))
    finally:
        collector.active -= 1
        if not collector.active:
            collector.by_trace.clear()
        fh.close()
        await stop_services(rc)
        if rc.openai is not None:
            await rc.openai.aclose()
        if rc.generator is not None and hasattr(rc.generator, "aclose"):
            await rc.generator.aclose()
        if rc.executor is not None:
            rc.executor.shutdown(wait=False, cancel_futures=True)
    rows = [done_rows[(t["id"], i)] for t in tasks for i in range(k) if (t["id"], i) in done_rows]
    if rows_out is not None:
        rows_out.extend(rows)
    summary = summarize(rows, k) | {"env": env.name, "model": e.model, "results": str(results)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


async def _score_group(env: Environment, parts: list[tuple[rollout_pb2.Rollout, int, RolloutState | None]],
                       threshold: float) -> list[dict[str, Any]]:  # fmt: skip
    """Group rewards over the scored rollouts of one task (errored ones are left out)."""
    ok = [
        (r, i, s)
        for r, i, s in parts
        if s is not None and r.status.kind in (Kind.KIND_OK, Kind.KIND_TRUNCATED)
    ]
    states = [group_state(copy.copy(s), r) for r, _, s in ok if s is not None]
    try:
        extra = await env.rubric.score_group(states)
    except RewardError as err:
        log.warning("task %s: %s; its rollouts are errors", parts[0][0].task_id, err)
        for r, _, _ in ok:
            r.status.CopyFrom(rollout_pb2.RolloutStatus(kind=Kind.KIND_ERROR,
                error_kind=rollout_pb2.RolloutStatus.ErrorKind.ERROR_KIND_REWARD, message=str(err)[:2000]))  # fmt: skip
            r.metrics["reward_error"] = 1.0
        extra = [Score([], {}) for _ in ok]
    for (r, _, _), score in zip(ok, extra, strict=True):
        for name, value, weight in score.rewards:
            r.rewards.add(name=name, value=value, weight=weight, from_group=True)
            r.reward += value * weight
        r.metrics.update(score.metrics)
    return [result_row(r, i, s, r.reward >= threshold) for r, i, s in parts]


async def _context(cfg: EvalConfig) -> RolloutContext:
    e, er = cfg.eval, cfg.env_runner
    executor = ThreadPoolExecutor(e.max_concurrency, thread_name_prefix="eval")
    if e.backend == "openai":
        import os

        from treadle.env_runner.session import OpenAIChat

        assert e.base_url is not None
        chat = OpenAIChat(
            e.base_url, e.model, os.environ.get(e.api_key_env), timeout_s=er.inference_timeout_s
        )
        return RolloutContext(None, None, "eval", executor=executor, openai=chat)
    if er.tokenizer is None:
        raise ConfigError(
            'backend "tokens" needs env_runner.tokenizer (the served model\'s folder or tokenizer.json)'
        )
    from treadle.env_runner.service import inference_generator
    from treadle.services.rendering import open_renderer

    renderer = open_renderer(
        er.renderer, er.tokenizer, force=er.renderer_force, what="env_runner.renderer"
    )
    client = inference_generator(er)
    from treadle.env_runner.siblings import SiblingCalls

    return RolloutContext(renderer, client, "eval", attempts=er.inference_attempts,
                          enable_thinking=er.enable_thinking, executor=executor,
                          siblings=SiblingCalls(er.group_call_window_s))  # fmt: skip


def main(argv: Sequence[str]) -> int:
    """``treadle eval`` (the CLI parses flags; see the module doc)."""
    from treadle.services.config import split_argv

    sources = split_argv(argv)
    from treadle.services.registry import known_sections

    cfg = load_config(EvalConfig, sources, known_sections=known_sections())
    if sources.dry_run:
        print(to_toml(cfg, only=["run", "eval", "env_runner"]), end="")
        return 0
    summary = asyncio.run(evaluate(cfg))
    print(f"[eval] {summary['env']} · {summary['model']}")
    print(summary_table(summary))
    print(f"[eval] results: {summary['results']}")
    return 0
