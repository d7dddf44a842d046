"""Fault injection on a real stack, ending in the rollout ledger.

    build_tiny_model ─▶ Stack: nats-server (1 node, or 3 in a JetStream cluster, sync_interval
        always) + object store (local directory, or SeaweedFS S3) + inference, trainer,
        orchestrator, env runner as separate processes (``python -m treadle.<service>``)
      ─▶ a scenario's fault, injected when its trigger sees the run mid-step
      ─▶ the supervisor restarts what dies, as a process manager would (no other help)
      ─▶ the run finishes: the trainer's last step, every batch published, inference
         serving the last policy
      ─▶ ``read_ledger`` (orchestrator/ledger.py) from the run's durable data ─▶ one row

A scenario *survives* when the run finishes within its deadline without a person, the
ledger shows nothing lost, nothing trained twice and no skipped trainer step, and no
service had to be restarted except the one the fault killed (a service that dies of a
NATS restart or a store outage is a failure even though the supervisor brings it back).

Not here: the ledger's definitions (``treadle.orchestrator.ledger``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from testkit.procs import wait_healthy
from testkit.seaweed import SeaweedS3
from treadle.inference.engine import parse_metrics
from treadle.orchestrator.ledger import Ledger, read_ledger
from treadle.proto.v1 import (
    common_pb2,
    env_runner_service_pb2_grpc,
    inference_service_pb2_grpc,
    orchestrator_service_pb2_grpc,
    trainer_service_pb2_grpc,
)
from treadle.services import usage
from treadle.services.bus import Bus
from treadle.services.errors import TreadleError
from treadle.services.nats_server import EmbeddedNats
from treadle.services.objectstore import ObjectStore, open_store
from treadle.services.ports import free_port
from treadle.services.rpc import open_channel
from treadle.services.sections import NatsSection, ObjectStoreSection
from treadle.services.supervisor import ManagedProcess, tail
from treadle.services.tiny_model import TinyModelSpec, build_tiny_model

log = logging.getLogger(__name__)

RUN = "chaos"
SERVICES = ("inference", "trainer", "orchestrator", "env_runner")
FINISHING = ("trainer", "orchestrator")  # exit 0 when the run is done; the others serve on


@dataclass(frozen=True)
class Settings:
    """Size of the run each scenario trains."""

    steps: int = 6
    checkpoint_every: int = 2
    group_size: int = 4
    groups_per_step: int = 2
    max_groups_in_flight: int = 4
    max_off_policy_steps: int = 2
    ack_wait_s: float = 10.0  # a killed env runner's requests come back after this
    max_tokens: int = 8  # sampled tokens per model call
    trigger_timeout_s: float = 900.0  # a fault whose moment never comes fails the scenario
    finish_timeout_s: float = 900.0  # after the last fault


def build_model(root: Path) -> Path:
    """The tiny Qwen3 every scenario serves and trains (vLLM on CPU needs head_dim 64)."""
    if (root / "config.json").is_file():
        return root
    return build_tiny_model(
        root,
        spec=TinyModelSpec(hidden_size=128, num_layers=2),
        bpe_vocab_size=300,
        vocab_multiple=1,
    )


def write_tasks(path: Path, n: int = 40) -> Path:
    path.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "text": "abcdefgh"[: 3 + i % 5]}) + "\n" for i in range(n)
        )
    )
    return path


# --- NATS: one node or a 3-node JetStream cluster --------------------------------------------
class Nats:
    """nats-server node(s) with JetStream, ``sync_interval: always``; in a cluster the bus
    creates R3 streams (``treadle.services.bus``). Nodes restart on their port and store."""

    def __init__(self, root: Path, num_nodes: int = 1):
        self.root = root
        self.ports = [free_port() for _ in range(num_nodes)]
        routes = [free_port() for _ in range(num_nodes)]
        self.nodes: list[EmbeddedNats] = []
        for i in range(num_nodes):
            conf = root / f"n{i + 1}.conf"
            conf.parent.mkdir(parents=True, exist_ok=True)
            text = "jetstream { sync_interval: always }\n"
            if num_nodes > 1:
                peers = ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes)
                text += (
                    f"cluster {{ name: {RUN}, listen: 127.0.0.1:{routes[i]}, routes: [{peers}] }}\n"
                )
            conf.write_text(text)
            self.nodes.append(
                EmbeddedNats(
                    root / f"n{i + 1}", root / f"n{i + 1}.log", port=self.ports[i], config_file=conf
                )
            )

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.ports[0]}"

    def start(self) -> str:
        for node in self.nodes:
            node.start()
        return self.url

    def kill(self, i: int) -> None:
        proc = self.nodes[i].process
        assert proc is not None
        assert proc.proc is not None
        os.kill(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait(timeout=30)

    def restart(self, i: int) -> None:
        self.nodes[i].start(timeout_s=60)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def live_url(self) -> str:
        for node, port in zip(self.nodes, self.ports, strict=True):
            if node.process is not None and node.process.poll() is None:
                return f"nats://127.0.0.1:{port}"
        raise TreadleError("no nats-server node is running")


# --- the stack -------------------------------------------------------------------------------
@dataclass
class Stack:
    """The four services of one run, supervised: what dies is started again."""

    root: Path
    settings: Settings
    model: Path
    nats: Nats
    s3: SeaweedS3 | None = None
    inference_replicas: int = 1  # inference, inference-2, ...: env runners use them all
    discovery: bool = False  # replicas announce themselves on NATS; no service lists them
    grpc: dict[str, int] = field(default_factory=lambda: {n: free_port() for n in SERVICES})
    http: int = field(default_factory=free_port)  # the first inference replica's
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    keep_down: set[str] = field(default_factory=set)  # killed on purpose, not restarted
    restarts: Counter[str] = field(default_factory=Counter)  # deaths of a running service
    killed: Counter[str] = field(default_factory=Counter)  # kills the scenario injected
    failed_starts: Counter[str] = field(default_factory=Counter)  # died while starting
    events: list[str] = field(default_factory=list)
    _started: float = field(default_factory=time.monotonic)
    _restarting: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.inference = [
            "inference",
            *(f"inference-{i}" for i in range(2, self.inference_replicas + 1)),
        ]
        self.https = {n: self.http if n == "inference" else free_port() for n in self.inference}
        for name in self.inference:
            self.grpc.setdefault(name, free_port())
        self.cfg = self.root / "run.toml"
        self.cfg.write_text(self._config())

    def _config(self) -> str:
        s = self.settings
        store = f'root = "{self.root / "store"}"'
        if self.s3 is not None:
            store = (f'backend = "s3"\nendpoint = "{self.s3.endpoint}"\nbucket = "chaos"\n'
                     f'access_key = "{self.s3.access_key}"\nsecret_key = "{self.s3.secret_key}"')  # fmt: skip
        return f"""
