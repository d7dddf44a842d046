"""Rubrics: how a rollout is scored.

Rewards and metrics are plain functions (sync or async) of the rollout. A function asks
for what it needs by parameter name, from:

    task        the task (dict)
    completion  the last assistant message's text
    messages    the whole conversation (OpenAI-style dicts, tool calls included)
    state       the RolloutState (info, turns, truncation, ...)
    answer      task["answer"] when the task has one

    def exact(completion, answer) -> float: ...
    rubric = Rubric(rewards=[exact, (brevity, 0.1)], metrics=[num_words])

A reward returns a float (or a dict of named floats); the rollout's reward is the
weighted sum. Metrics are recorded, never summed. **Group rewards** see every rollout of
a task at once (``tasks``, ``completions``, ``states``, ``messages`` as lists, ``task``
as the shared task) and return one value per rollout, e.g. a brevity bonus among
correct answers; a value may be a ``GroupResult`` to also record metrics on its rollout
(e.g. where a judge saw it). Each state then also holds the rollout's own ``reward`` and
``rewards`` and every rollout metric (``completion_tokens``, ...). Built-in group rewards
(a conciseness bonus, pairwise and ranking LLM judges) live in ``group_rewards``. A
reward that raises is a rollout status (``ERROR_KIND_REWARD``) and a metric, never a
crash of the runner.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.env_runner.runtimes.base import Runtime

RewardValue = float | dict[str, float]


@dataclass
class RolloutState:
    """What a harness leaves for scoring: the conversation and anything it recorded."""

    task: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    """Tool schemas the model was shown on its last turn (OpenAI function format)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form data the harness/tools record (e.g. test results), for rewards."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers recorded during the rollout (turns, tool calls, ...)."""
    num_turns: int = 0
    truncated: str = ""
    """Which limit ended the rollout ("" = none)."""
    reward: float = 0.0
    """Group rewards only: the rollout's reward from its rubric's own rewards (weighted
    sum, before any group reward)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Group rewards only: the rollout's own reward components, by name (unweighted)."""
    runtime: Runtime | None = None
    """The environment's runtime: where a reward that runs programs (tests) runs them
    (None: state built outside a rollout; such rewards use the default, the sandbox)."""

    @property
    def completion(self) -> str:
        for m in reversed(self.messages):
            if m.get("role") == "assistant":
                return str(m.get("content") or "")
        return ""


class RewardError(Exception):
    """A reward or metric function raised; ``name`` says which."""

    def __init__(self, name: str, error: BaseException):
        super().__init__(f"{name} raised {type(error).__name__}: {error}")
        self.name = name
        self.error = error


@dataclass
class Scored:
    fn: Callable[..., Any]
    weight: float
    name: str


def _entry(item: Any) -> Scored:
    if isinstance(item, Scored):
        return item
    if isinstance(item, tuple):
        fn, weight = item
        return Scored(fn, float(weight), getattr(fn, "__name__", type(fn).__name__))
    return Scored(item, 1.0, getattr(item, "__name__", type(item).__name__))


def _wants(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    params = inspect.signature(fn).parameters
    names = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params.values())


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def call_scorer(
    fn: Callable[..., Any], available: dict[str, Any], run_sync: Callable[..., Awaitable[Any]]
) -> Any:
    """Call ``fn`` with the arguments it names; sync functions go through ``run_sync``
    (a thread pool: a reward may block on a judge or a test run)."""
    names, var_kw = _wants(fn)
    unknown = names - available.keys()
    if unknown and not var_kw:
        missing = [n for n in unknown if not _has_default(fn, n)]
        if missing:
            raise TypeError(
                f"asks for {', '.join(sorted(missing))}; available: {', '.join(sorted(available))}"
            )
    kwargs = available if var_kw else {k: v for k, v in available.items() if k in names}
    if _is_async(fn):
        return await fn(**kwargs)
    return await run_sync(lambda: fn(**kwargs))


def _has_default(fn: Callable[..., Any], name: str) -> bool:
    p = inspect.signature(fn).parameters.get(name)
    return p is not None and p.default is not p.empty


def _values(name: str, result: Any) -> dict[str, float]:
    if isinstance(result, dict):
        return {f"{name}.{k}" if k != name else k: float(v) for k, v in result.items()}
    if isinstance(result, bool):
        return {name: float(result)}
    return {name: float(result)}


