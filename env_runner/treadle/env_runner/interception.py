"""The interception server: an OpenAI-compatible chat-completions API in front of rollouts.

A harness that is a separate program (a CLI agent, an SDK script) talks to "the model"
over HTTP; every request lands in its rollout's ModelSession, so each turn is rendered,
generated and recorded token-exactly like an in-process harness's. One server per env
runner serves every rollout it runs, told apart by the URL:

    POST /rollouts/{rollout_id}/v1/chat/completions    non-streaming or "stream": true (SSE)
    GET  /rollouts/{rollout_id}/v1/models

How the env runner wires it (one server for the process, started before rollouts run):

    server = InterceptionServer(host="127.0.0.1", port=0)
    await server.start()                      # InterceptionServer.current() now returns it
    rc = RolloutContext(..., services={"interception": server})
    ...
    await server.stop()                       # on shutdown

A harness serves one rollout for the time of its program (CommandHarness does this):

    async with server.serving(rollout_id, session, unix_socket=None) as ep:
        ep.base_url                           # OPENAI_BASE_URL for the program
        ...                                   # run the program
    if ep.error is not None:                  # Truncated / TurnError the program saw
        raise ep.error

``register``/``listen_unix``/``unregister`` are the same steps one by one. With
``unix_socket`` the rollout is also served on its own unix socket, and a request coming
through that socket may only reach that rollout (a sandboxed program cannot talk to
another rollout's session).

Every rollout has its own secret (``ep.api_key``, 256 random bits, made at ``register``):
each request must carry it as ``Authorization: Bearer <key>`` (what OpenAI clients send
for ``OPENAI_API_KEY``) or ``x-api-key``, on TCP and on the unix socket alike. Without it
the answer is 401 and the session is never touched, so knowing or guessing a rollout id
gives nothing; refusals are counted (``rejected_requests``, the metric
``treadle.interception.unauthorized``) and logged once per rollout.

What the request controls: messages, tools, max_tokens / max_completion_tokens and
temperature (in [0, 2], as OpenAI's). max_tokens is a wish: a call samples at most the rollout's own per-call
budget (its sampling.max_tokens), the room left under its max_total_tokens and the
model's context length, whatever the request asks. Everything else of sampling (top_p,
top_k, seed, penalties) is the rollout's and ignored, other fields (stop, tool_choice, ...)
too; but every sampling parameter a request sends must be what an OpenAI server accepts
(a finite number in its range, n = 1), or the request is refused. Content parts are
accepted when they are text.

A body is read whole only from a caller with the rollout's key, and only up to
``MAX_BODY_BYTES`` (413 above). Before it is parsed its nesting is measured without
recursion (a linear scan): lists/objects nested deeper than ``MAX_BODY_DEPTH`` (the native
core's limit, which the renderer enforces anyway) are refused, as are JSON's non-standard
constants (NaN, Infinity) Python's parser would otherwise accept.

Errors, OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``, the message
one line): an unknown rollout is 404, a missing or wrong key 401, a malformed body or a
sampling parameter out of range 400 (``param`` names it), a body over the size cap 413.
Refused bodies are counted (``bad_requests``, the metric
``treadle.interception.bad_requests`` by ``code``) and logged once per rollout; they do
not end the rollout. A limit of the rollout (``Truncated``: turns, tokens, wall time)
ends it: the truncation is kept on the endpoint and in
``state.info["truncated"] = (truncation, message)``, and this and every later request
get HTTP 400 "the rollout ended". A failed model call (``TurnError``) is 502 and kept
likewise (``state.info["turn_error"] = (error_kind, message)``). Client retries of the
same request are answered from the session's cache without a new generation.

Streaming is a replay: the turn is generated whole, then sent as SSE chunks (role,
reasoning_content, content, tool-call deltas, finish_reason, usage when asked). This
module does not run programs (cli_agent.py does) and knows nothing of sandboxes beyond
serving a unix socket.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from aiohttp import web

from treadle.env_runner.session import ModelSession, Truncated, Turn, TurnError
from treadle.proto.v1 import rollout_pb2
from treadle.services import telemetry

log = logging.getLogger(__name__)
_unauthorized = telemetry.meter(__name__).create_counter(
    "treadle.interception.unauthorized",
    description="requests refused for a missing or wrong rollout key",
)
_bad_requests = telemetry.meter(__name__).create_counter(
    "treadle.interception.bad_requests",
    description="requests with the rollout's key refused for their body (by code: "
    "invalid_json, too_deep, too_large, invalid_request, ...)",
)

Status = rollout_pb2.RolloutStatus
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_UNIX_PATH = 107  # sun_path is 108 bytes, NUL included
MAX_BODY_BYTES = 16 << 20
"""Largest request body read (413 above): ~4M tokens of text, beyond any model's context."""
MAX_BODY_DEPTH = 100
"""Deepest nesting of lists/objects in a body (treadle_native's json MAX_DEPTH)."""
MAX_ERROR_CHARS = 500
"""Error messages are one line of at most this many characters (they may quote input)."""


