"""Built-in group rewards: a conciseness bonus, a pairwise judge and a ranking judge.

    rubric = Rubric(rewards=[correct], group_rewards=[
        (ConcisenessBonus(shape="linear"), 0.2),            # shortest correct answers
        (PairwiseJudge("http://judge:8000/v1", "judge-model"), 0.5),  # win rate
        (RankingJudge("http://judge:8000/v1", "judge-model"), 0.5),   # rank, one call
    ])

Each is an ordinary group reward (``Rubric.group_rewards``), applied by ``treadle eval``
(k > 1) and, in RL, by an env runner when the orchestrator completes a group; each
returns a value in [0, 1] per rollout (the weight sets the size) plus metrics recorded
on the rollout under ``<name>.<key>``. From config, without code:
``[[env_runner.group_rewards.<env>]]`` tables (``kind`` = one of ``KINDS``, ``weight``,
the constructor's keyword arguments) add them to a served environment (``from_spec``).

The judges see the task (the prompt the policy saw) and the group's final answers in a
shuffled order: seeded by ``seed``, the task and the answers, so scoring a group again
gives the same order; each rollout records where the judge saw it (``.position``, 0
based), and each judge call's span (``judge_call``) the positions it showed and the
verdict it parsed. A judge that stays down, slow or
unparsable after its bounded attempts raises a ``JudgeError``: the group's rollouts
become reward errors (counted: ``num_group_reward_errors`` in RL, ``error:reward`` in
eval), never a silently wrong reward.

Not here: the HTTP call, retries and verdict parsers (``judge``), and per-rollout judges
(``rubric.JudgeReward``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

from treadle.env_runner.judge import JudgeClient, parse_preference, parse_ranking
from treadle.env_runner.rubric import GroupResult, RolloutState
from treadle.services.telemetry import tracer

NEUTRAL = 0.5
"""A judge's reward for a rollout it compared with nothing (a group of one, or a
``max_comparisons`` too small to reach it): the win rate of a coin flip."""


# --- conciseness ----------------------------------------------------------------------------
class ConcisenessBonus:
    """A bonus for the shortest correct answers of the group.

    ``correct`` decides which rollouts compete: None (default) = the rollout's own reward
    (the weighted sum of its rubric rewards, before group rewards) >= ``threshold`` (1.0,
    like ``treadle eval``'s pass_threshold); a name = that reward component >=
    ``threshold`` (an unknown name is an error naming those that exist); a callable =
    ``correct(state) -> bool``. Incorrect rollouts get 0.

    Length (``length``): "tokens" = the rollout's sampled completion tokens (metric
    ``completion_tokens``, every turn); "chars" = characters of every assistant message
    (content and tool-call arguments); "auto" (default) = tokens when every rollout of the
    group has them (> 0), else characters for the whole group (an OpenAI-compatible
    endpoint that reports no usage).

    Shape: "linear" (default) = 1 for the shortest, falling linearly to 0 for the longest
    correct answer; ties share the best rank among them (lengths 5, 5, 9 -> 1, 1, 0); a
    lone correct answer gets 1. "shortest" = 1 for every correct answer of the minimum
    length, 0 for the others. A group of one gets 0 (nothing to be shorter than).
    Metrics: ``.length``, ``.length_in_tokens`` (1 tokens, 0 characters), ``.correct``.
    """

    def __init__(
        self,
        *,
        correct: str | Callable[[RolloutState], Any] | None = None,
        threshold: float = 1.0,
        shape: Literal["linear", "shortest"] = "linear",
        length: Literal["auto", "tokens", "chars"] = "auto",
        name: str = "conciseness",
    ):
        if shape not in ("linear", "shortest"):
            raise ValueError(f'conciseness shape {shape!r}: use "linear" or "shortest"')
        if length not in ("auto", "tokens", "chars"):
            raise ValueError(f'conciseness length {length!r}: use "auto", "tokens" or "chars"')
        self.correct = correct
        self.threshold = threshold
        self.shape = shape
        self.length = length
        self.__name__ = name

    def is_correct(self, state: RolloutState) -> bool:
        if self.correct is None:
            return state.reward >= self.threshold
        if callable(self.correct):
            return bool(self.correct(state))
        if self.correct not in state.rewards:
            raise ValueError(
                f"correct = {self.correct!r} names no reward of the rollout; it has: "
                f"{', '.join(sorted(state.rewards)) or 'none'}"
            )
        return state.rewards[self.correct] >= self.threshold

    def lengths(self, states: Sequence[RolloutState]) -> tuple[list[float], bool]:
        """(each rollout's length, whether in tokens)."""
        tokens = [float(s.metrics.get("completion_tokens", 0.0)) for s in states]
        if self.length == "tokens" and not all(t > 0 for t in tokens):
            raise ValueError(
                'conciseness length = "tokens", but a rollout has no completion_tokens '
                '(the endpoint reports no usage): use length = "auto" or "chars"'
            )
        if self.length == "tokens" or (self.length == "auto" and all(t > 0 for t in tokens)):
            return tokens, True
        return [float(_chars(s)) for s in states], False

    async def __call__(self, states: list[RolloutState]) -> list[GroupResult]:
        correct = [self.is_correct(s) for s in states]
        lengths, in_tokens = self.lengths(states)
        ok = sorted(x for x, c in zip(lengths, correct, strict=True) if c)
        out = []
        for x, c in zip(lengths, correct, strict=True):
            value = 0.0
            if c and len(states) > 1:
                rank = ok.index(x)  # how many correct answers are strictly shorter
                if self.shape == "shortest":
                    value = float(rank == 0)
                else:
                    value = 1.0 - rank / (len(ok) - 1) if len(ok) > 1 else 1.0
            out.append(GroupResult(value, {"length": x, "length_in_tokens": float(in_tokens),
                                           "correct": float(c)}))  # fmt: skip
        return out


def _chars(state: RolloutState) -> int:
    n = 0
    for m in state.messages:
        if m.get("role") == "assistant":
            n += len(str(m.get("content") or ""))
            for c in m.get("tool_calls") or ():
                n += len(str((c.get("function") or {}).get("arguments") or ""))
    return n


# --- judges -----------------------------------------------------------------------------------
PAIRWISE_PROMPT = """You are comparing two responses to the same task.

[Task]
{prompt}

[Response A]
{a}

[Response B]
{b}

Which response is better? Judge correctness first, then helpfulness and clarity. Do not \
let the order of the responses or their length sway you. Explain briefly, then end with \
exactly one verdict: [[A]] if A is better, [[B]] if B is better, [[tie]] if they are \
equally good."""

RANKING_PROMPT = """You are ranking {n} responses to the same task.

[Task]
{prompt}

{responses}

Rank the responses from best to worst: correctness first, then helpfulness and clarity. \
Do not let their order or length sway you. Explain briefly, then end with one line of \
the form
RANKING: 2 > 1 > 3
naming every response number from 1 to {n} exactly once, best first."""

_COMMON_FIELDS = frozenset({"prompt", "task", "answer"})


def _check_template(template: str, fields: frozenset[str], what: str) -> None:
    """A template naming an unknown field is a ValueError now, not at the first group."""
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    roots = {n.split(".")[0].split("[")[0] for n in names}
    unknown = sorted(r for r in roots if r not in fields)
    if unknown or "" in roots:
        raise ValueError(f"{what} names {{{(unknown or [''])[0]}}}; it may use: "
                         + ", ".join("{" + f + "}" for f in sorted(fields)))  # fmt: skip


def prompt_text(state: RolloutState) -> str:
    """The task as the policy saw it: the messages before its first answer ("role:
    content" lines when there are several)."""
    shown = []
    for m in state.messages:
        if m.get("role") == "assistant":
            break
        shown.append(m)
    if len(shown) == 1:
        return str(shown[0].get("content") or "")
    return "\n\n".join(f"{m.get('role')}: {m.get('content') or ''}" for m in shown)


class _GroupJudge:
    """What both judges share: the client, the prompt, the shuffle and its record."""

    fields: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        prompt: str,
        system_prompt: str | None,
        name: str,
        seed: int,
        api_key_env: str,
        timeout_s: float,
        attempts: int,
        max_tokens: int,
        temperature: float,
        max_concurrency: int,
        retry_backoff_s: float,
    ):
        _check_template(prompt, self.fields, f"{name} prompt")
        self.client = JudgeClient(
            base_url, model, api_key_env=api_key_env, timeout_s=timeout_s, attempts=attempts,
            max_tokens=max_tokens, temperature=temperature, max_concurrency=max_concurrency,
            retry_backoff_s=retry_backoff_s,
        )  # fmt: skip
        self.prompt = prompt
        self.system_prompt = system_prompt
        self.seed = seed
        self.__name__ = name

    def shuffle(self, task: dict[str, Any], completions: Sequence[str]) -> tuple[list[int], int]:
        """(order: order[position] = rollout index, the group's seed). Seeded by ``seed``,
        the task and the completions: the same group is always shown the same way."""
        key = json.dumps([self.seed, task, list(completions)], sort_keys=True, default=str)
        group_seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")
        order = list(range(len(completions)))
        random.Random(group_seed).shuffle(order)
        return order, group_seed

    def messages(self, content: str) -> list[dict[str, Any]]:
        out = [{"role": "user", "content": content}]
        if self.system_prompt:
            out.insert(0, {"role": "system", "content": self.system_prompt})
        return out

    @staticmethod
    def common(task: dict[str, Any], states: Sequence[RolloutState]) -> dict[str, Any]:
        return {"prompt": prompt_text(states[0]), "task": task,
                "answer": task.get("answer", "")}  # fmt: skip


