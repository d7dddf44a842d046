"""OpenAI Responses: ``POST /rollouts/{rollout_id}/v1/responses``.

The request's ``input`` (a string, or a list of items) becomes chat messages:

    message                 {"role": user | system | developer | assistant, "content": str | [input_text | output_text]}
    function_call           joins the assistant message before it as a tool call (call_id, name, arguments)
    function_call_output    a tool message answering call_id (output: str | [input_text])
    reasoning               the reasoning_content of the assistant message after it (summary / content text)

``instructions`` is the system message, first. ``previous_response_id`` continues a
response this endpoint gave in the same rollout: its conversation (input and output,
without its instructions, as OpenAI does) comes before this input; the last
``MAX_STORED_RESPONSES`` responses of a rollout are kept, whatever ``store`` says.
``tools`` are function tools (``{"type": "function", "name", "description",
"parameters"}``); other tool types (hosted tools, custom/freeform tools) are refused, as
the model behind cannot call them. The request controls max_output_tokens and temperature
(in [0, 2]); top_p must be in (0, 1] and is the rollout's, like every other sampling
setting; reasoning, text, tool_choice, parallel_tool_calls, include, metadata, store,
truncation and user are accepted and ignored.

The answer is a ``response`` whose output items are a ``reasoning`` item (its text as
``reasoning_text`` content) when the model reasoned, a ``message`` with one
``output_text`` when it wrote text (or called no tool), and one ``function_call`` per tool
call; ``status`` is ``incomplete`` (``incomplete_details.reason = max_output_tokens``) when
the turn was cut by its token budget. With ``"stream": true`` the same response is replayed
as ``response.*`` SSE events (``event:`` line + ``data:`` with a ``sequence_number``):
created, in_progress, then per item output_item.added, its content_part / delta / done
events, output_item.done, and finally response.completed (or response.incomplete).
Errors are OpenAI's error object.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from treadle.env_runner.interception.dialect import Call, Dialect, EndpointView, register, sse
from treadle.env_runner.interception.openai_chat import OPENAI_ERROR_TYPES, openai_error_body
from treadle.env_runner.interception.parsing import (
    RequestError,
    arguments_json,
    boolean,
    integer,
    number,
    objects,
    shown,
    string,
    text_parts,
)
from treadle.env_runner.session import Turn

MAX_STORED_RESPONSES = 64
"""Responses of one rollout that ``previous_response_id`` can name (the latest ones)."""
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise RequestError(f"{where}.summary must be a list")
    return text_parts(parts, f"{where}.content", TEXT_PARTS) or ""


def input_messages(items: Any) -> list[dict[str, Any]]:
    """The Responses ``input`` as chat messages (see the module doc)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError("input must be a string or a list of items", param="input")
    out: list[dict[str, Any]] = []
    reasoning = ""  # waits for the assistant message it belongs to
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got "
                                   f"{shown(role)}", param="input")  # fmt: skip
            content = text_parts(item.get("content"), f"{where}.content", TEXT_PARTS) or ""
            m: dict[str, Any] = {"role": ROLES[role], "content": content}
            if ROLES[role] == "assistant" and reasoning:
                m["reasoning_content"], reasoning = reasoning, ""
            out.append(m)
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise RequestError(f"{where}: a function_call needs a string name and call_id",
                                   param="input")  # fmt: skip
            call = {"id": call_id, "type": "function", "function": {
                "name": name, "arguments": arguments_json(item.get("arguments"), f"{where}.arguments")}}  # fmt: skip
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise RequestError(f"{where}.call_id must be a string", param="input")
            output = text_parts(item.get("output"), f"{where}.output", TEXT_PARTS) or ""
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            reasoning += _reasoning_text(item, where)
        else:
            raise RequestError(
                f"{where}.type {shown(kind)} is not supported (message, function_call, "
                "function_call_output and reasoning items are)", param="input",
            )  # fmt: skip
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses function tools as chat-completions tools."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(objects(tools, "tools")):
        if t.get("type") != "function":
            raise RequestError(f"tools[{i}].type {shown(t.get('type'))} is not supported: only "
                               "function tools can be served", param="tools")  # fmt: skip
        if not isinstance(t.get("name"), str):
            raise RequestError(f"tools[{i}].name must be a string", param="tools")
        f = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": f})
    return out or None


def _ids(ep: EndpointView, turn: Turn) -> str:
    return f"{ep.rollout_id}_{turn.node_id}"  # the same for a retried request