class RequestError(ValueError):
    """A chat-completions request body that cannot be served (HTTP 400 unless ``status``)."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str = "invalid_request",
        status: int = 400,
    ):  # fmt: skip
        super().__init__(message)
        self.param = param
        """The body field at fault (OpenAI's error.param), when one is."""
        self.code = code
        self.status = status


@dataclass
class Endpoint:
    """One rollout as the server serves it."""

    rollout_id: str
    session: ModelSession
    base_url: str
    """``http://host:port/rollouts/{rollout_id}/v1`` on the server's TCP listener."""
    path: str
    """``/rollouts/{rollout_id}/v1``: the base URL's path (e.g. behind a relay)."""
    api_key: str = field(default="", repr=False)
    """The rollout's secret: every request must carry it (hand it to the program as
    ``OPENAI_API_KEY``)."""
    unix_socket: Path | None = None
    """The rollout's own unix socket, when it has one."""
    error: Truncated | TurnError | None = None
    """What ended the rollout during a request (every later request gets it too)."""
    num_requests: int = 0
    """Chat-completions requests answered with a turn (retries included)."""
    last_finish_reason: str = ""
    """finish_reason of the last turn answered ("stop" | "length" | "tool_calls")."""
    num_rejected: int = 0
    """Requests refused for a missing or wrong key."""
    num_bad_requests: int = 0
    """Requests with the key refused for their body (malformed, out of range, too deep/large)."""
    _site: web.UnixSite | None = field(default=None, repr=False)


def _error(
    status: int, message: str, kind: str, code: str | None = None, param: str | None = None
) -> web.Response:
    message = " ".join(message.split())  # one line, whatever an echoed value held
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


def _endpoint_error(e: Truncated | TurnError) -> web.Response:
    if isinstance(e, Truncated):
        name = Status.Truncation.Name(e.truncation)
        return _error(
            400, f"the rollout ended ({name}): {e}", "invalid_request_error", "rollout_ended"
        )
    name = Status.ErrorKind.Name(e.error_kind)
    return _error(502, f"the model call failed ({name}): {e}", "api_error", "model_call_failed")


# -- request parsing ------------------------------------------------------------------------
_ESCAPE = re.compile(rb"\\.", re.DOTALL)  # a backslash and the byte it escapes
_STRING = re.compile(rb'"[^"]*"')  # a string literal, once escapes are gone
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes) -> int:
    """How deep lists and objects nest in the JSON text ``raw``, without parsing it (and
    without recursion): escapes are dropped, then string literals, and the running count
    of the brackets left is taken. Linear in ``len(raw)``; exact for valid JSON."""
    brackets = _STRING.sub(b"", _ESCAPE.sub(b"", raw)).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    # '[' and '{' have bit 1 set, ']' and '}' do not: +1 for an opening, -1 for a closing
    steps = (np.frombuffer(brackets, np.uint8) & 2).astype(np.int32) - 1
    return int(np.cumsum(steps, dtype=np.int32).max())


