"""The interception server in each dialect, driven by the real SDK clients (``openai``'s
Chat Completions and Responses, ``anthropic``'s Messages), streaming and not, against an
in-process server whose rollouts' sessions use a scripted fake model (real qwen3 ids)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treadle_native
from testkit.fake_model import ScriptedGenerator, decode_qwen3, encode_qwen3
from testkit.paths import shared_tokenizer
from treadle.env_runner.interception import InterceptionServer
from treadle.env_runner.interception import server as server_module
from treadle.env_runner.rubric import RolloutState
from treadle.env_runner.session import Limits, ModelSession
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array

KEY = "rollout-one-key-0123456789"
OTHER_KEY = "rollout-two-key-0123456789"
ADD = {"name": "add", "description": "Add two integers.",
       "schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["a", "b"]}}  # fmt: skip
CHAT_TOOLS = [{"type": "function", "function": {"name": ADD["name"], "description": ADD["description"],
                                                "parameters": ADD["schema"]}}]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", "name": ADD["name"], "description": ADD["description"],
                    "parameters": ADD["schema"]}]  # fmt: skip
ANTHROPIC_TOOLS = [{"name": ADD["name"], "description": ADD["description"],
                    "input_schema": ADD["schema"]}]  # fmt: skip
THINK_CALL = (
    "<think>\nI should add.\n</think>\n\nLet me add.\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
)
FINAL = "It is 5.<|im_end|>"


@pytest.fixture(scope="module")
def renderer() -> treadle_native.Renderer:
    return treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))


class SlowGenerator(ScriptedGenerator):
    """A scripted model whose first ``slow_calls`` calls take ``delay_s``."""

    def __init__(self, answers: list[str], delay_s: float, slow_calls: int = 1):
        super().__init__(answers)
        self.delay_s, self.slow_calls = delay_s, slow_calls

    async def generate(self, prompt_ids: Any, **kw: Any) -> Any:
        if len(self.calls) < self.slow_calls:
            await asyncio.sleep(self.delay_s)
        return await super().generate(prompt_ids, **kw)


def make_session(
    renderer: treadle_native.Renderer, gen: ScriptedGenerator, rollout_id: str = "r1", **limits: Any
) -> ModelSession:
    rollout = rollout_pb2.Rollout(
        rollout_id=rollout_id, min_policy_version=-1, max_policy_version=-1
    )
    sampling = rollout_pb2.SamplingParams(max_tokens=64, temperature=1.0)
    return ModelSession(rollout, sampling, Limits(**limits), RolloutState(task={}),
                        renderer=renderer, generator=gen, attempts=1)  # fmt: skip


Body = Callable[[InterceptionServer], Awaitable[None]]


def serve(sessions: dict[str, ModelSession], body: Body) -> None:
    """Run ``body`` against a fresh server serving ``sessions`` (r1's key KEY, r2's OTHER_KEY)."""

    async def main() -> None:
        async with InterceptionServer() as server:
            for rollout_id, session in sessions.items():
                server.register(
                    rollout_id, session, api_key=KEY if rollout_id == "r1" else OTHER_KEY
                )
            await body(server)

    asyncio.run(main())


def oai(
    server: InterceptionServer, rollout_id: str = "r1", key: str = KEY, **kw: Any
) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/rollouts/{rollout_id}/v1", api_key=key,
                              max_retries=kw.pop("max_retries", 0), **kw)  # fmt: skip


def claude(
    server: InterceptionServer, rollout_id: str = "r1", key: str = KEY, **kw: Any
) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=f"{server.url}/rollouts/{rollout_id}", api_key=key,
                                    max_retries=kw.pop("max_retries", 0), **kw)  # fmt: skip


def all_ids(session: ModelSession) -> list[int]:
    return np.concatenate([to_array(n.token_ids) for n in session.rollout.nodes]).tolist()


def assert_one_token_exact_branch(session: ModelSession, gen: ScriptedGenerator) -> None:
    """Every call extended the previous one append-only: the graph is one branch whose ids
    are the last prompt + the last answer, the earlier answers' sampled ids kept inside."""
    prompts, answers = gen.calls, gen.answers
    for k in range(1, len(prompts)):
        prev = prompts[k - 1] + answers[k - 1]
        assert prompts[k][: len(prev)] == prev
    assert all_ids(session) == prompts[-1] + answers[min(len(prompts), len(answers)) - 1]
    assert session.rollout.metrics["num_branches"] == 1
    mask = np.concatenate([to_array(n.sampled_mask) for n in session.rollout.nodes])
    assert mask.sum() == sum(len(answers[min(k, len(answers) - 1)]) for k in range(len(prompts)))


