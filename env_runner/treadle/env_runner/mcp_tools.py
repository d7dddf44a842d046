"""Tools from MCP servers: every tool a Model Context Protocol server lists, offered to
the model like a Python tool (its name, description and input JSON schema become an
OpenAI function schema; a call is the server's ``tools/call``, answered with its text).

    # one server per env runner, shared by every rollout of the environment
    KV = MCPTools.stdio(sys.executable, ["kv_server.py"])
    ENVIRONMENT = Environment("kv", prompt=..., tools=KV.toolset([local_fn]), ...)

    # or scoped to a block (started on entry, stopped on exit)
    async with MCPTools.stdio("uvx", ["mcp-server-fetch"]) as server:
        tools = server.toolset()

    tools = mcp_toolset("uvx", ["mcp-server-fetch"])   # shorthand for the first form

    # a server someone else runs, over streamable HTTP
    DOCS = MCPTools.http("http://docs:8000/mcp", bearer_token_env="DOCS_TOKEN")

Lifetime. Starting a stdio server costs seconds, so one ``MCPTools`` is one server
process shared by every rollout that uses it — the harness calls ``env.toolset(task)``
per rollout and gets the same MCPToolSet back. The MCP client runs on a private thread
with its own event loop, so the connection serves rollouts on any event loop or thread.
It starts lazily: the first ``schemas()`` blocks its caller for the server's startup
(call ``start()`` beforehand to avoid that), later ones reuse the listed tools. A server
that crashes is restarted by the next call, at most ``max_restarts`` times. ``close()``,
leaving the ``with`` block, or the interpreter's exit stops it.

Errors are data. An ``isError`` result, a call that outlives ``timeout_s`` and a server
that died all come back from ``ToolSet.call`` as ``ToolResult(status="error")`` with a
text the model can read (the tool raises MCPToolError, which ToolSet turns into that);
arguments that do not fit the input schema are caught before the call
(``invalid_arguments``). A server that cannot start raises MCPStartError from
``start()``/``schemas()``; inside a rollout that is an environment error status.

Streamable HTTP. ``MCPTools.http(url)`` is the same shared, lazily connected ToolSet over
one MCP session with a server that runs elsewhere; ``headers`` and ``bearer_token_env``
(the name of an environment variable, read at each connect) authenticate it, and neither
is ever logged (the label is the URL without credentials or query). What is retried, at
most ``max_retries`` times, ``retry_backoff_s`` × 2^n apart:

    connect failed (server down)          retried: nothing was sent
    404 for the session (server restarted) retried in a new session: the request was refused
    connection broke during the call      not retried: the tool may have run ...
    no answer within timeout_s            ... unless idempotent=True
    401/403, malformed or oversized answer, isError   never (answers, not faults)

so a call fails after at most (1 + max_retries) × timeout_s plus the backoff, as an
error result; the next call opens a new session (no limit on reconnects: each call's
attempts are bounded). A server down at the first ``schemas()``/``start()`` is retried
the same way, then MCPStartError naming the URL. An answer event larger than
``max_response_bytes`` is an error result. (A connect failure, which the MCP client lets
end the whole transport, is turned into an error reply to that one request by the HTTP
transport here, which is how "not sent" is known for certain.)

Not here: isolation between rollouts (a stateful server's state is shared by all of
them: give each task its own server if it must not be), the legacy SSE transport, OAuth
flows (a token from the environment only), and MCP resources, prompts and sampling.
Needs the ``mcp`` package (the ``mcp`` extra of treadle-env-runner); stdio works with
mcp 1.x and 2.x (only wire-format fields are read), HTTP needs mcp 2.x (its
``streamable_http_client`` over httpx2).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import copy
import itertools
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

from treadle.env_runner.tools import RunSync, Tool, ToolResult, ToolSet, function_schema
from treadle.services.errors import ConfigError, TreadleError

log = logging.getLogger(__name__)

CONNECTION_CLOSED = -32000
"""JSON-RPC error code the MCP client raises when the server's pipe closed."""


class MCPStartError(TreadleError):
    """An MCP server could not be started or connected (or was closed for good)."""


