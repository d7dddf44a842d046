"""The admission gate: ASGI middleware the service installs in vLLM's API server.

    client ──POST /v1/..., /inference/v1/generate──▶ gate ──(open)──▶ vLLM routes
                                                       │ closed: the request waits here,
                                                       │ outside the engine, until reopened
    service ──POST /treadle/admission {open, drain}──▶ gate (token required)
    service ──probe with the token header──────────────▶ passes a closed gate

Why it exists: a weight update must verify the new weights by running a probe on the
engine *before* any client request sees them, and vLLM's own /pause stops the whole
scheduler (a paused engine cannot run the probe either). So the service closes this
gate, lets the requests already admitted finish on the old weights (``in_flight``
drops to 0), reloads, runs its probe through the gate, sets the new weight version and
reopens: every token a client gets was sampled by verified weights whose version label
is exact. vLLM starts with the gate closed, so no request runs before the service has
set the weight version of a (re)started engine.

It also guards vLLM's admin and dev routes (/pause, /collective_rpc, ...; dev mode is on
so that the service can use them): a POST outside the public generation and tokenizer
routes needs the token (so do vLLM's LoRA load/unload routes). The token reaches vLLM's
process in ``TREADLE_GATE_TOKEN``.

LoRA serving: the service names the adapter that is the policy (``adapter`` in a control
POST, set while the gate is closed). A generation request admitted afterwards whose JSON
body names the served model (``TREADLE_SERVED_MODEL_NAME``) or no model is rewritten to
name that adapter, so clients keep asking for "the policy" and every admitted request runs
on exactly one version. Requests naming an adapter themselves are left as they are.

Hosted serving (several runs' adapters on one engine, ``inference.hosted``): the service
registers each run as a client (``route`` in a control POST: the run's model name, the
sha256 of its key, the adapter serving it). From then on every generation request must
carry a run's key (``Authorization: Bearer <key>``: 401 without one) and may name only
that run's model, or none (403 otherwise: another run's model or adapter, the base); it
is bound at admission to the adapter serving that run now (its base until the run's first
adapter), so a request runs on exactly one version of its own run's adapter. The gate
counts the requests in flight per adapter, so the service unloads a replaced adapter only
once nothing runs on it. A run given a sampled-token quota (``max_sampled_tokens`` in its
route, with what it used before) has the tokens of each answer counted; the quota is
hard: a request is admitted with at most what is left of it, counting what the run's
requests in flight may still sample (``n`` x ``max_tokens``, reserved at admission and
replaced by the answer's count), its ``max_tokens`` lowered to fit when asked for more
or not given (its answer then ends with finish_reason "length"); once nothing is left its
requests get 429 naming it. It may not stream (a stream's tokens are not counted). A run removed at runtime (``unroute`` in a control POST: its model name) loses
its key and route at once: its clients get 401 like an unknown key, and its requests
already admitted finish on their adapter. A gate that hosts runs (``hosted`` in a control
POST, or a run's key registered) stays so with none left: no key, no generation.

Prompt logprobs alone (``TREADLE_GATE_SCORE_ALONE``, set when LoRA is enabled on CPU):
vLLM 0.32's CPU LoRA path fails, killing the engine, when a request for prompt logprobs
(a probe, a replica check, a teacher's scoring) shares a batch with other requests. Such
a request then waits until no other admitted request runs and runs alone; requests
admitted after it wait for it (it goes first: a score is short).

Stdlib only: this module is imported inside vLLM's process.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

log = logging.getLogger(__name__)

TOKEN_ENV = "TREADLE_GATE_TOKEN"
SERVED_NAME_ENV = "TREADLE_SERVED_MODEL_NAME"
SCORE_ALONE_ENV = "TREADLE_GATE_SCORE_ALONE"
TOKEN_HEADER = "x-treadle-gate"
CONTROL_PATH = "/treadle/admission"
# POST routes that generate (held while the gate is closed)
GATED_PREFIXES = ("/v1/", "/inference/v1/generate", "/invocations", "/generative_scoring")
# POST routes anyone may call at any time
PUBLIC_POSTS = ("/tokenize", "/detokenize", "/ping", "/inference/v1/abort_requests")
# POST routes under a gated prefix that only the service may call
RESERVED_POSTS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# public POST routes that only the service may call when it hosts several runs (a run
# could abort another run's requests by id)
HOSTED_RESERVED_POSTS = ("/inference/v1/abort_requests",)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


async def _json_response(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(data)),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that hands over ``body`` (already read) once, then the client's messages
    (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_body(scope: Scope, body: bytes, receive: Receive) -> tuple[Scope, Receive]:
    """The request with ``body`` in place of the one the client sent (read already)."""
    headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
    scope = dict(scope, headers=[*headers, (b"content-length", b"%d" % len(body))])
    return scope, _replaying(body, receive)


def _sampled_in(body: bytes) -> int:
    """Tokens an answer sampled: its choices' token ids (token route), else its usage's
    completion tokens (OpenAI routes); 0 for an error or anything else."""
    try:
        doc = json.loads(body)
    except ValueError:
        return 0
    if not isinstance(doc, dict):
        return 0
    choices = doc.get("choices")
    if isinstance(choices, list) and all(
        isinstance(c, dict) and isinstance(c.get("token_ids"), list) for c in choices
    ) and choices:  # fmt: skip
        return sum(len(c["token_ids"]) for c in choices)
    usage = doc.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return 0


class Lane:
    """Many shared holders or one exclusive one; a waiting exclusive one goes first."""

    def __init__(self) -> None:
        self.shared_holders = 0
        self.exclusive_held = False
        self.exclusive_waiting = 0
        self._changed = asyncio.Condition()

    async def acquire(self, exclusive: bool) -> None:
        async with self._changed:
            if exclusive:
                self.exclusive_waiting += 1
                try:
                    await self._changed.wait_for(
                        lambda: not self.exclusive_held and not self.shared_holders
                    )
                finally:
                    self.exclusive_waiting -= 1
                self.exclusive_held = True
            else:
                await self._changed.wait_for(
                    lambda: not self.exclusive_held and not self.exclusive_waiting
                )
                self.shared_holders += 1

    async def release(self, exclusive: bool) -> None:
        async with self._changed:
            if exclusive:
                self.exclusive_held = False
            else:
                self.shared_holders -= 1
            self._changed.notify_all()


def _json_object(body: bytes) -> dict[str, Any] | None:
    """A request body's JSON object, or None (empty, not JSON, not an object)."""
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _asks_prompt_logprobs(body: bytes) -> bool:
    doc = _json_object(body)
    if doc is None:
        return False
    sampling = doc.get("sampling_params")
    return doc.get("prompt_logprobs") is not None or (
        isinstance(sampling, dict) and sampling.get("prompt_logprobs") is not None
    )


