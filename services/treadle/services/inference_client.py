"""Client of the inference data plane: token ids in, token ids + logprobs + policy versions out.

    InferenceClient(base_url).generate(prompt_ids, max_tokens=..., ...)
        ── POST {base_url}/inference/v1/generate  (vLLM's token-in/token-out route) ──▶
        ◀── choices[0]: token_ids, logprobs.content[i].logprob, weight_versions spans ──
        ─▶ GenerateResult: numpy arrays, one entry per sampled token

Per-token policy versions come from vLLM's ``weight_versions``: contiguous spans
``{version, start, end}`` over output-token indexes, where ``version`` is the label the
inference service set when it loaded the weights (``str(policy_version)``). They are
expanded to one int32 per token (with a LoRA adapter serving, its version: the answer's
``model`` names the adapter, ``<run>-v<N>``); a gap, an overlap or a label that is not a policy
version is an ``InferenceResponseError``, never a guess (DESIGN.md invariant 3).

A server hosting several runs (``inference.hosted``) labels no tokens per run: a client
of one such run names its run as ``model`` and sends the run's key (``api_key``); the
server binds each request to one version of that run's adapter, and the answer's
``model`` names it, ``<model>-v<N>``: every token of it has version N (an answer from the
base, before the run's first adapter, is version 0 by vLLM's spans).

Every call has a deadline (``timeout_s``). Retries are bounded and only where repeating
the request is safe: generation has no side effect on the server, so a request that
never reached it (connection refused, e.g. during a restart of vLLM with new weights),
that the server dropped without an answer, or that it refused with 503 is sent again
with backoff while the deadline allows; when every attempt ends that way the error is
``InferenceUnreachableError`` (the request never ran: another replica may take it,
``inference_pool.py``). A read that times out is not retried (the server may still be
working on it). Errors carry vLLM's own message. ``score`` asks for a probe's prompt
logprobs and the version the server labels that answer with; ``prompt_logprobs`` for the
logprobs of any token sequence (a teacher scoring a student's tokens), and
``prompt_logprobs_many`` for several at once: one OpenAI completions request whose prompts
are the token ids (POST {base_url}/v1/completions, ``prompt_logprobs: 0``, ``max_tokens:
1``), which vLLM answers about twice as fast as one token-route request per sequence
(benchmarks/teacher_calls.py); a server without that route (HTTP 404/405) is asked on its
token route, one request per sequence, from then on; ``prompt_topk_many`` adds the
``k`` most likely tokens at each position and their logprobs (``prompt_logprobs: k``: a
teacher's distribution for top-k distillation); ``tokenize``,
``detokenize`` and ``accepts_token_id`` tell which tokenizer and vocabulary a server has.

Tracing: each call is a CLIENT span (``generate``/``score``/``prompt_logprobs``) and sends the W3C
``traceparent`` header, so vLLM's own request span (``llm_request``, when its OTLP
export is on) joins the caller's trace (a rollout's) as the span's child. A ``generate``
made directly inside a span that absorbs calls (``telemetry.absorbing_calls``: the env
runner's ``model_call``) records itself on that span instead (its attributes; a
``generate failed`` event per failed attempt), and vLLM's span becomes that span's child.

Lives in the chassis, free of vLLM and torch, so that env runners can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import numpy as np
from opentelemetry import trace

from treadle.services import telemetry
from treadle.services.errors import DecodeError, ServiceUnavailableError, TreadleError

log = logging.getLogger(__name__)
T = TypeVar("T")

GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
_RETRY_STATUS = (503,)


class InferenceUnavailableError(ServiceUnavailableError):
    """The inference server could not be reached, or did not answer before the deadline."""


class InferenceUnreachableError(InferenceUnavailableError):
    """Every attempt failed before the server answered (refused, dropped without an
    answer, 503): the request did not run there, so another replica may run it."""


class InferenceRequestError(TreadleError, ValueError):
    """The inference server refused the request (HTTP 4xx/5xx); carries its message."""

    def __init__(self, message: str, status_code: int, server_message: str = ""):
        super().__init__(message)
        self.status_code = status_code
        self.server_message = server_message  # the server's own words, as it sent them


class InferenceResponseError(DecodeError):
    """The server answered 200 with a body that breaks the generate contract."""


@dataclass(frozen=True)
class GenerateResult:
    """One completion of a prompt, token-exact."""

    token_ids: np.ndarray  # [num_tokens] int32, the sampled ids
    logprobs: (
        np.ndarray
    )  # [num_tokens] float32, logprob of each sampled id under the behaviour policy
    policy_versions: np.ndarray  # [num_tokens] int32, policy version that sampled each id
    finish_reason: str  # "stop" (eos / stop token), "length" (max_tokens), "abort", ...
    stop_reason: int | str | None  # the stop token id that ended generation, if any
    prompt_token_ids: np.ndarray  # [num_prompt_tokens] int32, the prompt as the engine saw it
    request_id: str
    model: str = ""  # the model that answered: the LoRA adapter (<run>-v<N>) when one serves

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class PromptScore:
    """What a server answers for a probe (``InferenceClient.score``)."""

    logprobs: tuple[float, ...]  # [num_tokens - 1], log p(t_i | t_0..t_{i-1}) as served
    policy_version: int  # the version the server labelled its answer with (-1: none)


def expand_weight_versions(
    spans: Sequence[Mapping[str, Any]] | None, num_tokens: int
) -> np.ndarray:
    """vLLM's weight-version spans -> one policy version per output token ([num_tokens] int32).

    Spans must tile [0, num_tokens) in order; labels must be integer policy versions.
    """
    out = np.empty(num_tokens, dtype=np.int32)
    if not spans:
        if num_tokens:
            raise InferenceResponseError(
                f"the server labelled none of {num_tokens} tokens with a weight version: "
                "is it a Treadle inference service (it sets the version when it loads weights)?"
            )
        return out
    pos = 0
    for i, span in enumerate(spans):
        try:
            label, start, end = span["version"], int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            raise InferenceResponseError(f"weight_versions[{i}] is malformed: {span!r}") from None
        if start != pos or end <= start or end > num_tokens:
            raise InferenceResponseError(
                f"weight_versions[{i}] covers tokens [{start}, {end}) but the spans must tile "
                f"[0, {num_tokens}) in order (next start expected at {pos})"
            )
        try:
            version = int(str(label))
        except ValueError:
            raise InferenceResponseError(
                f"tokens [{start}, {end}) carry the weight version {label!r}, which is not a policy "
                "version: the server served them before a policy version was set"
            ) from None
        if version < 0 or version > np.iinfo(np.int32).max:
            raise InferenceResponseError(
                f"weight_versions[{i}]: policy version {version} is out of range"
            )
        out[start:end] = version
        pos = end
    if pos != num_tokens:
        raise InferenceResponseError(f"weight_versions cover tokens [0, {pos}) of {num_tokens}")
    return out


def _error_message(resp: httpx.Response) -> str:
    """vLLM's own words from an error body (OpenAI-style, FastAPI-style or plain text)."""
    try:
        doc = resp.json()
    except ValueError:
        return resp.text.strip()[:1000] or resp.reason_phrase
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "detail" in doc:
            return str(doc["detail"])[:1000]
        if "message" in doc:
            return str(doc["message"])
    return str(doc)[:1000]