[run]
name = "{RUN}"
output_dir = "{self.root / "out"}"

[nats]
ack_wait_s = {s.ack_wait_s}

[object_store]
{store}

[inference]
model = "{self.model}"
max_model_len = 256

[trainer]
model = "{self.model}"
max_steps = {s.steps}
checkpoint_every = {s.checkpoint_every}

[trainer.optim]
lr = 1e-3

[orchestrator]
tasks = "{write_tasks(self.root / "tasks.jsonl")}"
max_steps = {s.steps}
group_size = {s.group_size}
groups_per_step = {s.groups_per_step}
max_groups_in_flight = {s.max_groups_in_flight}
max_async_level = 1
max_off_policy_steps = {s.max_off_policy_steps}
seq_len = 256
status_poll_s = 0.2

[orchestrator.sampling]
max_tokens = {s.max_tokens}

[env_runner]
tokenizer = "{self.model}"
max_concurrency = 4
"""

    def note(self, what: str) -> None:
        line = f"{time.monotonic() - self._started:7.1f}s {what}"
        self.events.append(line)
        log.info("chaos: %s", line)

    def store(self) -> ObjectStore:
        if self.s3 is None:
            return open_store(ObjectStoreSection(root=self.root / "store"), RUN, self.root)
        from pydantic import SecretStr

        section = ObjectStoreSection(
            backend="s3", endpoint=self.s3.endpoint, bucket="chaos", access_key=self.s3.access_key,
            secret_key=SecretStr(self.s3.secret_key),
        )  # fmt: skip
        return open_store(section, RUN, self.root)

    def argv(self, name: str) -> list[str]:
        service = _service(name)
        argv = [sys.executable, "-m", f"treadle.{service}", "@", str(self.cfg), "--nats.url",
                self.nats.url, f"--{service}.grpc.port", str(self.grpc[name])]  # fmt: skip
        urls = [f"http://127.0.0.1:{self.https[n]}" for n in self.inference]
        targets = [f"127.0.0.1:{self.grpc[n]}" for n in self.inference]
        if service == "inference":
            argv += ["--inference.http_port", str(self.https[name])]
            if self.discovery:
                argv += ["--inference.announce", "true"]
        if self.discovery and name in ("env_runner", "orchestrator"):
            argv += [f"--{name}.inference_discovery", "true"]
        elif name == "env_runner" and len(urls) == 1:
            argv += ["--env_runner.inference_url", urls[0]]
        elif name == "env_runner":
            argv += ["--env_runner.inference_urls", json.dumps(urls)]
        elif name == "orchestrator":
            argv += ["--orchestrator.inference_grpc", json.dumps(targets)]
        return argv

    def log_file(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    async def start(self, name: str, timeout_s: float = 600) -> None:
        """Start ``name`` and wait until it is healthy; ChildFailedError if it dies first."""
        proc = ManagedProcess(name, self.argv(name), self.log_file(name)).start()
        self.procs[name] = proc
        await wait_healthy(proc, f"127.0.0.1:{self.grpc[name]}", timeout_s=timeout_s)

    async def start_all(self) -> None:
        # the trainer loads while vLLM starts; rollouts need inference up first
        await asyncio.gather(*map(self._first_start, [*self.inference, "trainer"]))
        await self._first_start("orchestrator")
        await self._first_start("env_runner")
        self.note("stack healthy")

    async def _first_start(self, name: str, attempts: int = 3) -> None:
        """Start ``name``; a start that dies is tried again, as a process manager would
        (each failed start is in the events; children forked by a gRPC-busy process no
        longer die in gRPC's fork handlers: ``treadle.services.supervisor``)."""
        for attempt in range(1, attempts + 1):
            try:
                await self.start(name)
                return
            except TreadleError as e:
                self.failed_starts[name] += 1
                self.note(f"{name} failed to start ({str(e).splitlines()[0]})")
                if attempt == attempts:
                    raise

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` (by pid); the supervisor starts it again."""
        proc = self.procs[name]
        assert proc.proc is not None
        os.kill(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait(timeout=30)
        self.killed[name] += 1
        self.note(f"kill -9 {name} (pid {proc.pid})")

    def dead(self) -> list[str]:
        """Services that died (a finishing service's exit 0 is not a death)."""
        out = []
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is None or name in self._restarting or name in self.keep_down:
                continue
            if code != 0 or name not in FINISHING:
                out.append(name)
        return out

    async def _restart(self, name: str) -> None:
        """Start ``name`` again until it is healthy (backoff 1 s doubling to 10 s)."""
        self.restarts[name] += 1
        self.note(f"{name} exited with {self.procs[name].poll()}: restarting it")
        delay = 1.0
        try:
            while True:
                await asyncio.sleep(delay)
                try:
                    await self.start(name)
                except TreadleError as e:
                    self.failed_starts[name] += 1
                    self.note(f"{name} failed to start ({str(e).splitlines()[0]})")
                    delay = min(delay * 2, 10.0)
                    continue
                self.note(f"{name} healthy again")
                return
        finally:
            self._restarting.discard(name)

    async def supervise(self, stop: asyncio.Event) -> None:
        """Restart every service that dies, until ``stop``."""
        tasks: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set():
                for name in self.dead():
                    self._restarting.add(name)
                    t = asyncio.create_task(self._restart(name))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                await asyncio.sleep(0.25)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop(grace_s=20)
        for name in self.keep_down & set(self.inference):  # its vLLM outlived the kill -9
            from treadle.inference.engine import stop_leftover

            stop_leftover(self.root / "out" / RUN / "logs" / f"vllm-{self.https[name]}.pid")

    # --- status ----------------------------------------------------------------------------
    async def status(self, name: str) -> Any:
        """The service's GetStatus, or None when it does not answer."""
        stubs: dict[str, Callable[[Any], Any]] = {
            "trainer": trainer_service_pb2_grpc.TrainerControlStub,
            "inference": inference_service_pb2_grpc.InferenceAdminStub,
            "orchestrator": orchestrator_service_pb2_grpc.OrchestratorControlStub,
            "env_runner": env_runner_service_pb2_grpc.EnvRunnerControlStub,
        }
        try:
            async with open_channel(f"127.0.0.1:{self.grpc[name]}", default_timeout_s=2,
                                    max_attempts=1) as ch:  # fmt: skip
                return await stubs[_service(name)](ch).GetStatus(common_pb2.GetStatusRequest())
        except Exception:  # down, starting, restarting: no status now
            return None

    async def wait_for(self, what: str, ready: Callable[[], Awaitable[bool]],
                       interval_s: float = 0.1) -> None:  # fmt: skip
        """Until ``ready``; TimeoutError when the trigger timeout passes or the run finishes
        first (no later moment can come)."""
        deadline = time.monotonic() + self.settings.trigger_timeout_s
        while not await ready():
            if all(self.procs[n].poll() == 0 for n in FINISHING):
                raise TimeoutError(f"the run finished before the moment to inject the fault: "
                                   f"{what}")  # fmt: skip
            if time.monotonic() > deadline:
                raise TimeoutError(f"the moment to inject the fault never came: {what}")
            await asyncio.sleep(interval_s)

    async def training(self, step: int) -> bool:
        """The trainer is inside step ``step`` or a later one."""
        st = await self.status("trainer")
        if st is None:
            return False
        msg = st.info.message
        return msg.startswith("training step ") and int(msg.rsplit(" ", 1)[1]) >= step

    async def rollouts_running(self, after_step: int) -> bool:
        orch, runner = await self.status("orchestrator"), await self.status("env_runner")
        return bool(orch and runner and orch.step >= after_step and runner.num_active_rollouts)

    async def published(self, step: int) -> bool:
        """The orchestrator has published step ``step`` or a later one."""
        orch = await self.status("orchestrator")
        return bool(orch and orch.step >= step)

    async def generating(self, http: httpx.AsyncClient, name: str) -> bool:
        """Inference replica ``name``'s vLLM runs requests now: its own /metrics, read
        directly (one local GET, so it can be polled every few milliseconds: a request of a
        few tokens runs for tens of milliseconds)."""
        try:
            resp = await http.get(f"http://127.0.0.1:{self.https[name]}/metrics")
        except httpx.HTTPError:
            return False
        return resp.is_success and parse_metrics(resp.text).num_running_requests > 0

    async def finished(self) -> bool:
        """Trainer and orchestrator done (exit 0), inference serving the last policy (every
        replica that is not kept down)."""
        for name in FINISHING:
            if self.procs[name].poll() != 0:
                return False
        for name in self.inference:
            if name in self.keep_down:
                continue
            st = await self.status(name)
            if st is None or st.policy_version < self.settings.steps:
                return False
        return True

    async def progress(self) -> str:
        orch, trainer = await self.status("orchestrator"), await self.status("trainer")
        return (f"orchestrator step {orch.step if orch else '?'}, trainer step "
                f"{trainer.step if trainer else '?'}")  # fmt: skip


def _service(name: str) -> str:
    """The service a stack member runs (inference replicas: inference-2, ... -> inference)."""
    return "inference" if name.startswith("inference") else name


# --- faults -----------------------------------------------------------------------------------
Fault = Callable[[Stack], Awaitable[None]]


def kill_mid_step(name: str) -> Fault:
    """kill -9 ``name`` while the run is mid-step; the supervisor restarts it."""

    async def fault(stack: Stack) -> None:
        ckpt = stack.settings.checkpoint_every
        if name == "trainer":  # inside the step after a checkpoint: it must redo it, not skip
            await stack.wait_for(f"trainer in step {ckpt + 1}", lambda: stack.training(ckpt + 1))
        else:
            await stack.wait_for("rollouts running", lambda: stack.rollouts_running(ckpt))
        stack.kill(name)
        if name == "trainer":
            await stack.wait_for("trainer back", lambda: stack.training(ckpt + 2))

    return fault


def kill_replica(name: str) -> Fault:
    """kill -9 inference replica ``name`` while it generates; it stays down: the env
    runner's calls on it move to the other replicas."""

    async def fault(stack: Stack) -> None:
        stack.keep_down.add(name)
        await stack.wait_for("step 1 published", lambda: stack.published(1))
        # the run's calls reach this replica for a few hundred milliseconds in all: a coarse
        # poll of two services' status can miss every one of them
        async with httpx.AsyncClient(timeout=2.0) as http:
            await stack.wait_for(f"{name} generating", lambda: stack.generating(http, name),
                                 0.005)  # fmt: skip
        stack.kill(name)

    return fault


async def restart_nats(stack: Stack) -> None:
    """kill -9 the nats-server mid-step and start it again on its port and store."""
    await stack.wait_for("rollouts running", lambda: stack.rollouts_running(2))
    stack.nats.kill(0)
    stack.note("kill -9 nats-server")
    await asyncio.sleep(2)
    stack.nats.restart(0)
    stack.note("nats-server started again")


def store_outage(seconds: float) -> Fault:
    """The S3 server (SeaweedFS) down for ``seconds`` mid-step, then up on its ports and data."""

    async def fault(stack: Stack) -> None:
        assert stack.s3 is not None
        assert stack.s3.process is not None
        await stack.wait_for("trainer in step 3", lambda: stack.training(3))
        old = stack.s3.process
        assert old.proc is not None
        os.kill(old.proc.pid, signal.SIGKILL)
        old.proc.wait(timeout=30)
        stack.note(f"object store (S3) down for {seconds:.0f}s")
        await asyncio.sleep(seconds)
        stack.s3.process = ManagedProcess(old.name, old.argv, old.log_file).start()
        stack.note("object store (S3) up again")

    return fault


def store_read_only(seconds: float) -> Fault:
    """The local store's disk (a tmpfs mounted at its root) remounted read-only for
    ``seconds`` mid-step, then read-write again."""

    async def fault(stack: Stack) -> None:
        mnt = stack.root / "store"
        await stack.wait_for("trainer in step 3", lambda: stack.training(3))
        await asyncio.to_thread(_mount, "-o", "remount,ro", str(mnt))
        stack.note(f"object store (local) read-only for {seconds:.0f}s")
        await asyncio.sleep(seconds)
        await asyncio.to_thread(_mount, "-o", "remount,rw", str(mnt))
        stack.note("object store (local) writable again")

    return fault


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode:
        raise OSError(f"mount {' '.join(args)}: {proc.stderr.strip()}")


async def kill_cluster_node(stack: Stack) -> None:
    """kill -9 the cluster node that leads the ROLLOUTS stream, mid-step; it stays down."""
    await stack.wait_for("rollouts running", lambda: stack.rollouts_running(2))
    bus = await Bus.connect(NatsSection(url=stack.nats.url), RUN)
    try:
        info = await bus.js.stream_info(bus.subjects.stream_name("ROLLOUTS"))
        replicas = info.config.num_replicas
        leader = info.cluster.leader if info.cluster else None
    finally:
        await bus.close()
    if replicas != len(stack.nats.nodes):
        raise TreadleError(
            f"ROLLOUTS has {replicas} replicas in a {len(stack.nats.nodes)}-node cluster"
        )
    names = [f"treadle-n{i + 1}" for i in range(len(stack.nats.nodes))]
    i = names.index(leader) if leader in names else 1
    stack.nats.kill(i)
    stack.note(f"kill -9 nats node {names[i]} (ROLLOUTS leader {leader}, R{replicas})")


def in_sequence(*faults: Fault) -> Fault:
    async def fault(stack: Stack) -> None:
        for f in faults:
            await f(stack)

    return fault


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: Fault
    nats_nodes: int = 1
    s3: bool = False
    tmpfs_store: bool = False  # the local store on its own tmpfs (needs root to mount)
    inference_replicas: int = 1
    discovery: bool = False  # inference replicas found through NATS, none listed


SCENARIOS = (
    Scenario("kill -9 trainer mid-step", kill_mid_step("trainer")),
    Scenario("kill -9 inference", kill_mid_step("inference")),
    Scenario("kill -9 orchestrator", kill_mid_step("orchestrator")),
    Scenario("kill -9 env runner", kill_mid_step("env_runner")),
    Scenario("restart NATS (kill -9)", restart_nats),
    Scenario("object store (S3) down 30 s", store_outage(30.0), s3=True),
    Scenario("object store (local) read-only 30 s", store_read_only(30.0), tmpfs_store=True),
    Scenario("3-node JetStream cluster, kill -9 a node", kill_cluster_node, nats_nodes=3),
    Scenario(
        "2 inference replicas, kill -9 one (stays down)",
        kill_replica("inference-2"),
        inference_replicas=2,
    ),
    Scenario(
        "2 inference replicas found through NATS, kill -9 one (stays down)",
        kill_replica("inference-2"),
        inference_replicas=2,
        discovery=True,
    ),
)


# --- one run ------------------------------------------------------------------------------------
@dataclass
class Outcome:
    scenario: str
    survived: bool
    reason: str
    ledger: Ledger | None
    restarts: dict[str, int]
    wall_s: float
    events: list[str]

    def row(self) -> dict[str, Any]:
        led = self.ledger
        restarts = ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items())) or "-"
        return {
            "scenario": self.scenario,
            "survived": "yes" if self.survived else "NO",
            "requested": led.requested if led else "?",
            "completed": led.completed if led else "?",
            "trained": led.trained if led else "?",
            "dropped": led.dropped if led else "?",
            "lost": led.lost if led else "?",
            "trained twice": led.trained_twice if led else "?",
            "restarts": restarts,
            "wall s": f"{self.wall_s:.0f}",
        }


async def run_scenario(scenario: Scenario, root: Path, model: Path, settings: Settings) -> Outcome:
    """One stack, one fault, one ledger. Everything started here is stopped by pid."""
    started = time.monotonic()
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    nats = Nats(root / "nats", scenario.nats_nodes)
    s3 = SeaweedS3(root / "s3") if scenario.s3 else None
    stack: Stack | None = None
    problems: list[str] = []
    ledger = None
    mounted = None
    try:
        if scenario.tmpfs_store:
            mounted = root / "store"
            await asyncio.to_thread(mounted.mkdir, parents=True, exist_ok=True)
            await asyncio.to_thread(_mount, "-t", "tmpfs", "-o", "size=2g", "tmpfs", str(mounted))
        nats.start()
        if s3 is not None:
            s3.start()
        stack = Stack(
            root, settings, model, nats, s3, scenario.inference_replicas, scenario.discovery
        )
        await stack.start_all()
        stop = asyncio.Event()
        supervisor = asyncio.create_task(stack.supervise(stop))
        try:
            await scenario.fault(stack)
            deadline = time.monotonic() + settings.finish_timeout_s
            while not await stack.finished():
                if supervisor.done():
                    supervisor.result()
                if time.monotonic() > deadline:
                    problems.append(f"did not finish within {settings.finish_timeout_s:.0f}s "
                                    f"after the fault ({await stack.progress()})")  # fmt: skip
                    break
                await asyncio.sleep(1)
        finally:
            stop.set()
            await supervisor
        stack.note("run finished" if not problems else "gave up")
        ledger, billed = await _ledger(stack, settings)
        problems += ledger.problems() + billed
        unplanned = {
            k: n - stack.killed[k] for k, n in stack.restarts.items() if n > stack.killed[k]
        }
        if unplanned:
            problems.append("died and were restarted: " + ", ".join(
                f"{k} ({n}x: {_last_error(stack.log_file(k))})" for k, n in unplanned.items()))  # fmt: skip
    except (TreadleError, TimeoutError, OSError) as e:
        problems.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    finally:
        if stack is not None:
            stack.stop()
        if s3 is not None:
            s3.stop()
        nats.stop()
        if mounted is not None:
            await asyncio.to_thread(subprocess.run, ["umount", "-l", str(mounted)], check=False)
    return Outcome(
        scenario.name,
        not problems,
        "; ".join(problems),
        ledger,
        dict(stack.restarts) if stack else {},
        time.monotonic() - started,
        stack.events if stack else [],
    )


def run_survived(scenario: Scenario, root: Path, settings: Settings,
                 restarts: dict[str, int]) -> Outcome:  # fmt: skip
    """For tests: run ``scenario`` under ``root`` (model and run), print its row and events,
    and assert it was survived: nothing lost or trained twice, something trained, and
    exactly ``restarts`` made by the supervisor."""
    outcome = asyncio.run(run_scenario(scenario, root / "run", build_model(root / "model"),
                                       settings))  # fmt: skip
    print(report([outcome]))
    print("\n".join(outcome.events))
    assert outcome.ledger is not None, outcome.reason
    assert outcome.ledger.lost == 0, outcome.reason
    assert outcome.ledger.trained_twice == 0, outcome.reason
    assert outcome.ledger.trained > 0
    assert outcome.restarts == restarts, outcome.reason
    assert outcome.survived, outcome.reason
    return outcome


async def _ledger(stack: Stack, settings: Settings) -> tuple[Ledger, list[str]]:
    """The rollout ledger, and what the usage ledger gets wrong against the run's records
    (every rollout the orchestrator took and every trained step billed once, exactly)."""
    store = await asyncio.to_thread(stack.store)
    bus = await Bus.connect(NatsSection(url=stack.nats.live_url()), RUN, store=store)
    try:
        ledger = await read_ledger(bus, store, settings.group_size)
        billed = await usage.read_usage(bus)
        check = await usage.check_usage(bus, store, billed)
    finally:
        await bus.close()
    problems = [f"usage ledger: {p}" for p in check.problems]
    if billed.steps != ledger.trainer_step or check.steps_checked != ledger.trainer_step:
        problems.append(f"usage ledger: {billed.steps} steps billed, {check.steps_checked} "
                        f"checked, {ledger.trainer_step} trained")  # fmt: skip
    if not check.rollouts_checked or billed.total("sampled_tokens") <= 0:
        problems.append("usage ledger: no rollout billed")
    return ledger, problems


def _last_error(log_file: Path) -> str:
    """The last ERROR line of a service log, shortened (why it died)."""
    errors = [line for line in tail(log_file, 400).splitlines() if " ERROR " in line]
    return errors[-1].split(" ERROR ", 1)[1].strip()[:160] if errors else "no error logged"


COLUMNS = ("scenario", "survived", "requested", "completed", "trained", "dropped", "lost",
           "trained twice", "restarts", "wall s")  # fmt: skip


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of ``rows`` (dicts keyed by ``COLUMNS``)."""
    cells = [[str(r.get(c, "")) for c in COLUMNS] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def report(outcomes: list[Outcome]) -> str:
    """The ledger table, then why each failed scenario failed and what the trainer redid."""
    rows = []
    notes: list[str] = []
    for o in outcomes:
        row = o.row()
        if not o.survived:
            notes.append(f"[{len(notes) + 1}] {o.scenario}: {o.reason}")
            row["survived"] = f"NO [{len(notes)}]"
        rows.append(row)
    for o in outcomes:
        if o.ledger is not None and o.ledger.lineage.redone:
            notes.append(f"    {o.scenario}: the trainer redid {o.ledger.lineage.redone} step(s) "
                         "from its last checkpoint after the restart")  # fmt: skip
    return "\n".join([format_table(rows), *notes])
