"""What an API dialect is to the interception server, and the registry of dialects.

A dialect turns its request body into a ``Call`` (chat messages and tools as the
ModelSession takes them), and the session's ``Turn`` back into its answer: a JSON body,
or the SSE events of a stream, and errors in its own shape. It holds no state of its own;
what must outlive a request (OpenAI Responses' stored conversations) lives on the
rollout's endpoint. The server (server.py) does the rest: routing, keys, body limits,
retries, the session call.

Adding a dialect is adding a module that defines a ``Dialect`` subclass and calls
``register`` with an instance (openai_chat.py, openai_responses.py, anthropic.py), then
importing it from ``__init__.py``.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from aiohttp import web

from treadle.env_runner.interception.parsing import RequestError, one_line
from treadle.env_runner.session import Turn


class EndpointView(Protocol):
    """What a dialect reads of the rollout's endpoint (``server.Endpoint``)."""

    rollout_id: str
    conversations: OrderedDict[str, list[dict[str, Any]]]
    """OpenAI Responses: conversations by response id, for ``previous_response_id``."""


@dataclass
class Call:
    """One request as the session takes it."""

    messages: list[dict[str, Any]]
    """Chat messages (role system/user/assistant/tool, string content, tool_calls with JSON
    text arguments, tool_call_id, reasoning_content)."""
    tools: list[dict[str, Any]] | None
    """Chat-completions tools (``{"type": "function", "function": {...}}``), or None."""
    max_tokens: int | None
    """What the request asks for (the session clamps it to the rollout's budget)."""
    temperature: float | None
    stream: bool
    model: str
    """The model name the answer echoes."""
    stop: list[str] | None = None
    """Stop sequences: the turn ends where its content first holds one."""
    echo: dict[str, Any] = field(default_factory=dict)
    """Dialect fields the answer repeats (stream_options, instructions, tools as sent, ...)."""


class Dialect:
    """One API's wire format (see the module doc); subclasses set the class attributes."""

    name: ClassVar[str]
    """Short name, for logs, metrics and the benchmark (``openai_chat``, ...)."""
    method: ClassVar[str] = "POST"
    path: ClassVar[str]
    """The route under ``/rollouts/{rollout_id}``, e.g. ``/v1/chat/completions``."""
    key_env: ClassVar[str]
    """The environment variable a program puts the rollout's key in, named in a 401."""
    error_types: ClassVar[Mapping[int, str]]
    """HTTP status -> the dialect's error type name."""

    def parse(
        self, body: dict[str, Any], headers: Mapping[str, str], ep: EndpointView, default_model: str
    ) -> Call:
        """The request as a Call; RequestError when the dialect's API would refuse it."""
        raise NotImplementedError

    def body(self, ep: EndpointView, call: Call, turn: Turn) -> dict[str, Any]:
        """The non-streaming answer."""
        raise NotImplementedError

    def events(self, ep: EndpointView, call: Call, turn: Turn) -> Iterator[bytes]:
        """The streamed answer: SSE frames (``event:``/``data:`` lines, blank-line ended)."""
        raise NotImplementedError

    def answered(self, ep: EndpointView, call: Call, turn: Turn) -> None:
        """Called once per turn the session generated (not for retries answered from the
        cache): keep what a later request may refer to."""

    def error_body(self, status: int, message: str, code: str | None,
                   param: str | None) -> dict[str, Any]:  # fmt: skip
        """The JSON body of an error answer."""
        raise NotImplementedError

    def error(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> web.Response:
        """An error answer in the dialect's shape; ``message`` is cut to one line."""
        return web.json_response(self.error_body(status, one_line(message), code, param),
                                 status=status)  # fmt: skip

    def request_error(self, e: RequestError) -> web.Response:
        return self.error(e.status, str(e), e.code, e.param)


DIALECTS: dict[str, Dialect] = {}
"""Every registered dialect by name."""


def register(dialect: Dialect) -> Dialect:
    """Serve ``dialect`` on every interception server started from now on."""
    if dialect.name in DIALECTS:
        raise ValueError(f"an interception dialect named {dialect.name!r} is already registered")
    for other in DIALECTS.values():
        if (other.method, other.path) == (dialect.method, dialect.path):
            raise ValueError(f"{dialect.name} and {other.name} both serve {dialect.path}")
    DIALECTS[dialect.name] = dialect
    return dialect


def sse(data: dict[str, Any], event: str | None = None) -> bytes:
    """One SSE frame: ``event: <event>`` (when given) and ``data: <json>``."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def finish_reason(turn: Turn) -> str:
    """OpenAI's finish_reason of ``turn``: stop | length | tool_calls."""
    if turn.finish_reason == "length":
        return "length"
    return "tool_calls" if turn.message.get("tool_calls") else "stop"