def parse_generate_response(doc: Any, model: str | None = None) -> GenerateResult:
    """A /inference/v1/generate JSON body (output_mode 'tokens') -> its first completion.

    ``model``: the run the request named; an answer naming one of its adapters
    (``<model>-v<N>``) was sampled entirely by version N (module doc)."""
    return parse_generate_choices(doc, model, 1)[0]


def parse_generate_choices(doc: Any, model: str | None = None, n: int = 1) -> list[GenerateResult]:
    """The ``n`` completions of a generate answer (``sampling_params.n`` = ``n``), in order;
    fewer or more choices than asked for break the contract."""
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or len(choices) < n or (n > 1 and len(choices) != n):
        raise InferenceResponseError(
            f"not a generate response with {n} choice(s): {str(doc)[:300]}"
        )
    answered = str(doc.get("model") or "")
    adapter_version = _adapter_version(answered, model)
    prompt = np.asarray(doc.get("prompt_token_ids") or [], dtype=np.int32)
    return [_parse_choice(c, k, answered, adapter_version, prompt, str(doc.get("request_id", "")))
            for k, c in enumerate(choices[:n])]  # fmt: skip


def _parse_choice(
    choice: Any, k: int, answered: str, adapter_version: int | None, prompt: np.ndarray,
    request_id: str,
) -> GenerateResult:  # fmt: skip
    try:
        ids = choice["token_ids"] or []
        content = (choice.get("logprobs") or {}).get("content") or []
    except (KeyError, TypeError, AttributeError):
        raise InferenceResponseError(
            f"choice {k} is not a completion: {str(choice)[:300]}"
        ) from None
    if len(content) != len(ids):
        raise InferenceResponseError(f"{len(ids)} sampled tokens but {len(content)} logprobs")
    for i, (tid, entry) in enumerate(zip(ids, content, strict=True)):
        if entry.get("token_id") != tid:
            raise InferenceResponseError(
                f"logprob {i} is for token {entry.get('token_id')}, not {tid}"
            )
    token_ids = np.asarray(ids, dtype=np.int32)
    logprobs = np.asarray([float(e["logprob"]) for e in content], dtype=np.float32)
    if adapter_version is not None:
        versions = np.full(len(ids), adapter_version, dtype=np.int32)
    else:
        versions = expand_weight_versions(choice.get("weight_versions"), len(ids))
    return GenerateResult(
        token_ids=token_ids,
        logprobs=logprobs,
        policy_versions=versions,
        finish_reason=str(choice.get("finish_reason")),
        stop_reason=choice.get("stop_reason"),
        prompt_token_ids=prompt,
        request_id=request_id,
        model=answered,
    )


