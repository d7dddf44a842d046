"""OpenAI Chat Completions: ``POST /rollouts/{rollout_id}/v1/chat/completions``.

What the request controls: messages, tools, max_tokens / max_completion_tokens,
temperature (in [0, 2], as OpenAI's) and stop (a string or up to 4: the turn ends where
its content first holds one, finish_reason "stop"). Everything else of sampling (top_p,
top_k, seed, penalties) is the rollout's and ignored, other fields (tool_choice, ...) too; but
every sampling parameter a request sends must be what an OpenAI server accepts (a finite
number in its range, n = 1), or the request is refused. Content parts are accepted when
they are text; ``developer`` messages are system messages.

The answer is a ``chat.completion``; with ``"stream": true`` the same turn replayed as
``chat.completion.chunk`` SSE frames (role, reasoning_content, content, tool-call deltas,
finish_reason, usage when ``stream_options.include_usage``), then ``data: [DONE]``.
Errors: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from treadle.env_runner.interception.dialect import (
    Call,
    Dialect,
    EndpointView,
    finish_reason,
    register,
    sse,
)
from treadle.env_runner.interception.parsing import (
    RequestError,
    arguments_json,
    boolean,
    integer,
    number,
    objects,
    shown,
    text_parts,
)
from treadle.env_runner.session import Turn

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PARTS = ("text", "input_text", "output_text")

OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                      404: "not_found_error", 413: "invalid_request_error", 500: "api_error",
                      502: "api_error"}  # fmt: skip


def openai_error_body(types: Mapping[int, str], status: int, message: str, code: str | None,
                      param: str | None) -> dict[str, Any]:  # fmt: skip
    """OpenAI's error object (Chat Completions and Responses alike)."""
    kind = types.get(status, "api_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def check_sampling(body: dict[str, Any]) -> None:
    """Refuse what an OpenAI server would: sampling parameters out of range or of the wrong
    type, n other than 1 -- even those this server ignores (the rollout's apply)."""
    number(body, "top_p", 0.0, 1.0, lo_open=True)
    number(body, "presence_penalty", -2.0, 2.0)
    number(body, "frequency_penalty", -2.0, 2.0)
    integer(body, "top_k", -1)
    integer(body, "seed", -(2**63), 2**63 - 1)
    integer(body, "top_logprobs", 0, 20)
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
        raise RequestError(f"n must be 1 (one rollout, one completion), got {shown(n)}", param="n")
    boolean(body, "logprobs")
    boolean(body, "stream")


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    if not isinstance(c, dict):
        raise RequestError(f"{where} must be an object")
    f = c.get("function", c)
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise RequestError(f"{where}.function.name must be a string")
    args = arguments_json(f.get("arguments"), f"{where}.function.arguments")
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
    content = text_parts(m.get("content"), f"{where}.content", TEXT_PARTS)
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


def usage(turn: Turn) -> dict[str, int]:
    p, c = turn.num_prompt_tokens, turn.num_completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class OpenAIChat(Dialect):
    name: ClassVar[str] = "openai_chat"
    path: ClassVar[str] = "/v1/chat/completions"
    key_env: ClassVar[str] = "OPENAI_API_KEY"
    error_types: ClassVar[Mapping[int, str]] = OPENAI_ERROR_TYPES

    def parse(
        self, body: dict[str, Any], headers: Mapping[str, str], ep: EndpointView, default_model: str
    ) -> Call:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        tools = body.get("tools")
        if tools is not None:
            objects(tools, "tools")
        # any size is accepted: the session samples at most the rollout's budget
        max_tokens = integer(body, "max_completion_tokens", 1)
        legacy = integer(body, "max_tokens", 1)
        temperature = number(body, "temperature", 0.0, 2.0)
        check_sampling(body)
        options = body.get("stream_options") or {}
        model = body.get("model")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (
            not isinstance(stops, list)
            or len(stops) > 4
            or not all(isinstance(x, str) for x in stops)
        ):
            raise RequestError(f"stop must be a string or a list of at most 4, got {shown(stop)}",
                               param="stop")  # fmt: skip
        return Call(
            messages=[_message(m, i) for i, m in enumerate(messages)],
            tools=tools or None,
            max_tokens=legacy if max_tokens is None else max_tokens,
            temperature=temperature,
            stream=boolean(body, "stream"),
            model=model if isinstance(model, str) and model else default_model,
            stop=stops or None,
            echo={
                "include_usage": bool(isinstance(options, dict) and options.get("include_usage"))
            },
        )

    def body(self, ep: EndpointView, call: Call, turn: Turn) -> dict[str, Any]:
        """The OpenAI ``chat.completion`` object of ``turn``."""
        msg = turn.message
        message: dict[str, Any] = {"role": "assistant", "content": msg["content"]}
        if msg.get("tool_calls"):
            message["tool_calls"] = msg["tool_calls"]
            message["content"] = msg["content"] or None
        if turn.reasoning:
            message["reasoning_content"] = turn.reasoning
        return {
            "id": f"chatcmpl-{ep.rollout_id}-{turn.node_id}",  # the same for a retried request
            "object": "chat.completion",
            "created": int(time.time()),
            "model": call.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish_reason(turn),
                }
            ],
            "usage": usage(turn),
        }

    def events(self, ep: EndpointView, call: Call, turn: Turn) -> Iterator[bytes]:
        """The ``chat.completion.chunk`` frames that stream ``turn``, then ``[DONE]``."""
        base = {"id": f"chatcmpl-{ep.rollout_id}-{turn.node_id}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": call.model}  # fmt: skip

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return sse({**base, "choices": [choice]})

        yield chunk({"role": "assistant", "content": ""})
        if turn.reasoning:
            yield chunk({"reasoning_content": turn.reasoning})
        if turn.content:
            yield chunk({"content": turn.content})
        for i, c in enumerate(turn.message.get("tool_calls") or []):
            f = c["function"]
            yield chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                         "function": {"name": f["name"], "arguments": f["arguments"]}}]})  # fmt: skip
        yield chunk({}, finish_reason(turn))
        if call.echo.get("include_usage"):
            yield sse({**base, "choices": [], "usage": usage(turn)})
        yield b"data: [DONE]\n\n"

    def error_body(self, status: int, message: str, code: str | None,
                   param: str | None) -> dict[str, Any]:  # fmt: skip
        return openai_error_body(self.error_types, status, message, code, param)


register(OpenAIChat())
