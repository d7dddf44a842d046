"""The trainer service on 2 ranks (`python -m treadle.trainer --nproc-per-node 2`, what
`treadle serve trainer` runs: torchrun, gloo on CPU, FSDP2) on a real nats-server,
against the same steps trained in one process:

    reference, 1 rank in-process: steps 1 2 3 4 (the weights every version must have)
    life 1, 2 ranks: steps 1 2 (checkpoint) 3, then rank 1 killed (kill -9) mid-step 4
        ─▶ the job stops by itself with one line naming rank 1; step 4 is not announced
    1 rank in-process: resumes the 2-rank checkpoint of step 2, trains 3, checkpoints
    life 2, 2 ranks: resumes that 1-rank checkpoint of step 3, trains 4 only; SIGTERM
        ─▶ checkpoint of step 4, exit 0

Each version's weights equal the reference's (and step 1's loss the reference loss), so
one 2-rank step equals the 1-rank step and DCP checkpoints reshard 2 -> 1 and 1 -> 2.

Tolerance: the jobs compute the same sums in another order (FSDP2 reduce-scatters each
rank's gradient sum; micro-batches are packed for 1 vs 2 ranks, so matmul shapes
differ), so float32 results agree to rounding, not bitwise: loss within 1e-5 relative,
weights within 1e-5 absolute. A gradient lost, doubled or applied to the wrong shard
moves weights by about lr = 1e-3 (AdamW's step is ~ lr * sign(gradient)), 100x the
bound. Adam's epsilon is 1e-5 here, not 1e-8: an element whose gradient is a
cancellation residue near 1e-8 moves by ~lr/2 whatever its exact value, so with eps 1e-8
a rounding difference in it showed as 2.7e-5 in one embedding weight (measured); with
eps 1e-5 the update is proportional to such gradients and rounding stays rounding
(measured max 1.5e-7).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from testkit.trainer import make_batch, store_batch, tiny_qwen3, vocab_size_of
from treadle.proto.v1 import common_pb2, metrics_pb2, policy_pb2
from treadle.proto.v1 import trainer_service_pb2_grpc as tgrpc
from treadle.services.bus import Bus
from treadle.services.objectstore import LocalObjectStore
from treadle.services.rpc import open_channel
from treadle.services.sections import NatsSection
from treadle.services.supervisor import ManagedProcess
from treadle.trainer.models.hf import load_safetensors
from treadle.trainer.spec import SPEC as TRAINER
from treadle.trainer.spec import TrainerSection
from treadle.trainer.trainer import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LR, EPS = 1e-3, 1e-5
WEIGHTS_ATOL = 1e-5
RTOL = 1e-5
Weights = dict[str, torch.Tensor]


def section(model: Path) -> TrainerSection:
    return TrainerSection(model=model, device="cpu", optim={"lr": LR, "eps": EPS})  # type: ignore[arg-type]


def trainer_argv(root: Path, nats_url: str, port: int, model: Path) -> list[str]:
    return [
        sys.executable, "-m", "treadle.trainer", "--nproc-per-node", "2",
        "--nats.url", nats_url, "--nats.ack_wait_s", "5",
        "--run.name", "ranks", "--run.output_dir", str(root / "out"),
        "--object_store.root", str(root / "store"),
        "--trainer.grpc.port", str(port), "--trainer.model", str(model),
        "--trainer.device", "cpu", "--trainer.checkpoint_every", "2",
        "--trainer.optim.lr", str(LR), "--trainer.optim.eps", str(EPS),
        "--trainer.distributed.shutdown_timeout_s", "20",
    ]  # fmt: skip


def published(store: LocalObjectStore, version: int, dest: Path) -> Weights:
    store.fetch_dir(f"policies/v{version:06d}", dest)
    return load_safetensors(dest)


def assert_close(a: Weights, b: Weights) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= WEIGHTS_ATOL, f"weights differ by {worst:.3g}"


def ranks_of(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the torchrun agent's children."""
    out = {}
    for child in psutil.Process(agent_pid).children():
        env = child.environ()
        if "RANK" in env:
            out[int(env["RANK"])] = child.pid
    return out