def _adapter_version(answered: str, model: str | None) -> int | None:
    """N when ``answered`` is ``<model>-v<N>`` (one adapter version of the run ``model``)."""
    if not model or not answered.startswith(f"{model}-v"):
        return None
    digits = answered[len(model) + 2 :]
    if not digits.isdigit() or len(digits) > 9:
        return None
    return int(digits)


def _prompt_logprobs_body(ids: list[int], model: str | None, top_k: int = 0) -> dict[str, Any]:
    """A generate request that returns the prompt logprobs of ``ids`` (one greedy token),
    with the ``top_k`` most likely tokens at each position."""
    body: dict[str, Any] = {
        "token_ids": ids,
        "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k,
                            "logprobs": 0, "detokenize": False},
        "return_token_ids": True,
    }  # fmt: skip
    if model is not None:
        body["model"] = model
    return body


@dataclass(frozen=True)
class PromptTopK:
    """Prompt logprobs of a sequence of n token ids with the server's ``k`` most likely
    tokens at each position (``prompt_topk_many``); row i is position i + 1."""

    logprobs: np.ndarray  # [n - 1] float32: log p(ids[i + 1] | ids[: i + 1])
    top_ids: np.ndarray  # [n - 1, k] int32: the k most likely tokens there, by rank
    top_logprobs: np.ndarray  # [n - 1, k] float32: their logprobs


