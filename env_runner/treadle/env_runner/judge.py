"""A judge model behind any OpenAI-compatible chat-completions endpoint, for rewards.

    client = JudgeClient("http://127.0.0.1:8000/v1", "judge-model", attempts=3)
    async with client.session() as ask:
        verdict, reply = await ask(messages, parse_preference, what="pairwise verdict")

Owns the HTTP call (API key read from an environment variable at call time, never
logged), bounded retries with backoff, a span per call (``judge_call``, like a model
call's ``model_call``), and the parsers of the verdicts judges are asked for. Every
failure is a typed ``JudgeError``: ``JudgeUnavailable`` (down, slow, an HTTP error),
``JudgeAnswerError`` (answers that never parsed). What a verdict is worth, and which
completions a judge sees in which order, belong to the rewards (``group_rewards``).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from treadle.services.telemetry import tracer

T = TypeVar("T")

RETRIED_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
"""HTTP statuses worth another attempt; any other non-200 answer fails at once."""


class JudgeError(Exception):
    """A judge could not give a usable verdict (a group reward error, never a crash)."""


class JudgeUnavailable(JudgeError):
    """The endpoint was unreachable, too slow, or answered an HTTP error."""


class JudgeAnswerError(JudgeError):
    """Every attempt's answer was malformed (e.g. no verdict, not a ranking)."""


class MalformedAnswer(ValueError):
    """Raised by a parser: the answer holds no usable verdict (the message says why)."""


Ask = Callable[..., Awaitable[tuple[T, str]]]
"""``ask(messages, parse, what, shown="")`` -> (parsed verdict, raw reply); ``shown`` (e.g.
the positions a call showed) goes on the call's span with the verdict."""