async def until(predicate: Any, proc: ManagedProcess, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if proc.poll() is not None:
            raise proc.failure("died")
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


def test_trainer_ranks_two_ranks_equal_one_reshard_and_survive_a_rank_killed_mid_step(
    tmp_path: Path, nats_url: str, free_port: int
) -> None:
    model = tiny_qwen3(tmp_path / "model")
    vocab = vocab_size_of(model)
    # the reference: 1 rank, in this process
    scratch = LocalObjectStore(tmp_path / "scratch")
    one = Trainer(section(model), scratch, checkpoint_dir=tmp_path / "ref")
    before = {k: v.clone() for k, v in one.policy.hf_state_dict().items()}
    ref: dict[int, dict[str, float]] = {}
    ref_w: dict[int, Weights] = {}
    for step in (1, 2, 3, 4):
        ref[step] = one.train_step(store_batch(scratch, make_batch(step, vocab_size=vocab))).metrics
        ref_w[step] = {k: v.clone() for k, v in one.policy.hf_state_dict().items()}
    del one
    assert max(float((ref_w[1][k] - before[k]).abs().max()) for k in before) > 0.5 * LR

    store = LocalObjectStore(tmp_path / "store")
    argv = trainer_argv(tmp_path, nats_url, free_port, model)
    target = f"127.0.0.1:{free_port}"
    logs = [tmp_path / "life1.log", tmp_path / "life2.log"]

    async def publish(bus: Bus, step: int) -> None:
        ready = store_batch(store, make_batch(step, vocab_size=vocab, num_ranks=2), num_ranks=2)
        await bus.publish(bus.subjects.batches(step), ready, msg_id=f"batch-{step}")

    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), "ranks", store=store)
        await bus.ensure_streams()
        versions: list[int] = []
        metrics: dict[int, dict[str, float]] = {}

        async def on_policy(msg: Any) -> None:
            versions.append(policy_pb2.PolicyPublished.FromString(msg.data).policy_version)

        async def on_metrics(msg: Any) -> None:
            report = metrics_pb2.MetricsReport.FromString(msg.data)
            metrics.setdefault(report.step, dict(report.values))

        await bus.nc.subscribe(bus.subjects.policy_published, cb=on_policy)
        await bus.nc.subscribe(bus.subjects.metrics("trainer"), cb=on_metrics)
        for step in (1, 2, 3):
            await publish(bus, step)

        # life 1: steps 1..3 on 2 ranks, then rank 1 is killed in the middle of step 4
        agent = ManagedProcess("trainer", argv, logs[0]).start()
        try:
            assert agent.pid is not None
            await until(lambda: _last_is(versions, 3), agent)
            ranks = ranks_of(agent.pid)
            assert sorted(ranks) == [0, 1]
            async with open_channel(target, [TRAINER.control]) as channel:
                stub = tgrpc.TrainerControlStub(channel)
                assert (await stub.GetStatus(common_pb2.GetStatusRequest())).world_size == 2
                os.kill(ranks[1], signal.SIGSTOP)  # frozen: rank 0 starts step 4 and waits on it
                await publish(bus, 4)

                async def in_step_4() -> bool:
                    s = await stub.GetStatus(common_pb2.GetStatusRequest())
                    return bool(s.step == 3 and not s.waiting_for_batch)

                await until(in_step_4, agent)
            await asyncio.sleep(0.5)
            os.kill(ranks[1], signal.SIGKILL)
            started = time.monotonic()
            code = await asyncio.to_thread(agent.proc.wait, 60)  # type: ignore[union-attr]
            stop_s = time.monotonic() - started
        finally:
            agent.stop()
        assert code == 1
        assert stop_s < 30, stop_s
        assert not psutil.pid_exists(ranks[0]) or psutil.Process(ranks[0]).status() == "zombie"
        failed = [line for line in logs[0].read_text().splitlines() if "trainer failed" in line]
        assert any(  # the launcher names the rank that died first, and what to do
            f"rank 1 (local rank 1, pid {ranks[1]}) was killed by SIGKILL" in line
            and "resumes from the newest checkpoint" in line
            for line in failed
        ), failed
        assert any("a rank of the trainer job is gone" in line for line in failed), failed
        assert versions == [1, 2, 3]  # step 4 never announced
        # one 2-rank step == the 1-rank step (grad_norm: the gradient before clipping, which
        # AdamW's update would not show if it were scaled)
        for key in ("loss", "grad_norm", "entropy", "loss_tokens"):
            assert metrics[1][key] == pytest.approx(ref[1][key], rel=RTOL), key
        for v in (1, 2, 3):
            assert_close(published(store, v, tmp_path / f"life1-v{v}"), ref_w[v])
        meta = store.read_manifest("checkpoints/trainer/step000002").metadata
        assert meta["world_size"] == 2

        # 1 rank resumes the 2-rank checkpoint (2 -> 1), trains step 3, checkpoints it
        one = Trainer(section(model), store, checkpoint_dir=tmp_path / "one")
        assert one.resume() == 2
        ready = store_batch(scratch, make_batch(3, vocab_size=vocab))
        m3 = one.train_step(ready, scratch.get_bytes(ready.data)).metrics
        assert m3["grad_norm"] == pytest.approx(ref[3]["grad_norm"], rel=RTOL)
        assert_close(one.policy.hf_state_dict(), ref_w[3])
        one.save_checkpoint()
        del one

        # life 2: 2 ranks resume that 1-rank checkpoint (1 -> 2) and train step 4 only
        agent = ManagedProcess("trainer", argv, logs[1]).start()
        try:
            await until(lambda: _last_is(versions, 4), agent)
            agent.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            code = await asyncio.to_thread(agent.proc.wait, 60)  # type: ignore[union-attr]
        finally:
            agent.stop()
        assert code == 0
        assert versions == [1, 2, 3, 4]
        assert metrics[4]["grad_norm"] == pytest.approx(ref[4]["grad_norm"], rel=RTOL)
        assert_close(published(store, 4, tmp_path / "life2-v4"), ref_w[4])
        second = logs[1].read_text()
        assert "resumed from checkpoint of step 3" in second
        assert sorted(int(s) for s in re.findall(r" step (\d+): ", second)) == [4]  # once
        final = store.read_manifest("checkpoints/trainer/step000004").metadata
        assert (final["step"], final["world_size"]) == (4, 2)
        await bus.close()

    asyncio.run(main())


async def _last_is(values: list[int], last: int) -> bool:
    return bool(values) and values[-1] == last
