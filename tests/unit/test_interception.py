"""The interception server: OpenAI-shaped answers from a ModelSession, recorded token-exactly,
over a real aiohttp server on a free loopback port (in process) and an httpx client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import treadle_native
from testkit.fake_model import ScriptedGenerator, encode_qwen3
from testkit.paths import shared_tokenizer
from treadle.env_runner.interception import (
    MAX_BODY_BYTES,
    MAX_BODY_DEPTH,
    InterceptionServer,
    json_depth,
)
from treadle.env_runner.rubric import RolloutState
from treadle.env_runner.session import Limits, ModelSession, Truncated
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array

Truncation = rollout_pb2.RolloutStatus.Truncation
ErrorKind = rollout_pb2.RolloutStatus.ErrorKind

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def renderer() -> treadle_native.Renderer:
    return treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))


def make_session(
    renderer: treadle_native.Renderer, gen: ScriptedGenerator, rollout_id: str = "r1", **limits: Any
) -> ModelSession:
    rollout = rollout_pb2.Rollout(
        rollout_id=rollout_id, min_policy_version=-1, max_policy_version=-1
    )
    sampling = rollout_pb2.SamplingParams(max_tokens=32, temperature=1.0)
    return ModelSession(rollout, sampling, Limits(**limits), RolloutState(task={}),
                        renderer=renderer, generator=gen, attempts=1)  # fmt: skip


Body = Callable[[InterceptionServer, httpx.AsyncClient], Awaitable[None]]
KEY = "test-rollout-key-0123456789"  # every rollout of `serve` gets it; the client sends it
AUTH = {"Authorization": f"Bearer {KEY}"}


def serve(sessions: dict[str, ModelSession], body: Body) -> None:
    async def main() -> None:
        async with InterceptionServer() as server:
            assert InterceptionServer.current() is server
            for rollout_id, session in sessions.items():
                server.register(rollout_id, session, api_key=KEY)
            async with httpx.AsyncClient(base_url=server.url, timeout=10, headers=AUTH) as client:
                await body(server, client)
        with pytest.raises(RuntimeError, match="no interception server"):
            InterceptionServer.current()

    asyncio.run(main())


CHAT = "/rollouts/r1/v1/chat/completions"


def all_ids(session: ModelSession) -> list[int]:
    return np.concatenate([to_array(n.token_ids) for n in session.rollout.nodes]).tolist()


def sse(text: str) -> list[Any]:
    """The data payloads of an SSE body ("[DONE]" kept as a string)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_interception_answers_a_chat_completion(renderer: treadle_native.Renderer) -> None:
    answer = encode_qwen3("<think>\nshort\n</think>\n\nolleh<|im_end|>")
    gen = ScriptedGenerator([answer])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        models = await client.get("/rollouts/r1/v1/models")
        assert models.json()["data"][0]["id"] == "treadle"
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Reverse: "},
                    {"type": "text", "text": "hello"},
                ],
            }
        ]
        r = await client.post(CHAT, json={"model": "m", "messages": messages, "max_tokens": 20})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["object"] == "chat.completion"
        assert doc["model"] == "m"
        assert doc["id"] == f"chatcmpl-r1-{session.rollout.nodes[-1].node_id}"
        choice = doc["choices"][0]
        assert choice["message"] == {
            "role": "assistant",
            "content": "olleh",
            "reasoning_content": "short",
        }
        assert choice["finish_reason"] == "stop"
        prompt = renderer.render(
            [{"role": "user", "content": "Reverse: hello"}], add_generation_prompt=True
        )
        assert gen.calls == [prompt.token_ids.tolist()]  # text parts joined, rendered once
        assert doc["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(answer),
                                "total_tokens": len(prompt) + len(answer)}  # fmt: skip

    serve({"r1": session}, body)
    assert all_ids(session) == gen.calls[0] + answer
    assert session.state.messages[-1]["content"] == "olleh"


