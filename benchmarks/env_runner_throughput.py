"""Env runner throughput: rollouts/s with an instant fake model; interception overhead per dialect.

    .venv/bin/python benchmarks/env_runner_throughput.py [--n 1000] [--concurrency 8,32,128] [--envs reverse_text,tool_search] [--tool-calls 2]
                                                         [--parts runner,interception,cli_agent] [--interception-calls 1000]

Part ``interception`` (benchmarks/interception_overhead.py, which says how) measures the
interception server's overhead per model call in each dialect (OpenAI Chat Completions,
Responses, Anthropic Messages; JSON and streamed), median and p99, against a direct
ModelSession call with an instant model. Part ``cli_agent``
(benchmarks/cli_agent_throughput.py) measures rollouts/s of a CLI-agent harness (a
program making one call in each dialect) in the local and the sandbox runtime. Part
``runner`` is the rest of this docstring.

What runs, all on this machine:

    benchmark process ── RolloutRequested ×N ──▶ embedded nats-server ──▶ `treadle serve env_runner`
      │ (publisher + collector)                                               │ (a real separate process)
      │ ◀──────────── RolloutCompleted ×N ─────────────────────────────────────┘
      └─ thread: fake inference (aiohttp), POST /inference/v1/generate ◀── the runner's model calls

The fake model answers every generate call at once with fixed qwen3 token ids:
reverse_text gets ``<think>\\n\\n</think>\\n\\nabc<|im_end|>`` (one model call per
rollout); tool_search gets ``--tool-calls`` tool calls (a search, then calculator calls)
before ``Founded in 1712.<|im_end|>`` — it counts the ``<tool_response>`` tokens in the
prompt to know which turn it is, so a rollout makes tool_calls + 1 model calls. So the
numbers measure the env runner itself: pulling, rendering (treadle_native), the HTTP
round trip, parsing, tools, rewards, building and publishing the Rollout.

For each concurrency setting a fresh runner (its own run name) serves every env in
``--envs``; the envs are measured one after another. Per env: N requests are published
at once, and rollouts/s = N / (first publish -> last completion received); "steady/s"
leaves out the first 10% of completions (startup, imports, connection setup). Every
completion's status is checked; anything not OK is counted and its messages printed.
CPU ms/rollout is utime+stime from /proc of the runner, of nats-server and of this
process (fake model + publisher + collector), so on a small machine you can see who
holds the cores; the runner's event-loop thread is also split into time on a core and
time runnable but waiting for one (/proc/<pid>/schedstat). With an instant model the
runner is CPU-bound, so rollouts/s is about 1 / (runner CPU per rollout) when it has a
core to itself. Absolute numbers depend on the machine; on shared cores read the
runner's CPU per rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cli_agent_throughput  # benchmarks/, beside this file
import interception_overhead
import nats.errors
from aiohttp import web
from tokenizers import Tokenizer

from treadle.proto.v1 import rollout_pb2
from treadle.services.bus import Bus
from treadle.services.nats_server import EmbeddedNats
from treadle.services.sections import NatsSection
from treadle.services.supervisor import ManagedProcess

ROOT = Path(__file__).resolve().parents[1]
# the folder tests/testkit/paths.py's shared_tokenizer("qwen3") names
TOKENIZER = ROOT.parent / "shared" / "tokenizers" / "qwen3"
TASKS = {
    "reverse_text": {"text": "hello world"},
    "tool_search": {"question": "In what year was Brindle founded?", "answer": 1712},
}
REVERSE_ANSWER = "<think>\n\n</think>\n\nabc<|im_end|>"
SEARCH_CALL = (
    '<tool_call>\n{"name": "search", "arguments": {"query": "Brindle"}}\n</tool_call><|im_end|>'
)
CALC_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1712 + 0"}}\n</tool_call><|im_end|>'
FINAL_ANSWER = "Founded in 1712.<|im_end|>"
CLK_TCK = os.sysconf("SC_CLK_TCK")
Status = rollout_pb2.RolloutStatus


# --- the fake model -----------------------------------------------------------------------
class FakeInference:
    """vLLM's token route answered instantly from a thread of this process (see module doc)."""

    def __init__(self, tokenizer: Path, tool_calls: int):
        tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))

        def ids(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False).ids

        def special(token: str) -> int:
            tid = tok.token_to_id(token)
            if tid is None:
                raise ValueError(f"{tokenizer} has no {token} token: is it a qwen3 tokenizer?")
            return tid

        self.tool_call_id = special("<tool_call>")
        self.tool_response_id = special("<tool_response>")
        self.tool_calls = tool_calls
        self.reverse = self._body(ids(REVERSE_ANSWER))
        self.calls = [
            self._body(ids(SEARCH_CALL if k == 0 else CALC_CALL)) for k in range(tool_calls)
        ]
        self.final = self._body(ids(FINAL_ANSWER))
        self.num_requests = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="fake-inference", daemon=True
        )
        self.runner: web.AppRunner | None = None

    @staticmethod
    def _body(token_ids: list[int]) -> bytes:
        n = len(token_ids)
        doc = {
            "request_id": "fake",
            "output_mode": "tokens",
            "choices": [{
                "index": 0,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": token_ids,
                "logprobs": {"content": [{"token_id": t, "logprob": -0.1} for t in token_ids]},
                "weight_versions": [{"version": "0", "start": 0, "end": n}],
            }],
        }  # fmt: skip
        return json.dumps(doc).encode()

    def answer(self, prompt_ids: list[int]) -> bytes:
        """reverse_text when the prompt offers no tools; tool_search's next turn otherwise."""
        if self.tool_call_id not in prompt_ids:  # the qwen3 tools preamble names <tool_call>
            return self.reverse
        turn = prompt_ids.count(self.tool_response_id)
        return self.calls[turn] if turn < self.tool_calls else self.final

    async def _generate(self, request: web.Request) -> web.Response:
        self.num_requests += 1
        body = json.loads(await request.read())
        return web.Response(body=self.answer(body["token_ids"]), content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _start(self, sock: socket.socket) -> None:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.SockSite(self.runner, sock).start()

    def start(self) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # bound here: no race for the port
        port = sock.getsockname()[1]
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(sock), self.loop).result(timeout=10)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


