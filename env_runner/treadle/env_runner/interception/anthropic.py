"""Anthropic Messages: ``POST /rollouts/{rollout_id}/v1/messages``.

Point the Anthropic SDK (or Claude Code) at ``http://host:port/rollouts/{rollout_id}``
(``ANTHROPIC_BASE_URL``) with the rollout's key as ``ANTHROPIC_API_KEY`` (sent as
``x-api-key``; ``Authorization: Bearer`` works too). Requests must carry an
``anthropic-version`` header, as Anthropic's API requires; its value is not checked.

The request becomes chat messages: ``system`` (a string or text blocks) first, then each
message in order (a ``system`` message among them -- Claude Code sends one -- is a system
message where it stands, its text blocks joined), each message's content blocks:

    text              joined into the message's content
    tool_use          (assistant) a tool call: id, name, input (serialised to JSON text)
    tool_result       (user) a tool message answering tool_use_id (content: str | text blocks)
    thinking          (assistant) the message's reasoning_content; redacted_thinking is dropped

Images, documents and server-tool blocks are refused, as is a last assistant message
(prefill: the model cannot continue a turn here). ``tools`` are client tools (``name``,
``description``, ``input_schema``); server tools (typed ``web_search_...``, ``bash_...``)
are refused. The request controls ``max_tokens`` (required) and ``temperature`` (in [0, 1]);
top_p and top_k must be in range and are the rollout's, like every other sampling setting.
``stop_sequences`` end the turn where its text first holds one (``stop_reason``
``stop_sequence``, the sequence in ``stop_sequence``; the recorded sample ends with the
token that completed it). ``thinking`` is accepted and ignored (the environment decides
whether the model thinks); tool_choice, metadata and service_tier are ignored.

The answer is a ``message`` whose content is a ``thinking`` block (when the model reasoned;
its ``signature`` is empty), a ``text`` block (when it wrote text, or made no tool call)
and one ``tool_use`` block per tool call; ``stop_reason`` is ``max_tokens`` when the turn
was cut by its token budget, ``stop_sequence`` when one of the request's ended it, else
``tool_use`` when it calls tools, else ``end_turn``.
With ``"stream": true`` the same message is replayed as Anthropic's SSE events:
message_start, ping, per block content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop, message_delta (stop_reason,
usage.output_tokens), message_stop. Errors: ``{"type": "error", "error": {"type",
"message"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from treadle.env_runner.interception.dialect import Call, Dialect, EndpointView, register, sse
from treadle.env_runner.interception.parsing import (
    RequestError,
    boolean,
    integer,
    number,
    objects,
    shown,
    string,
    text_parts,
)
from treadle.env_runner.session import Turn

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               500: "api_error", 502: "api_error"}  # fmt: skip
TEXT = ("text",)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    blocks = objects(content, where)
    if not blocks:
        raise RequestError(f"{where} must not be empty")
    return blocks


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user message's blocks: tool results as tool messages, text as user messages, in order."""
    out: list[dict[str, Any]] = []
    text: list[str] | None = None
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            if text is None:
                text = []
                out.append({"role": "user", "content": ""})
            text.append(text_parts([b], f"{where}[{j}]", TEXT) or "")
            out[-1]["content"] = "".join(text)
        elif kind == "tool_result":
            tool_use_id = b.get("tool_use_id")
            if not isinstance(tool_use_id, str):
                raise RequestError(f"{where}[{j}].tool_use_id must be a string")
            result = text_parts(b.get("content"), f"{where}[{j}].content", TEXT) or ""
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": result})
            text = None
        else:
            raise RequestError(f"{where}[{j}]: a user message's blocks must be text or "
                               f"tool_result, got {shown(kind)}")  # fmt: skip
    return out


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            text.append(text_parts([b], f"{where}[{j}]", TEXT) or "")
        elif kind == "thinking":
            thinking = b.get("thinking")
            if not isinstance(thinking, str):
                raise RequestError(f"{where}[{j}].thinking must be a string")
            reasoning.append(thinking)
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            name, call_id, args = b.get("name"), b.get("id"), b.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise RequestError(f"{where}[{j}]: a tool_use needs a string id and name")
            if not isinstance(args, dict):
                raise RequestError(f"{where}[{j}].input must be an object, got {shown(args)}")
            calls.append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(args, ensure_ascii=False)}})  # fmt: skip
        else:
            raise RequestError(f"{where}[{j}]: an assistant message's blocks must be text, "
                               f"thinking or tool_use, got {shown(kind)}")  # fmt: skip
    m: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        m["reasoning_content"] = "".join(reasoning)
    if calls:
        m["tool_calls"] = calls
    return m


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``system`` + ``messages`` as chat messages (see the module doc)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: must be a non-empty list")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = (
            system
            if isinstance(system, str)
            else text_parts(objects(system, "system"), "system", TEXT)
        )
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise RequestError(f"{where}: must be an object")
        role = m.get("role")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if role == "user":
            out += _user(blocks, f"{where}.content")
        elif role == "assistant":
            out.append(_assistant(blocks, f"{where}.content"))
        elif role == "system":  # mid-conversation instructions (Claude Code sends them)
            text = text_parts(blocks, f"{where}.content", TEXT)
            if text:
                out.append({"role": "system", "content": text})
        else:
            raise RequestError(
                f"{where}.role: must be user, assistant or system, got {shown(role)}"
            )
    if messages[-1].get("role") == "assistant":
        raise RequestError("the last message is the assistant's: continuing a prefilled "
                           "assistant turn is not supported here")  # fmt: skip
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic client tools as chat-completions tools."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(objects(tools, "tools")):
        if t.get("type") not in (None, "custom"):
            raise RequestError(f"tools.{i}.type {shown(t.get('type'))} is not supported: "
                               "only client tools can be served")  # fmt: skip
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise RequestError(f"tools.{i}: a tool needs a string name and an input_schema object")
        f = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            f["description"] = t["description"]
        out.append({"type": "function", "function": f})
    return out or None


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(turn: Turn) -> list[dict[str, Any]]:
    """The answer's content blocks (see the module doc)."""
    blocks: list[dict[str, Any]] = []
    if turn.reasoning:
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    msg = turn.message
    calls = msg.get("tool_calls") or []
    if msg["content"] or not calls:
        blocks.append({"type": "text", "text": msg["content"]})
    for c in calls:
        f = c["function"]
        blocks.append({"type": "tool_use", "id": c["id"], "name": f["name"],
                       "input": _input(f["arguments"])})  # fmt: skip
    return blocks


