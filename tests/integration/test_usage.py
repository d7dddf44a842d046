"""The usage ledger read back and held against the run's own records, on a real
nats-server and a local object store filled the way the services fill them; and
`treadle usage` over two runs of two tenants. (The services recording it for real, under
kill -9 and a NATS restart: tests/integration/test_chaos.py.)"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import numpy as np
import pytest

from testkit.hosted import write_config
from treadle.proto.v1 import batch_pb2, common_pb2, policy_pb2, rollout_pb2
from treadle.services import usage
from treadle.services.bus import Bus
from treadle.services.cli import main as cli_main
from treadle.services.objectstore import LocalObjectStore
from treadle.services.sections import NatsSection

pytestmark = pytest.mark.integration

_runs = itertools.count()


def arr(values: list[int], dtype: type) -> common_pb2.TokenArray:
    data = np.asarray(values, dtype=dtype)
    return common_pb2.TokenArray(data=data.tobytes(), shape=[len(values)])


def stored_batch(step: int, docs: list[int], loss: list[int]) -> batch_pb2.Batch:
    """A batch of one micro-batch: documents of ``docs`` tokens, ``loss`` of each in the loss."""
    cu = [0, *itertools.accumulate(docs)]
    mask: list[int] = []
    for n, k in zip(docs, loss, strict=True):
        mask += [0] * (n - k) + [1] * k
    mb = batch_pb2.MicroBatch(num_tokens=64, cu_seqlens=arr(cu, np.int32),
                              loss_mask=arr(mask + [0] * (64 - len(mask)), np.uint8))  # fmt: skip
    return batch_pb2.Batch(step=step, micro_batches=[mb])


async def fill(bus: Bus, store: LocalObjectStore, tenant: str) -> None:
    """What a run of 2 steps leaves: 4 rollouts (the orchestrator took the first 3), 2 stored
    batches, policy v2 announced, and the services' usage records."""
    for i in range(4):
        rollout = rollout_pb2.Rollout(rollout_id=f"r{i}", group_id="g")
        rollout.timing.prompt_tokens, rollout.timing.sampled_tokens = 10 + i, 5 * (i + 1)
        await bus.publish(bus.subjects.rollouts_completed,
                          rollout_pb2.RolloutCompleted(rollout=rollout), msg_id=f"r{i}")  # fmt: skip
    consumer = await bus.consumer("ROLLOUTS", "orchestrator", bus.subjects.rollouts_completed,
                                  rollout_pb2.RolloutCompleted)  # fmt: skip
    taken = 0
    stop = asyncio.Event()

    async def take(msg: rollout_pb2.RolloutCompleted, delivery: object) -> None:
        nonlocal taken
        r = msg.rollout
        if r.rollout_id == "r1":  # recorded twice (a redelivery): billed once
            await usage.record(bus, "orchestrator", "rollout/r1", tenant, rollouts=1,
                               prompt_tokens=999, sampled_tokens=999)  # fmt: skip
        await usage.record(bus, "orchestrator", f"rollout/{r.rollout_id}", tenant, rollouts=1,
                           prompt_tokens=r.timing.prompt_tokens,
                           sampled_tokens=r.timing.sampled_tokens)  # fmt: skip
        taken += 1
        if taken == 3:  # the run ends: r3 stays unconsumed
            stop.set()

    await consumer.run(take, stop)
    for step, docs, loss in ((1, [20, 12], [5, 4]), (2, [30], [7])):
        store.put_bytes(f"batches/step{step:06d}",
                        stored_batch(step, docs, loss).SerializeToString())  # fmt: skip
        await usage.record(bus, "trainer", f"step/{step}", tenant, trained_tokens=sum(docs),
                           loss_tokens=sum(loss), trainer_s=1.5)  # fmt: skip
    await bus.publish(bus.subjects.policy_published,
                      policy_pb2.PolicyPublished(policy_version=2), msg_id="policy-2")  # fmt: skip


def run_of(nats_url: str, tmp_path: Path, tenant: str) -> tuple[str, LocalObjectStore]:
    run = f"usage{next(_runs)}x{tmp_path.name[-6:]}".replace("_", "")
    store = LocalObjectStore(tmp_path / run / "store")

    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
        try:
            await bus.ensure_streams()
            await fill(bus, store, tenant)
        finally:
            await bus.close()

    asyncio.run(main())
    return run, store


