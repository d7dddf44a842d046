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

Not here: isolation between rollouts (a stateful server's state is shared by all of
them: give each task its own server if it must not be), the HTTP transports, and MCP
resources, prompts and sampling. Needs the ``mcp`` package (the ``mcp`` extra of
treadle-env-runner); mcp 1.x and 2.x both work (only wire-format fields are read).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import copy
import itertools
import json
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
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


def _require_mcp() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise ConfigError(
            "MCP tools need the `mcp` package: pip install 'treadle-env-runner[mcp]'"
        ) from None


def _leaf(e: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, as anyio raises them."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _describe(e: BaseException) -> str:
    e = _leaf(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


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


# -- one running server -------------------------------------------------------------------------


class _Connection:
    """One server process and its MCP session, on a private thread and event loop."""

    def __init__(self, label: str, params: Any, errlog: TextIO | str | Path | None):
        self.label = label
        self.params = params
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
        from mcp.client.stdio import stdio_client

        t0 = time.monotonic()
        try:
            async with stdio_client(self.params, errlog=self.errlog) as (read, write), ClientSession(read, write) as session:  # fmt: skip
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
            self.lost = self.lost or _describe(e)
            if not self.ready.done():
                self.ready.set_exception(
                    MCPStartError(f"MCP server {self.label} did not start: {self.lost}")
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
        command: str,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        *,
        cwd: str | Path | None = None,
        name: str | None = None,
        include: Sequence[str] | None = None,
        prefix: str = "",
        timeout_s: float = 60.0,
        startup_timeout_s: float = 60.0,
        max_restarts: int = 3,
        errlog: TextIO | str | Path | None = None,
    ):
        if not command:
            raise ConfigError("MCPTools needs a command to start the server")
        if max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {max_restarts}")
        self.command = command
        self.args = [str(a) for a in args]
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.label = name or " ".join([Path(command).name, *self.args])[:80]
        self.include = set(include) if include is not None else None
        self.prefix = prefix
        self.timeout_s = timeout_s
        """Seconds one tool call may take (0 = no limit)."""
        self.startup_timeout_s = startup_timeout_s
        """Seconds the server may take to start and list its tools."""
        self.max_restarts = max_restarts
        """Restarts after a crash or failed start; then the tools only answer errors."""
        self.errlog = errlog
        """Where the server's stderr goes: a text file, a path to append to, or None for
        this process's stderr."""
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

    def __repr__(self) -> str:
        return f"MCPTools({self.label!r}, starts={self.num_starts}, closed={self._closed})"

    # -- lifecycle --------------------------------------------------------------------------------
    def _params(self) -> Any:
        from mcp import StdioServerParameters

        return StdioServerParameters(
            command=self.command, args=self.args, env=self.env, cwd=self.cwd
        )

    def _current(self) -> _Connection:
        """The live connection, or a new one that is starting (not waited for)."""
        global _atexit_registered
        _require_mcp()
        with self._lock:
            if self._closed:
                raise MCPStartError(f"MCP server {self.label} was closed")
            conn = self._conn
            if conn is not None and not conn.lost:
                return conn
            if self.num_starts > self.max_restarts:
                raise MCPStartError(
                    f"MCP server {self.label} stopped {self.num_starts} times (last: {conn.lost if conn else '?'}); "
                    f"not restarting it again (max_restarts={self.max_restarts})"
                )
            if conn is not None:
                log.warning("MCP server %s stopped (%s): restarting it", self.label, conn.lost)
            new = self._conn = _Connection(self.label, self._params(), self.errlog)
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

    def start(self) -> MCPTools:
        """Start the server (if it is not running) and wait until its tools are listed;
        MCPStartError if it cannot. Blocks: from async code use ``await astart()``."""
        self._wait(self._current())
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
            conn = self._current()
            return self._adopt(conn, self._wait(conn))
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
        """Call the server's tool ``name``; its text, or MCPToolError (see the module doc)."""
        try:
            conn = self._current()
            if not conn.ready.done():
                await asyncio.to_thread(self._wait, conn)
        except MCPStartError as e:
            raise MCPToolError(str(e)) from None
        try:
            result = await conn.call(name, arguments, self.timeout_s)
        except TimeoutError:
            raise MCPToolError(f"{name} did not answer within {self.timeout_s:g} s") from None
        except MCPToolError:
            raise
        except Exception as e:
            if _is_connection_lost(e):
                conn.lost = conn.lost or _describe(e)
                more = (
                    "it is restarted for the next call"
                    if self.num_starts <= self.max_restarts
                    else "it is not restarted"
                )
                raise MCPToolError(
                    f"the tool server stopped during the call ({conn.lost}); {more}"
                ) from None
            raise MCPToolError(_describe(e)) from None
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