def test_interception_streams_content_and_tool_call_deltas(
    renderer: treadle_native.Renderer,
) -> None:
    answer = encode_qwen3(
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    )
    gen = ScriptedGenerator([answer])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        req = {"messages": [{"role": "user", "content": "2+3?"}], "tools": TOOLS, "stream": True,
               "stream_options": {"include_usage": True}}  # fmt: skip
        r = await client.post(CHAT, json=req)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert deltas[0]["role"] == "assistant"
        assert "".join(d.get("content") or "" for d in deltas).strip() == "Let me add."
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "add")]
        assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
        assert calls[0]["id"]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "tool_calls"
        assert set(finish[:-1]) == {None}
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == len(answer)

    serve({"r1": session}, body)
    assert len(gen.calls) == 1


def test_interception_tool_round_trip_bridges_token_exact(
    renderer: treadle_native.Renderer,
) -> None:
    call = encode_qwen3(
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    )
    final = encode_qwen3("It is 5.<|im_end|>")
    gen = ScriptedGenerator([call, final])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "2+3?"}]
        r1 = (await client.post(CHAT, json={"messages": messages, "tools": TOOLS})).json()
        msg = r1["choices"][0]["message"]
        assert r1["choices"][0]["finish_reason"] == "tool_calls"
        assert msg["content"] is None
        (tc,) = msg["tool_calls"]
        assert isinstance(tc["function"]["arguments"], str)  # OpenAI: arguments are JSON text
        assert json.loads(tc["function"]["arguments"]) == {"a": 2, "b": 3}
        messages += [msg, {"role": "tool", "tool_call_id": tc["id"], "content": "5"}]
        r2 = (await client.post(CHAT, json={"messages": messages, "tools": TOOLS})).json()
        assert r2["choices"][0]["message"]["content"] == "It is 5."
        assert r2["choices"][0]["finish_reason"] == "stop"

    serve({"r1": session}, body)
    first, second = gen.calls
    assert second[: len(first) + len(call)] == first + call  # append-only: sampled ids kept
    assert all_ids(session) == second + final  # one branch, token-exact
    assert session.rollout.metrics["num_branches"] == 1
    nodes = session.rollout.nodes
    assert [n.parent_id for n in nodes] == [-1, *range(len(nodes) - 1)]
    mask = np.concatenate([to_array(n.sampled_mask) for n in nodes])
    assert mask.sum() == len(call) + len(final)
    assert nodes[-1].content == "It is 5."


def test_interception_retried_request_is_not_generated_twice(
    renderer: treadle_native.Renderer,
) -> None:
    gen = ScriptedGenerator(["one<|im_end|>", "two<|im_end|>"])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        first = (await client.post(CHAT, json=req)).json()
        again = (await client.post(CHAT, json=req)).json()
        streamed = sse((await client.post(CHAT, json={**req, "stream": True})).text)
        assert again["id"] == first["id"]
        assert again["choices"] == first["choices"]
        assert streamed[1]["choices"][0]["delta"]["content"] == "one"
        assert server.endpoint("r1").num_requests == 3

    serve({"r1": session}, body)
    assert len(gen.calls) == 1
    assert session.num_turns == 1
    assert sum(n.role == rollout_pb2.ROLE_ASSISTANT for n in session.rollout.nodes) == 1


def test_interception_unknown_rollout_is_404(renderer: treadle_native.Renderer) -> None:
    gen = ScriptedGenerator(["x<|im_end|>"])

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        req = {"messages": [{"role": "user", "content": "hi"}]}
        r = await client.post("/rollouts/nope/v1/chat/completions", json=req)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "unknown_rollout"
        assert (await client.get("/rollouts/nope/v1/models")).status_code == 404
        await server.unregister("r1")
        assert (await client.post(CHAT, json=req)).status_code == 404

    serve({"r1": make_session(renderer, gen)}, body)
    assert gen.calls == []


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"messages": []}', "non-empty list"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', "role must be one of"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', "n must be 1"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            "only text parts",
        ),
    ],
)
def test_interception_malformed_body_is_400(
    renderer: treadle_native.Renderer, content: bytes, error: str
) -> None:
    gen = ScriptedGenerator(["x<|im_end|>"])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        r = await client.post(CHAT, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert error in r.json()["error"]["message"]
        ok = await client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})
        assert ok.status_code == 200  # a bad request does not end the rollout

    serve({"r1": session}, body)
    assert len(gen.calls) == 1
    assert "truncated" not in session.state.info