def parse_prompt_logprobs(doc: Any, ids: Sequence[int], top_k: int = 0) -> PromptTopK:
    """The logprob of each prompt token after the first from a generate response with
    prompt logprobs, and (``top_k`` > 0) the ``top_k`` tokens of ranks 1..top_k at each
    position (vLLM adds the prompt's own token to them when its rank is lower)."""
    entries = doc.get("prompt_logprobs") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise InferenceResponseError(
            f"asked for the prompt logprobs of {len(ids)} tokens, got "
            f"{len(entries) if isinstance(entries, list) else 'none'}"
        )
    n = len(ids) - 1
    out = np.empty(n, dtype=np.float32)
    top_ids = np.zeros((n, top_k), dtype=np.int32)
    top_lps = np.zeros((n, top_k), dtype=np.float32)
    for pos, (entry, tid) in enumerate(zip(entries[1:], ids[1:], strict=True), start=1):
        item = entry.get(str(tid)) if isinstance(entry, dict) else None
        if not isinstance(item, dict) or "logprob" not in item:
            raise InferenceResponseError(f"no prompt logprob for token {tid} at position {pos}")
        out[pos - 1] = float(item["logprob"])
        if top_k:
            assert isinstance(entry, dict)
            _top_of(entry, top_k, pos, top_ids[pos - 1], top_lps[pos - 1])
    return PromptTopK(out, top_ids, top_lps)


def _top_of(entry: dict[str, Any], k: int, pos: int, ids: np.ndarray, lps: np.ndarray) -> None:
    """Ranks 1..k of one position's entry into ``ids``/``lps``; InferenceResponseError
    when one is missing or not a token id with a finite logprob."""
    seen: set[int] = set()
    for key, item in entry.items():
        rank = item.get("rank") if isinstance(item, dict) else None
        if not isinstance(rank, int) or not 1 <= rank <= k:
            continue
        lp = item.get("logprob")
        if not key.isdigit() or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise InferenceResponseError(f"a top-{k} entry {key!r}: {str(item)[:100]} at {pos}")
        if rank in seen:
            raise InferenceResponseError(f"two tokens of rank {rank} at position {pos}")
        seen.add(rank)
        ids[rank - 1], lps[rank - 1] = int(key), float(lp)
    if len(seen) != k:
        raise InferenceResponseError(
            f"asked for the top {k} tokens at each position, got {len(seen)} at position {pos} "
            "(is the server's --max-logprobs below it?)"
        )


def parse_completions_prompt_logprobs(
    doc: Any, seqs: Sequence[Sequence[int]], top_k: int = 0
) -> list[PromptTopK]:
    """Each prompt's logprobs after its first token (and its top ``top_k``) from a
    /v1/completions response whose prompts were ``seqs`` (token ids) and that asked for
    ``prompt_logprobs``: one choice a prompt, matched by its ``index``."""
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or len(choices) != len(seqs):
        raise InferenceResponseError(
            f"asked for the prompt logprobs of {len(seqs)} prompts, got "
            f"{len(choices) if isinstance(choices, list) else 'no'} choices"
        )
    by_index: dict[int, Any] = {}
    for c in choices:
        index = c.get("index") if isinstance(c, dict) else None
        if not isinstance(index, int) or not 0 <= index < len(seqs) or index in by_index:
            raise InferenceResponseError(f"a completions choice with index {index!r}")
        by_index[index] = c
    return [parse_prompt_logprobs(by_index[i], ids, top_k) for i, ids in enumerate(seqs)]


def _no_route(e: InferenceRequestError) -> bool:
    """The server has no such route (not: it has no such model, also HTTP 404 in vLLM)."""
    return e.status_code == 405 or (
        e.status_code == 404 and "model" not in e.server_message.lower()
    )


