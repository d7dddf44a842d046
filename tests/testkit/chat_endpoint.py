"""A scripted OpenAI-compatible chat endpoint (HTTP, in a thread) for rejection sampling.

    with ReverserEndpoint(port=0) as url:  # http://127.0.0.1:<port>/v1 (0: a free port)
        ...                          # ReverserEndpoint.calls: every request body

reverse_text: a request with seed % 3 == 0 gets the text reversed (reward 1), seed % 3 ==
1 the reversal without its last character (partial credit), otherwise the text echoed.
tool_search: a user turn gets a search call, a tool result the year it names. It stands
in for a source model where the model is incidental; it honours no other parameter.

    with ScriptedEndpoint(script) as url:  # any answer: script(body) -> str | (status, text)
        ...                                # endpoint.calls / .headers: every request

ScriptedEndpoint answers each request with ``script(request body)``: a string is the
assistant's content (a 200 chat completion), a (status, text) pair is sent as is (an
HTTP error or a body that is no chat completion); a script may sleep (a slow endpoint).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar


class _Handler(BaseHTTPRequestHandler):
    calls: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.calls.append(body)
        last = body["messages"][-1]
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if body.get("tools"):
            if last["role"] == "user":
                message["tool_calls"] = [{"id": "c1", "type": "function", "function": {
                    "name": "search", "arguments": json.dumps({"query": "Brindle"})}}]  # fmt: skip
            else:
                year = re.search(r"founded in (\d+)", last["content"])
                message["content"] = f"Founded in {year.group(1) if year else '?'}."
        else:
            text, seed = last["content"], body.get("seed", 0)
            message["content"] = {0: text[::-1], 1: text[:0:-1]}.get(seed % 3, text)
        data = json.dumps({
            "id": "x", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3},
        }).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # socketserver's 5 refuses a burst of concurrent samples


class ReverserEndpoint:
    calls = _Handler.calls

    def __init__(self, port: int = 0):
        self.port = port

    def __enter__(self) -> str:
        _Handler.calls.clear()
        self.server = _Server(("127.0.0.1", self.port), _Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_port}/v1"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


Script = Callable[[dict[str, Any]], "str | tuple[int, str]"]


class _ScriptedHandler(BaseHTTPRequestHandler):
    server: _ScriptedServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        endpoint = self.server.endpoint
        with endpoint.lock:
            endpoint.calls.append(body)
            endpoint.headers.append(dict(self.headers))
        out = endpoint.script(body)
        if isinstance(out, tuple):
            status, text = out
        else:
            status, text = 200, json.dumps({
                "id": "x", "object": "chat.completion", "model": body.get("model", ""),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": out}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": max(1, len(out) // 4)},
            })  # fmt: skip
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class _ScriptedServer(ThreadingHTTPServer):
    request_queue_size = 128
    daemon_threads = True
    endpoint: ScriptedEndpoint


class ScriptedEndpoint:
    """An OpenAI-compatible chat endpoint answering ``script(body)`` (see the module doc)."""

    def __init__(self, script: Script, port: int = 0):
        self.script = script
        self.port = port
        self.calls: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        """Each request's HTTP headers, in the order of ``calls``."""
        self.lock = threading.Lock()

    def __enter__(self) -> str:
        self.server = _ScriptedServer(("127.0.0.1", self.port), _ScriptedHandler)
        self.server.endpoint = self
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_port}/v1"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