# --- measuring ------------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields 3.. of proc(5); the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def loop_sched_s(pid: int) -> tuple[float, float]:
    """(on CPU, waiting in the run queue) of a process's main thread — the runner's event
    loop — in seconds (/proc/<pid>/schedstat)."""
    run_ns, wait_ns, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(run_ns) * 1e-9, int(wait_ns) * 1e-9


def seconds(ts: Any) -> float:
    return ts.seconds + ts.nanos * 1e-9


@dataclass
class Result:
    env: str
    concurrency: int
    num_requested: int
    wall_s: float = 0.0
    publish_s: float = 0.0  # first publish -> last publish acked
    received: list[float] = field(default_factory=list)  # monotonic receive times
    statuses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    num_model_calls: int = 0
    latency_s: list[float] = field(default_factory=list)  # started -> finished, per rollout
    cpu_s: dict[str, float] = field(default_factory=dict)  # runner / nats / bench
    loop_on_cpu_s: float = 0.0  # the runner's main thread (its event loop)
    loop_runq_s: float = 0.0  # ... runnable but waiting for a core

    @property
    def num_done(self) -> int:
        return len(self.received)

    @property
    def rate(self) -> float:
        return self.num_done / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def steady_rate(self) -> float:
        t = sorted(self.received)
        k = len(t) // 10
        if len(t) - k < 2 or k == 0:
            return float("nan")
        return (len(t) - k) / (t[-1] - t[k - 1])


def make_request(env: str, i: int, max_tokens: int) -> rollout_pb2.RolloutRequested:
    req = rollout_pb2.RolloutRequested(
        rollout_id=uuid.uuid4().hex,
        group_id=f"g{i // 8}",
        group_index=i % 8,
        group_size=8,
        env=env,
        task_id="t0",
        task_json=json.dumps(TASKS[env]),
        sampling=rollout_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens),
        policy_version=0,
    )
    req.requested_at.GetCurrentTime()
    return req