def _no_constant(name: str) -> Any:
    raise RequestError(
        f"the body is not JSON: {name} is not a JSON value (numbers must be finite)",
        code="invalid_json",
    )


def load_body(raw: bytes) -> Any:
    """A request body as JSON, refused (RequestError) when it is not UTF-8 JSON, nests
    deeper than MAX_BODY_DEPTH, or holds NaN/Infinity; never a RecursionError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("the body is not UTF-8 text", code="invalid_json") from None
    depth = json_depth(raw)
    too_deep = RequestError(
        f"the body nests lists/objects {depth} deep; at most {MAX_BODY_DEPTH} are accepted",
        code="too_deep",
    )
    if depth > MAX_BODY_DEPTH:
        raise too_deep
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise RequestError(f"the body is not JSON: {e}", code="invalid_json") from None
    except RecursionError:  # not reached: the depth check comes first
        raise too_deep from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _integer(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    """``body[key]``: None, or an integer (not a bool) in [lo, hi]; RequestError otherwise."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RequestError(f"{key} must be an integer {bound}, got {_shown(v)}", param=key)
    return v


def _number(
    body: dict[str, Any], key: str, lo: float, hi: float, *, lo_open: bool = False
) -> float | None:
    """``body[key]``: None, or a finite number in [lo, hi] (``(lo, hi]`` with ``lo_open``)."""
    v = body.get(key)
    if v is None:
        return None
    ok = (
        isinstance(v, int | float) and not isinstance(v, bool)
        and (isinstance(v, int) or math.isfinite(v))
        and (lo < v if lo_open else lo <= v) and v <= hi
    )  # fmt: skip
    if not ok:
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise RequestError(f"{key} must be a finite number in {span}, got {_shown(v)}", param=key)
    return float(v)


