"""MCP tools against a real MCP server (FastMCP / MCPServer over stdio, in a temp file):
schemas, calls, tool errors, crashes and restarts, lifetime, and a ToolUse rollout."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import treadle_native
from testkit.fake_model import ScriptedGenerator, decode_qwen3
from testkit.paths import shared_tokenizer
from treadle.env_runner.environments import Environment
from treadle.env_runner.harnesses import ToolUse
from treadle.env_runner.mcp_tools import MCPStartError, MCPTools, MCPToolSet
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import Rubric
from treadle.proto.v1 import rollout_pb2

pytest.importorskip("mcp")
pytestmark = pytest.mark.integration

Kind = rollout_pb2.RolloutStatus.Kind

SERVER = '''
import os
try:  # mcp 2.x renamed FastMCP to MCPServer
    from mcp.server.mcpserver import MCPServer as FastMCP
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP
    from mcp.server.fastmcp.exceptions import ToolError

with open(os.environ["MCP_TEST_PIDS"], "a") as f:
    f.write(f"{os.getpid()}\\n")

app = FastMCP("kv")
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
def crash() -> str:
    """Exit the server at once."""
    os._exit(3)


app.run()
'''


def pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def kv_server(tmp: Path, **kwargs: Any) -> MCPTools:
    script = tmp / "kv_server.py"
    script.write_text(SERVER)
    return MCPTools.stdio(
        sys.executable, [str(script)], env={"MCP_TEST_PIDS": str(tmp / "pids")},
        errlog=tmp / "server.stderr", startup_timeout_s=60, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MCPTools]:
    """One server for the module's tests, as an env runner would share it."""
    server = kv_server(tmp_path_factory.mktemp("kv")).start()
    yield server
    server.close()


def test_mcp_tools_list_schemas_as_openai_functions(kv: MCPTools) -> None:
    schemas = {s["function"]["name"]: s for s in kv.toolset().schemas()}
    assert set(schemas) == {"add", "lookup", "crash"}
    add = schemas["add"]
    assert add["type"] == "function"
    assert add["function"]["description"] == "Add two integers."
    assert add["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "integer"},
        },  # pydantic titles stripped
        "required": ["a", "b"],
    }
    assert schemas["crash"]["function"]["parameters"]["properties"] == {}


def test_mcp_tool_call_returns_the_text_content(kv: MCPTools) -> None:
    tools = kv.toolset()

    async def calls() -> list[Any]:
        one = await tools.call("lookup", '{"key": "nile"}')
        many = await asyncio.gather(*(tools.call("add", {"a": i, "b": 100}) for i in range(8)))
        return [one, *many]

    one, *many = asyncio.run(calls())
    assert (one.status, one.content) == ("ok", "6650 km")
    assert [r.content for r in many] == [
        str(i + 100) for i in range(8)
    ]  # concurrent calls, one server
    assert kv.num_starts == 1


def test_mcp_tool_errors_are_error_results_not_exceptions(kv: MCPTools) -> None:
    tools = kv.toolset()

    async def calls() -> list[Any]:
        return [
            await tools.call("lookup", {"key": "zzz"}),  # the tool raised: isError result
            await tools.call("add", {"a": "x", "b": 1}),  # caught by the input schema
            await tools.call("add", {"a": 1}),
            await tools.call("subtract", {"a": 1, "b": 2}),
        ]

    failed, wrong_type, missing, unknown = asyncio.run(calls())
    assert failed.status == "error"
    assert "no entry for 'zzz'" in failed.content
    assert (wrong_type.status, missing.status) == ("invalid_arguments", "invalid_arguments")
    assert "'x' is not of type 'integer'" in wrong_type.content
    assert "'b' is a required property" in missing.content
    assert unknown.status == "unknown_tool"
    assert asyncio.run(tools.call("add", {"a": 2, "b": 3})).content == "5"  # still serving


