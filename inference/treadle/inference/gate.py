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

Prompt logprobs alone (``TREADLE_GATE_SCORE_ALONE``, set when LoRA is enabled on CPU):
vLLM 0.32's CPU LoRA path fails, killing the engine, when a request for prompt logprobs
(a probe, a replica check, a teacher's scoring) shares a batch with other requests. Such
a request then waits until no other admitted request runs and runs alone; requests
admitted after it wait for it (it goes first: a score is short).

Stdlib only: this module is imported inside vLLM's process.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

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


def _asks_prompt_logprobs(body: bytes) -> bool:
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        return False
    if not isinstance(doc, dict):
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
        if method in ("GET", "HEAD", "OPTIONS") or path.startswith(PUBLIC_POSTS):
            await self.app(scope, receive, send)
            return
        if not path.startswith(GATED_PREFIXES) or path.startswith(RESERVED_POSTS):
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
        if not self.is_open and not await self._wait_until_open():
            await _json_response(
                send,
                503,
                {"error": {"message": "the inference engine is restarting with new weights; retry",
                           "type": "ServiceUnavailableError", "code": 503}},
            )  # fmt: skip
            return
        self.in_flight += 1
        self._idle.clear()
        try:
            if self.adapter is not None:  # bound at admission: one version per request
                scope, receive = await self._to_adapter(scope, receive, self.adapter)
            await self._run(scope, receive, send)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

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
        try:
            doc = json.loads(body) if body else None
        except ValueError:
            doc = None
        if isinstance(doc, dict) and doc.get("model") in (None, self.served_name):
            doc["model"] = adapter
            body = json.dumps(doc).encode()
            headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
            scope = dict(scope, headers=[*headers, (b"content-length", b"%d" % len(body))])
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
                self.set_open(bool(body["open"]), reject_held=bool(body.get("reject_held")))
                if not self.is_open and body.get("drain_timeout_s"):
                    await self.drain(float(body["drain_timeout_s"]))
            except (ValueError, KeyError, TypeError) as e:
                await _json_response(
                    send, 400, {"error": {"message": f"bad request: {e}", "code": 400}}
                )
                return
        state = {"open": self.is_open, "in_flight": self.in_flight, "held": self.held,
                 "adapter": self.adapter}  # fmt: skip
        await _json_response(send, 200, state)
