"""Interception overhead per call, per dialect: the HTTP path against a direct session call.

    .venv/bin/python benchmarks/interception_overhead.py [--n 1000]

(also run by ``benchmarks/env_runner_throughput.py``, part ``interception``.)

What runs, all on this machine:

    client process (http.client, keep-alive) ── POST /rollouts/r/v1/{chat/completions | responses | messages}
        │                                            ▼
        │                          this process: InterceptionServer ──▶ ModelSession.chat ──▶ instant model
        └─ times each call, request written -> answer read whole (SSE: to its last event)

    this process, no HTTP: ModelSession.chat(messages, tools) ──▶ instant model   ("direct")

Both paths run the same session work per call (render a fresh conversation of a system
prompt, one user message and one tool with the real qwen3 renderer, generate, parse,
record the nodes); every call's user message differs, so no retry cache answers. The
instant model returns fixed qwen3 ids (``<think>`` block + text) at once. The overhead of
a dialect is its latency minus the direct call's, at the median and at p99: what the
HTTP server, the dialect's parsing and answer (JSON or the SSE replay) and the client's
own request/response handling cost per call. The client is a separate process, so on a
2-core machine shared with other work the numbers are noisy: read the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "qwen3"
ANSWER = "<think>\nEasy.\n</think>\n\nThe answer is 42.<|im_end|>"
SYSTEM = "You are a careful assistant. Answer briefly."
SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
KEY = "benchmark-rollout-key-0123456789"


def bodies(stream: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    """Per dialect: (route, body template; ``__I__`` in the user text is the call's index)."""
    user = "Question number __I__: what is six times seven?"
    return {
        "openai_chat": ("/v1/chat/completions", {
            "model": "m", "max_tokens": 32, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "tools": [{"type": "function", "function": {"name": "search", "description": "Search.",
                                                        "parameters": SCHEMA}}]}),
        "openai_responses": ("/v1/responses", {
            "model": "m", "max_output_tokens": 32, "stream": stream, "instructions": SYSTEM,
            "input": user,
            "tools": [{"type": "function", "name": "search", "description": "Search.", "parameters": SCHEMA}]}),
        "anthropic": ("/v1/messages", {
            "model": "m", "max_tokens": 32, "stream": stream, "system": SYSTEM,
            "messages": [{"role": "user", "content": user}],
            "tools": [{"name": "search", "description": "Search.", "input_schema": SCHEMA}]}),
    }  # fmt: skip


# The client: its own process, one keep-alive connection, bodies encoded before timing.
CLIENT = r"""
import http.client, json, sys, time
host, port, path, key, n, warmup, template = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + key,
           "anthropic-version": "2023-06-01"}
conn = http.client.HTTPConnection(host, port)
out = []
cpu0 = 0.0
for i in range(warmup + n):
    if i == warmup:
        cpu0 = time.process_time()
    body = template.replace("__I__", str(i)).encode()
    t0 = time.perf_counter()
    conn.request("POST", path, body, headers)
    r = conn.getresponse()
    data = r.read()
    dt = time.perf_counter() - t0
    if r.status != 200:
        sys.exit(f"HTTP {r.status}: {data[:300]!r}")
    if i >= warmup:
        out.append(dt)
print(json.dumps({"latency_s": out, "cpu_s": time.process_time() - cpu0}))
"""


@dataclass
class Row:
    name: str
    latency_s: list[float]
    """Per call, seconds."""
    cpu_s: float
    """CPU time of this process (server + session) over the timed calls."""
    client_cpu_s: float = 0.0
    """CPU time of the client process over the timed calls."""

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latency_s, q)) * 1e3


class InstantModel:
    """Answers every generate call at once with the same qwen3 ids."""

    def __init__(self, ids: list[int]):
        n = len(ids)
        self.result = _Gen(np.asarray(ids, np.int32), np.full(n, -0.1, np.float32),
                           np.zeros(n, np.int32), "stop")  # fmt: skip

    async def generate(self, prompt_ids: Any, **kw: Any) -> Any:
        return self.result


@dataclass
class _Gen:
    token_ids: np.ndarray  # [num_tokens] int32
    logprobs: np.ndarray  # [num_tokens] float32
    policy_versions: np.ndarray  # [num_tokens] int32
    finish_reason: str