async def measure(
    bus: Bus, env: str, concurrency: int, n: int, max_tokens: int, timeout_s: float,
    pids: dict[str, int], runner: ManagedProcess,
) -> Result:  # fmt: skip
    """Publish n requests for env, collect their completions, return what was seen."""
    res = Result(env, concurrency, n)
    requests = [make_request(env, i, max_tokens) for i in range(n)]
    wanted = {r.rollout_id for r in requests}
    consumer = await bus.consumer(
        "ROLLOUTS", f"bench-{env}", bus.subjects.rollouts_completed, rollout_pb2.RolloutCompleted,
        max_ack_pending=10_000,
    )  # fmt: skip
    sub = consumer.sub  # a bare fetch/ack loop: the collector should cost as little CPU as it can
    subject = bus.subjects.rollouts_requested(env)
    cpu0 = {name: cpu_s(pid) for name, pid in pids.items()}
    sched0 = loop_sched_s(pids["runner"])
    t0 = time.monotonic()

    async def publish_all() -> None:
        for k in range(0, n, 100):
            await asyncio.gather(
                *(bus.publish(subject, r, msg_id=r.rollout_id) for r in requests[k : k + 100])
            )
        res.publish_s = time.monotonic() - t0

    publisher = asyncio.create_task(publish_all())
    deadline = t0 + timeout_s
    while wanted and time.monotonic() < deadline:
        if runner.poll() is not None:
            raise runner.failure("died during the benchmark")
        try:
            msgs = await sub.fetch(512, timeout=0.5)
        except (nats.errors.TimeoutError, TimeoutError):
            continue
        now = time.monotonic()
        for m in msgs:
            done = await bus.decode(rollout_pb2.RolloutCompleted, m.data, m.headers, m.subject)
            await m.ack()
            r = done.rollout
            if r.rollout_id not in wanted:
                continue
            wanted.discard(r.rollout_id)
            res.received.append(now)
            kind = Status.Kind.Name(r.status.kind)
            res.statuses[kind] += 1
            if r.status.kind != Status.Kind.KIND_OK:
                err = Status.ErrorKind.Name(r.status.error_kind)
                res.errors[f"{kind} {err}: {r.status.message[:300]}"] += 1
            res.num_model_calls += r.timing.num_model_calls
            res.latency_s.append(seconds(r.timing.finished_at) - seconds(r.timing.started_at))
    res.wall_s = (max(res.received) if res.received else time.monotonic()) - t0
    res.cpu_s = {name: cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
    sched1 = loop_sched_s(pids["runner"])
    res.loop_on_cpu_s, res.loop_runq_s = sched1[0] - sched0[0], sched1[1] - sched0[1]
    await publisher
    await sub.unsubscribe()
    return res


# --- one runner per concurrency setting --------------------------------------------------
def runner_argv(
    nats_url: str,
    run_name: str,
    out_dir: Path,
    inference_url: str,
    envs: list[str],
    concurrency: int,
) -> list[str]:
    return [
        str(Path(sys.executable).parent / "treadle"), "serve", "env_runner",
        "--nats.url", nats_url,
        "--run.name", run_name,
        "--run.output_dir", str(out_dir),
        "--env_runner.tokenizer", str(TOKENIZER),
        "--env_runner.inference_url", inference_url,
        "--env_runner.envs", json.dumps(envs),
        "--env_runner.max_concurrency", str(concurrency),
        "--env_runner.grpc.port", "0",
    ]  # fmt: skip


async def wait_consuming(
    bus: Bus, envs: list[str], runner: ManagedProcess, timeout_s: float = 120.0
) -> None:
    """Until the runner has its pull consumers (service.py names them env-runner-<env>)."""
    stream = bus.subjects.stream_name("ROLLOUT_REQUESTS")
    deadline = time.monotonic() + timeout_s
    missing = list(envs)
    while missing:
        if runner.poll() is not None:
            raise runner.failure("died during startup")
        if time.monotonic() > deadline:
            raise runner.failure(f"has no consumer for {missing} after {timeout_s:.0f}s")
        try:
            await bus.js.consumer_info(stream, f"env-runner-{missing[0]}")
            missing.pop(0)
        except Exception:  # stream or consumer not created yet
            await asyncio.sleep(0.2)


async def run_setting(
    args: argparse.Namespace, concurrency: int, nats: EmbeddedNats, fake_url: str, tmp: Path
) -> list[Result]:
    assert nats.url is not None
    assert nats.process is not None
    assert nats.process.pid is not None
    run_name = f"bench-envrunner-c{concurrency}-{uuid.uuid4().hex[:6]}"
    argv = runner_argv(nats.url, run_name, tmp / "runs", fake_url, args.envs, concurrency)
    runner = ManagedProcess("env_runner", argv, tmp / f"{run_name}.log")
    bus = await Bus.connect(NatsSection(url=nats.url), run_name, name="bench")
    results = []
    try:
        await bus.ensure_streams()
        runner.start()
        await wait_consuming(bus, args.envs, runner)
        assert runner.pid is not None
        pids = {"runner": runner.pid, "nats": nats.process.pid, "bench": os.getpid()}
        for env in args.envs:
            res = await measure(
                bus, env, concurrency, args.n, args.max_tokens, args.timeout_s, pids, runner
            )
            results.append(res)
            print(
                f"  {env} @ {concurrency}: {res.num_done}/{res.num_requested} in {res.wall_s:.1f}s "
                f"({res.rate:.0f}/s; publishing took {res.publish_s:.1f}s)",
                flush=True,
            )
    finally:
        runner.stop(grace_s=10.0)
        await bus.close()
    return results


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    print(
        f"\nfake model: instant; {args.n} rollouts per row; tool_search = {args.tool_calls} tool "
        f"call(s) + answer; {os.cpu_count()} CPU cores (shared by the runner, nats-server and "
        "this process)"
    )
    head = (
        f"{'env':>13} {'conc':>5} {'rollouts':>9} {'not ok':>7} {'seconds':>8} {'rollouts/s':>11} "
        f"{'steady/s':>9} {'calls/rollout':>14} {'calls/s':>8} {'p50 latency ms':>15} "
        f"{'runner CPU ms/rollout':>22} {'loop on CPU':>12} {'loop runq':>10} {'nats ms':>8} {'bench ms':>9}"
    )
    print(head)
    for r in results:
        done = max(1, r.num_done)
        p50 = statistics.median(r.latency_s) * 1e3 if r.latency_s else float("nan")
        not_ok = r.num_done - r.statuses.get("KIND_OK", 0) + (r.num_requested - r.num_done)
        print(
            f"{r.env:>13} {r.concurrency:>5} {r.num_done:>9} {not_ok:>7} {r.wall_s:>8.2f} "
            f"{r.rate:>11.1f} {r.steady_rate:>9.1f} {r.num_model_calls / done:>14.2f} "
            f"{r.num_model_calls / r.wall_s:>8.1f} {p50:>15.1f} "
            f"{r.cpu_s['runner'] / done * 1e3:>22.2f} {r.loop_on_cpu_s / r.wall_s:>12.0%} "
            f"{r.loop_runq_s / r.wall_s:>10.0%} "
            f"{r.cpu_s['nats'] / done * 1e3:>8.2f} {r.cpu_s['bench'] / done * 1e3:>9.2f}"
        )
    print(
        "(seconds: first publish -> last completion; steady/s leaves out the first 10% of "
        "completions; latency: runner start -> finish of one rollout; CPU ms are per rollout "
        "(runner: all its threads; bench = fake model + publisher + collector); loop on CPU / "
        "loop runq: share of the time the runner's event-loop thread ran / was runnable but "
        "waited for a core — together near 100% means the runner is CPU-bound)"
    )
    for r in results:
        if r.errors or r.num_done < r.num_requested:
            print(f"\n{r.env} @ {r.concurrency}: statuses {dict(r.statuses)}, "
                  f"{r.num_requested - r.num_done} never completed")  # fmt: skip
            for msg, count in r.errors.most_common(5):
                print(f"  {count:>5} x {msg}")


async def amain(args: argparse.Namespace, tmp: Path) -> list[Result]:
    nats = EmbeddedNats(tmp / "nats", tmp / "nats.log")
    fake = FakeInference(TOKENIZER, args.tool_calls)
    results: list[Result] = []
    try:
        nats.start()
        fake_url = fake.start()
        print(f"nats {nats.url}, fake inference {fake_url}, logs in {tmp}", flush=True)
        for c in args.concurrency:
            results += await run_setting(args, c, nats, fake_url, tmp)
        print(f"(the fake model answered {fake.num_requests} generate calls)", flush=True)
    finally:
        fake.stop()
        nats.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=1000, help="rollouts per env and concurrency")
    p.add_argument("--concurrency", default="8,32,128", help="env_runner.max_concurrency values")
    p.add_argument("--envs", default="reverse_text,tool_search")
    p.add_argument(
        "--tool-calls", type=int, default=2,
        help="tool calls the fake model makes in tool_search before it answers (model calls = this + 1)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=32, help="sampling.max_tokens of each request")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up on one row after this")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, JetStream store)")
    p.add_argument("--parts", default="runner,interception,cli_agent", help="what to measure")
    p.add_argument("--cli-agent-n", type=int, default=200,
                   help="rollouts per runtime x dialect row of the cli_agent part")  # fmt: skip
    p.add_argument("--interception-calls", type=int, default=1000,
                   help="timed calls per dialect row of the interception part")  # fmt: skip
    args = p.parse_args()
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    known = {"runner", "interception", "cli_agent"}
    if parts - known:
        sys.exit(f"unknown parts {sorted(parts - known)}: {', '.join(sorted(known))}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    unknown = set(args.envs) - set(TASKS)
    if unknown:
        sys.exit(f"no benchmark task for {sorted(unknown)}; known: {sorted(TASKS)}")
    if not (TOKENIZER / "tokenizer.json").is_file():
        sys.exit(f"{TOKENIZER} has no tokenizer.json (is ../shared beside the checkout?)")
    if "interception" in parts:
        interception_overhead.print_rows(
            asyncio.run(interception_overhead.measure(args.interception_calls))
        )
    if "cli_agent" in parts:
        dialects = ["openai_chat", "openai_responses", "anthropic"]
        rows = asyncio.run(cli_agent_throughput.measure(dialects, ["local", "sandbox"],
                                                         args.cli_agent_n, 8))  # fmt: skip
        cli_agent_throughput.print_rows(rows, 8)
    if "runner" not in parts:
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-envrunner-"))
    ok = False
    try:
        results = asyncio.run(amain(args, tmp))
        print_table(results, args)
        ok = True
    finally:
        if ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}", file=sys.stderr)


if __name__ == "__main__":
    main()