def test_interception_turn_limit_ends_the_rollout(renderer: treadle_native.Renderer) -> None:
    gen = ScriptedGenerator(["one<|im_end|>"])
    session = make_session(renderer, gen, max_turns=1)

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        r1 = await client.post(CHAT, json={"messages": messages})
        messages += [r1.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
        r2 = await client.post(CHAT, json={"messages": messages})
        assert r2.status_code == 400
        err = r2.json()["error"]
        assert err["code"] == "rollout_ended"
        assert "TRUNCATION_MAX_TURNS" in err["message"]
        # even a request the session has cached: the rollout ended
        r3 = await client.post(CHAT, json={"messages": messages[:1]})
        assert r3.status_code == 400
        assert isinstance(server.endpoint("r1").error, Truncated)

    serve({"r1": session}, body)
    assert len(gen.calls) == 1
    truncation, message = session.state.info["truncated"]
    assert truncation == Truncation.TRUNCATION_MAX_TURNS
    assert "turn limit 1" in message


def test_interception_failed_model_call_is_502(renderer: treadle_native.Renderer) -> None:
    session = make_session(renderer, ScriptedGenerator([[1]], fail_times=1))

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        r = await client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 502
        assert "inference unreachable" in r.json()["error"]["message"]

    serve({"r1": session}, body)
    kind, message = session.state.info["turn_error"]
    assert kind == ErrorKind.ERROR_KIND_INFERENCE
    assert "inference unreachable" in message


def test_interception_unix_socket_serves_only_its_rollout(
    renderer: treadle_native.Renderer, tmp_path: Path
) -> None:
    gen = ScriptedGenerator(["x<|im_end|>"])
    other = ScriptedGenerator(["y<|im_end|>"])
    path = tmp_path / "r1.sock"

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        ep = await server.listen_unix("r1", path)
        assert ep.unix_socket == path
        assert path.exists()
        transport = httpx.AsyncHTTPTransport(uds=str(path))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://sandbox", headers=AUTH
        ) as uds:
            req = {"messages": [{"role": "user", "content": "hi"}]}
            assert (await uds.post(f"{ep.path}/chat/completions", json=req)).status_code == 200
            assert (await uds.post("/rollouts/r2/v1/chat/completions", json=req)).status_code == 404
        await server.unregister("r1")
        assert not path.exists()

    serve({"r1": make_session(renderer, gen), "r2": make_session(renderer, other, "r2")}, body)
    assert len(gen.calls) == 1
    assert other.calls == []


def test_interception_requests_without_the_rollout_s_key_are_refused(
    renderer: treadle_native.Renderer, tmp_path: Path
) -> None:
    """Knowing the rollout id is not enough: no key, a wrong key or another rollout's key
    get 401 (TCP and unix socket alike) and the session never generates."""
    gen = ScriptedGenerator(["x<|im_end|>"])
    path = tmp_path / "r1.sock"

    async def main() -> None:
        async with InterceptionServer() as server:
            server.register("r1", make_session(renderer, gen))
            server.register("r2", make_session(renderer, gen, "r2"))
            key1, key2 = server.endpoint("r1").api_key, server.endpoint("r2").api_key
            assert len(key1) >= 40
            assert key1 != key2
            await server.listen_unix("r1", path)
            req = {"messages": [{"role": "user", "content": "hi"}]}
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                for headers in ({}, {"Authorization": "Bearer guess"},
                                {"Authorization": f"Bearer {key2}"}, {"x-api-key": key2}):  # fmt: skip
                    r = await client.post(CHAT, json=req, headers=headers)
                    assert r.status_code == 401, headers
                    assert r.json()["error"]["code"] == "invalid_api_key"
                r = await client.get("/rollouts/r1/v1/models")
                assert r.status_code == 401
            transport = httpx.AsyncHTTPTransport(uds=str(path))
            async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as uds:
                assert (await uds.post(CHAT, json=req)).status_code == 401
            assert server.rejected_requests == 6
            assert server.endpoint("r1").num_rejected == 6
            assert gen.calls == []
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                ok = await client.post(CHAT, json=req, headers={"x-api-key": key1})
                assert ok.status_code == 200
            assert len(gen.calls) == 1

    asyncio.run(main())