def test_mcp_server_crash_is_an_error_then_a_bounded_restart(tmp_path: Path) -> None:
    server = kv_server(tmp_path, max_restarts=1)
    tools = server.toolset()
    try:
        assert len(tools) == 3

        async def calls() -> list[Any]:
            return [
                await tools.call("crash", {}),
                await tools.call("add", {"a": 1, "b": 2}),  # restarts the server
                await tools.call("crash", {}),
                await tools.call("add", {"a": 1, "b": 2}),  # no restarts left
            ]

        crashed, after, crashed_again, refused = asyncio.run(calls())
        assert crashed.status == "error"
        assert "stopped during the call" in crashed.content
        assert (after.status, after.content) == ("ok", "3")
        assert crashed_again.status == "error"
        assert refused.status == "error"
        assert "not restarting" in refused.content
        assert server.num_starts == 2
        assert len(pids(tmp_path / "pids")) == 2
    finally:
        server.close()
    assert not any(alive(p) for p in pids(tmp_path / "pids"))


def test_mcp_tools_async_context_starts_filters_and_stops_the_server(tmp_path: Path) -> None:
    async def scoped() -> tuple[list[str], Any]:
        async with kv_server(tmp_path, include=["add"], prefix="kv_") as server:
            assert len(pids(tmp_path / "pids")) == 1
            assert alive(pids(tmp_path / "pids")[0])
            tools = server.toolset()
            names = [s["function"]["name"] for s in tools.schemas()]
            return names, await tools.call("kv_add", {"a": 20, "b": 22})

    names, result = asyncio.run(scoped())
    assert names == ["kv_add"]
    assert (result.status, result.content) == ("ok", "42")
    [pid] = pids(tmp_path / "pids")
    assert not alive(pid)  # leaving the block stopped the server


def test_mcp_server_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    server = MCPTools.stdio(sys.executable, ["-c", "import sys; sys.exit(7)"], name="broken",
                            startup_timeout_s=30, max_restarts=0, errlog=tmp_path / "err")  # fmt: skip
    tools = server.toolset()
    assert tools  # an MCP toolset counts as non-empty before it connects
    with pytest.raises(MCPStartError, match="broken did not start"):
        tools.schemas()
    result = asyncio.run(MCPToolSet([server]).call("add", {"a": 1}))
    assert result.status == "error"
    assert "broken" in result.content
    server.close()


# -- a ToolUse rollout calling the MCP tool -----------------------------------------------------


def test_mcp_tool_in_a_tool_use_rollout(kv: MCPTools) -> None:
    def correct(completion: str, answer: str) -> float:
        return float(answer in completion)

    env = Environment("mcp_kv", prompt=lambda task: task["question"], tools=kv.toolset(),  # type: ignore[arg-type]
                      rubric=Rubric(rewards=[correct]), required=("question", "answer"))  # fmt: skip
    assert isinstance(env.harness, ToolUse)
    gen = ScriptedGenerator([
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"key": "nile"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nThe Nile is 6650 km long.<|im_end|>",
    ])  # fmt: skip
    req = rollout_pb2.RolloutRequested(
        rollout_id="r-mcp", group_id="g", env="mcp_kv", task_id="nile",
        task_json=json.dumps({"question": "How long is the Nile?", "answer": "6650 km"}),
        sampling=rollout_pb2.SamplingParams(max_tokens=64, temperature=1.0),
    )  # fmt: skip
    rc = RolloutContext(
        treadle_native.Renderer("qwen3", shared_tokenizer("qwen3")), gen, "runner-1"
    )
    r = asyncio.run(run_rollout(req, env, rc))
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert r.metrics["tool_calls"] == 1
    prompts = [decode_qwen3(ids) for ids in gen.calls]
    assert len(prompts) == 2
    assert '"name": "lookup"' in prompts[0]  # the MCP schema reached the model
    assert "<tool_response>\n6650 km\n</tool_response>" in prompts[1]
    tool_nodes = [n for n in r.nodes if n.role == rollout_pb2.ROLE_TOOL]
    assert [n.content for n in tool_nodes] == ["6650 km"]