def _shown(text: str) -> str:
    return text if text.strip() else "(empty response)"


class PairwiseJudge(_GroupJudge):
    """A judge model compares the group's answers two at a time; the reward is each
    rollout's win rate (a tie counts half).

    Comparisons follow a round-robin schedule over the shuffled order (the circle
    method: each round pairs every rollout once, one sits out when the group is odd),
    so every pair is compared once (n(n-1)/2 calls), or, with ``max_comparisons``, the
    first rounds up to that many calls (everyone is compared about equally often).
    Which answer is shown as A is a seeded coin flip per pair. The judge ends with
    ``[[A]]``, ``[[B]]`` or ``[[tie]]`` (``judge.parse_preference``). A rollout compared
    with nothing gets ``NEUTRAL`` (0.5). ``prompt`` may use {prompt} (the task as the
    policy saw it), {task} (the task dict: ``{task[question]}``), {answer} (the task's
    answer, if any), {a} and {b}. Metrics: ``.position``, ``.comparisons``, ``.wins``,
    ``.shown_first`` (times shown as A). The API key comes from the environment variable
    ``api_key_env`` (unset: none sent).
    """

    fields = _COMMON_FIELDS | {"a", "b"}

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        prompt: str = PAIRWISE_PROMPT,
        system_prompt: str | None = None,
        max_comparisons: int | None = None,
        name: str = "pairwise_judge",
        seed: int = 0,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        attempts: int = 3,
        max_tokens: int = 1024,
        temperature: float = 0.0,
        max_concurrency: int = 8,
        retry_backoff_s: float = 0.5,
    ):
        super().__init__(
            base_url, model, prompt=prompt, system_prompt=system_prompt, name=name, seed=seed,
            api_key_env=api_key_env, timeout_s=timeout_s, attempts=attempts, max_tokens=max_tokens,
            temperature=temperature, max_concurrency=max_concurrency, retry_backoff_s=retry_backoff_s,
        )  # fmt: skip
        if max_comparisons is not None and max_comparisons < 1:
            raise ValueError("pairwise judge max_comparisons must be >= 1 (or None: all pairs)")
        self.max_comparisons = max_comparisons

    async def __call__(
        self, task: dict[str, Any], states: list[RolloutState], completions: list[str]
    ) -> list[GroupResult]:
        n = len(states)
        order, group_seed = self.shuffle(task, completions)
        rng = random.Random(group_seed + 1)
        pairs = round_robin(n)
        if self.max_comparisons is not None:
            pairs = pairs[: self.max_comparisons]
        # (position shown as A, position shown as B), in shuffled positions
        shown = [(p, q) if rng.random() < 0.5 else (q, p) for p, q in pairs]
        common = self.common(task, states)
        with tracer(__name__).start_as_current_span(
            "group_reward", attributes={"treadle.group_reward": self.__name__,
                                        "treadle.num_rollouts": n, "treadle.judge.seed": group_seed, "treadle.judge.num_calls": len(shown)},
        ):  # fmt: skip
            async with self.client.session() as ask:
                verdicts = await _all([
                    ask(self.messages(self.prompt.format(
                        **common, a=_shown(completions[order[a]]), b=_shown(completions[order[b]]))),
                        parse_preference, "pairwise verdict", f"A={a} B={b}")
                    for a, b in shown
                ])  # fmt: skip
        wins = [0.0] * n
        comparisons = [0] * n
        first = [0] * n
        for (a, b), (value, _reply) in zip(shown, verdicts, strict=True):
            ia, ib = order[a], order[b]
            wins[ia] += value
            wins[ib] += 1.0 - value
            comparisons[ia] += 1
            comparisons[ib] += 1
            first[ia] += 1
        position = {i: p for p, i in enumerate(order)}
        return [
            GroupResult(wins[i] / comparisons[i] if comparisons[i] else NEUTRAL,
                        {"position": float(position[i]),
                         "comparisons": float(comparisons[i]), "wins": wins[i],
                         "shown_first": float(first[i])})
            for i in range(n)
        ]  # fmt: skip