# -- OpenAI Responses ---------------------------------------------------------------------------
def test_interception_responses_tool_round_trip_with_the_openai_sdk(
    renderer: treadle_native.Renderer,
) -> None:
    gen = ScriptedGenerator([THINK_CALL, FINAL])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer) -> None:
        client = oai(server)
        r1 = await client.responses.create(model="m", instructions="Be brief.", input="2+3?",
                                           tools=RESPONSES_TOOLS)  # type: ignore[arg-type]  # fmt: skip
        assert r1.status == "completed"
        assert [o.type for o in r1.output] == ["reasoning", "message", "function_call"]
        reasoning, _, call = r1.output
        assert reasoning.content[0].text == "I should add."  # type: ignore[union-attr,index]
        assert r1.output_text == "Let me add."
        assert (call.name, json.loads(call.arguments)) == ("add", {"a": 2, "b": 3})  # type: ignore[union-attr]
        assert r1.usage is not None
        assert r1.usage.output_tokens == len(gen.answers[0])
        follow = [{"role": "user", "content": "2+3?"},
                  *[o.model_dump(exclude_none=True) for o in r1.output],
                  {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]  # type: ignore[union-attr]  # fmt: skip
        r2 = await client.responses.create(model="m", instructions="Be brief.", input=follow,  # type: ignore[arg-type]
                                           tools=RESPONSES_TOOLS)  # type: ignore[arg-type]  # fmt: skip
        assert r2.output_text == "It is 5."
        assert r2.id != r1.id
        # previous_response_id: the stored conversation + only the new item, same prompt
        r3 = await client.responses.create(
            model="m",
            instructions="Be brief.",
            previous_response_id=r1.id,
            tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],  # type: ignore[union-attr]
        )
        assert r3.id == r2.id  # the same conversation: answered as a retry, not generated again
        await client.close()

    serve({"r1": session}, body)
    assert len(gen.calls) == 2
    assert_one_token_exact_branch(session, gen)
    system = session.rollout.nodes[0]
    assert (system.role, system.content) == (rollout_pb2.ROLE_SYSTEM, "Be brief.")


def test_interception_responses_stream_is_what_the_sdk_accumulates(
    renderer: treadle_native.Renderer,
) -> None:
    gen = ScriptedGenerator([THINK_CALL])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer) -> None:
        client = oai(server)
        kw: dict[str, Any] = {"model": "m", "input": "2+3?", "tools": RESPONSES_TOOLS}
        plain = await client.responses.create(**kw)
        async with client.responses.stream(**kw) as stream:  # the SDK's strict accumulator
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        dump: dict[str, Any] = {"exclude_none": True, "exclude": {"created_at"}}
        assert final.model_dump(**dump) == plain.model_dump(**dump)  # the SDK's parsed_* aside
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        assert "response.reasoning_text.delta" in kinds
        assert "response.output_text.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
        assert (
            kinds.count("response.output_item.added")
            == kinds.count("response.output_item.done")
            == 3
        )
        raw = await client.responses.create(**kw, stream=True)
        numbers = [event.sequence_number async for event in raw]
        assert numbers == list(range(len(kinds)))
        await client.close()

    serve({"r1": session}, body)
    assert len(gen.calls) == 1  # the same request three times: one generation