async def _all(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Every call's answer; when some fail, the others still end (none is left running)
    and the error raised is a refusal if there is one (it is not retried), else the first."""
    got = await asyncio.gather(*calls, return_exceptions=True)
    errors = [g for g in got if isinstance(g, BaseException)]
    if errors:
        refusals = [e for e in errors if isinstance(e, InferenceRequestError)]
        raise (refusals or errors)[0]
    return [g for g in got if not isinstance(g, BaseException)]


class InferenceClient:
    """Async client of one inference server's generate route (see module doc)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 300.0,
        *,
        max_retries: int = 20,
        connect_timeout_s: float = 5.0,
        model: str | None = None,
        api_key: str | None = None,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.connect_timeout_s = connect_timeout_s
        self.model = model
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.completions = True  # False once the server said it has no /v1/completions
        # keep a connection per concurrent request alive: httpx keeps 20 by default, and an
        # env runner with 32 rollouts in flight then connected (and closed) again per call
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        self._http = httpx.AsyncClient(base_url=self.base_url, limits=limits)

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def generate(
        self, prompt_ids: Sequence[int] | np.ndarray, **kwargs: Any
    ) -> GenerateResult:
        """Sample one completion of ``prompt_ids`` (the arguments of ``generate_n``)."""
        return (await self.generate_n(prompt_ids, 1, **kwargs))[0]

    async def generate_n(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        n: int,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_tokens: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> list[GenerateResult]:
        """Sample ``n`` completions of ``prompt_ids`` in one request (vLLM's parallel
        sampling: the prompt is computed once); ``top_k`` 0 means no top-k cut. Each
        completion carries its own tokens, logprobs and per-token versions.

        ``timeout_s`` (default: the client's) bounds the whole call, retries included.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty: the engine needs at least one prompt token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        sampling: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_tokens": min_tokens,
            "logprobs": 0,
            "detokenize": False,
            "ignore_eos": ignore_eos,
        }
        if n > 1:
            sampling["n"] = n
        if seed is not None:
            sampling["seed"] = seed
        if stop_token_ids:
            sampling["stop_token_ids"] = [int(t) for t in stop_token_ids]
        body: dict[str, Any] = {
            "token_ids": prompt,
            "sampling_params": sampling,
            "return_token_ids": True,
        }
        if request_id is not None:
            body["request_id"] = request_id
        if self.model is not None:
            body["model"] = self.model
        attributes: dict[str, str | int] = {
            "server.address": self.base_url, "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.usage.prompt_tokens": len(prompt),
        }  # fmt: skip
        if n > 1:
            attributes["gen_ai.request.choice.count"] = n
        owner = telemetry.absorbing_span()  # a model call's span stands for this call
        span_cm: contextlib.AbstractContextManager[trace.Span] = (
            contextlib.nullcontext(owner)
            if owner is not None
            else telemetry.tracer(__name__).start_as_current_span(
                "generate", kind=trace.SpanKind.CLIENT, attributes=attributes
            )
        )
        with span_cm as span:
            if owner is not None:
                owner.set_attributes(attributes)
            try:
                doc = await self._post_json(
                    GENERATE_PATH, body, self.timeout_s if timeout_s is None else timeout_s
                )
                results = parse_generate_choices(doc, self.model, n)
            except BaseException as e:
                if owner is not None:  # the caller may try again: each failure is kept
                    owner.add_event("generate failed", {
                        "server.address": self.base_url, "error.type": type(e).__name__,
                        "exception.message": str(e)[:500],
                    })  # fmt: skip
                raise
            span.set_attribute("gen_ai.usage.completion_tokens", sum(r.num_tokens for r in results))
        return results

    async def health(self, timeout_s: float = 2.0) -> bool:
        """True when the server answers its /health route."""
        try:
            resp = await self._http.get("/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def liveness(self, timeout_s: float = 2.0) -> bool | None:
        """True when /health answers 200, False when the server refuses or breaks the
        connection or answers an error, None when it is only slow to answer."""
        try:
            resp = await self._http.get("/health", timeout=timeout_s)
        except httpx.TimeoutException:
            return None
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def score(self, token_ids: Sequence[int], timeout_s: float = 30.0) -> PromptScore:
        """The served logprobs of ``token_ids`` (a probe) and the policy version the server
        labels its answer with, from one generate request: both describe the same weights."""
        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise ValueError("a probe needs at least two token ids")
        with telemetry.tracer(__name__).start_as_current_span(
            "score", kind=trace.SpanKind.CLIENT, attributes={"server.address": self.base_url}
        ):
            doc = await self._post_json(GENERATE_PATH, _prompt_logprobs_body(ids, self.model),
                                        timeout_s)  # fmt: skip
        logprobs = parse_prompt_logprobs(doc, ids).logprobs
        versions = parse_generate_response(doc, self.model).policy_versions
        return PromptScore(tuple(logprobs.tolist()), int(versions[0]) if versions.size else -1)

    async def prompt_logprobs(
        self, token_ids: Sequence[int] | np.ndarray, *, timeout_s: float | None = None
    ) -> np.ndarray:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 as served now ([len - 1] float32),
        from one generate request (vLLM's prompt logprobs; one token is sampled and
        dropped, so the sequence must leave room for one more token in the server's
        context). Unlike ``score``, the answer need not carry a policy version: any vLLM
        with the token route (a teacher) can answer."""
        got = await self._prompt_one([int(t) for t in token_ids], 0, timeout_s)
        return got.logprobs

    async def _prompt_one(self, ids: list[int], top_k: int, timeout_s: float | None) -> PromptTopK:
        if len(ids) < 2:
            raise ValueError("prompt logprobs need at least two token ids")
        with telemetry.tracer(__name__).start_as_current_span(
            "prompt_logprobs", kind=trace.SpanKind.CLIENT,
            attributes={"server.address": self.base_url, "gen_ai.usage.prompt_tokens": len(ids)},
        ):  # fmt: skip
            doc = await self._post_json(
                GENERATE_PATH, _prompt_logprobs_body(ids, self.model, top_k),
                self.timeout_s if timeout_s is None else timeout_s,
            )  # fmt: skip
        return parse_prompt_logprobs(doc, ids, top_k)

    async def prompt_logprobs_many(
        self, sequences: Sequence[Sequence[int] | np.ndarray], *, timeout_s: float | None = None
    ) -> list[np.ndarray]:
        """``prompt_logprobs`` of each of ``sequences``, in one /v1/completions request of
        token-id prompts (the engine schedules them together); on a server without that
        route, one token-route request per sequence, sent together. ``timeout_s`` bounds
        the whole call."""
        return [
            got.logprobs for got in await self.prompt_topk_many(sequences, 0, timeout_s=timeout_s)
        ]

    async def prompt_topk_many(
        self,
        sequences: Sequence[Sequence[int] | np.ndarray],
        top_k: int,
        *,
        timeout_s: float | None = None,
    ) -> list[PromptTopK]:
        """``prompt_logprobs_many`` with the ``top_k`` most likely tokens at each position
        (vLLM answers at most its ``--max-logprobs``, 20 unless set)."""
        seqs = [[int(t) for t in s] for s in sequences]
        if any(len(s) < 2 for s in seqs):
            raise ValueError("prompt logprobs need at least two token ids per sequence")
        if top_k < 0:
            raise ValueError(f"top_k = {top_k} < 0")
        if not seqs:
            return []
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self.completions:
            body: dict[str, Any] = {
                "prompt": seqs, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k,
            }  # fmt: skip
            if self.model is not None:
                body["model"] = self.model
            with telemetry.tracer(__name__).start_as_current_span(
                "prompt_logprobs", kind=trace.SpanKind.CLIENT,
                attributes={"server.address": self.base_url,
                            "gen_ai.usage.prompt_tokens": sum(len(s) for s in seqs),
                            "treadle.num_sequences": len(seqs), "treadle.top_k": top_k},
            ):  # fmt: skip
                try:
                    doc = await self._post_json(COMPLETIONS_PATH, body, timeout)
                except InferenceRequestError as e:
                    if not _no_route(e):
                        raise
                    self.completions = False
                    log.warning(
                        "%s has no %s (%s): prompt logprobs are asked on its token route, "
                        "one request per sequence", self.base_url, COMPLETIONS_PATH, e,
                    )  # fmt: skip
                else:
                    return parse_completions_prompt_logprobs(doc, seqs, top_k)
        return await _all([self._prompt_one(s, top_k, timeout) for s in seqs])

    async def tokenize(self, text: str, timeout_s: float = 30.0) -> list[int]:
        """The server's token ids of ``text`` (vLLM's /tokenize, no special tokens added)."""
        body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        if self.model is not None:
            body["model"] = self.model
        doc = await self._post_json(TOKENIZE_PATH, body, timeout_s)
        tokens = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise InferenceResponseError(f"not a /tokenize response: {str(doc)[:300]}")
        return tokens

    async def detokenize(self, token_ids: Sequence[int], timeout_s: float = 30.0) -> str:
        """The server's text of ``token_ids`` (vLLM's /detokenize)."""
        body: dict[str, Any] = {"tokens": [int(t) for t in token_ids]}
        if self.model is not None:
            body["model"] = self.model
        doc = await self._post_json(DETOKENIZE_PATH, body, timeout_s)
        text = doc.get("prompt") if isinstance(doc, dict) else None
        if not isinstance(text, str):
            raise InferenceResponseError(f"not a /detokenize response: {str(doc)[:300]}")
        return text

    async def accepts_token_id(self, token_id: int, timeout_s: float = 30.0) -> bool:
        """Whether the server takes ``token_id`` as input: vLLM refuses an id above both its
        tokenizer's and its model's vocabulary with HTTP 400 ('... out of vocabulary')."""
        body = _prompt_logprobs_body([int(token_id)], self.model)
        body["sampling_params"].pop("prompt_logprobs")
        try:
            await self._post_json(GENERATE_PATH, body, timeout_s)
        except InferenceRequestError as e:
            if e.status_code == 400 and "vocabulary" in str(e):
                return False
            raise
        return True

    async def _post_json(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        url = f"{self.base_url}{path}"
        deadline = time.monotonic() + timeout_s
        headers = telemetry.inject(dict(self._auth))  # traceparent: vLLM's span joins the trace
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InferenceUnavailableError(
                    f"{url}: no answer within {timeout_s:.1f}s ({attempt} attempts)"
                )
            timeout = httpx.Timeout(remaining, connect=min(remaining, self.connect_timeout_s))
            why: str
            try:
                resp = await self._http.post(path, json=body, timeout=timeout, headers=headers)
            except (
                httpx.ConnectError,
                httpx.ConnectTimeout,
                httpx.RemoteProtocolError,
                httpx.ReadError,
            ) as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
                raise InferenceUnavailableError(
                    f"{url}: no answer within {timeout_s:.1f}s (the server may be overloaded)"
                ) from None
            except httpx.HTTPError as e:
                raise InferenceUnavailableError(f"{url}: {type(e).__name__}: {e}") from None
            else:
                if resp.status_code == 200:
                    try:
                        return resp.json()
                    except ValueError:
                        raise InferenceResponseError(
                            f"{url} answered 200 without JSON: {resp.text[:300]!r}"
                        ) from None
                message = _error_message(resp)
                if resp.status_code not in _RETRY_STATUS:
                    raise InferenceRequestError(
                        f"{url} answered HTTP {resp.status_code}: {message}",
                        resp.status_code,
                        message,
                    )
                why = f"HTTP {resp.status_code}: {message}"
            attempt += 1
            if attempt > self.max_retries:
                raise InferenceUnreachableError(
                    f"cannot reach the inference server at {url} ({why}; {attempt} attempts)"
                )
            delay = min(0.25 * 2 ** (attempt - 1), 3.0, max(0.0, deadline - time.monotonic()))
            log.debug("generate attempt %d failed (%s); retrying in %.2fs", attempt, why, delay)
            await asyncio.sleep(delay)