class JudgeClient:
    """Calls a judge model with bounded retries (see the module doc).

    ``attempts`` bounds the calls per question, whatever failed: a transport error, a
    timeout (``timeout_s`` per call), a retried HTTP status, or an answer ``parse``
    rejects (the next attempt samples again). 4xx answers other than 408/409/425/429
    (a bad key, an unknown model) fail at once.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        attempts: int = 3,
        retry_backoff_s: float = 0.5,
        max_tokens: int = 1024,
        temperature: float = 0.0,
        max_concurrency: int = 8,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge base_url {base_url!r} is not an http(s):// URL")
        if attempts < 1 or timeout_s <= 0 or max_tokens < 1 or max_concurrency < 1:
            raise ValueError(
                "judge attempts, timeout_s, max_tokens and max_concurrency must be > 0"
            )
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.retry_backoff_s = retry_backoff_s
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_concurrency = max_concurrency

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Ask[Any]]:
        """An ``ask(messages, parse, what)`` bound to one HTTP client (one group's calls);
        at most ``max_concurrency`` calls at once."""
        import httpx

        headers = {}
        if key := os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {key}"
        sem = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=headers) as http:

            async def ask(
                messages: list[dict[str, Any]],
                parse: Callable[[str], T],
                what: str,
                shown: str = "",
            ) -> tuple[T, str]:
                async with sem:
                    return await self._ask(http, messages, parse, what, shown)

            yield ask

    async def _ask(
        self,
        http: Any,
        messages: list[dict[str, Any]],
        parse: Callable[[str], T],
        what: str,
        shown: str,
    ) -> tuple[T, str]:
        """(parse(reply), reply) of the first attempt whose reply parses."""
        problems: list[str] = []
        transport_only = True
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            with tracer(__name__).start_as_current_span(
                "judge_call", attributes={"treadle.judge.model": self.model, "treadle.judge.what": what,
                                          "treadle.judge.attempt": attempt, "treadle.judge.shown": shown},
            ) as span:  # fmt: skip
                try:
                    reply = await self._call(http, messages)
                except _Retry as e:
                    problems.append(str(e))
                    span.set_attribute("treadle.judge.error", str(e)[:300])
                    continue
                try:
                    value = parse(reply)
                except MalformedAnswer as e:
                    transport_only = False
                    problems.append(f"malformed {what}: {e} (answer: {_clip(reply)})")
                    span.set_attribute("treadle.judge.error", f"malformed: {e}"[:300])
                    continue
                span.set_attribute("treadle.judge.verdict", str(value)[:300])
            return value, reply
        kind = JudgeUnavailable if transport_only else JudgeAnswerError
        raise kind(
            f"judge {self.model!r} at {self.base_url}: no usable {what} in {self.attempts} "
            f"attempt(s); last: {problems[-1]}"
        )

    async def _call(self, http: Any, messages: list[dict[str, Any]]) -> str:
        import httpx

        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature}  # fmt: skip
        try:
            resp = await http.post(f"{self.base_url}/chat/completions", json=body)
        except httpx.TimeoutException:
            raise _Retry(f"no answer within {self.timeout_s:g} s") from None
        except httpx.HTTPError as e:
            raise _Retry(f"unreachable ({type(e).__name__}: {e})") from None
        if resp.status_code in RETRIED_STATUSES:
            raise _Retry(f"HTTP {resp.status_code}: {_clip(resp.text)}")
        if resp.status_code != 200:
            raise JudgeUnavailable(
                f"judge {self.model!r} at {self.base_url} answered HTTP {resp.status_code} "
                f"(not retried): {_clip(resp.text)}"
            )
        try:
            content = resp.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise _Retry(f"not a chat completion ({type(e).__name__}: {e})") from None
        return str(content or "")


class _Retry(Exception):
    """A failed call worth another attempt."""


def _clip(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= n else text[:n] + "...")


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def strip_thinking(reply: str) -> str:
    """The reply without ``<think>...</think>`` blocks (an unclosed one: without it all)."""
    reply = _THINK.sub("", reply)
    cut = reply.lower().find("<think>")
    return reply[:cut] if cut >= 0 else reply


# --- verdicts -----------------------------------------------------------------------------
_PREFERENCE = re.compile(r"\[\[\s*(A|B|tie)\s*\]\]", re.IGNORECASE)
PREFERENCE_VALUES = {"a": 1.0, "b": 0.0, "tie": 0.5}


def parse_preference(reply: str) -> float:
    """A pairwise verdict: 1.0 when A is better, 0.0 when B is, 0.5 for a tie.

    The verdict is ``[[A]]``, ``[[B]]`` or ``[[tie]]`` anywhere in the reply (case
    ignored), or the whole reply being just ``A``, ``B`` or ``tie``. Two different
    verdicts, or none, are malformed. ``<think>`` blocks are ignored."""
    reply = strip_thinking(reply)
    found = {m.lower() for m in _PREFERENCE.findall(reply)}
    if not found:
        bare = reply.strip().strip(".*:[]()\"'` \n").lower()
        if bare in PREFERENCE_VALUES:
            return PREFERENCE_VALUES[bare]
        raise MalformedAnswer("no verdict [[A]], [[B]] or [[tie]]")
    if len(found) > 1:
        raise MalformedAnswer(f"several different verdicts ({', '.join(sorted(found))})")
    return PREFERENCE_VALUES[found.pop()]


_RANKING_LINE = re.compile(r"ranking\s*[:=]\s*(.+)", re.IGNORECASE)
_ONLY_NUMBERS = re.compile(r"[\s\[\]()#,>;.\d]+")


def parse_ranking(reply: str, n: int) -> list[int]:
    """A ranking of responses 1..n, best first: the numbers of the last line reading
    ``RANKING: 3 > 1 > 2`` (case ignored; any separators), or the whole reply when it is
    nothing but numbers and separators. Each of 1..n must appear exactly once.
    ``<think>`` blocks are ignored."""
    reply = strip_thinking(reply)
    lines = _RANKING_LINE.findall(reply)
    if lines:
        text = lines[-1]
    elif _ONLY_NUMBERS.fullmatch(reply.strip() or "x"):
        text = reply
    else:
        raise MalformedAnswer("no line 'RANKING: ...'")
    ranking = [int(x) for x in re.findall(r"\d+", text)]
    if not ranking:
        raise MalformedAnswer("the ranking names no response")
    bad = sorted({x for x in ranking if not 1 <= x <= n})
    if bad:
        raise MalformedAnswer(f"names response {bad[0]}, only 1..{n} exist")
    twice = sorted({x for x in ranking if ranking.count(x) > 1})
    if twice:
        raise MalformedAnswer(f"names response {twice[0]} more than once")
    if len(ranking) != n:
        missing = sorted(set(range(1, n + 1)) - set(ranking))
        raise MalformedAnswer(f"leaves out response(s) {', '.join(map(str, missing))}")
    return ranking