def output_items(ep: EndpointView, turn: Turn) -> list[dict[str, Any]]:
    """The response's output items for ``turn`` (see the module doc)."""
    suffix = _ids(ep, turn)
    status = "incomplete" if turn.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if turn.reasoning:
        items.append({"type": "reasoning", "id": f"rs_{suffix}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": turn.reasoning}],
                      "status": status})  # fmt: skip
    msg = turn.message
    calls = msg.get("tool_calls") or []
    if msg["content"] or not calls:
        items.append({"type": "message", "id": f"msg_{suffix}", "status": status,
                      "role": "assistant", "content": [
                          {"type": "output_text", "text": msg["content"], "annotations": [], "logprobs": []}]})  # fmt: skip
    for j, c in enumerate(calls):
        items.append({"type": "function_call", "id": f"fc_{suffix}_{j}", "call_id": c["id"],
                      "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                      "status": "completed"})  # fmt: skip
    return items


class OpenAIResponses(Dialect):
    name: ClassVar[str] = "openai_responses"
    path: ClassVar[str] = "/v1/responses"
    key_env: ClassVar[str] = "OPENAI_API_KEY"
    error_types: ClassVar[Mapping[int, str]] = OPENAI_ERROR_TYPES

    def parse(
        self, body: dict[str, Any], headers: Mapping[str, str], ep: EndpointView, default_model: str
    ) -> Call:
        if body.get("input") is None:
            raise RequestError("input is required", param="input")
        messages = input_messages(body["input"])
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise RequestError("instructions must be a string", param="instructions")
        previous = string(body, "previous_response_id")
        if previous is not None:
            if previous not in ep.conversations:
                raise RequestError(
                    f"previous_response_id {shown(previous)} is not a response of this rollout "
                    f"(the last {MAX_STORED_RESPONSES} are kept)", param="previous_response_id",
                    code="previous_response_not_found",
                )  # fmt: skip
            messages = [*ep.conversations[previous], *messages]
        if not messages:
            raise RequestError("input must hold at least one item", param="input")
        history = messages
        if instructions:
            messages = [{"role": "system", "content": instructions}, *messages]
        max_tokens = integer(body, "max_output_tokens", 1)
        temperature = number(body, "temperature", 0.0, 2.0)
        number(body, "top_p", 0.0, 1.0, lo_open=True)
        integer(body, "top_logprobs", 0, 20)
        model = body.get("model")
        return Call(
            messages=messages,
            tools=chat_tools(body.get("tools")),
            max_tokens=max_tokens,
            temperature=temperature,
            stream=boolean(body, "stream"),
            model=model if isinstance(model, str) and model else default_model,
            echo={
                "instructions": instructions,
                "tools": body.get("tools") or [],
                "previous_response_id": previous,
                "history": history,
                "temperature": temperature,
                "max_output_tokens": max_tokens,
                "tool_choice": body.get("tool_choice", "auto"),
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "store": body.get("store", True),
                "metadata": body.get("metadata") or {},
            },
        )

    def response(self, ep: EndpointView, call: Call, turn: Turn | None) -> dict[str, Any]:
        """The ``response`` object: in progress (``turn`` None, no output yet) or done."""
        e = call.echo
        doc: dict[str, Any] = {
            "id": f"resp_{_ids(ep, turn) if turn else ''}", "object": "response",
            "created_at": int(time.time()), "status": "in_progress", "error": None,
            "incomplete_details": None, "instructions": e["instructions"], "model": call.model,
            "output": [], "parallel_tool_calls": e["parallel_tool_calls"],
            "previous_response_id": e["previous_response_id"], "reasoning": None,
            "store": e["store"], "temperature": e["temperature"], "text": {"format": {"type": "text"}},
            "tool_choice": e["tool_choice"], "tools": e["tools"], "top_p": None,
            "truncation": "disabled", "max_output_tokens": e["max_output_tokens"],
            "metadata": e["metadata"], "usage": None,
        }  # fmt: skip
        if turn is None:
            return doc
        cut = turn.finish_reason == "length"
        p, c = turn.num_prompt_tokens, turn.num_completion_tokens
        doc.update(
            status="incomplete" if cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            output=output_items(ep, turn),
            usage={"input_tokens": p, "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": p + c},
        )  # fmt: skip
        return doc

    def body(self, ep: EndpointView, call: Call, turn: Turn) -> dict[str, Any]:
        return self.response(ep, call, turn)

    def events(self, ep: EndpointView, call: Call, turn: Turn) -> Iterator[bytes]:
        done = self.response(ep, call, turn)
        start = {
            **self.response(ep, call, None),
            "id": done["id"],
            "created_at": done["created_at"],
        }
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            seq += 1
            return sse({"type": kind, "sequence_number": seq - 1, **fields}, kind)

        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        for k, item in enumerate(done["output"]):
            at = {"item_id": item["id"], "output_index": k}
            if item["type"] == "function_call":
                yield event("response.output_item.added", output_index=k,
                            item={**item, "arguments": "", "status": "in_progress"})  # fmt: skip
                yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                yield event("response.function_call_arguments.done", **at,
                            name=item["name"], arguments=item["arguments"])  # fmt: skip
            else:
                key = "content"
                part = item[key][0]
                text, kind = part["text"], part["type"]
                empty = {**part, "text": ""}
                yield event("response.output_item.added", output_index=k,
                            item={**item, key: [], "status": "in_progress"})  # fmt: skip
                yield event("response.content_part.added", **at, content_index=0, part=empty)
                delta = (
                    "response.output_text" if kind == "output_text" else "response.reasoning_text"
                )
                extra: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
                yield event(f"{delta}.delta", **at, content_index=0, delta=text, **extra)
                yield event(f"{delta}.done", **at, content_index=0, text=text, **extra)
                yield event("response.content_part.done", **at, content_index=0, part=part)
            yield event("response.output_item.done", output_index=k, item=item)
        yield event(f"response.{done['status']}", response=done)

    def answered(self, ep: EndpointView, call: Call, turn: Turn) -> None:
        """Keep the conversation (without instructions) for ``previous_response_id``."""
        msg = dict(turn.message)
        if turn.reasoning:
            msg["reasoning_content"] = turn.reasoning
        convs = ep.conversations
        convs[f"resp_{_ids(ep, turn)}"] = [*call.echo["history"], msg]
        while len(convs) > MAX_STORED_RESPONSES:
            del convs[next(iter(convs))]

    def error_body(self, status: int, message: str, code: str | None,
                   param: str | None) -> dict[str, Any]:  # fmt: skip
        return openai_error_body(self.error_types, status, message, code, param)


register(OpenAIResponses())