def test_interception_responses_cut_turn_is_incomplete(renderer: treadle_native.Renderer) -> None:
    gen = ScriptedGenerator(["It is a long"])  # no <|im_end|>: the token budget ran out
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer) -> None:
        client = oai(server)
        r = await client.responses.create(model="m", input="go", max_output_tokens=4)
        assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # type: ignore[union-attr]
        assert r.output_text == "It is a long"
        events = [e async for e in await client.responses.create(model="m", input="go",
                                                                 max_output_tokens=4, stream=True)]  # fmt: skip
        assert events[-1].type == "response.incomplete"
        await client.close()

    serve({"r1": session}, body)
    assert gen.sampling[0]["max_tokens"] == 4


# -- Anthropic Messages -------------------------------------------------------------------------
def test_interception_anthropic_tool_round_trip_with_the_anthropic_sdk(
    renderer: treadle_native.Renderer,
) -> None:
    gen = ScriptedGenerator([THINK_CALL, FINAL])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer) -> None:
        client = claude(server)
        messages: list[Any] = [{"role": "user", "content": "2+3?"}]
        m1 = await client.messages.create(model="claude-x", max_tokens=100, system="Be brief.",
                                          messages=messages, tools=ANTHROPIC_TOOLS)  # type: ignore[arg-type]  # fmt: skip
        assert m1.stop_reason == "tool_use"
        assert [b.type for b in m1.content] == ["thinking", "text", "tool_use"]
        thinking, text, use = m1.content
        assert thinking.thinking == "I should add."  # type: ignore[union-attr]
        assert text.text == "Let me add."  # type: ignore[union-attr]
        assert (use.name, use.input) == ("add", {"a": 2, "b": 3})  # type: ignore[union-attr]
        assert m1.model == "claude-x"
        assert m1.usage.output_tokens == len(gen.answers[0])
        messages += [{"role": "assistant", "content": [b.model_dump() for b in m1.content]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]  # type: ignore[union-attr]  # fmt: skip
        m2 = await client.messages.create(model="claude-x", max_tokens=100, system="Be brief.",
                                          messages=messages, tools=ANTHROPIC_TOOLS)  # type: ignore[arg-type]  # fmt: skip
        assert (m2.stop_reason, m2.content[0].text) == ("end_turn", "It is 5.")  # type: ignore[union-attr]
        await client.close()

    serve({"r1": session}, body)
    assert len(gen.calls) == 2
    assert_one_token_exact_branch(session, gen)
    tool = session.rollout.nodes[-2]
    assert (tool.role, tool.content) == (rollout_pb2.ROLE_TOOL, "5")


def test_interception_anthropic_stream_is_the_sdk_s_message(
    renderer: treadle_native.Renderer,
) -> None:
    gen = ScriptedGenerator([THINK_CALL])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer) -> None:
        client = claude(server)
        kw: dict[str, Any] = {"model": "claude-x", "max_tokens": 100, "tools": ANTHROPIC_TOOLS,
                              "messages": [{"role": "user", "content": "2+3?"}]}  # fmt: skip
        plain = await client.messages.create(**kw)
        async with client.messages.stream(**kw) as stream:
            final = await stream.get_final_message()
        assert final.model_dump() == plain.model_dump()
        raw = await client.messages.create(**kw, stream=True)
        events = [e async for e in raw]
        kinds = [e.type for e in events]
        assert kinds[0] == "message_start"
        assert kinds[-2:] == ["message_delta", "message_stop"]
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
        assert deltas == ["thinking_delta", "text_delta", "input_json_delta"]
        assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
        await client.close()

    serve({"r1": session}, body)
    assert len(gen.calls) == 1