def _session(model: InstantModel, renderer: Any) -> Any:
    from treadle.env_runner.rubric import RolloutState
    from treadle.env_runner.session import Limits, ModelSession
    from treadle.proto.v1 import rollout_pb2

    rollout = rollout_pb2.Rollout(rollout_id="r", min_policy_version=-1, max_policy_version=-1)
    sampling = rollout_pb2.SamplingParams(max_tokens=32, temperature=1.0)
    return ModelSession(rollout, sampling, Limits(), RolloutState(task={}), renderer=renderer,
                        generator=model, attempts=1)  # fmt: skip


async def _client(url: str, path: str, template: str, n: int, warmup: int) -> dict[str, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, host, port, path, KEY, str(n), str(warmup), template,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the benchmark client failed (exit {proc.returncode})")
    doc: dict[str, Any] = json.loads(out)
    return doc


async def measure(n: int, warmup: int = 100) -> list[Row]:
    import treadle_native
    from treadle.env_runner.interception import InterceptionServer
    from treadle.env_runner.interception.openai_chat import OpenAIChat

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    model = InstantModel(tok.encode(ANSWER, add_special_tokens=False).ids)
    renderer = treadle_native.Renderer("qwen3", str(TOKENIZER))
    rows = []
    # direct: the chat dialect's own conversion of the same request, then the session
    route, template = bodies(False)["openai_chat"]
    session = _session(model, renderer)
    direct, cpu = [], 0.0
    for i in range(warmup + n):
        doc = json.loads(json.dumps(template).replace("__I__", str(i)))
        call = OpenAIChat().parse(doc, {}, None, "m")  # type: ignore[arg-type]
        c0, t0 = time.process_time(), time.perf_counter()
        await session.chat(call.messages, call.tools, max_tokens=call.max_tokens)
        if i >= warmup:
            direct.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
    rows.append(Row("direct session.chat", direct, cpu))
    async with InterceptionServer() as server:
        for stream in (False, True):
            for dialect, (route, template) in bodies(stream).items():
                server.register("r", _session(model, renderer), api_key=KEY)
                c0 = time.process_time()  # the warm-up calls too: scaled below
                try:
                    out = await _client(
                        server.url, "/rollouts/r" + route, json.dumps(template), n, warmup
                    )
                finally:
                    await server.unregister("r")
                cpu = (time.process_time() - c0) * n / (n + warmup)
                name = f"{dialect}{' stream' if stream else ''}"
                rows.append(Row(name, out["latency_s"], cpu, out["cpu_s"]))
    return rows


def print_rows(rows: list[Row]) -> None:
    direct = rows[0]
    n = len(direct.latency_s)
    d50, d99, dcpu = direct.pct(50), direct.pct(99), direct.cpu_s / n * 1e3
    print(f"\ninterception overhead per call ({n} calls per row; instant model; client in its "
          "own process)")  # fmt: skip
    print(f"{'path':>24} {'p50 ms':>7} {'p99 ms':>7} {'overhead p50':>13} {'overhead p99':>13} "
          f"{'server CPU ms':>14} {'CPU overhead':>13} {'client CPU ms':>14}")  # fmt: skip
    for r in rows:
        p50, p99, cpu = r.pct(50), r.pct(99), r.cpu_s / n * 1e3
        extra = ("", "", "", "")
        if r is not direct:
            extra = (f"{p50 - d50:.3f}", f"{p99 - d99:.3f}", f"{cpu - dcpu:.3f}",
                     f"{r.client_cpu_s / n * 1e3:.3f}")  # fmt: skip
        print(f"{r.name:>24} {p50:>7.3f} {p99:>7.3f} {extra[0]:>13} {extra[1]:>13} "
              f"{cpu:>14.3f} {extra[2]:>13} {extra[3]:>14}")  # fmt: skip
    worst = max(r.pct(50) - d50 for r in rows[1:])
    print(f"(overhead: the row's latency minus the direct call's at the same percentile, goal "
          f"< 2 ms at the median: worst {worst:.3f} ms. server CPU: this process's CPU time per "
          "call (HTTP server, dialect, session); CPU overhead: minus the direct call's. On "
          "shared cores latency includes waiting for a core; CPU time does not. Mean direct "
          f"call {statistics.mean(direct.latency_s) * 1e3:.3f} ms.)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=1000, help="timed calls per row (after 100 warm-up)")
    args = p.parse_args()
    if not (TOKENIZER / "tokenizer.json").is_file():
        sys.exit(f"{TOKENIZER} has no tokenizer.json (is ../shared beside the checkout?)")
    print_rows(asyncio.run(measure(args.n)))


if __name__ == "__main__":
    main()