def test_interception_clamps_max_tokens_to_the_rollout_s_budget(
    renderer: treadle_native.Renderer,
) -> None:
    """A program asks for 10^12 tokens: the call samples at most the rollout's per-call
    budget (sampling.max_tokens = 32), and never past the model's context length."""
    gen = ScriptedGenerator(["x<|im_end|>"])
    prompt = [{"role": "user", "content": "hi"}]
    num_prompt = len(renderer.render(prompt, add_generation_prompt=True).token_ids)
    short = ScriptedGenerator(["x<|im_end|>"])
    sessions = {
        "r1": make_session(renderer, gen),
        "r2": make_session(renderer, short, "r2", max_model_len=num_prompt + 7),
    }

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        for i, asked in enumerate([10**12, 2**31, 5]):
            r = await client.post(CHAT, json={"messages": [{"role": "user", "content": f"{i}"}],
                                              "max_completion_tokens": asked})  # fmt: skip
            assert r.status_code == 200, r.text
        r = await client.post("/rollouts/r2/v1/chat/completions",
                              json={"messages": prompt, "max_tokens": 10**12})  # fmt: skip
        assert r.status_code == 200, r.text
        over = [{"role": "user", "content": "hi " * 20}]
        r = await client.post("/rollouts/r2/v1/chat/completions", json={"messages": over})
        assert r.status_code == 400
        assert "context length" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "context_length_exceeded"  # what clients know

    serve(sessions, body)
    assert [kw["max_tokens"] for kw in gen.sampling] == [32, 32, 5]
    assert [kw["max_tokens"] for kw in short.sampling] == [7]
    assert len(short.calls[0]) == num_prompt
    truncation, _ = sessions["r2"].state.info["truncated"]
    assert truncation == Truncation.TRUNCATION_MAX_TOTAL_TOKENS


def _with(extra: bytes) -> bytes:
    return b'{"messages": [{"role": "user", "content": "x"}], ' + extra + b"}"


@pytest.mark.parametrize(
    ("content", "code", "param"),
    [
        (_with(b'"temperature": NaN'), "invalid_json", None),
        (_with(b'"temperature": Infinity'), "invalid_json", None),
        (_with(b'"temperature": -Infinity'), "invalid_json", None),
        (_with(b'"metadata": {"x": NaN}'), "invalid_json", None),
        (_with(b'"temperature": 1e999'), "invalid_request", "temperature"),
        (_with(b'"temperature": -0.5'), "invalid_request", "temperature"),
        (_with(b'"temperature": 1e12'), "invalid_request", "temperature"),
        (_with(b'"temperature": "hot"'), "invalid_request", "temperature"),
        (_with(b'"temperature": true'), "invalid_request", "temperature"),
        (_with(b'"top_p": 0'), "invalid_request", "top_p"),
        (_with(b'"top_p": 1.5'), "invalid_request", "top_p"),
        (_with(b'"top_p": -1e999'), "invalid_request", "top_p"),
        (_with(b'"top_p": [0.5]'), "invalid_request", "top_p"),
        (_with(b'"n": -1'), "invalid_request", "n"),
        (_with(b'"n": 1000000000000000000000000'), "invalid_request", "n"),
        (_with(b'"n": true'), "invalid_request", "n"),
        (_with(b'"n": 1.0'), "invalid_request", "n"),
        (_with(b'"max_tokens": 1e12'), "invalid_request", "max_tokens"),
        (_with(b'"max_tokens": "100"'), "invalid_request", "max_tokens"),
        (_with(b'"max_tokens": -7'), "invalid_request", "max_tokens"),
        (_with(b'"max_completion_tokens": false'), "invalid_request", "max_completion_tokens"),
        (_with(b'"presence_penalty": 9'), "invalid_request", "presence_penalty"),
        (_with(b'"frequency_penalty": "x"'), "invalid_request", "frequency_penalty"),
        (_with(b'"seed": 1.5'), "invalid_request", "seed"),
        (_with(b'"seed": 100000000000000000000000'), "invalid_request", "seed"),
        (_with(b'"top_k": -2'), "invalid_request", "top_k"),
        (_with(b'"top_logprobs": 10000'), "invalid_request", "top_logprobs"),
        (_with(b'"logprobs": "yes"'), "invalid_request", "logprobs"),
        (_with(b'"stream": 1'), "invalid_request", "stream"),
        (b"\xff\xfe{}", "invalid_json", None),
    ],
)
def test_interception_out_of_range_sampling_is_a_one_line_400(
    renderer: treadle_native.Renderer, content: bytes, code: str, param: str | None
) -> None:
    """Non-finite, out-of-range or mistyped sampling parameters never reach the generator:
    HTTP 400 with one OpenAI-style line naming the field, counted; the rollout goes on."""
    gen = ScriptedGenerator(["x<|im_end|>"])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        r = await client.post(CHAT, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param)
        assert "\n" not in err["message"]
        assert len(err["message"]) <= 500
        if param is not None:
            assert err["message"].startswith(param)
        assert gen.calls == []
        assert server.bad_requests == 1
        assert server.endpoint("r1").num_bad_requests == 1
        ok = await client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})
        assert ok.status_code == 200

    serve({"r1": session}, body)
    assert len(gen.calls) == 1
    assert gen.sampling[0]["temperature"] == 1.0


