"""A fake teacher: a threaded HTTP server answering the vLLM routes a distillation teacher
is asked on (/v1/completions and /inference/v1/generate with prompt logprobs, /tokenize,
/detokenize) from simple rules, recording what it was sent."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeTeacherServer:
    """Every token's teacher logprob is ``logprob`` (asked for the top k: ids 0..k-1 at
    -1, -2, ...; ``entry``); ids at or above ``vocab`` are out of
    its vocabulary (400, as vLLM); ``offset`` shifts its tokenizer's ids (another
    tokenizer); the first ``num_failures`` scoring requests answer HTTP 400; without
    ``completions`` it has no /v1/completions (404, as a server with the token route only).
    ``scored``: every sequence it was asked to score; ``requests``: the scoring requests
    (path, body); ``headers``: theirs."""

    def __init__(
        self,
        *,
        logprob: float = -1.5,
        vocab: int = 64,
        offset: int = 0,
        num_failures: int = 0,
        completions: bool = True,
    ):
        self.logprob = logprob
        self.vocab = vocab
        self.offset = offset
        self.num_failures = num_failures
        self.completions = completions
        self.scored: list[list[int]] = []
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
                status, reply = fake.answer(self.path, body, dict(self.headers))
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
        if path == "/tokenize":
            return 200, {"tokens": [ord(c) % 50 + self.offset for c in body["prompt"]]}
        if path == "/detokenize":
            if any(t >= self.vocab for t in body["tokens"]):
                return 400, {"error": {"message": "Token id out of vocabulary"}}
            return 200, {"prompt": "".join(chr(65 + t % 26) for t in body["tokens"])}
        if path == "/v1/completions" and self.completions:
            prompts = body["prompt"]
        elif path == "/inference/v1/generate":
            prompts = [body["token_ids"]]
        else:
            return 404, {"detail": "Not Found"}
        if (top := max(max(ids) for ids in prompts)) >= self.vocab:
            return 400, {"error": {"message": f"Token id {top} is out of vocabulary"}}
        scoring = (body if path == "/v1/completions" else body["sampling_params"]).get(
            "prompt_logprobs"
        ) is not None
        with self.lock:
            if scoring:
                self.scored += prompts
                self.requests.append((path, body))
                self.headers.append(headers)
                if self.num_failures > 0:
                    self.num_failures -= 1
                    return 400, {"error": {"message": "scripted teacher failure"}}
        k = int((body if path == "/v1/completions" else body["sampling_params"]).get(
            "prompt_logprobs") or 0)  # fmt: skip
        entries = [[None] + [self.entry(t, k) for t in ids[1:]] for ids in prompts]
        if path == "/v1/completions":
            return 200, {"id": "fake", "choices": [
                {"index": i, "text": "", "prompt_logprobs": e, "finish_reason": "length"}
                for i, e in reversed(list(enumerate(entries)))  # any order: matched by index
            ]}  # fmt: skip
        return 200, {
            "request_id": "fake",
            "prompt_logprobs": entries[0],
            "choices": [{"token_ids": [1], "logprobs": None, "finish_reason": "length"}],
        }

    def entry(self, token: int, k: int) -> dict[str, Any]:
        """One position: ``token`` at ``logprob``, and with ``k`` the top k: ids 0..k-1
        at logprobs -1, -2, ... (the token's rank after them unless it is one of them)."""
        out = {str(j): {"logprob": -1.0 - j, "rank": j + 1} for j in range(k)}
        if str(token) not in out:
            out[str(token)] = {"logprob": self.logprob, "rank": k + 1}
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
