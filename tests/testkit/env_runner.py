"""Helpers for the env runner service tests: a fake inference server, a runner process,
publishing requests and reading back what the runner published.

    test ── RolloutRequested ──▶ nats-server ──▶ `treadle serve env_runner` (real process)
      │ ◀──── ROLLOUTS stream read by sequence ───────┘ │ model calls
      └─ thread: FakeInference (aiohttp) ◀─────────────┘ POST /inference/v1/generate

The fake answers with fixed qwen3 token ids (the ideas of
benchmarks/env_runner_throughput.py, copied, not imported): reverse_text gets
``<think>\\n\\n</think>\\n\\nabc<|im_end|>``; a prompt that offers tools gets a search tool
call until it holds ``tool_calls`` tool responses, then ``Founded in 1712.<|im_end|>``.
It can sleep before answering, hold every answer until released, and it records what a
test asserts on: generate calls, calls in flight (and their maximum), calls per task tag.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import nats.js.errors
from aiohttp import web
from tokenizers import Tokenizer

from treadle.proto.v1 import rollout_pb2
from treadle.services.bus import HDR_MSG_ID, Bus
from treadle.services.supervisor import ManagedProcess

REVERSE_ANSWER = "<think>\n\n</think>\n\nabc<|im_end|>"
SEARCH_CALL = (
    '<tool_call>\n{"name": "search", "arguments": {"query": "Brindle"}}\n</tool_call><|im_end|>'
)
FINAL_ANSWER = "Founded in 1712.<|im_end|>"
TAG_RE = re.compile(r"item-\d{3}")
"""Tags that name a task inside a prompt (see ``reverse_task``)."""


def reverse_task(i: int) -> dict[str, str]:
    """A reverse_text task whose prompt carries the tag ``item-<i>`` (FakeInference counts it)."""
    return {"text": f"item-{i:03d}"}


SEARCH_TASK = {"question": "In what year was Brindle founded?", "answer": 1712}


class FakeInference:
    """vLLM's token route, answered from a thread of the test process (see module doc)."""

    def __init__(self, tokenizer: Path, *, delay_s: float = 0.0, tool_calls: int = 1):
        self.tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
        self.tool_call_id = self._special("<tool_call>")
        self.tool_response_id = self._special("<tool_response>")
        self.delay_s = delay_s
        self.tool_calls = tool_calls
        self.reverse = self._body(REVERSE_ANSWER)
        self.search = self._body(SEARCH_CALL)
        self.final = self._body(FINAL_ANSWER)
        self._lock = threading.Lock()
        self.num_generate = 0  # generate calls received
        self.max_active = 0  # most calls in flight at once
        self._active: Counter[str] = Counter()  # tag -> calls in flight
        self._calls: Counter[str] = Counter()  # tag -> calls received
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-inference",
                                       daemon=True)  # fmt: skip
        self._open: asyncio.Event | None = None  # set: answers flow; clear: they are held
        self.runner: web.AppRunner | None = None

    def _special(self, token: str) -> int:
        tid = self.tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"the tokenizer has no {token} token: is it a qwen3 tokenizer?")
        return tid

    def _body(self, text: str) -> bytes:
        token_ids = self.tok.encode(text, add_special_tokens=False).ids
        doc = {
            "request_id": "fake",
            "output_mode": "tokens",
            "choices": [{
                "index": 0,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": token_ids,
                "logprobs": {"content": [{"token_id": t, "logprob": -0.1} for t in token_ids]},
                "weight_versions": [{"version": "0", "start": 0, "end": len(token_ids)}],
            }],
        }  # fmt: skip
        return json.dumps(doc).encode()

    # -- what tests read (any thread) -----------------------------------------------------
    @property
    def num_active(self) -> int:
        with self._lock:
            return sum(self._active.values())

    def active_tags(self) -> set[str]:
        with self._lock:
            return {tag for tag, n in self._active.items() if n > 0}

    def calls_per_tag(self) -> Counter[str]:
        with self._lock:
            return Counter(self._calls)

    def hold(self) -> None:
        """From now on, answers wait (after their delay) until ``release``: when this
        returns, every call counted in ``num_active`` is certain not to be answered."""
        self._in_loop(lambda event: event.clear())

    def release(self) -> None:
        self._in_loop(lambda event: event.set())

    def _in_loop(self, fn: Callable[[asyncio.Event], None]) -> None:
        assert self._open is not None, "start() first"
        event = self._open

        async def run() -> None:
            fn(event)

        asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    # -- the server ---------------------------------------------------------------------------
    def _answer(self, prompt_ids: list[int]) -> bytes:
        if self.tool_call_id not in prompt_ids:  # the qwen3 tools preamble names <tool_call>
            return self.reverse
        turn = prompt_ids.count(self.tool_response_id)
        return self.search if turn < self.tool_calls else self.final

    async def _generate(self, request: web.Request) -> web.Response:
        prompt_ids = json.loads(await request.read())["token_ids"]
        found = TAG_RE.search(self.tok.decode(prompt_ids, skip_special_tokens=False))
        tag = found.group(0) if found else ""
        with self._lock:
            self.num_generate += 1
            self._calls[tag] += 1
            self._active[tag] += 1
            self.max_active = max(self.max_active, sum(self._active.values()))
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            assert self._open is not None
            await self._open.wait()  # no suspension when open: answered in this same step
            return web.Response(body=self._answer(prompt_ids), content_type="application/json")
        finally:
            with self._lock:
                self._active[tag] -= 1

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _start(self, sock: socket.socket) -> None:
        self._open = asyncio.Event()
        self._open.set()
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.SockSite(self.runner, sock).start()

    def start(self) -> str:
        """Serve on a free loopback port; returns the base URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # bound here: no race for the port
        port = sock.getsockname()[1]
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(sock), self.loop).result(timeout=10)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        if self._open is not None:
            self.release()  # held answers finish instead of hanging the cleanup
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def start_runner(
    tmp: Path, name: str, *, nats_url: str, run_name: str, tokenizer: Path,
    inference_url: str | list[str], envs: list[str], max_concurrency: int,
    extra: tuple[str, ...] = (),
) -> ManagedProcess:  # fmt: skip
    """Start `treadle serve env_runner` (not waiting for it); its log is tmp/<name>.log.
    ``inference_url``: one inference server, or a list of replicas."""
    argv = [
        Path(sys.executable).parent / "treadle", "serve", "env_runner",
        "--nats.url", nats_url,
        "--run.name", run_name,
        "--run.output_dir", tmp / "runs",
        "--env_runner.tokenizer", tokenizer,
        *(("--env_runner.inference_urls", json.dumps(inference_url))
          if isinstance(inference_url, list) else ("--env_runner.inference_url", inference_url)),
        "--env_runner.envs", json.dumps(envs),
        "--env_runner.max_concurrency", str(max_concurrency),
        "--env_runner.grpc.port", "0",
        *extra,
    ]  # fmt: skip
    return ManagedProcess(name, [str(a) for a in argv], tmp / f"{name}.log").start()


def make_request(env: str, i: int, task: Mapping[str, object]) -> rollout_pb2.RolloutRequested:
    req = rollout_pb2.RolloutRequested(
        rollout_id=f"{env}-{i:03d}-{time.monotonic_ns()}",
        group_id=f"g{i}",
        group_index=0,
        group_size=1,
        env=env,
        task_id=f"t{i}",
        task_json=json.dumps(task),
        sampling=rollout_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=32),
        policy_version=0,
    )
    req.requested_at.GetCurrentTime()
    return req


async def publish_requests(bus: Bus, requests: list[rollout_pb2.RolloutRequested]) -> None:
    """Publish as the orchestrator does: Nats-Msg-Id = rollout_id."""
    for r in requests:
        await bus.publish(bus.subjects.rollouts_requested(r.env), r, msg_id=r.rollout_id)


async def read_completed(bus: Bus) -> list[tuple[str, rollout_pb2.RolloutCompleted]]:
    """Every message of the run's ROLLOUTS stream, in order: (Nats-Msg-Id, RolloutCompleted)."""
    stream = bus.subjects.stream_name("ROLLOUTS")
    state = (await bus.js.stream_info(stream)).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        try:
            raw = await bus.js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:  # a deleted sequence
            continue
        headers = raw.headers or {}
        done = await bus.decode(
            rollout_pb2.RolloutCompleted, raw.data or b"", headers, f"seq {seq}"
        )
        out.append((headers.get(HDR_MSG_ID, ""), done))
    return out


async def num_messages(bus: Bus, stream_base: str) -> int:
    info = await bus.js.stream_info(bus.subjects.stream_name(stream_base))
    return int(info.state.messages)


async def wait_for(
    what: str,
    check: Callable[[], Awaitable[bool]],
    timeout_s: float,
    *runners: ManagedProcess,
    detail: Callable[[], Awaitable[str]] | None = None,
    poll_s: float = 0.2,
) -> None:
    """Until ``await check()`` is true; fails naming ``what``, ``await detail()`` (what was
    seen instead) and the end of each runner's log."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        for r in runners:
            if r.poll() is not None:
                raise r.failure(f"died while waiting for {what}")
        if time.monotonic() > deadline:
            seen = f" ({await detail()})" if detail is not None else ""
            logs = "\n".join(str(r.failure("is running")) for r in runners)
            raise AssertionError(
                f"timed out after {timeout_s:.0f}s waiting for {what}{seen}\n{logs}"
            )
        await asyncio.sleep(poll_s)