def _nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


@pytest.mark.parametrize(
    "content",
    [
        _nested(100_000).encode(),
        _nested(100_000, '{"a":', "}").encode(),
        ("[" * 100_000).encode(),  # unterminated: json.loads recurses before it sees the end
        _with(b'"tools": ' + _nested(100_000).encode()),
        _with(b'"metadata": ' + _nested(100).encode()),  # 101 levels with the body's own
        # brackets in strings do not count, escaped quotes do not end a string
        _with(b'"metadata": {"s": "\\\\\\" [[[[", "t": ' + _nested(99).encode() + b"}"),
    ],
    ids=["array", "object", "unterminated", "tools", "just-over", "after-a-string"],
)
def test_interception_deeply_nested_body_is_a_400_not_a_traceback(
    renderer: treadle_native.Renderer, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    gen = ScriptedGenerator(["x<|im_end|>"])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        r = await client.post(CHAT, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "too_deep"
        assert "at most 100" in err["message"]
        assert server.bad_requests == 1
        ok = await client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})
        assert ok.status_code == 200

    serve({"r1": session}, body)
    assert len(gen.calls) == 1
    assert "Traceback" not in caplog.text
    assert "RecursionError" not in caplog.text


def test_interception_body_at_the_depth_limit_is_served(
    renderer: treadle_native.Renderer,
) -> None:
    gen = ScriptedGenerator(["x<|im_end|>"])
    deep = {"messages": [{"role": "user", "content": "x"}], "metadata": json.loads(_nested(99))}
    assert json_depth(json.dumps(deep).encode()) == MAX_BODY_DEPTH

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        r = await client.post(CHAT, json=deep)
        assert r.status_code == 200, r.text

    serve({"r1": make_session(renderer, gen)}, body)


def test_interception_oversized_body_is_a_413(renderer: treadle_native.Renderer) -> None:
    gen = ScriptedGenerator(["x<|im_end|>"])

    async def body(server: InterceptionServer, client: httpx.AsyncClient) -> None:
        big = _with(b'"metadata": "' + b"a" * MAX_BODY_BYTES + b'"')
        r = await client.post(CHAT, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "too_large")
        assert server.bad_requests == 1
        ok = await client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})
        assert ok.status_code == 200

    serve({"r1": make_session(renderer, gen)}, body)
    assert len(gen.calls) == 1


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def test_json_depth_matches_the_parsed_depth() -> None:
    """The scan's depth is the parsed value's, whatever strings hold (brackets, escaped
    quotes and backslashes, unicode escapes)."""
    rng = np.random.default_rng(0)
    pieces = ["[", "]", "{", "}", '"', "\\", "\\\\", '\\"', "a", "é", "\n", ",", ":"]

    def value(level: int) -> Any:
        kind = int(rng.integers(0, 5 if level < 12 else 2))
        if kind == 0:
            return "".join(pieces[int(i)] for i in rng.integers(0, len(pieces), 6))
        if kind == 1:
            return float(rng.integers(-5, 5))
        if kind in (2, 3):
            return [value(level + 1) for _ in range(int(rng.integers(0, 4)))]
        return {f'k{i}["': value(level + 1) for i in range(int(rng.integers(0, 4)))}

    for _ in range(300):
        v = value(0)
        for ensure_ascii in (True, False):
            raw = json.dumps(v, ensure_ascii=ensure_ascii).encode()
            assert json_depth(raw) == _depth(v), raw