class MCPToolError(TreadleError):
    """An MCP tool call failed: an ``isError`` result, a timeout, or a lost server."""


def _require_mcp(http: bool = False) -> None:
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise ConfigError(
            "MCP tools need the `mcp` package: pip install 'treadle-env-runner[mcp]'"
        ) from None
    if http:
        try:
            import httpx2  # noqa: F401
            from mcp.client.streamable_http import streamable_http_client  # noqa: F401
        except ImportError:
            raise ConfigError(
                "MCP over streamable HTTP needs mcp 2.x: pip install 'mcp>=2,<3'"
            ) from None


def _leaf(e: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, as anyio raises them."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _describe(e: BaseException) -> str:
    e = _leaf(e)
    message = getattr(getattr(e, "error", None), "message", None)  # an MCP (JSON-RPC) error
    if isinstance(message, str) and message:
        return message
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _error_code(e: BaseException) -> int | None:
    """The JSON-RPC error code of an MCP error (None for other exceptions)."""
    e = _leaf(e)
    code = getattr(e, "code", None)
    if not isinstance(code, int) and hasattr(e, "error"):
        code = getattr(e.error, "code", None)
    return code if isinstance(code, int) else None


def _failure(e: BaseException) -> str:
    """How a call failed: "not_sent" (the request never reached a server that knew it, so
    the tool did not run and a retry is safe), "lost" (the connection broke after the
    request went out: the tool may have run), "bad_response" (an answer came that could
    not be read: too large or not an SSE stream), or "" (the server answered an error)."""
    code = _error_code(e)
    if code == CONNECTION_CLOSED and _describe(e).startswith("SSE stream failed"):
        return "bad_response"  # the client's SSEError: a protocol fault, not a lost server
    if code in (NOT_SENT, SESSION_EXPIRED):
        return "not_sent"
    if code == MAYBE_SENT or _is_connection_lost(e):
        return "lost"
    return ""


class _Retry(Exception):
    """One attempt of a call failed in a way that may be retried (never escapes call)."""


def _is_connection_lost(e: BaseException) -> bool:
    import anyio

    e = _leaf(e)
    if getattr(e, "code", None) == CONNECTION_CLOSED or (
        hasattr(e, "error") and getattr(e.error, "code", None) == CONNECTION_CLOSED
    ):
        return True
    return isinstance(e, (anyio.ClosedResourceError, anyio.BrokenResourceError,
                          anyio.EndOfStream, BrokenPipeError, ConnectionError))  # fmt: skip


# -- schemas and results (wire format: the same under mcp 1.x and 2.x) ------------------------

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _strip_titles(schema: Any) -> Any:
    """``schema`` without ``title`` keys (pydantic adds one per field: tokens in every
    prompt, no information). Property *names* called "title" are kept."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if k != "title"}
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strip_titles(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_strip_titles(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _strip_titles(out[key])
    return out


def function_parameters(input_schema: Any) -> dict[str, Any]:
    """An MCP tool's ``inputSchema`` as OpenAI function ``parameters`` (an object schema
    with ``properties``, titles stripped)."""
    schema = _strip_titles(copy.deepcopy(input_schema)) if isinstance(input_schema, dict) else {}
    schema.setdefault("type", "object")
    schema.setdefault("properties", {})
    return schema


def result_text(result: dict[str, Any]) -> str:
    """The text of a ``CallToolResult`` (wire-format dict): text blocks joined by newlines;
    other blocks are named in brackets; structured content when there is no block."""
    parts: list[str] = []
    for block in result.get("content") or []:
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind == "resource":
            res = block.get("resource") or {}
            parts.append(str(res["text"]) if "text" in res else f"[resource {res.get('uri', '')}]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.get('uri', '')}]")
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {block.get('mimeType', '')}]")
        else:
            parts.append(json.dumps(block, ensure_ascii=False))
    if not parts and result.get("structuredContent") is not None:
        parts.append(json.dumps(result["structuredContent"], ensure_ascii=False))
    return "\n".join(parts)


async def _list_tools(session: Any) -> list[dict[str, Any]]:
    """Every tool the server lists (all pages), as wire-format dicts."""
    tools: list[dict[str, Any]] = []
    cursor = None
    while True:
        if cursor is None:
            page = await session.list_tools()
        else:
            from mcp import types

            try:
                page = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
            except TypeError:  # mcp < 1.13 took the cursor itself
                page = await session.list_tools(cursor=cursor)
        d = page.model_dump(by_alias=True, mode="json", exclude_none=True)
        tools += d.get("tools") or []
        cursor = d.get("nextCursor")
        if not cursor:
            return tools


# -- transports: stdio and streamable HTTP -------------------------------------------------------

NOT_SENT = -32098
"""JSON-RPC error code for an HTTP request that never reached the server (the connection
could not be opened): the tool did not run, so the call is safe to retry."""

MAYBE_SENT = -32097
"""JSON-RPC error code for an HTTP request whose connection broke before any answer: the
tool may have run."""

SESSION_EXPIRED = -32096
"""JSON-RPC error code for an HTTP 404 to a request that carried a session id: the server
restarted or ended the session and did not handle the request (the MCP spec: start a new
session), so a new session may retry it."""

INVALID_REQUEST = -32600

Opener = Callable[[TextIO], AbstractAsyncContextManager[Any]]
"""Opens one transport (its stderr sink as argument); yields (read, write, ...) streams."""


def _stdio_opener(params: Any) -> Opener:
    def open_stdio(errlog: TextIO) -> AbstractAsyncContextManager[Any]:
        from mcp.client.stdio import stdio_client

        return stdio_client(params, errlog=errlog)

    return open_stdio


def _http_transport() -> Any:
    """An httpx2 transport that turns a failed connection into a JSON-RPC error answer.

    The MCP client lets an exception from a POST end the whole transport (and its other
    calls); here it becomes an error reply to that one request instead: ``NOT_SENT`` when
    the connection could not be opened, ``MAYBE_SENT`` when it broke before the response
    began, ``SESSION_EXPIRED`` for a 404 to a request in a session. An HTTP 401/403 without a JSON-RPC body is named as such (the client would say
    only "Server returned an error response")."""
    import httpx2

    def reply(request: Any, status: int, code: int, message: str) -> Any:
        error = {"code": code, "message": message}
        return httpx2.Response(status, json={"jsonrpc": "2.0", "id": None, "error": error},
                               request=request)  # fmt: skip

    class Transport(httpx2.AsyncHTTPTransport):
        async def handle_async_request(self, request: Any) -> Any:
            try:
                response = await super().handle_async_request(request)
            except (httpx2.ConnectError, httpx2.ConnectTimeout) as e:
                if request.method != "POST":
                    raise
                return reply(request, 503, NOT_SENT, f"cannot connect ({_describe(e)})")
            except httpx2.TransportError as e:
                if request.method != "POST":
                    raise
                return reply(request, 502, MAYBE_SENT, f"connection lost ({_describe(e)})")
            if (
                request.method == "POST"
                and response.status_code == 404
                and "mcp-session-id" in request.headers
            ):
                await response.aclose()
                return reply(
                    request, 404, SESSION_EXPIRED, "the server no longer knows the session"
                )
            content_type = response.headers.get("content-type", "").lower()
            if response.status_code in (401, 403) and not content_type.startswith(
                "application/json"
            ):
                await response.aclose()
                return reply(request, response.status_code, INVALID_REQUEST,
                             f"HTTP {response.status_code} {response.reason_phrase} "
                             "(are the headers / token right?)")  # fmt: skip
            return response

    return Transport()


def _http_opener(url: str, headers: dict[str, str], bearer_token_env: str | None,
                 connect_timeout_s: float, max_response_bytes: int) -> Opener:  # fmt: skip
    @asynccontextmanager
    async def open_http(errlog: TextIO) -> AsyncIterator[Any]:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        sent = dict(headers)
        if bearer_token_env:
            token = os.environ.get(bearer_token_env)
            if not token:
                raise MCPStartError(
                    f"the environment variable {bearer_token_env} (the bearer token) is not set"
                )
            sent["Authorization"] = f"Bearer {token}"
        timeout = httpx2.Timeout(30.0, connect=connect_timeout_s or None, read=300.0)
        async with httpx2.AsyncClient(headers=sent, timeout=timeout, transport=_http_transport()) as client, \
                streamable_http_client(url, http_client=client,
                                       max_sse_event_size=max_response_bytes) as streams:  # fmt: skip
            yield streams

    return open_http


def _safe_url(url: str) -> str:
    """``url`` without credentials or query (for logs and messages)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# -- one running server -------------------------------------------------------------------------