def ledger_of(
    nats_url: str, run: str, store: LocalObjectStore
) -> tuple[usage.Usage, usage.UsageCheck]:
    async def main() -> tuple[usage.Usage, usage.UsageCheck]:
        bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
        try:
            got = await usage.read_usage(bus)
            return got, await usage.check_usage(bus, store, got)
        finally:
            await bus.close()

    return asyncio.run(main())


def test_usage_ledger_bills_each_unit_once_and_matches_the_runs_records(
    nats_url: str, tmp_path: Path
) -> None:
    run, store = run_of(nats_url, tmp_path, "acme")
    got, check = ledger_of(nats_url, run, store)
    assert check.problems == []
    assert (check.rollouts_checked, check.steps_checked, check.not_consumed) == (3, 2, 1)
    assert got.num_records == 6  # r1 twice
    totals = {k: got.total(k) for k in usage.COUNTS}
    assert totals == {"rollouts": 3, "prompt_tokens": 10 + 11 + 12, "sampled_tokens": 5 + 10 + 15,
                      "trained_tokens": 62, "loss_tokens": 16}  # fmt: skip
    assert (got.steps, got.trainer_s, got.tenant) == (2, 3.0, "acme")


def test_usage_check_names_what_the_ledger_gets_wrong(nats_url: str, tmp_path: Path) -> None:
    run, store = run_of(nats_url, tmp_path, "acme")

    async def tamper() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
        try:  # a step billed with the wrong tokens, one billed that never trained
            await usage.record(bus, "trainer", "step/2", "acme", trained_tokens=31, loss_tokens=7)
            await usage.record(bus, "trainer", "step/3", "acme", trained_tokens=5)
        finally:
            await bus.close()

    asyncio.run(tamper())
    got, check = ledger_of(nats_url, run, store)
    del got.units["rollout/r2"]  # a consumed rollout missing from the ledger
    check = asyncio.run(_check(nats_url, run, store, got))
    assert check.problems == [
        "rollout/r2 was consumed but is not in the usage ledger",
        "step/2: the ledger says (tokens, loss tokens) = (31, 7), its batch holds (30, 7)",
        "step/3 is in the usage ledger but no policy of it was published",
    ]


async def _check(
    nats_url: str, run: str, store: LocalObjectStore, got: usage.Usage
) -> usage.UsageCheck:
    bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
    try:
        return await usage.check_usage(bus, store, got)
    finally:
        await bus.close()


def test_treadle_usage_prints_each_run_and_sums_per_tenant(
    nats_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = []
    for tenant in ("acme", "acme", "globex"):
        run, store = run_of(nats_url, tmp_path, tenant)
        files.append(write_config(tmp_path / f"{run}.toml", {
            "run": {"name": run, "output_dir": tmp_path, "tenant": tenant},
            "nats": {"url": nats_url},
            "object_store": {"root": store.root},
        }))  # fmt: skip
    argv = ["usage", "--check"] + [a for f in files for a in ("--run-file", str(f))]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("the ledger matches the run's records (3 rollouts, 2 steps checked; "
                     "1 completed rollouts not consumed, 0 aged out)") == 3  # fmt: skip
    tenants = out.split("per tenant:")[1].split("\n")
    acme = next(line for line in tenants if " acme " in line).split()
    globex = next(line for line in tenants if " globex " in line).split()
    assert acme == ["acme", "6", "66", "60", "4", "124", "32", "6.0"]
    assert globex == ["globex", "3", "33", "30", "2", "62", "16", "3.0"]

    # a difference fails the command
    async def forge() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
        try:
            await usage.record(bus, "trainer", "step/1", "globex", trained_tokens=1)
        finally:
            await bus.close()

    asyncio.run(forge())
    assert cli_main(["usage", "--check", "--run-file", str(files[-1])]) == 1
    assert "step/1: the ledger says (tokens, loss tokens) = (1, 0)" in capsys.readouterr().out


def test_a_run_that_recorded_nothing_has_an_empty_ledger(nats_url: str, tmp_path: Path) -> None:
    """A stream never written to (JetStream: first sequence 0) reads as empty, not as an
    error: a hosted run with a quota starts from such a ledger."""
    run = f"usage{next(_runs)}empty{tmp_path.name[-6:]}".replace("_", "")
    store = LocalObjectStore(tmp_path / run / "store")

    async def main() -> usage.Usage:
        bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
        try:
            await bus.ensure_streams()
            return await usage.read_usage(bus)
        finally:
            await bus.close()

    got = asyncio.run(main())
    assert (got.num_records, got.steps, got.units) == (0, 0, {})