def test_interception_anthropic_cut_turn_is_max_tokens(renderer: treadle_native.Renderer) -> None:
    gen = ScriptedGenerator(["It is a long"])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer) -> None:
        client = claude(server)
        m = await client.messages.create(model="c", max_tokens=4,
                                         messages=[{"role": "user", "content": "go"}])  # fmt: skip
        assert (m.stop_reason, m.content[0].text) == ("max_tokens", "It is a long")  # type: ignore[union-attr]
        await client.close()

    serve({"r1": session}, body)


def test_interception_dialects_share_one_message_graph(renderer: treadle_native.Renderer) -> None:
    """A conversation begun in Chat Completions and continued in Anthropic Messages, then
    Responses, is one token-exact branch of the rollout's graph."""
    again = '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 1}}\n</tool_call><|im_end|>'
    gen = ScriptedGenerator([THINK_CALL, again, FINAL])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer) -> None:
        o, c = oai(server), claude(server)
        chat = await o.chat.completions.create(model="m", tools=CHAT_TOOLS,  # type: ignore[arg-type]
                                               messages=[{"role": "user", "content": "2+3+1?"}])  # fmt: skip
        call = chat.choices[0].message.tool_calls[0]  # type: ignore[index]
        args = json.loads(call.function.arguments)  # type: ignore[union-attr]
        history: list[Any] = [
            {"role": "user", "content": "2+3+1?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me add."},
                                              {"type": "tool_use", "id": call.id, "name": "add", "input": args}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}]},
        ]  # fmt: skip
        m = await c.messages.create(
            model="c", max_tokens=50, messages=history, tools=ANTHROPIC_TOOLS
        )  # type: ignore[arg-type]
        (use,) = m.content
        assert (use.type, use.input) == ("tool_use", {"a": 5, "b": 1})  # type: ignore[union-attr]
        items = [{"role": "user", "content": "2+3+1?"},
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
                 {"type": "function_call", "call_id": call.id, "name": "add", "arguments": call.function.arguments},  # type: ignore[union-attr]
                 {"type": "function_call_output", "call_id": call.id, "output": "5"},
                 {"type": "function_call", "call_id": use.id, "name": "add", "arguments": '{"a": 5, "b": 1}'},  # type: ignore[union-attr]
                 {"type": "function_call_output", "call_id": use.id, "output": "6"}]  # type: ignore[union-attr]  # fmt: skip
        r = await o.responses.create(model="m", input=items, tools=RESPONSES_TOOLS)  # type: ignore[arg-type]
        assert r.output_text == "It is 5."
        await o.close()
        await c.close()

    serve({"r1": session}, body)
    assert len(gen.calls) == 3
    assert_one_token_exact_branch(session, gen)


# -- retries ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dialect", ["openai_chat", "openai_responses", "anthropic"])
def test_interception_sdk_retry_after_a_timeout_is_one_sample(
    renderer: treadle_native.Renderer, dialect: str
) -> None:
    """The SDK gives up on a slow answer (its read timeout drops the connection) and sends
    the request again: the retry waits for the first attempt's turn; one generation."""
    gen = SlowGenerator(["hello<|im_end|>"], delay_s=0.6)
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer) -> None:
        messages: Any = [{"role": "user", "content": "hi"}]
        if dialect == "anthropic":
            c = claude(server, max_retries=3, timeout=0.25)
            m = await c.messages.create(model="c", max_tokens=10, messages=messages)
            text = m.content[0].text  # type: ignore[union-attr]
            await c.close()
        else:
            o = oai(server, max_retries=3, timeout=0.25)
            if dialect == "openai_chat":
                text = (
                    (await o.chat.completions.create(model="m", messages=messages))
                    .choices[0]
                    .message.content
                )
            else:
                text = (await o.responses.create(model="m", input=messages)).output_text
            await o.close()
        assert text == "hello"
        ep = server.endpoint("r1")
        assert ep.num_retries >= 1
        assert ep.num_requests == ep.num_retries + 1

    serve({"r1": session}, body)
    assert len(gen.calls) == 1
    assert session.num_turns == 1