def stop_reason(turn: Turn) -> str:
    if turn.finish_reason == "length":
        return "max_tokens"
    if turn.stop_sequence:
        return "stop_sequence"
    return "tool_use" if turn.message.get("tool_calls") else "end_turn"


class AnthropicMessages(Dialect):
    name: ClassVar[str] = "anthropic"
    path: ClassVar[str] = "/v1/messages"
    key_env: ClassVar[str] = "ANTHROPIC_API_KEY"
    error_types: ClassVar[Mapping[int, str]] = ERROR_TYPES

    def parse(
        self, body: dict[str, Any], headers: Mapping[str, str], ep: EndpointView, default_model: str
    ) -> Call:
        if not headers.get("anthropic-version"):
            raise RequestError("anthropic-version: header is required")
        model = string(body, "model", required=True)
        max_tokens = integer(body, "max_tokens", 1)
        if max_tokens is None:
            raise RequestError("max_tokens: Field required", param="max_tokens")
        temperature = number(body, "temperature", 0.0, 1.0)
        number(body, "top_p", 0.0, 1.0)
        integer(body, "top_k", 0)
        stops = body.get("stop_sequences")
        if stops is not None and (
            not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)
        ):
            raise RequestError("stop_sequences: must be a list of strings")
        thinking = body.get("thinking")
        if thinking is not None and (
            not isinstance(thinking, dict)
            or thinking.get("type") not in ("enabled", "disabled", "adaptive")
        ):
            raise RequestError("thinking: must be {type: enabled | disabled | adaptive, ...}")
        return Call(
            messages=chat_messages(body),
            tools=chat_tools(body.get("tools")),
            max_tokens=max_tokens,
            temperature=temperature,
            stream=boolean(body, "stream"),
            model=model or default_model,
            stop=stops or None,
        )

    def body(self, ep: EndpointView, call: Call, turn: Turn) -> dict[str, Any]:
        return {
            "id": f"msg_{ep.rollout_id}_{turn.node_id}",  # the same for a retried request
            "type": "message",
            "role": "assistant",
            "model": call.model,
            "content": content_blocks(turn),
            "stop_reason": stop_reason(turn),
            "stop_sequence": turn.stop_sequence or None,
            "usage": {
                "input_tokens": turn.num_prompt_tokens,
                "output_tokens": turn.num_completion_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }

    def events(self, ep: EndpointView, call: Call, turn: Turn) -> Iterator[bytes]:
        done = self.body(ep, call, turn)
        usage = {**done["usage"], "output_tokens": 0}
        start = {**done, "content": [], "stop_reason": None, "usage": usage}
        yield sse({"type": "message_start", "message": start}, "message_start")
        yield sse({"type": "ping"}, "ping")
        for i, b in enumerate(done["content"]):
            if b["type"] == "thinking":
                empty, delta = (
                    {**b, "thinking": ""},
                    {"type": "thinking_delta", "thinking": b["thinking"]},
                )
            elif b["type"] == "text":
                empty, delta = {**b, "text": ""}, {"type": "text_delta", "text": b["text"]}
            else:
                partial = json.dumps(b["input"], ensure_ascii=False)
                empty, delta = (
                    {**b, "input": {}},
                    {"type": "input_json_delta", "partial_json": partial},
                )
            yield sse({"type": "content_block_start", "index": i, "content_block": empty},
                      "content_block_start")  # fmt: skip
            yield sse({"type": "content_block_delta", "index": i, "delta": delta},
                      "content_block_delta")  # fmt: skip
            yield sse({"type": "content_block_stop", "index": i}, "content_block_stop")
        yield sse({"type": "message_delta",
                   "delta": {"stop_reason": done["stop_reason"], "stop_sequence": done["stop_sequence"]},
                   "usage": {"output_tokens": turn.num_completion_tokens}}, "message_delta")  # fmt: skip
        yield sse({"type": "message_stop"}, "message_stop")

    def error_body(self, status: int, message: str, code: str | None,
                   param: str | None) -> dict[str, Any]:  # fmt: skip
        kind = self.error_types.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}


register(AnthropicMessages())