def _check_sampling(body: dict[str, Any]) -> None:
    """Refuse what an OpenAI server would: sampling parameters out of range or of the wrong
    type, n other than 1 -- even those this server ignores (the rollout's apply)."""
    _number(body, "top_p", 0.0, 1.0, lo_open=True)
    _number(body, "presence_penalty", -2.0, 2.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    _integer(body, "top_k", -1)
    _integer(body, "seed", -(2**63), 2**63 - 1)
    _integer(body, "top_logprobs", 0, 20)
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
        raise RequestError(f"n must be 1 (one rollout, one completion), got {_shown(n)}", param="n")
    for key in ("logprobs", "stream"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise RequestError(f"{key} must be a boolean, got {_shown(body[key])}", param=key)


def _text(content: Any, where: str) -> str | None:
    """Message content as the renderer takes it: a string or None (text parts joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(p.get("text") or ""))
            else:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise RequestError(
                    f"{where}.content[{i}]: only text parts are supported, got {kind!r}"
                )
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string, a list of text parts or null")


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    if not isinstance(c, dict):
        raise RequestError(f"{where} must be an object")
    f = c.get("function", c)
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise RequestError(f"{where}.function.name must be a string")
    args = f.get("arguments")
    if args is None:
        args = "{}"
    elif not isinstance(args, str):
        args = json.dumps(args)
    out: dict[str, Any] = {"type": "function", "function": {"name": f["name"], "arguments": args}}
    if c.get("id") is not None:
        out["id"] = str(c["id"])
    return out


def _message(m: Any, i: int) -> dict[str, Any]:
    """A client message reduced to the fields the renderer and the session use."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = _text(m.get("content"), where)
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls must be a list on an assistant message")
        if calls:
            out["tool_calls"] = [
                _tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
    out["content"] = content if content is not None or role == "assistant" else ""
    for key in ("name", "tool_call_id", "reasoning_content"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    temperature: float | None
    stream: bool
    include_usage: bool
    model: str


def parse_request(body: Any, default_model: str) -> ChatRequest:
    """The parts of a chat-completions body the session uses; RequestError when malformed."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise RequestError("tools must be a list of objects")
    # any size is accepted: the session samples at most the rollout's budget
    max_tokens = _integer(body, "max_completion_tokens", 1)
    legacy = _integer(body, "max_tokens", 1)
    max_tokens = legacy if max_tokens is None else max_tokens
    temperature = _number(body, "temperature", 0.0, 2.0)
    _check_sampling(body)
    stream = bool(body.get("stream", False))
    options = body.get("stream_options") or {}
    model = body.get("model")
    return ChatRequest(
        messages=[_message(m, i) for i, m in enumerate(messages)],
        tools=tools or None,
        max_tokens=max_tokens,
        temperature=temperature,
        stream=stream,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        model=model if isinstance(model, str) and model else default_model,
    )


# -- response shapes --------------------------------------------------------------------------
def _finish_reason(turn: Turn) -> str:
    if turn.finish_reason == "length":
        return "length"
    return "tool_calls" if turn.message.get("tool_calls") else "stop"


def _usage(turn: Turn) -> dict[str, int]:
    p, c = turn.num_prompt_tokens, turn.num_completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_body(rollout_id: str, turn: Turn, model: str) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` object of ``turn``."""
    msg = turn.message
    message: dict[str, Any] = {"role": "assistant", "content": msg["content"]}
    if msg.get("tool_calls"):
        message["tool_calls"] = msg["tool_calls"]
        message["content"] = msg["content"] or None
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    return {
        "id": f"chatcmpl-{rollout_id}-{turn.node_id}",  # the same for a retried request
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": _finish_reason(turn),
            }
        ],
        "usage": _usage(turn),
    }


def completion_chunks(
    rollout_id: str, turn: Turn, model: str, include_usage: bool
) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects that stream ``turn``."""
    base = {"id": f"chatcmpl-{rollout_id}-{turn.node_id}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}  # fmt: skip

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            **base,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    out = [chunk({"role": "assistant", "content": ""})]
    if turn.reasoning:
        out.append(chunk({"reasoning_content": turn.reasoning}))
    if turn.content:
        out.append(chunk({"content": turn.content}))
    for i, call in enumerate(turn.message.get("tool_calls") or []):
        f = call["function"]
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": f["name"], "arguments": f["arguments"]}}]}))  # fmt: skip
    out.append(chunk({}, _finish_reason(turn)))
    if include_usage:
        out.append({**base, "choices": [], "usage": _usage(turn)})
    return out


# -- the server ---------------------------------------------------------------------------------
class InterceptionServer:
    """One OpenAI-compatible endpoint per rollout, on one aiohttp server (see the module doc)."""

    _current: ClassVar[InterceptionServer | None] = None

    def __init__(self, host: str = "127.0.0.1", port: int = 0, model_name: str = "treadle"):
        self.host = host
        self.port = port
        """TCP port (0: a free one, known after start())."""
        self.model_name = model_name
        """What /v1/models lists and responses echo when a request names no model."""
        self._endpoints: dict[str, Endpoint] = {}
        self._unix: dict[str, str] = {}  # socket path -> rollout id
        self.rejected_requests = 0
        """Requests refused for a missing or wrong rollout key (since start)."""
        self.bad_requests = 0
        """Requests with a rollout's key refused for their body (since start)."""
        self._runner: web.AppRunner | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @classmethod
    def current(cls) -> InterceptionServer:
        """The server this process started last and has not stopped."""
        if cls._current is None:
            raise RuntimeError(
                "no interception server is running in this process: start one with "
                "`await InterceptionServer().start()` (the env runner does) or pass server= to the harness"
            )
        return cls._current

    async def start(self) -> InterceptionServer:
        if self._runner is not None:
            raise RuntimeError("the interception server is already running")
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        prefix = "/rollouts/{rollout_id}/v1"
        app.router.add_post(prefix + "/chat/completions", self._chat)
        app.router.add_get(prefix + "/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        InterceptionServer._current = self
        log.info("[startup] interception server on %s", self.url)
        return self

    async def stop(self) -> None:
        for rollout_id in list(self._endpoints):
            await self.unregister(rollout_id)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if InterceptionServer._current is self:
            InterceptionServer._current = None

    async def __aenter__(self) -> InterceptionServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """``http://host:port`` of the TCP listener."""
        if self._runner is None:
            raise RuntimeError("the interception server is not running: call start() first")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # -- rollouts ----------------------------------------------------------------------------
    def register(self, rollout_id: str, session: ModelSession, api_key: str | None = None) -> str:
        """Serve ``session`` at ``/rollouts/{rollout_id}/v1``; returns that base URL.
        Requests must carry ``api_key`` (default: a fresh random one, ``endpoint().api_key``)."""
        if not rollout_id or "/" in rollout_id:
            raise ValueError(f"rollout id {rollout_id!r} cannot be a URL path segment")
        if rollout_id in self._endpoints:
            raise ValueError(
                f"rollout {rollout_id!r} is already registered with the interception server"
            )
        if api_key is not None and len(api_key) < 16:
            raise ValueError("a rollout's api_key must be at least 16 characters")
        path = f"/rollouts/{rollout_id}/v1"
        key = api_key or secrets.token_urlsafe(32)
        ep = Endpoint(rollout_id, session, self.url + path, path, api_key=key)
        self._endpoints[rollout_id] = ep
        return ep.base_url

    def endpoint(self, rollout_id: str) -> Endpoint:
        """The registered rollout (KeyError when it is not)."""
        return self._endpoints[rollout_id]

    async def listen_unix(self, rollout_id: str, path: Path) -> Endpoint:
        """Also serve the registered rollout on the unix socket ``path`` (and only it)."""
        ep = self._endpoints[rollout_id]
        if ep._site is not None:
            raise ValueError(f"rollout {rollout_id!r} already has a unix socket ({ep.unix_socket})")
        path = Path(path)
        if len(str(path).encode()) > MAX_UNIX_PATH:
            raise ValueError(
                f"unix socket path {path} is longer than {MAX_UNIX_PATH} bytes: use a shorter directory"
            )
        assert self._runner is not None
        site = web.UnixSite(self._runner, str(path))
        await site.start()
        ep._site, ep.unix_socket = site, path
        self._unix[str(path)] = rollout_id
        return ep

    async def unregister(self, rollout_id: str) -> Endpoint | None:
        """Stop serving the rollout (its unix socket too); returns its endpoint, if any."""
        ep = self._endpoints.pop(rollout_id, None)
        if ep is not None and ep._site is not None:
            self._unix.pop(str(ep.unix_socket), None)
            await ep._site.stop()
            ep._site = None
            with contextlib.suppress(FileNotFoundError):
                assert ep.unix_socket is not None
                ep.unix_socket.unlink()
        return ep

    @contextlib.asynccontextmanager
    async def serving(
        self,
        rollout_id: str,
        session: ModelSession,
        unix_socket: Path | None = None,
        api_key: str | None = None,
    ) -> AsyncIterator[Endpoint]:
        """Serve the rollout inside the block (``register`` + ``listen_unix`` + ``unregister``)."""
        self.register(rollout_id, session, api_key)
        try:
            if unix_socket is not None:
                await self.listen_unix(rollout_id, unix_socket)
            yield self._endpoints[rollout_id]
        finally:
            await self.unregister(rollout_id)

    # -- handlers ------------------------------------------------------------------------------
    def _lookup(self, request: web.Request) -> Endpoint | None:
        rollout_id = request.match_info["rollout_id"]
        transport = request.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        if isinstance(sockname, str) and sockname and self._unix.get(sockname) != rollout_id:
            return None  # a rollout's own unix socket serves that rollout only
        return self._endpoints.get(rollout_id)

    def _authorized(self, ep: Endpoint, request: web.Request) -> bool:
        """Whether the request carries the rollout's key (counted and logged when not)."""
        given = request.headers.get("Authorization", "")
        given = (
            given[7:] if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        )
        if given and hmac.compare_digest(given.encode(), ep.api_key.encode()):
            return True
        self.rejected_requests += 1
        ep.num_rejected += 1
        _unauthorized.add(1)
        if ep.num_rejected == 1:
            log.warning("rollout %s: refused a request without its key", ep.rollout_id)
        return False

    @staticmethod
    def _unauthorized() -> web.Response:
        return _error(
            401,
            "this rollout's endpoint needs its key (OPENAI_API_KEY as given to the program)",
            "authentication_error",
            "invalid_api_key",
        )

    def _unknown(self, request: web.Request) -> web.Response:
        rollout_id = request.match_info["rollout_id"]
        return _error(
            404,
            f"no rollout {rollout_id!r} is being served here",
            "not_found_error",
            "unknown_rollout",
        )

    async def _models(self, request: web.Request) -> web.Response:
        ep = self._lookup(request)
        if ep is None:
            return self._unknown(request)
        if not self._authorized(ep, request):
            return self._unauthorized()
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "treadle"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        ep = self._lookup(request)
        if ep is None:
            return self._unknown(request)
        if not self._authorized(ep, request):
            return self._unauthorized()
        if ep.error is not None:
            return _endpoint_error(ep.error)
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise RequestError(
                    f"the body is larger than {MAX_BODY_BYTES} bytes", code="too_large", status=413
                ) from None
            req = parse_request(load_body(raw), self.model_name)
        except RequestError as e:
            return self._bad_request(ep, e)
        try:
            turn = await ep.session.chat(req.messages, req.tools, max_tokens=req.max_tokens,
                                         temperature=req.temperature)  # fmt: skip
        except Truncated as e:
            self._record(ep, e)
            return _endpoint_error(e)
        except TurnError as e:
            self._record(ep, e)
            return _endpoint_error(e)
        except Exception as e:  # a bug of ours: an internal error of the rollout; the server lives
            log.exception("rollout %s: chat completion failed inside Treadle", ep.rollout_id)
            err = TurnError(Status.ErrorKind.ERROR_KIND_INTERNAL, f"{type(e).__name__}: {e}")
            self._record(ep, err)
            return _endpoint_error(err)
        ep.num_requests += 1
        ep.last_finish_reason = _finish_reason(turn)
        if not req.stream:
            return web.json_response(completion_body(ep.rollout_id, turn, req.model))
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):  # the client left: the turn is recorded anyway
            for chunk in completion_chunks(ep.rollout_id, turn, req.model, req.include_usage):
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        return resp

    def _bad_request(self, ep: Endpoint, e: RequestError) -> web.Response:
        """The 400/413 answer to a body the server refuses (counted, logged once per rollout)."""
        self.bad_requests += 1
        ep.num_bad_requests += 1
        _bad_requests.add(1, {"code": e.code})
        if ep.num_bad_requests == 1:
            log.warning("rollout %s: refused a request (%s): %.200s", ep.rollout_id, e.code, e)
        return _error(e.status, str(e), "invalid_request_error", e.code, e.param)

    @staticmethod
    def _record(ep: Endpoint, e: Truncated | TurnError) -> None:
        ep.error = e
        info = ep.session.state.info
        if isinstance(e, Truncated):
            info["truncated"] = (e.truncation, str(e))
        else:
            info["turn_error"] = (e.error_kind, str(e))
        log.info("rollout %s ended during a request: %s", ep.rollout_id, e)