def test_interception_retry_after_other_requests_is_recognised(
    renderer: treadle_native.Renderer,
) -> None:
    """A retry that comes after another request of the rollout (an agent's side call) still
    gets its own turn back, byte-identical body against the last RETRY_MEMORY requests."""
    gen = ScriptedGenerator(["one<|im_end|>", "two<|im_end|>", "three<|im_end|>"])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer) -> None:
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
            url = "/rollouts/r1/v1/messages"
            a = {"model": "c", "max_tokens": 9, "messages": [{"role": "user", "content": "a"}]}
            b = {"model": "c", "max_tokens": 9, "messages": [{"role": "user", "content": "b"}]}
            first = (await http.post(url, json=a)).json()
            assert (await http.post(url, json=b)).json()["content"][0]["text"] == "two"
            again = (await http.post(url, json=a)).json()
            assert again == first
            # the same conversation in another dialect is not a byte-identical retry, but
            # it is the session's last one neither: a new sample
            chat = await http.post("/rollouts/r1/v1/chat/completions",
                                   json={"messages": a["messages"], "max_tokens": 9})  # fmt: skip
            assert chat.json()["choices"][0]["message"]["content"] == "three"

    serve({"r1": session}, body)
    assert len(gen.calls) == 3


# -- refusals -----------------------------------------------------------------------------------
async def _chat(client: openai.AsyncOpenAI, **kw: Any) -> Any:
    return await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], **kw
    )


async def _responses(client: openai.AsyncOpenAI, **kw: Any) -> Any:
    return await client.responses.create(model="m", input="hi", **kw)


async def _messages(client: anthropic.AsyncAnthropic, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 10)
    return await client.messages.create(
        model="c", messages=[{"role": "user", "content": "hi"}], **kw
    )


DIALECT_CALLS = {
    "openai_chat": (oai, _chat, openai),
    "openai_responses": (oai, _responses, openai),
    "anthropic": (claude, _messages, anthropic),
}


@pytest.mark.parametrize("dialect", list(DIALECT_CALLS))
def test_interception_refusals_are_the_sdk_s_typed_errors(
    renderer: treadle_native.Renderer, dialect: str
) -> None:
    """Another rollout's key, an unknown rollout, an ended one, a bad parameter, a body too
    large, a rollout a limit ended: each is the SDK's own exception class (the dialect's
    status and error shape), never a generation, never a crash; the rollout goes on."""
    make, call, sdk = DIALECT_CALLS[dialect]
    gen = ScriptedGenerator(["fine<|im_end|>"])
    other = ScriptedGenerator(["other<|im_end|>"])
    session = make_session(renderer, gen, max_turns=1)
    bad = {"openai_chat": {"temperature": 9}, "openai_responses": {"tools": [{"type": "web_search"}]},
           "anthropic": {"extra_body": {"temperature": 1.5}}}[dialect]  # fmt: skip

    async def body(server: InterceptionServer) -> None:
        ok, wrong_key, ghost, ended = (make(server), make(server, key=OTHER_KEY),
                                       make(server, rollout_id="ghost"),
                                       make(server, rollout_id="r2", key=OTHER_KEY))  # fmt: skip
        with pytest.raises(sdk.AuthenticationError) as auth:
            await call(wrong_key)  # r2's key on r1's endpoint
        with pytest.raises(sdk.NotFoundError, match="no rollout 'ghost'"):
            await call(ghost)
        with pytest.raises(sdk.BadRequestError) as bad_request:
            await call(ok, **bad)
        with pytest.raises(sdk.APIStatusError) as too_large:
            await call(ok, extra_body={"metadata": {"pad": "x" * 3000}})
        assert too_large.value.status_code == 413
        assert (server.rejected_requests, server.bad_requests) == (1, 2)
        assert await call(ok)  # the rollout went on: its one allowed turn
        with pytest.raises(sdk.BadRequestError, match="the rollout ended"):
            await call(
                ok, **{"openai_responses": {"max_output_tokens": 7}}.get(dialect, {"max_tokens": 7})
            )
        await server.unregister("r2")
        with pytest.raises(sdk.NotFoundError, match="has ended"):
            await call(ended)
        for e in (auth.value, bad_request.value, too_large.value):
            body = e.body
            if dialect == "anthropic":  # the SDK hands over the whole body
                assert (body["type"], set(body["error"])) == ("error", {"type", "message"})
            else:  # the OpenAI SDK hands over body["error"]
                assert set(body) == {"message", "type", "param", "code"}
        for client in (ok, wrong_key, ghost, ended):
            await client.close()

    server_module.MAX_BODY_BYTES, saved = 2048, server_module.MAX_BODY_BYTES
    try:
        serve({"r1": session, "r2": make_session(renderer, other, "r2")}, body)
    finally:
        server_module.MAX_BODY_BYTES = saved
    assert len(gen.calls) == 1
    assert other.calls == []