def round_robin(n: int) -> list[tuple[int, int]]:
    """Every pair of 0..n-1 once, in rounds where each index plays at most once (the
    circle method), so a prefix compares everyone about equally often."""
    players: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    out = []
    for _ in range(m - 1):
        for k in range(m // 2):
            p, q = players[k], players[m - 1 - k]
            if p is not None and q is not None:
                out.append((min(p, q), max(p, q)))
        players = [players[0], players[-1], *players[1:-1]]
    return out


class RankingJudge(_GroupJudge):
    """A judge model ranks the whole group in one call; the reward falls linearly with
    the rank: 1 for the best, 0 for the worst ((n - 1 - rank) / (n - 1)).

    The judge sees the answers as [Response 1] .. [Response n] in the shuffled order and
    ends with ``RANKING: 2 > 1 > 3`` (``judge.parse_ranking``: every number exactly
    once, or the answer is malformed and the judge is asked again). A group of one is not sent: it gets ``NEUTRAL`` (0.5). ``prompt`` may use
    {prompt}, {task}, {answer}, {n} and {responses} (the numbered answers). Metrics:
    ``.position``, ``.rank`` (0 = best; -1 when not judged).
    """

    fields = _COMMON_FIELDS | {"n", "responses"}

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        prompt: str = RANKING_PROMPT,
        system_prompt: str | None = None,
        name: str = "ranking_judge",
        seed: int = 0,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 120.0,
        attempts: int = 3,
        max_tokens: int = 2048,
        temperature: float = 0.0,
        retry_backoff_s: float = 0.5,
    ):
        super().__init__(
            base_url, model, prompt=prompt, system_prompt=system_prompt, name=name, seed=seed,
            api_key_env=api_key_env, timeout_s=timeout_s, attempts=attempts, max_tokens=max_tokens,
            temperature=temperature, max_concurrency=1, retry_backoff_s=retry_backoff_s,
        )  # fmt: skip

    async def __call__(
        self, task: dict[str, Any], states: list[RolloutState], completions: list[str]
    ) -> list[GroupResult]:
        n = len(states)
        order, group_seed = self.shuffle(task, completions)
        position = {i: p for p, i in enumerate(order)}
        if n == 1:
            return [GroupResult(NEUTRAL, {"position": 0.0, "rank": -1.0})]
        responses = "\n\n".join(
            f"[Response {p + 1}]\n{_shown(completions[i])}" for p, i in enumerate(order)
        )
        content = self.prompt.format(**self.common(task, states), n=n, responses=responses)
        with tracer(__name__).start_as_current_span(
            "group_reward", attributes={"treadle.group_reward": self.__name__,
                                        "treadle.num_rollouts": n, "treadle.judge.seed": group_seed, "treadle.judge.num_calls": 1},
        ):  # fmt: skip
            async with self.client.session() as ask:
                ranking, _reply = await ask(self.messages(content), lambda r: parse_ranking(r, n),
                                            "ranking", f"responses 1..{n}")  # fmt: skip
        rank = {order[label - 1]: r for r, label in enumerate(ranking)}
        return [
            GroupResult((n - 1 - rank[i]) / (n - 1),
                        {"position": float(position[i]), "rank": float(rank[i])})
            for i in range(n)
        ]  # fmt: skip


async def _all(calls: list[Any]) -> list[Any]:
    """Await every call; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# --- from config ------------------------------------------------------------------------------
KINDS: dict[str, Callable[..., Any]] = {
    "conciseness": ConcisenessBonus,
    "pairwise_judge": PairwiseJudge,
    "ranking_judge": RankingJudge,
}
"""Group rewards a config can name (``kind``)."""


def from_spec(spec: Mapping[str, Any]) -> tuple[Any, float]:
    """(group reward, weight) from a config table: ``kind`` (a name in ``KINDS``),
    ``weight`` (default 1.0), and the rest as the constructor's keyword arguments. A
    missing or unknown kind or argument is a ValueError naming what is allowed."""
    args = dict(spec)
    kind = args.pop("kind", None)
    weight = args.pop("weight", 1.0)
    if kind not in KINDS:
        raise ValueError(f"group reward kind {kind!r}: use one of {', '.join(sorted(KINDS))}")
    try:
        weight = float(weight)
    except (TypeError, ValueError):
        raise ValueError(f"group reward {kind}: weight {weight!r} is not a number") from None
    try:
        return KINDS[kind](**args), weight
    except TypeError as e:
        raise ValueError(f"group reward {kind}: {e}") from None
