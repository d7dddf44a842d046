"""MCP tools over streamable HTTP against a real server (MCPServer under uvicorn, run as a
subprocess on a free local port): list and call, auth headers, a server that is down, one
killed mid-run and started again, a slow tool, a crash during a call, bad responses, and a
ToolUse rollout."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import treadle_native
from testkit.fake_model import ScriptedGenerator, decode_qwen3
from testkit.paths import shared_tokenizer
from treadle.env_runner.environments import Environment
from treadle.env_runner.harnesses import ToolUse
from treadle.env_runner.mcp_tools import MCPStartError, MCPTools
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import Rubric
from treadle.proto.v1 import rollout_pb2

pytest.importorskip("mcp.client.streamable_http")
pytestmark = pytest.mark.integration

Kind = rollout_pb2.RolloutStatus.Kind

SERVER = '''
import asyncio, os, sys
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("kv")
TABLE = {"nile": "6650 km", "amazon": "6400 km"}


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def lookup(key: str) -> str:
    """Look a key up in the table."""
    if key not in TABLE:
        raise ToolError(f"no entry for {key!r}")
    return TABLE[key]


@app.tool()
async def sleep(seconds: float) -> str:
    """Wait, then answer."""
    await asyncio.sleep(seconds)
    return "awake"


@app.tool()
def crash() -> str:
    """Note the call, then exit the server at once."""
    with open(os.environ["MCP_TEST_CALLS"], "a") as f:
        f.write("crash\\n")
    os._exit(3)


@app.tool()
def big(n: int) -> str:
    """A text of n bytes."""
    return "x" * n


inner = app.streamable_http_app()
TOKEN = os.environ.get("MCP_TEST_TOKEN")


async def guarded(scope, receive, send):
    if scope["type"] == "http" and TOKEN:
        if dict(scope["headers"]).get(b"authorization", b"").decode() != f"Bearer {TOKEN}":
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"unauthorized"})
            return
    await inner(scope, receive, send)


class Listening(uvicorn.Server):
    """Notes its pid once its socket listens (the test waits for that line)."""

    async def startup(self, sockets=None):
        await super().startup(sockets)
        with open(os.environ["MCP_TEST_LISTENING"], "a") as f:
            f.write(f"{os.getpid()}\\n")


config = uvicorn.Config(guarded, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
Listening(config).run()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """The test server as a subprocess; ``start`` again after ``kill`` uses the same port.
    ``respawn``: a shell loop starts it again whenever it exits (as a supervisor would)."""

    def __init__(self, tmp: Path, token: str | None = None, respawn: bool = False):
        self.respawn = respawn
        self.script = tmp / "kv_http_server.py"
        self.script.write_text(SERVER)
        self.calls = tmp / "calls"
        self.listening = tmp / "listening"
        self.log = tmp / "server.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.env = {**os.environ, "MCP_TEST_CALLS": str(self.calls),
                    "MCP_TEST_LISTENING": str(self.listening)}  # fmt: skip
        if token:
            self.env["MCP_TEST_TOKEN"] = token
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        cmd = [sys.executable, str(self.script), str(self.port)]
        if self.respawn:
            cmd = ["sh", "-c", 'while :; do "$@"; done', "respawn", *cmd]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=log,
                                         start_new_session=True)  # fmt: skip
        self.wait_listening(self.num_listened() + 1)
        return self

    def wait_listening(self, times: int) -> None:
        """Wait until a server has started listening for the ``times``-th time. Each one
        notes it once its socket listens, so this never mistakes a crashed server that is
        still closing its sockets, or some other process, for the one wanted (a connect
        probe could)."""
        assert self.proc is not None
        deadline = time.monotonic() + 30
        while self.num_listened() < times:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            assert time.monotonic() < deadline, f"the MCP test server did not listen within 30 s: {self.log}"  # fmt: skip
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server, and a respawn loop with it
            self.proc.wait(10)

    def num_listened(self) -> int:
        return len(self.listening.read_text().split()) if self.listening.exists() else 0

    def num_crash_calls(self) -> int:
        return len(self.calls.read_text().split()) if self.calls.exists() else 0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path).start()
    yield s
    s.kill()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_mcp_http_lists_and_calls_tools(server: Server) -> None:
    kv = MCPTools.http(server.url, timeout_s=10)
    try:
        tools = kv.toolset()
        schemas = {s["function"]["name"]: s["function"] for s in tools.schemas()}
        assert set(schemas) == {"add", "lookup", "sleep", "crash", "big"}
        assert schemas["add"]["parameters"] == {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        }

        async def calls() -> list[Any]:
            one = await tools.call("lookup", '{"key": "nile"}')
            many = await asyncio.gather(*(tools.call("add", {"a": i, "b": 100}) for i in range(8)))
            failed = await tools.call("lookup", {"key": "zzz"})
            wrong = await tools.call("add", {"a": "x", "b": 1})
            return [one, many, failed, wrong]

        one, many, failed, wrong = run(calls())
        assert (one.status, one.content) == ("ok", "6650 km")
        assert [r.content for r in many] == [str(i + 100) for i in range(8)]
        assert failed.status == "error"
        assert "no entry for 'zzz'" in failed.content
        assert wrong.status == "invalid_arguments"
        assert kv.num_starts == 1  # one session for every call
    finally:
        kv.close()


def test_mcp_http_server_down_at_start_is_a_start_error_naming_the_url(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there
    kv = MCPTools.http(url, max_retries=2, retry_backoff_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(
        MCPStartError, match=f"MCP server {url} did not open a session: cannot connect"
    ):
        kv.start()
    assert time.monotonic() - t0 < 10
    assert kv.num_starts == 3  # the first try and two retries
    result = run(kv.toolset().call("add", {"a": 1, "b": 2}))
    assert result.status == "error"
    assert url in result.content
    kv.close()


def test_mcp_http_server_killed_then_restarted_on_the_same_port(server: Server) -> None:
    kv = MCPTools.http(server.url, timeout_s=10, max_retries=2, retry_backoff_s=0.1)
    tools = kv.toolset()
    try:
        assert run(tools.call("add", {"a": 1, "b": 2})).content == "3"
        server.kill()
        down = run(tools.call("add", {"a": 1, "b": 2}))
        assert down.status == "error"
        assert "did not open a session: cannot connect" in down.content
        assert "(3 attempts)" in down.content
        server.start()
        back = run(tools.call("add", {"a": 2, "b": 2}))
        assert (back.status, back.content) == ("ok", "4")
        # killed and restarted between two calls: the old session id gets a 404, the call
        # is retried in a new session without the caller seeing an error
        server.kill()
        server.start()
        again = run(tools.call("add", {"a": 3, "b": 2}))
        assert (again.status, again.content) == ("ok", "5")
    finally:
        kv.close()


def test_mcp_http_crash_during_a_call_is_an_error_and_not_retried(tmp_path: Path) -> None:
    server = Server(tmp_path, respawn=True).start()  # back within about a second
    kv = MCPTools.http(server.url, timeout_s=10, max_retries=3, retry_backoff_s=0.5)
    tools = kv.toolset()
    try:
        crashed = run(tools.call("crash", {}))
        assert crashed.status == "error"
        assert "stopped during the call" in crashed.content
        server.wait_listening(2)  # the respawn loop's second server
        # the crash may have run the tool: it is not sent again to the respawned server
        assert run(tools.call("add", {"a": 1, "b": 1})).content == "2"
        assert server.num_crash_calls() == 1
        assert kv.num_starts == 2
    finally:
        kv.close()
        server.kill()


def test_mcp_http_slow_tool_is_a_timeout_error_within_the_bound(server: Server) -> None:
    kv = MCPTools.http(server.url, timeout_s=1, max_retries=2, retry_backoff_s=0.1)
    twice = MCPTools.http(server.url, timeout_s=1, max_retries=1, retry_backoff_s=0.1,
                          idempotent=True)  # fmt: skip
    try:
        kv.start()
        t0 = time.monotonic()
        slow = run(kv.toolset().call("sleep", {"seconds": 30}))
        took = time.monotonic() - t0
        assert (slow.status, slow.content) == ("error", "error: MCPToolError: sleep did not answer within 1 s")  # fmt: skip
        assert 1 <= took < 3  # a call that may have run is not retried
        assert run(kv.toolset().call("add", {"a": 1, "b": 1})).content == "2"  # still serving

        twice.start()
        t0 = time.monotonic()
        slow = run(twice.toolset().call("sleep", {"seconds": 30}))
        took = time.monotonic() - t0
        assert slow.status == "error"
        assert "(2 attempts)" in slow.content
        assert 2 <= took < 5  # idempotent: one retry, each attempt bounded
    finally:
        kv.close()
        twice.close()


def test_mcp_http_oversized_response_is_an_error(server: Server) -> None:
    kv = MCPTools.http(server.url, timeout_s=10, max_response_bytes=50_000)
    tools = kv.toolset()
    try:
        assert run(tools.call("big", {"n": 1000})).content == "x" * 1000
        huge = run(tools.call("big", {"n": 200_000}))
        assert huge.status == "error"
        assert "answer was unusable" in huge.content
        assert "exceeded the 50000 byte limit" in huge.content
        assert run(tools.call("big", {"n": 10})).content == "x" * 10  # serving again
    finally:
        kv.close()


def test_mcp_http_bearer_token_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    secret = "s3cret-token-4711"
    server = Server(tmp_path, token=secret).start()
    caplog.set_level(logging.DEBUG)
    try:
        monkeypatch.setenv("KV_TOKEN", secret)
        ok = MCPTools.http(server.url, bearer_token_env="KV_TOKEN")
        assert run(ok.toolset().call("add", {"a": 1, "b": 2})).content == "3"
        ok.close()

        monkeypatch.setenv("KV_TOKEN", "wrong")
        refused = MCPTools.http(server.url, bearer_token_env="KV_TOKEN", retry_backoff_s=0.1)
        with pytest.raises(MCPStartError, match="HTTP 401 Unauthorized"):
            refused.start()
        assert refused.num_starts == 1  # a refusal is not retried
        refused.close()

        monkeypatch.delenv("KV_TOKEN")
        unset = MCPTools.http(server.url, bearer_token_env="KV_TOKEN")
        with pytest.raises(MCPStartError, match=r"KV_TOKEN .* is not set"):
            unset.start()
        unset.close()
    finally:
        server.kill()
    assert secret not in caplog.text


class Garbage(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = b'{"jsonrpc": "2.0", "id": 1, "result": {"not json'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_mcp_http_malformed_response_is_a_start_error() -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}/mcp"
    kv = MCPTools.http(url, connect_timeout_s=10, retry_backoff_s=0.1)
    try:
        t0 = time.monotonic()
        with pytest.raises(MCPStartError, match="did not open a session: Failed to parse JSON"):
            kv.start()
        assert time.monotonic() - t0 < 10
        assert kv.num_starts == 1  # the server answered: not retried
    finally:
        kv.close()
        httpd.shutdown()
        httpd.server_close()


def rollout_with(env: Environment, gen: ScriptedGenerator, task: dict[str, Any]) -> Any:
    """One rollout of ``env`` on ``task`` with the scripted model (Qwen3 template)."""
    req = rollout_pb2.RolloutRequested(
        rollout_id=f"r-{env.name}", group_id="g", env=env.name, task_id="t",
        task_json=json.dumps(task), sampling=rollout_pb2.SamplingParams(max_tokens=64, temperature=1.0),
    )  # fmt: skip
    rc = RolloutContext(
        treadle_native.Renderer("qwen3", shared_tokenizer("qwen3")), gen, "runner-1"
    )
    return run(run_rollout(req, env, rc))


def test_mcp_http_tool_in_a_tool_use_rollout(server: Server) -> None:
    kv = MCPTools.http(server.url, timeout_s=10)

    def correct(completion: str, answer: str) -> float:
        return float(answer in completion)

    env = Environment("mcp_http_kv", prompt=lambda task: task["question"], tools=kv.toolset(),  # type: ignore[arg-type]
                      rubric=Rubric(rewards=[correct]), required=("question", "answer"))  # fmt: skip
    assert isinstance(env.harness, ToolUse)
    gen = ScriptedGenerator([
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"key": "nile"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nThe Nile is 6650 km long.<|im_end|>",
    ])  # fmt: skip
    try:
        r = rollout_with(env, gen, {"question": "How long is the Nile?", "answer": "6650 km"})
    finally:
        kv.close()
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert r.metrics["tool_calls"] == 1
    prompts = [decode_qwen3(ids) for ids in gen.calls]
    assert '"name": "lookup"' in prompts[0]  # the MCP schema reached the model
    assert "<tool_response>\n6650 km\n</tool_response>" in prompts[1]


def test_mcp_http_server_down_in_a_rollout_is_an_environment_error() -> None:
    kv = MCPTools.http(f"http://127.0.0.1:{free_port()}/mcp", max_retries=0)
    env = Environment("mcp_http_down", prompt=lambda task: task["question"], tools=kv.toolset(),  # type: ignore[arg-type]
                      rubric=Rubric(rewards=[lambda completion: 0.0]), required=("question",))  # fmt: skip
    gen = ScriptedGenerator(["<think>\n\n</think>\n\nNo idea.<|im_end|>"])
    try:
        r = rollout_with(env, gen, {"question": "?"})
    finally:
        kv.close()
    assert r.status.kind == Kind.KIND_ERROR
    assert r.status.error_kind == rollout_pb2.RolloutStatus.ERROR_KIND_ENV, r.status
    assert "did not open a session: cannot connect" in r.status.message