def test_interception_anthropic_requires_its_version_header_and_max_tokens(
    renderer: treadle_native.Renderer,
) -> None:
    gen = ScriptedGenerator(["x<|im_end|>"])

    async def body(server: InterceptionServer) -> None:
        async with httpx.AsyncClient(base_url=server.url, headers={"x-api-key": KEY}) as http:
            url = "/rollouts/r1/v1/messages"
            msgs = [{"role": "user", "content": "hi"}]
            r = await http.post(url, json={"model": "c", "max_tokens": 5, "messages": msgs})
            assert r.status_code == 400
            assert r.json() == {"type": "error", "error": {
                "type": "invalid_request_error", "message": "anthropic-version: header is required"}}  # fmt: skip
            http.headers["anthropic-version"] = "2023-06-01"
            for doc, error in [
                ({"model": "c", "messages": msgs}, "max_tokens"),
                ({"model": "c", "max_tokens": 5, "messages": [*msgs, {"role": "assistant", "content": "I"}]}, "prefill"),
                ({"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "tool_result"),
                ({"model": "c", "max_tokens": 5, "messages": msgs, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "client tools"),
            ]:  # fmt: skip
                r = await http.post(url, json=doc)
                assert r.status_code == 400, doc
                assert error in r.json()["error"]["message"]

    serve({"r1": make_session(renderer, gen)}, body)
    assert gen.calls == []


# -- bad input, generated ------------------------------------------------------------------------
ROUTES = {"openai_chat": "/v1/chat/completions", "openai_responses": "/v1/responses",
          "anthropic": "/v1/messages"}  # fmt: skip
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-3, 3) | st.sampled_from(
        ["", "hi", "user", "assistant", "system", "tool", "text", "tool_use", "tool_result",
         "function_call", "function_call_output", "message", "reasoning", "thinking", "input_text"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["role", "content", "type", "text", "id", "name", "input", "arguments", "call_id",
         "tool_use_id", "output", "tool_calls", "function", "thinking", "summary"]), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
_bodies = st.fixed_dictionaries(
    {}, optional={"model": _json, "messages": _json, "input": _json, "system": _json,
                  "instructions": _json, "tools": _json, "max_tokens": _json, "stream": _json,
                  "temperature": _json, "previous_response_id": _json})  # fmt: skip


def test_interception_any_body_is_an_answer_or_the_dialect_s_error(
    renderer: treadle_native.Renderer,
) -> None:
    """Generated bodies, well-formed or not, in every dialect: 200 or a 4xx in the dialect's
    error shape -- never a 500, never a dead server."""
    gen = ScriptedGenerator(["ok<|im_end|>"])
    statuses: dict[int, int] = {}

    async def body(server: InterceptionServer) -> None:
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:

            @settings(max_examples=150, deadline=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            @given(dialect=st.sampled_from(list(ROUTES)), doc=_bodies)
            def check(dialect: str, doc: dict[str, Any]) -> None:
                fut = asyncio.run_coroutine_threadsafe(
                    http.post(f"/rollouts/r1{ROUTES[dialect]}", json=doc), loop
                )
                r = fut.result(timeout=10)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code in (200, 400), r.text
                if r.status_code == 400:
                    err = r.json()
                    if dialect == "anthropic":
                        assert err["type"] == "error"
                    assert err["error"]["type"] == "invalid_request_error"
                    assert "\n" not in err["error"]["message"]

            loop = asyncio.get_running_loop()
            await asyncio.to_thread(check)

    serve({"r1": make_session(renderer, gen)}, body)
    assert statuses.get(400, 0) > 0


# -- stop sequences -----------------------------------------------------------------------------
def test_interception_stop_sequence_cuts_the_turn_and_its_sample(
    renderer: treadle_native.Renderer,
) -> None:
    """Anthropic's stop_sequences and Chat Completions' stop: the content ends before the
    sequence, stop_reason says so, the recorded sample ends with the token completing it,
    and the next turn still extends it append-only."""
    answer = encode_qwen3("Counting: 1 2 STOP 3 4<|im_end|>")
    gen = ScriptedGenerator([answer, "Done.<|im_end|>", "x, y, z<|im_end|>"])
    session = make_session(renderer, gen)

    async def body(server: InterceptionServer) -> None:
        c = claude(server)
        kw: dict[str, Any] = {"model": "c", "max_tokens": 50, "stop_sequences": ["STOP", "4"],
                              "messages": [{"role": "user", "content": "count"}]}  # fmt: skip
        m = await c.messages.create(**kw)
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "STOP")
        assert m.content[0].text == "Counting: 1 2 "  # type: ignore[union-attr]
        async with c.messages.stream(**kw) as stream:
            assert (await stream.get_final_message()).model_dump() == m.model_dump()
        kw["messages"] += [{"role": "assistant", "content": "Counting: 1 2 "},
                           {"role": "user", "content": "go on"}]  # fmt: skip
        m2 = await c.messages.create(**kw)
        assert (m2.stop_reason, m2.stop_sequence) == ("end_turn", None)
        await c.close()
        o = oai(server)
        chat = await o.chat.completions.create(model="m", stop=", z",
                                               messages=[{"role": "user", "content": "abc"}])  # fmt: skip
        assert chat.choices[0].message.content == "x, y"
        assert chat.choices[0].finish_reason == "stop"
        await o.close()

    serve({"r1": session}, body)
    first, second, _ = gen.calls
    nodes = session.rollout.nodes
    kept = np.concatenate([to_array(n.token_ids) for n in nodes[:2]])[len(first) :].tolist()
    assert nodes[1].role == rollout_pb2.ROLE_ASSISTANT
    assert 0 < len(kept) < len(answer)
    assert kept == answer[: len(kept)]
    assert decode_qwen3(kept).endswith("STOP")
    assert second[: len(first) + len(kept)] == first + kept  # the next turn extends the cut one
    assert session.rollout.metrics["num_branches"] == 2  # "abc" is a new conversation


def test_interception_anthropic_system_messages_stay_where_they_stand() -> None:
    """A system message among the messages (Claude Code sends one after the first user
    message) is a system message at its place; other roles are refused, named."""
    from treadle.env_runner.interception.anthropic import chat_messages
    from treadle.env_runner.interception.parsing import RequestError

    extra = [{"type": "text", "text": "Agents: a"}, {"type": "text", "text": ", b"}]
    body = {"system": "S", "messages": [
        {"role": "user", "content": "hi"}, {"role": "system", "content": extra},
        {"role": "system", "content": " "}, {"role": "user", "content": "go"}]}  # fmt: skip
    assert chat_messages(body) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
        {"role": "system", "content": "Agents: a, b"}, {"role": "system", "content": " "},
        {"role": "user", "content": "go"},
    ]  # fmt: skip
    with pytest.raises(RequestError, match=r"messages\.0\.role: must be user, assistant or system"):
        chat_messages({"messages": [{"role": "tool", "content": "x"}]})
