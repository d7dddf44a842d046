"""The interception server: one aiohttp server, every rollout's endpoint, every dialect.

It owns routing (``/rollouts/{rollout_id}`` + each dialect's path), the rollouts' keys,
body limits, retries and the call into the rollout's ModelSession; what a request and an
answer look like is the dialects' (dialect.py and its registered modules).

Per request, in order: an unknown (or ended) rollout is 404; a missing or wrong key 401
(the session is never touched, so a rollout id gives nothing); a rollout a limit or a
failed model call already ended answers that again (400 / 502); a body over
``MAX_BODY_BYTES`` is 413, a body the dialect refuses 400; then the session generates the
turn, the dialect answers it (JSON, or SSE replayed from the finished turn).

Retries. A request whose body is byte-identical, on the same route, to one of the last
``RETRY_MEMORY`` requests of the rollout that got a turn -- or to one still being
answered -- is a retry: it gets that same turn (the same response id), and nothing is
generated or recorded again. That is what a client does after a dropped connection or a
timeout: the OpenAI and Anthropic SDKs (and Claude Code, Codex) resend the same bytes, and
the generation of the first attempt goes on when its client leaves (aiohttp does not
cancel handlers), so the retry waits for it. A program that sends the very same request
again on purpose gets the same answer too, as from a deterministic server. Besides, the
session itself answers an immediate repeat of its last conversation from its cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from aiohttp import web

from treadle.env_runner.interception.dialect import DIALECTS, Call, Dialect, finish_reason
from treadle.env_runner.interception.parsing import MAX_BODY_BYTES, RequestError, load_body
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
    "invalid_json, too_deep, too_large, invalid_request, ...; and dialect)",
)

Status = rollout_pb2.RolloutStatus
MAX_UNIX_PATH = 107  # sun_path is 108 bytes, NUL included
RETRY_MEMORY = 16
"""Answered requests per rollout a retry is recognised against (see the module doc)."""
ENDED_MEMORY = 4096
"""Ended rollouts whose late requests are told so (404 "the rollout ended")."""


@dataclass
class Endpoint:
    """One rollout as the server serves it."""

    rollout_id: str
    session: ModelSession
    base_url: str
    """``http://host:port/rollouts/{rollout_id}/v1`` on the server's TCP listener: the
    OpenAI SDKs' base URL (OPENAI_BASE_URL)."""
    path: str
    """``/rollouts/{rollout_id}/v1``: the base URL's path (e.g. behind a relay)."""
    api_key: str = field(default="", repr=False)
    """The rollout's secret: every request must carry it (hand it to the program as
    ``OPENAI_API_KEY`` / ``ANTHROPIC_API_KEY``, :meth:`env` does)."""
    unix_socket: Path | None = None
    """The rollout's own unix socket, when it has one."""
    error: Truncated | TurnError | None = None
    """What ended the rollout during a request (every later request gets it too)."""
    ended: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set with ``error``: the harness stops waiting for a program that keeps going."""
    num_requests: int = 0
    """Requests answered with a turn (retries included), in every dialect."""
    num_retries: int = 0
    """Of those, the retries answered with an earlier turn (see the module doc)."""
    last_finish_reason: str = ""
    """finish_reason of the last turn answered ("stop" | "length" | "tool_calls")."""
    num_rejected: int = 0
    """Requests refused for a missing or wrong key."""
    num_bad_requests: int = 0
    """Requests with the key refused for their body (malformed, out of range, too deep/large)."""
    conversations: OrderedDict[str, list[dict[str, Any]]] = field(
        default_factory=OrderedDict, repr=False
    )
    """OpenAI Responses: conversations by response id, for ``previous_response_id``."""
    _recent: OrderedDict[bytes, Turn] = field(default_factory=OrderedDict, repr=False)
    _inflight: dict[bytes, asyncio.Future[Turn]] = field(default_factory=dict, repr=False)
    _site: web.UnixSite | None = field(default=None, repr=False)

    @property
    def root_url(self) -> str:
        """``http://host:port/rollouts/{rollout_id}``: the Anthropic SDK's base URL
        (ANTHROPIC_BASE_URL; it adds ``/v1/messages``)."""
        return self.base_url.removesuffix("/v1")

    def env(self, base_url: str | None = None) -> dict[str, str]:
        """The variables a program needs to reach this endpoint with any SDK: OpenAI's
        and Anthropic's base URL and key. ``base_url``: the OpenAI base URL as the program
        sees it (e.g. through a relay), default :attr:`base_url`."""
        base = base_url or self.base_url
        return {"OPENAI_BASE_URL": base, "OPENAI_API_KEY": self.api_key,
                "ANTHROPIC_BASE_URL": base.removesuffix("/v1"), "ANTHROPIC_API_KEY": self.api_key}  # fmt: skip


class InterceptionServer:
    """Every rollout's endpoint in every dialect, on one aiohttp server (see the package doc)."""

    _current: ClassVar[InterceptionServer | None] = None

    def __init__(self, host: str = "127.0.0.1", port: int = 0, model_name: str = "treadle"):
        self.host = host
        self.port = port
        """TCP port (0: a free one, known after start())."""
        self.model_name = model_name
        """What /v1/models lists and answers echo when a request names no model."""
        self._endpoints: dict[str, Endpoint] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
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
        prefix = "/rollouts/{rollout_id}"
        for dialect in DIALECTS.values():
            app.router.add_route(dialect.method, prefix + dialect.path, self._handler(dialect))
        app.router.add_get(prefix + "/v1/models", self._models)
        # handler_cancellation=False (aiohttp's default, said here because retries rely on
        # it): a client that leaves does not cancel its generation, its retry gets the turn
        runner = web.AppRunner(app, access_log=None, handler_cancellation=False)
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
        log.info("[startup] interception server on %s (%s)", self.url, ", ".join(DIALECTS))
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
        """Serve ``session`` at ``/rollouts/{rollout_id}``; returns the OpenAI base URL
        (``.../v1``). Requests must carry ``api_key`` (default: a fresh random one,
        ``endpoint().api_key``)."""
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
        self._ended.pop(rollout_id, None)
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
        """Stop serving the rollout (its unix socket too); returns its endpoint, if any.
        Later requests for it are 404 "the rollout ended"."""
        ep = self._endpoints.pop(rollout_id, None)
        if ep is None:
            return None
        self._ended[rollout_id] = None
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        if ep._site is not None:
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

    def _refusal(self, request: web.Request, dialect: Dialect) -> web.Response | Endpoint:
        """The endpoint of the request, or the answer that refuses it (404 / 401)."""
        ep = self._lookup(request)
        if ep is None:
            rollout_id = request.match_info["rollout_id"]
            if rollout_id in self._ended:
                return dialect.error(404, f"rollout {rollout_id!r} has ended: its endpoint is "
                                     "closed", "rollout_ended")  # fmt: skip
            return dialect.error(404, f"no rollout {rollout_id!r} is being served here",
                                 "unknown_rollout")  # fmt: skip
        if not self._authorized(ep, request):
            return dialect.error(401, f"this rollout's endpoint needs its key ({dialect.key_env} "
                                 "as given to the program)", "invalid_api_key")  # fmt: skip
        return ep

    async def _models(self, request: web.Request) -> web.Response:
        anthropic = "anthropic-version" in request.headers
        dialect = DIALECTS["anthropic" if anthropic else "openai_chat"]
        ep = self._refusal(request, dialect)
        if isinstance(ep, web.Response):
            return ep
        if anthropic:
            model: dict[str, Any] = {"type": "model", "id": self.model_name, "display_name": self.model_name,
                                     "created_at": "1970-01-01T00:00:00Z"}  # fmt: skip
            return web.json_response({"data": [model], "has_more": False,
                                      "first_id": self.model_name, "last_id": self.model_name})  # fmt: skip
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "treadle"}
        return web.json_response({"object": "list", "data": [model]})

    def _handler(self, dialect: Dialect) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            return await self._serve(request, dialect)

        return handle

    async def _serve(self, request: web.Request, dialect: Dialect) -> web.Response:
        ep = self._refusal(request, dialect)
        if isinstance(ep, web.Response):
            return ep
        if ep.error is not None:
            return _ended(dialect, ep.error)
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise RequestError(
                    f"the body is larger than {MAX_BODY_BYTES} bytes", code="too_large", status=413
                ) from None
            call = dialect.parse(load_body(raw), request.headers, ep, self.model_name)
        except RequestError as e:
            return self._bad_request(ep, dialect, e)
        except Exception as e:  # a bug of ours on odd input: this request fails, nothing else
            log.exception("rollout %s: cannot read a %s request", ep.rollout_id, dialect.name)
            return dialect.error(500, f"internal error reading the request ({type(e).__name__})",
                                 "internal_error")  # fmt: skip
        try:
            turn = await self._turn(ep, dialect, raw, call)
        except (Truncated, TurnError) as e:
            return _ended(dialect, e)
        ep.num_requests += 1
        ep.last_finish_reason = finish_reason(turn)
        if not call.stream:
            return web.json_response(dialect.body(ep, call, turn))
        # a replay of the finished turn: the whole event stream in one body (one write, with
        # its length); the client's SSE parser splits the events as they come
        return web.Response(body=b"".join(dialect.events(ep, call, turn)),
                            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})  # fmt: skip

    async def _turn(self, ep: Endpoint, dialect: Dialect, raw: bytes, call: Call) -> Turn:
        """The session's turn for ``call``; a retry (the same bytes on the same route as a
        recent or running request) gets that request's turn."""
        key = hashlib.blake2b(raw, digest_size=16, person=dialect.name[:16].encode()).digest()
        turn = ep._recent.get(key)
        if turn is not None:
            ep.num_retries += 1
            return turn
        running = ep._inflight.get(key)
        if running is None:
            running = asyncio.ensure_future(self._generate(ep, dialect, call))
            ep._inflight[key] = running
            running.add_done_callback(lambda t: _settled(ep, key, t))
        else:
            ep.num_retries += 1
        # shielded: a client that leaves must not cancel the turn its retry will ask for
        turn = await asyncio.shield(running)
        ep._recent[key] = turn
        while len(ep._recent) > RETRY_MEMORY:
            ep._recent.popitem(last=False)
        return turn

    async def _generate(self, ep: Endpoint, dialect: Dialect, call: Call) -> Turn:
        try:
            turn = await ep.session.chat(call.messages, call.tools, max_tokens=call.max_tokens,
                                         temperature=call.temperature, stop=call.stop)  # fmt: skip
        except (Truncated, TurnError) as e:
            self._record(ep, e)
            raise
        except Exception as e:  # a bug of ours: an internal error of the rollout; the server lives
            log.exception("rollout %s: model call failed inside Treadle", ep.rollout_id)
            err = TurnError(Status.ErrorKind.ERROR_KIND_INTERNAL, f"{type(e).__name__}: {e}")
            self._record(ep, err)
            raise err from None
        dialect.answered(ep, call, turn)
        return turn

    def _bad_request(self, ep: Endpoint, dialect: Dialect, e: RequestError) -> web.Response:
        """The 400/413 answer to a body the server refuses (counted, logged once per rollout)."""
        self.bad_requests += 1
        ep.num_bad_requests += 1
        _bad_requests.add(1, {"code": e.code, "dialect": dialect.name})
        if ep.num_bad_requests == 1:
            log.warning("rollout %s: refused a %s request (%s): %.200s", ep.rollout_id,
                        dialect.name, e.code, e)  # fmt: skip
        return dialect.request_error(e)

    @staticmethod
    def _record(ep: Endpoint, e: Truncated | TurnError) -> None:
        ep.error = e
        ep.ended.set()
        info = ep.session.state.info
        if isinstance(e, Truncated):
            info["truncated"] = (e.truncation, str(e))
        else:
            info["turn_error"] = (e.error_kind, str(e))
        log.info("rollout %s ended during a request: %s", ep.rollout_id, e)


def _settled(ep: Endpoint, key: bytes, task: asyncio.Future[Turn]) -> None:
    ep._inflight.pop(key, None)
    if not task.cancelled():
        task.exception()  # retrieved: every waiter may have left


def _ended(dialect: Dialect, e: Truncated | TurnError) -> web.Response:
    """The answer of a rollout a limit (400) or a failed model call (502) ended. A
    conversation past its token budget or the model's context is OpenAI's
    ``context_length_exceeded``: clients know not to send it again (litellm raises its
    ContextWindowExceededError, which agents stop on instead of retrying)."""
    if isinstance(e, Truncated):
        name = Status.Truncation.Name(e.truncation)
        code = (
            "context_length_exceeded"
            if e.truncation == Status.Truncation.TRUNCATION_MAX_TOTAL_TOKENS
            else "rollout_ended"
        )
        return dialect.error(400, f"the rollout ended ({name}): {e}", code)
    name = Status.ErrorKind.Name(e.error_kind)
    return dialect.error(502, f"the model call failed ({name}): {e}", "model_call_failed")