class _Connection:
    """One server process and its MCP session, on a private thread and event loop."""

    def __init__(self, label: str, opener: Opener, errlog: TextIO | str | Path | None,
                 start_failed: str = "did not start"):  # fmt: skip
        self.label = label
        self.opener = opener
        self.start_failed = start_failed
        self._own_log = isinstance(errlog, (str, Path))
        self.errlog: TextIO = (
            open(errlog, "a")  # noqa: SIM115 (closed in close())
            if isinstance(errlog, (str, Path))
            else (errlog or sys.stderr)
        )
        self.ready: concurrent.futures.Future[list[dict[str, Any]]] = concurrent.futures.Future()
        """The server's tools once initialized; MCPStartError if it failed to start."""
        self.lost = ""
        """Why this connection is unusable ("" while it is starting or serving)."""
        self.error: BaseException | None = None
        """What ended the connection (None while it serves or after a clean close)."""
        self.loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()  # binds to self.loop on first use (there)
        self._session: Any = None
        self._serving: concurrent.futures.Future[None] | None = None
        self._thread = threading.Thread(
            target=self._run_loop, name=f"mcp:{label}"[:40], daemon=True
        )

    def begin(self) -> None:
        self._thread.start()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(), self.loop)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def _serve(self) -> None:
        from mcp import ClientSession

        t0 = time.monotonic()
        try:
            async with self.opener(self.errlog) as streams, ClientSession(streams[0], streams[1]) as session:  # fmt: skip
                await session.initialize()
                tools = await _list_tools(session)
                self._session = session
                log.info(
                    "[startup] MCP server %s: %d tools in %.1f s",
                    self.label,
                    len(tools),
                    time.monotonic() - t0,
                )
                self.ready.set_result(tools)
                await self._stop.wait()
        except BaseException as e:
            self.error = _leaf(e)
            self.lost = self.lost or _describe(e)
            if not self.ready.done():
                self.ready.set_exception(
                    MCPStartError(f"MCP server {self.label} {self.start_failed}: {self.lost}")
                )
            if not isinstance(e, Exception):
                raise
        finally:
            self.lost = self.lost or "closed"
            self._session = None

    async def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """``tools/call`` from any event loop; the result as a wire-format dict."""

        async def on_loop() -> dict[str, Any]:
            if self._session is None:
                raise MCPToolError(
                    f"MCP server {self.label} is not connected ({self.lost or 'starting'})"
                )
            result = await self._session.call_tool(name, arguments)
            return dict(result.model_dump(by_alias=True, mode="json", exclude_none=True))

        try:
            fut = asyncio.run_coroutine_threadsafe(on_loop(), self.loop)
        except RuntimeError:  # the loop is closed: the connection ended
            raise MCPToolError(
                f"MCP server {self.label} is not connected ({self.lost or 'closed'})"
            ) from None
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s or None)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the server and the thread (blocking, at most about 2 × ``timeout_s``)."""
        self.lost = self.lost or "closed"
        try:
            if self._thread.is_alive():
                self._stop_thread(timeout_s)
        finally:
            if self._own_log:
                self.errlog.close()

    def _stop_thread(self, timeout_s: float) -> None:
        try:
            self.loop.call_soon_threadsafe(self._stop.set)
        except RuntimeError:
            return  # the loop already closed
        if self._serving is not None:
            try:
                self._serving.result(timeout_s)
            except concurrent.futures.TimeoutError:  # stuck before serving (e.g. initialize)
                self._serving.cancel()
                try:
                    self._serving.result(timeout_s)
                except BaseException:
                    log.warning(
                        "MCP server %s did not stop within %.0f s", self.label, 2 * timeout_s
                    )
            except BaseException:
                pass  # it failed earlier: already recorded in self.lost
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:
            pass
        self._thread.join(timeout_s)

    def close_soon(self) -> None:
        """``close`` on a helper thread (for callers that must not block)."""
        threading.Thread(
            target=self.close, name=f"mcp-close:{self.label}"[:40], daemon=True
        ).start()


# -- the public side ------------------------------------------------------------------------------

_OPEN: weakref.WeakSet[MCPTools] = weakref.WeakSet()
_ATEXIT = threading.Lock()
_atexit_registered = False


def _close_all() -> None:
    for server in list(_OPEN):
        server.close()


class MCPTools:
    """One MCP server (started lazily, shared, restarted after a crash) and its tools.

    See the module doc. ``include`` keeps only the named tools; ``prefix`` is put before
    every tool name the model sees (to tell two servers' tools apart).
    """

    def __init__(
        self,
        command: str = "",
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        *,
        url: str | None = None,
        headers: dict[str, str] | None = None,
        bearer_token_env: str | None = None,
        cwd: str | Path | None = None,
        name: str | None = None,
        include: Sequence[str] | None = None,
        prefix: str = "",
        timeout_s: float = 60.0,
        startup_timeout_s: float = 60.0,
        max_restarts: int | None = 3,
        max_retries: int = 0,
        retry_backoff_s: float = 0.5,
        idempotent: bool = False,
        max_response_bytes: int = 4 << 20,
        errlog: TextIO | str | Path | None = None,
    ):
        if bool(command) == bool(url):
            raise ConfigError("MCPTools needs either a command (stdio) or a url (HTTP)")
        if url is not None and not url.startswith(("http://", "https://")):
            raise ConfigError(f"an MCP server url must start with http:// or https://, got {_safe_url(url)!r}")  # fmt: skip
        if max_restarts is not None and max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {max_restarts}")
        if max_retries < 0 or retry_backoff_s < 0:
            raise ConfigError("max_retries and retry_backoff_s must be >= 0")
        if max_response_bytes <= 0:
            raise ConfigError(f"max_response_bytes must be > 0, got {max_response_bytes}")
        self.command = command
        self.args = [str(a) for a in args]
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.url = url
        """The streamable HTTP endpoint (None for a stdio server)."""
        self.headers = dict(headers or {})
        """Sent with every HTTP request (never logged)."""
        self.bearer_token_env = bearer_token_env
        """Name of the environment variable whose value is sent as ``Authorization: Bearer``
        (read at each connect; never logged)."""
        self.label = name or (
            _safe_url(url) if url else " ".join([Path(command).name, *self.args])[:80]
        )
        self.include = set(include) if include is not None else None
        self.prefix = prefix
        self.timeout_s = timeout_s
        """Seconds one tool call (one attempt) may take (0 = no limit)."""
        self.startup_timeout_s = startup_timeout_s
        """Seconds the server may take to start (or connect) and list its tools."""
        self.max_restarts = max_restarts
        """Restarts after a crash or failed start (None: no limit); then the tools only
        answer errors."""
        self.max_retries = max_retries
        """Retries of a call or a start that failed in a way that is safe to retry (see the
        module doc); ``retry_backoff_s`` × 2^n seconds apart."""
        self.retry_backoff_s = retry_backoff_s
        self.idempotent = idempotent
        """The server's tools may run twice: also retry calls that timed out or lost the
        connection after they were sent."""
        self.max_response_bytes = max_response_bytes
        """Largest response event an HTTP server may send (larger: an error result)."""
        self.errlog = errlog
        """Where the server's stderr goes: a text file, a path to append to, or None for
        this process's stderr (stdio servers)."""
        self.num_starts = 0
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._closed = False
        self._tools: list[MCPTool] | None = None
        self._tools_from: _Connection | None = None

    @classmethod
    def stdio(cls, command: str, args: Sequence[str] = (), env: dict[str, str] | None = None,
              **kwargs: Any) -> MCPTools:  # fmt: skip
        """A server run as ``command args`` that speaks MCP on its stdin/stdout; ``env`` is
        added to the default environment the MCP client passes on."""
        return cls(command, args, env, **kwargs)

    @classmethod
    def http(
        cls,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        bearer_token_env: str | None = None,
        name: str | None = None,
        include: Sequence[str] | None = None,
        prefix: str = "",
        timeout_s: float = 60.0,
        connect_timeout_s: float = 30.0,
        max_retries: int = 2,
        retry_backoff_s: float = 0.5,
        idempotent: bool = False,
        max_response_bytes: int = 4 << 20,
    ) -> MCPTools:
        """A running server at ``url`` that speaks MCP over streamable HTTP (someone else
        runs it). A lost session is re-established by the next call (no limit: each call's
        attempts are bounded by ``max_retries``)."""
        return cls(url=url, headers=headers, bearer_token_env=bearer_token_env, name=name,
                   include=include, prefix=prefix, timeout_s=timeout_s,
                   startup_timeout_s=connect_timeout_s, max_restarts=None,
                   max_retries=max_retries, retry_backoff_s=retry_backoff_s,
                   idempotent=idempotent, max_response_bytes=max_response_bytes)  # fmt: skip

    def __repr__(self) -> str:
        return f"MCPTools({self.label!r}, starts={self.num_starts}, closed={self._closed})"

    # -- lifecycle --------------------------------------------------------------------------------
    def _opener(self) -> Opener:
        if self.url is not None:
            return _http_opener(self.url, self.headers, self.bearer_token_env,
                                self.startup_timeout_s, self.max_response_bytes)  # fmt: skip
        from mcp import StdioServerParameters

        return _stdio_opener(
            StdioServerParameters(command=self.command, args=self.args, env=self.env, cwd=self.cwd)
        )

    def _current(self) -> _Connection:
        """The live connection, or a new one that is starting (not waited for)."""
        global _atexit_registered
        _require_mcp(http=self.url is not None)
        with self._lock:
            if self._closed:
                raise MCPStartError(f"MCP server {self.label} was closed")
            conn = self._conn
            if conn is not None and not conn.lost:
                return conn
            if self.max_restarts is not None and self.num_starts > self.max_restarts:
                raise MCPStartError(
                    f"MCP server {self.label} stopped {self.num_starts} times (last: {conn.lost if conn else '?'}); "
                    f"not restarting it again (max_restarts={self.max_restarts})"
                )
            if conn is not None and conn.ready.done() and conn.ready.exception() is None:
                log.warning(
                    "MCP server %s stopped (%s): %s", self.label, conn.lost,
                    "reconnecting" if self.url else "restarting it",
                )  # fmt: skip
            new = self._conn = _Connection(
                self.label, self._opener(), self.errlog,
                "did not open a session" if self.url else "did not start",
            )  # fmt: skip
            self.num_starts += 1
            new.begin()
            _OPEN.add(self)
        with _ATEXIT:
            if not _atexit_registered:
                atexit.register(_close_all)
                _atexit_registered = True
        if conn is not None:
            conn.close_soon()
        return new

    def _wait(self, conn: _Connection) -> list[dict[str, Any]]:
        try:
            return conn.ready.result(self.startup_timeout_s or None)
        except concurrent.futures.TimeoutError:
            conn.lost = conn.lost or f"not ready within {self.startup_timeout_s:g} s"
            conn.close_soon()
            raise MCPStartError(
                f"MCP server {self.label} did not start within {self.startup_timeout_s:g} s"
            ) from None
        except MCPStartError:
            conn.close_soon()  # end its thread now, not at the next restart or exit
            raise

    def _start_transient(self, conn: _Connection) -> bool:
        """Whether a failed connect may be tried again: an HTTP server that could not be
        reached (it may be restarting)."""
        return (
            self.url is not None
            and not self._closed
            and conn.error is not None
            and _failure(conn.error) != ""
        )

    def _backoff_s(self, attempt: int) -> float:
        return min(self.retry_backoff_s * 2**attempt, 30.0)

    def _started(self) -> tuple[_Connection, list[dict[str, Any]]]:
        """The live connection and its tools, connecting (with retries) if needed."""
        attempt = 0
        while True:
            conn = self._current()
            try:
                return conn, self._wait(conn)
            except MCPStartError:
                if attempt >= self.max_retries or not self._start_transient(conn):
                    raise
            log.warning("MCP server %s could not be reached (%s): retrying", self.label, conn.lost)
            time.sleep(self._backoff_s(attempt))
            attempt += 1

    def start(self) -> MCPTools:
        """Start the server (if it is not running) and wait until its tools are listed;
        MCPStartError if it cannot. Blocks: from async code use ``await astart()``."""
        self._started()
        return self

    async def astart(self) -> MCPTools:
        """``start`` without blocking the running event loop."""
        await asyncio.to_thread(self.start)
        return self

    def close(self) -> None:
        """Stop the server for good (idempotent); later calls answer errors."""
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        _OPEN.discard(self)
        if conn is not None:
            conn.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> MCPTools:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> MCPTools:
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- tools ------------------------------------------------------------------------------------
    def tools(self) -> list[MCPTool]:
        """The server's tools (after ``include``/``prefix``). The first call starts the
        server and waits for it; later calls return the last listed tools without
        waiting, even while a crashed server is down (the next tool call restarts it)."""
        with self._lock:
            cached, conn = self._tools, self._conn
        if cached is None:
            return self._adopt(*self._started())
        if (
            conn is not None
            and conn is not self._tools_from
            and conn.ready.done()
            and conn.ready.exception() is None
        ):
            return self._adopt(conn, conn.ready.result())  # list the restarted server again
        return cached

    def _adopt(self, conn: _Connection, listed: list[dict[str, Any]]) -> list[MCPTool]:
        if self.include is not None and (missing := self.include - {t["name"] for t in listed}):
            raise ConfigError(
                f"MCP server {self.label} has no tool(s) {', '.join(sorted(missing))}"
            )
        tools = [
            MCPTool(
                self,
                t["name"],
                t.get("description") or "",
                t.get("inputSchema"),
                self.prefix + t["name"],
            )
            for t in listed
            if self.include is None or t["name"] in self.include
        ]
        with self._lock:
            self._tools, self._tools_from = tools, conn
        return tools

    def toolset(self, extra: Sequence[Tool | Callable[..., Any]] = ()) -> MCPToolSet:
        """A ToolSet of this server's tools (plus ``extra`` Python tools) that connects on
        first use; hand it to ``Environment(tools=...)``."""
        return MCPToolSet([self], extra)

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call the server's tool ``name``; its text, or MCPToolError (see the module doc).
        A failure that is safe to retry is retried ``max_retries`` times with backoff."""
        attempt = 0
        while True:
            try:
                return await self._call_once(name, arguments)
            except _Retry as e:
                if attempt >= self.max_retries or self._closed:
                    tries = f" ({attempt + 1} attempts)" if attempt else ""
                    raise MCPToolError(f"{e}{tries}") from None
                log.info("MCP call %s on %s failed (%s): retrying", name, self.label, e)
            await asyncio.sleep(self._backoff_s(attempt))
            attempt += 1

    async def _call_once(self, name: str, arguments: dict[str, Any]) -> str:
        try:
            conn = self._current()
        except MCPStartError as e:
            raise MCPToolError(str(e)) from None
        if not conn.ready.done():
            try:
                await asyncio.to_thread(self._wait, conn)
            except MCPStartError as e:
                if self._start_transient(conn):
                    raise _Retry(str(e)) from None
                raise MCPToolError(str(e)) from None
        try:
            result = await conn.call(name, arguments, self.timeout_s)
        except TimeoutError:
            message = f"{name} did not answer within {self.timeout_s:g} s"
            if self.idempotent:
                raise _Retry(message) from None
            raise MCPToolError(message) from None
        except MCPToolError:
            raise
        except Exception as e:
            failure = _failure(e)
            if not failure:
                raise MCPToolError(_describe(e)) from None
            if failure == "bad_response":
                raise MCPToolError(
                    f"the tool server's answer was unusable ({_describe(e)})"
                ) from None
            conn.lost = conn.lost or _describe(e)
            if failure == "not_sent":
                raise _Retry(f"the tool server could not be reached ({_describe(e)})") from None
            if self.url is not None:
                more = "the session is re-established by the next call"
            elif self.max_restarts is None or self.num_starts <= self.max_restarts:
                more = "it is restarted for the next call"
            else:
                more = "it is not restarted"
            message = f"the tool server stopped during the call ({conn.lost}); {more}"
            if self.idempotent:
                raise _Retry(message) from None
            raise MCPToolError(message) from None
        text = result_text(result)
        if result.get("isError"):
            raise MCPToolError(text or f"{name} failed")
        return text


class MCPTool:
    """One tool of an MCP server, in the shape ToolSet takes (like tools.Tool)."""

    is_async = True
    accepts_state = False

    def __init__(self, server: MCPTools, remote_name: str, description: str,
                 input_schema: Any, name: str | None = None):  # fmt: skip
        self.server = server
        self.remote_name = remote_name
        self.name = name or remote_name
        self.description = description or remote_name
        self.parameters = function_parameters(input_schema)
        self._validator = self._make_validator(self.parameters)

    def _make_validator(self, schema: dict[str, Any]) -> Any:
        import jsonschema  # type: ignore[import-untyped]

        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as e:
            log.warning(
                "MCP tool %s has an invalid input schema (%s): arguments go unchecked",
                self.name,
                e.message,
            )
            return None
        return cls(schema)

    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, self.description, self.parameters)

    def check(self, args: dict[str, Any]) -> str | None:
        """Why ``args`` do not fit the input schema (None when they do)."""
        if self._validator is None:
            return None
        import jsonschema

        error = jsonschema.exceptions.best_match(self._validator.iter_errors(args))
        if error is None:
            return None
        where = ".".join(str(p) for p in error.absolute_path)
        return f"{where}: {error.message}" if where else error.message

    async def fn(self, **arguments: Any) -> str:
        return await self.server.call(self.remote_name, arguments)


class MCPToolSet(ToolSet):
    """A ToolSet of MCP servers' tools plus Python tools; the servers connect on first
    use (``schemas()`` or ``call``). It counts as non-empty before connecting, so an
    Environment given one picks the ToolUse harness without starting anything."""

    def __init__(
        self, servers: Sequence[MCPTools], extra: Sequence[Tool | Callable[..., Any]] = ()
    ):
        super().__init__(extra)
        self.servers = list(servers)
        self._local = dict(self.tools)
        self._loaded: tuple[int, ...] | None = None

    def _load(self) -> None:
        lists = [s.tools() for s in self.servers]
        key = tuple(id(x) for x in itertools.chain(*lists))
        if key == self._loaded:
            return
        tools: dict[str, Any] = dict(self._local)
        for t in itertools.chain(*lists):
            if t.name in tools:
                raise ValueError(f"two tools are named {t.name!r} (give a server a prefix)")
            tools[t.name] = t
        self.tools, self._loaded = tools, key

    def __bool__(self) -> bool:
        return bool(self.servers or self._local)

    def __len__(self) -> int:
        self._load()
        return len(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        self._load()
        return super().schemas()

    async def call(self, name: str, arguments: str | dict[str, Any], state: Any = None,
                   run_sync: RunSync | None = None) -> ToolResult:  # fmt: skip
        if self._loaded is None:
            try:
                await asyncio.to_thread(self._load)
            except (MCPStartError, ValueError) as e:
                return ToolResult(f"error: {e}", "error")
        return await super().call(name, arguments, state, run_sync)


def mcp_toolset(command: str, args: Sequence[str] = (), env: dict[str, str] | None = None,
                extra: Sequence[Tool | Callable[..., Any]] = (), **kwargs: Any) -> MCPToolSet:  # fmt: skip
    """``MCPTools.stdio(command, args, env, **kwargs).toolset(extra)``: a shared, lazily
    started server's tools for ``Environment(tools=...)``."""
    return MCPTools.stdio(command, args, env, **kwargs).toolset(extra)