class AdmissionGate:
    """Holds generation requests while closed; counts the ones admitted (see module doc)."""

    def __init__(self, app: ASGIApp, token: str | None = None) -> None:
        self.app = app
        self.token = (os.environ.get(TOKEN_ENV, "") if token is None else token).encode()
        # without a token (vLLM started by hand) the gate stays open and guards nothing
        self.is_open = not self.token
        self._opened = asyncio.Event()
        if self.is_open:
            self._opened.set()
        self.in_flight = 0  # gated requests admitted and not finished
        self.held = 0  # gated requests waiting for the gate to open
        self._idle = asyncio.Event()  # set while in_flight == 0
        self._idle.set()
        self.rejecting = False  # held requests get 503 (the engine is about to restart)
        self.adapter: str | None = None  # the LoRA adapter that serves as the policy
        # hosted serving: every generation request needs a run's key, even with no run left
        self.hosted = False
        # hosted serving: sha256 of each run's key -> its model name; model -> its adapter
        self.clients: dict[bytes, str] = {}
        self.routes: dict[str, str | None] = {}
        self.adapter_in_flight: dict[str, int] = {}  # hosted: requests bound to each model
        self.quota: dict[str, int] = {}  # hosted: sampled tokens a run may have, in all
        self.sampled: dict[str, int] = {}  # hosted: sampled tokens answered per run
        self.reserved: dict[str, int] = {}  # hosted: what a run's requests in flight may sample
        self.served_name = os.environ.get(SERVED_NAME_ENV, "")
        self.score_alone = os.environ.get(SCORE_ALONE_ENV, "") == "1"
        self.lane = Lane()  # with score_alone: prompt-logprobs requests run exclusively

    def _authorized(self, scope: Scope) -> bool:
        got = _header(scope, TOKEN_HEADER.encode())
        return bool(self.token) and got is not None and hmac.compare_digest(got, self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.token:
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path == CONTROL_PATH:
            await self._control(scope, receive, send)
            return
        hosted_only = self.hosted and path.startswith(HOSTED_RESERVED_POSTS)
        if method in ("GET", "HEAD", "OPTIONS") or (
            path.startswith(PUBLIC_POSTS) and not hosted_only
        ):
            await self.app(scope, receive, send)
            return
        if not path.startswith(GATED_PREFIXES) or path.startswith(RESERVED_POSTS) or hosted_only:
            if not self._authorized(scope):
                await _json_response(
                    send,
                    403,
                    {"error": {"message": f"{path} is reserved for the Treadle inference service",
                               "type": "PermissionDeniedError", "code": 403}},
                )  # fmt: skip
                return
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):  # the service's own probe: passes a closed gate
            await self._run(scope, receive, send)
            return
        client: str | None = None
        if self.hosted:
            client = self._client(scope)
            if client is None:
                await _json_response(
                    send,
                    401,
                    {"error": {"message": "this server serves several runs: send your run's key "
                               "(Authorization: Bearer <key>)", "type": "AuthenticationError",
                               "code": 401}},
                )  # fmt: skip
                return
        if not self.is_open and not await self._wait_until_open():
            await _json_response(
                send,
                503,
                {"error": {"message": "the inference engine is restarting with new weights; retry",
                           "type": "ServiceUnavailableError", "code": 503}},
            )  # fmt: skip
            return
        bound: str | None = None
        release: Callable[[], None] | None = None  # what a request holds of its run's quota
        if client is not None:  # bound at admission to the run's adapter of now
            doc = _json_object(await _read_body(receive))
            named = doc.get("model") if doc is not None else None
            if doc is None or named not in (None, client):
                why = (
                    "a JSON request body is required"
                    if doc is None
                    else f"this key serves model {client!r} only, not {named!r}"
                )
                await _json_response(
                    send, 403, {"error": {"message": why, "type": "PermissionDeniedError",
                                          "code": 403}},
                )  # fmt: skip
                return
            refused, reserve = self._over_quota(client, doc)
            if refused is not None:
                await _json_response(send, *refused)
                return
            if client in self.quota:  # what it samples is counted from the answer
                send, release = self._counting(client, send, reserve)
            bound = self.routes.get(client) or self.served_name
            doc["model"] = bound
            scope, receive = _with_body(scope, json.dumps(doc).encode(), receive)
            self.adapter_in_flight[bound] = self.adapter_in_flight.get(bound, 0) + 1
        self.in_flight += 1
        self._idle.clear()
        try:
            if client is None and self.adapter is not None:  # one version per request
                scope, receive = await self._to_adapter(scope, receive, self.adapter)
            await self._run(scope, receive, send)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()
            if release is not None:
                release()  # answered or not, the request holds nothing of its quota now
            if bound is not None:
                self.adapter_in_flight[bound] -= 1
                if not self.adapter_in_flight[bound]:
                    del self.adapter_in_flight[bound]

    def _over_quota(
        self, client: str, doc: dict[str, Any]
    ) -> tuple[tuple[int, dict[str, Any]] | None, int]:
        """((status, body) refusing the request, or None to admit it; the tokens it may
        sample, reserved against ``client``'s quota until it is answered). A run with a
        quota: a stream is refused (its tokens could not be counted), so is a request once
        nothing is left; an admitted one's ``max_tokens`` is lowered (in ``doc``) to fit
        what is left, ``n`` samples of it."""
        limit = self.quota.get(client)
        if limit is None:
            return None, 0

        def refuse(status: int, kind: str, why: str) -> tuple[tuple[int, dict[str, Any]], int]:
            return (status, {"error": {"message": why, "type": kind, "code": status}}), 0

        if doc.get("stream"):
            return refuse(400, "BadRequestError", f"run {client!r} has a sampled-token quota: "
                          "its requests are counted from whole answers and may not stream")  # fmt: skip
        # the token route's sampling settings, else the OpenAI routes' own fields
        params = doc.get("sampling_params")
        params = params if isinstance(params, dict) else doc
        n = params.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return refuse(400, "BadRequestError", f"n must be an integer >= 1, got {n!r}")
        asked = [
            params[k] for k in ("max_tokens", "max_completion_tokens") if params.get(k) is not None
        ]
        if any(not isinstance(a, int) or isinstance(a, bool) or a < 1 for a in asked):
            return refuse(
                400, "BadRequestError", f"max_tokens must be an integer >= 1, got {asked}"
            )
        used, running = self.sampled.get(client, 0), self.reserved.get(client, 0)
        left = limit - used - running
        each = left // n
        if each < 1:
            held = f" and its requests running may sample {running} more" if running else ""
            return refuse(429, "QuotaExceededError",
                          f"run {client!r} has used {used} sampled tokens of its quota of "
                          f"{limit}{held} (inference.hosted.quotas): "
                          + ("no more generation for it" if left <= 0 else
                             f"{left} left, fewer than the {n} samples asked for"))  # fmt: skip
        # both given: the larger may be the one the route reads, so it is the one held
        if not asked or max(asked) > each:
            for k in ("max_tokens", "max_completion_tokens"):
                if k in params or (k == "max_tokens" and not asked):
                    params[k] = each
            log.info("run %s: max_tokens %s lowered to %d: %d of its quota of %d sampled "
                     "tokens left for %d sample(s)", client, max(asked) if asked else "(unset)",
                     each, left, limit, n)  # fmt: skip
            return None, n * each
        return None, n * max(asked)

    def _counting(self, client: str, send: Send, reserve: int) -> tuple[Send, Callable[[], None]]:
        """(``send`` that adds the tokens an answer sampled to ``client``'s count, the
        release of ``reserve``): ``reserve`` of its quota is held until the answer is
        counted or the request ends unanswered, whichever comes first."""
        chunks: list[bytes] = []
        self.reserved[client] = self.reserved.get(client, 0) + reserve
        held = [reserve]

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))
                if not message.get("more_body"):
                    self._release(client, held)
                    self.sampled[client] = self.sampled.get(client, 0) + _sampled_in(
                        b"".join(chunks)
                    )
            await send(message)

        return counted, lambda: self._release(client, held)

    def _release(self, client: str, held: list[int]) -> None:
        """Give back what a request of ``client`` held of its quota, once."""
        if held[0]:
            left = self.reserved.get(client, 0) - held[0]
            held[0] = 0
            if left > 0:
                self.reserved[client] = left
            else:
                self.reserved.pop(client, None)

    def _client(self, scope: Scope) -> str | None:
        """The run whose key the request carries (hosted serving), or None."""
        got = _header(scope, b"authorization") or b""
        scheme, _, key = got.partition(b" ")
        if scheme.lower() != b"bearer" or not key.strip():
            return None
        digest = hashlib.sha256(key.strip()).digest()
        for known, model in self.clients.items():
            if hmac.compare_digest(known, digest):
                return model
        return None

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; with score_alone, a prompt-logprobs one runs alone."""
        if not self.score_alone:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        exclusive = _asks_prompt_logprobs(body)
        await self.lane.acquire(exclusive)
        try:
            await self.app(scope, _replaying(body, receive), send)
        finally:
            await self.lane.release(exclusive)

    async def _to_adapter(
        self, scope: Scope, receive: Receive, adapter: str
    ) -> tuple[Scope, Receive]:
        """The request with its JSON body's model set to ``adapter`` when it names the
        served model or none; otherwise unchanged (vLLM answers it as it is)."""
        body = await _read_body(receive)
        doc = _json_object(body)
        if doc is not None and doc.get("model") in (None, self.served_name):
            doc["model"] = adapter
            return _with_body(scope, json.dumps(doc).encode(), receive)
        return scope, _replaying(body, receive)

    async def _wait_until_open(self) -> bool:
        """Hold a request until the gate opens (True) or held requests are rejected (False)."""
        self.held += 1
        try:
            while not self.is_open:
                if self.rejecting:
                    return False
                await self._opened.wait()
            return True
        finally:
            self.held -= 1

    def set_open(self, is_open: bool, *, reject_held: bool = False) -> None:
        self.is_open = is_open
        self.rejecting = reject_held and not is_open
        if is_open:
            self._opened.set()
        else:
            self._opened.clear()
            if self.rejecting:  # wake the held requests so they answer 503
                self._opened.set()
                self._opened.clear()

    async def drain(self, timeout_s: float) -> int:
        """Wait until no admitted request is in flight (or timeout); returns how many are."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass
        return self.in_flight

    async def _control(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._authorized(scope):
            await _json_response(send, 403, {"error": {"message": "token required", "code": 403}})
            return
        if scope.get("method") == "POST":
            try:
                body = json.loads(await _read_body(receive) or b"{}")
                if "adapter" in body:
                    adapter = body["adapter"]
                    if adapter is not None and not isinstance(adapter, str):
                        raise ValueError(f"adapter must be a name or null, got {adapter!r}")
                    self.adapter = adapter
                if "hosted" in body:
                    if body["hosted"] is not True:
                        raise ValueError(f"hosted can only be set (true), got {body['hosted']!r}")
                    self.hosted = True
                if "route" in body:
                    self._set_route(body["route"])
                if "unroute" in body:
                    self._unroute(body["unroute"])
                if "open" not in body and body.keys() & {"route", "unroute", "hosted"}:
                    body["open"] = self.is_open  # a route change alone: gate unchanged
                self.set_open(bool(body["open"]), reject_held=bool(body.get("reject_held")))
                if not self.is_open and body.get("drain_timeout_s"):
                    await self.drain(float(body["drain_timeout_s"]))
            except (ValueError, KeyError, TypeError) as e:
                await _json_response(
                    send, 400, {"error": {"message": f"bad request: {e}", "code": 400}}
                )
                return
        state = {"open": self.is_open, "in_flight": self.in_flight, "held": self.held,
                 "adapter": self.adapter, "routes": self.routes,
                 "adapter_in_flight": self.adapter_in_flight}  # fmt: skip
        if self.quota:
            state["sampled"] = self.sampled
        await _json_response(send, 200, state)

    def _set_route(self, route: Any) -> None:
        """{model, adapter (a name or null: the base), key_sha256 (hex, optional)}."""
        model, adapter = route["model"], route.get("adapter")
        if not isinstance(model, str) or not model:
            raise ValueError(f"route.model must be a name, got {model!r}")
        if adapter is not None and not isinstance(adapter, str):
            raise ValueError(f"route.adapter must be a name or null, got {adapter!r}")
        quota = None
        if "max_sampled_tokens" in route:  # with what the run used before (its ledger)
            quota = int(route["max_sampled_tokens"]), int(route.get("sampled_tokens", 0))
            if quota[0] < 1 or quota[1] < 0:
                raise ValueError("route.max_sampled_tokens must be >= 1, sampled_tokens >= 0")
        key = route.get("key_sha256")
        if key is not None:
            digest = bytes.fromhex(key)
            if len(digest) != 32:
                raise ValueError("route.key_sha256 must be 64 hex digits")
            taken = self.clients.get(digest)
            if taken is not None and taken != model:
                raise ValueError(f"that key is already model {taken!r}'s")
            self.clients = {d: m for d, m in self.clients.items() if m != model}
            self.clients[digest] = model
            self.hosted = True
        elif model not in self.routes:
            raise ValueError(f"route for {model!r} needs key_sha256 the first time")
        if quota is not None:
            self.quota[model] = quota[0]
            self.sampled[model] = max(quota[1], self.sampled.get(model, 0))
        self.routes[model] = adapter

    def _unroute(self, model: Any) -> None:
        """Forget run ``model``: its key, its route and its quota (a run not routed: no-op).
        What it sampled stays counted: added again, its quota counts it."""
        if not isinstance(model, str) or not model:
            raise ValueError(f"unroute must be a run's model name, got {model!r}")
        self.clients = {d: m for d, m in self.clients.items() if m != model}
        self.routes.pop(model, None)
        self.quota.pop(model, None)