async def _default_sync(fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


@dataclass
class GroupResult:
    """One rollout's value from a group reward, with metrics to record on that rollout
    (never summed into its reward), e.g. ``{"position": 2.0}``: recorded as
    ``<group reward name>.<key>``."""

    value: RewardValue
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Score:
    rewards: list[tuple[str, float, float]]  # (name, value, weight)
    metrics: dict[str, float]

    @property
    def total(self) -> float:
        return float(sum(v * w for _, v, w in self.rewards))


class Rubric:
    """Reward functions with weights, metrics, and group rewards (see the module doc)."""

    def __init__(
        self,
        rewards: Sequence[Any] = (),
        metrics: Sequence[Callable[..., Any]] = (),
        group_rewards: Sequence[Any] = (),
    ):
        self.rewards = [_entry(r) for r in rewards]
        self.metrics = [_entry(m) for m in metrics]
        self.group_rewards = [_entry(g) for g in group_rewards]
        for s in (*self.rewards, *self.metrics, *self.group_rewards):
            if not callable(s.fn):
                raise TypeError(f"{s.name!r} is not callable")

    def add_reward(
        self, fn: Callable[..., Any], weight: float = 1.0, name: str | None = None
    ) -> Rubric:
        self.rewards.append(Scored(fn, weight, name or fn.__name__))
        return self

    def add_metric(self, fn: Callable[..., Any], name: str | None = None) -> Rubric:
        self.metrics.append(Scored(fn, 0.0, name or fn.__name__))
        return self

    def add_group_reward(
        self, fn: Callable[..., Any], weight: float = 1.0, name: str | None = None
    ) -> Rubric:
        self.group_rewards.append(Scored(fn, weight, name or fn.__name__))
        return self

    @staticmethod
    def available(state: RolloutState) -> dict[str, Any]:
        a = {
            "task": state.task,
            "completion": state.completion,
            "messages": state.messages,
            "state": state,
            "info": state.info,
        }
        if "answer" in state.task:
            a["answer"] = state.task["answer"]
        return a

    async def score(
        self, state: RolloutState, run_sync: Callable[..., Awaitable[Any]] = _default_sync
    ) -> Score:
        """Every reward and metric of one rollout; RewardError if one raises."""
        available = self.available(state)
        rewards: list[tuple[str, float, float]] = []
        metrics: dict[str, float] = {}
        for s in self.rewards:
            try:
                values = _values(s.name, await call_scorer(s.fn, available, run_sync))
            except Exception as e:
                raise RewardError(s.name, e) from e
            rewards += [(k, v, s.weight) for k, v in values.items()]
        for s in self.metrics:
            try:
                metrics.update(_values(s.name, await call_scorer(s.fn, available, run_sync)))
            except Exception as e:
                raise RewardError(s.name, e) from e
        return Score(rewards, metrics)

    async def score_group(
        self,
        states: Sequence[RolloutState],
        run_sync: Callable[..., Awaitable[Any]] = _default_sync,
    ) -> list[Score]:
        """Group rewards: for each rollout, its group rewards and the metrics they record;
        RewardError if a function raises or returns the wrong number of values."""
        out = [Score([], {}) for _ in states]
        if not self.group_rewards or not states:
            return out
        available = {
            "task": states[0].task,
            "tasks": [s.task for s in states],
            "completions": [s.completion for s in states],
            "messages": [s.messages for s in states],
            "states": list(states),
        }
        if "answer" in states[0].task:
            available["answer"] = states[0].task["answer"]
        for s in self.group_rewards:
            try:
                values = await call_scorer(s.fn, available, run_sync)
                values = list(values)
                if len(values) != len(states):
                    raise ValueError(f"returned {len(values)} values for {len(states)} rollouts")
                parsed = []
                for v in values:
                    metrics = v.metrics if isinstance(v, GroupResult) else {}
                    v = v.value if isinstance(v, GroupResult) else v
                    parsed.append((_values(s.name, v), _values(s.name, metrics)))
            except Exception as e:
                raise RewardError(s.name, e) from e
            for score, (rewards, metrics) in zip(out, parsed, strict=True):
                score.rewards += [(k, val, s.weight) for k, val in rewards.items()]
                score.metrics.update(metrics)
        return out


class JudgeReward:
    """A reward from an LLM judge at any OpenAI-compatible chat-completions endpoint.

    The judge sees ``prompt`` formatted with the task's fields plus ``completion``, and
    its reply is scored by ``parse`` (default: 1.0 if the reply starts with "yes").
    An unreachable judge or an HTTP error raises, so the rollout ends with
    ``ERROR_KIND_REWARD`` and the runner counts it.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        prompt: str,
        *,
        name: str = "judge",
        api_key_env: str = "OPENAI_API_KEY",
        parse: Callable[[str], float] | None = None,
        timeout_s: float = 60.0,
        max_tokens: int = 64,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.prompt = prompt
        self.__name__ = name
        self.api_key_env = api_key_env
        self.parse = parse or (lambda text: 1.0 if text.strip().lower().startswith("yes") else 0.0)
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens

    async def __call__(self, task: dict[str, Any], completion: str) -> float:
        import httpx

        content = self.prompt.format(**{**task, "completion": completion})
        headers = {}
        if key := os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {key}"
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            try:
                resp = await client.post(
                    f"{self.base_url}/chat/completions", json=body, headers=headers
                )
            except httpx.HTTPError as e:
                raise ConnectionError(f"judge at {self.base_url} unreachable: {e}") from None
        if resp.status_code != 200:
            raise RuntimeError(f"judge answered HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            reply = resp.json()["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
            raise RuntimeError(f"judge reply is not a chat completion: {e}") from None
        return float(self.parse(reply))
