"""The usage ledger of a run: its billable work, recorded as it happens, read back, checked.

    orchestrator: each RolloutCompleted it receives ─▶ UsageRecord "rollout/<id>": prompt and
                  sampled tokens of the rollout's model calls (the env runner's RolloutTiming),
                  published before the delivery is acked
    trainer:      each trained step ─▶ UsageRecord "step/<N>": tokens and loss tokens of its
                  batch manifest (BatchReady), trainer seconds, published after the step's
                  policy is announced
        ─▶ stream USAGE_<run> (limits retention, no age limit: it outlives ROLLOUTS)

``read_usage`` keeps one record per unit, the last one recorded: a unit is recorded again
when its work is redelivered (a rollout whose ack was lost) or redone (a step retrained
after a restart from a checkpoint), and billed once. ``check_usage`` holds the ledger
against the run's own records of the same work: each rollout on ROLLOUTS has its record
with the same token counts, each stored batch of a trained step (1 .. the last
PolicyPublished) its step record with the tokens its micro-batches hold (recounted from the
data, not from the manifest), and the ledger has no unit those records lack; a difference
names the unit. Rollouts that aged out of ROLLOUTS (``nats.rollouts_max_age_s``) are
counted as not checkable, and completed rollouts the orchestrator has not taken (above
its consumer's ack floor: a run that ended with rollouts in flight) as not consumed; both
are reported, neither is an error. Only what the orchestrator took is billed.

Every record carries the run's tenant (``run.tenant``); ``treadle usage`` prints the ledger
of each run it is given and the sums per tenant.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.js.errors
import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp

from treadle.proto.v1 import batch_pb2, metrics_pb2, policy_pb2, rollout_pb2
from treadle.services.bus import Bus
from treadle.services.codecs import decode_message
from treadle.services.errors import DecodeError, IntegrityError, ObjectNotFoundError
from treadle.services.objectstore import ObjectStore

STREAM = "USAGE"
COUNTS = ("rollouts", "prompt_tokens", "sampled_tokens", "trained_tokens", "loss_tokens")


async def record(bus: Bus, service: str, unit: str, tenant: str, **counts: Any) -> None:
    """Publish one unit's record on the run's usage ledger (raises when it is not stored:
    the caller's work then stays unacknowledged and is recorded when redone)."""
    stamp = Timestamp()
    stamp.GetCurrentTime()
    msg = metrics_pb2.UsageRecord(service=service, unit=unit, tenant=tenant, time=stamp, **counts)
    # no Nats-Msg-Id: a unit recorded again must be stored again (the last record counts)
    await bus.publish(bus.subjects.usage(service), msg, msg_id=None)


@dataclass
class Usage:
    """A run's ledger: the last record of each unit, and their sums."""

    run: str
    units: dict[str, metrics_pb2.UsageRecord] = field(default_factory=dict)
    num_records: int = 0  # records read, re-recorded units included
    undecodable: int = 0  # records that could not be read (dead-lettered)

    @property
    def tenant(self) -> str:
        tenants = {r.tenant for r in self.units.values()}
        return tenants.pop() if len(tenants) == 1 else "(several)" if tenants else self.run

    def total(self, name: str) -> float:
        return float(sum(getattr(r, name) for r in self.units.values()))

    @property
    def steps(self) -> int:
        return sum(1 for u in self.units if u.startswith("step/"))

    @property
    def trainer_s(self) -> float:
        return self.total("trainer_s")


async def read_usage(bus: Bus) -> Usage:
    """The ledger of the run ``bus`` is bound to (module doc)."""
    usage = Usage(bus.subjects.run)
    for raw in await bus.stored(STREAM):
        usage.num_records += 1
        try:
            rec = await bus.decode_stored(STREAM, raw, metrics_pb2.UsageRecord)
        except (DecodeError, IntegrityError, ObjectNotFoundError):
            usage.undecodable += 1
            continue
        usage.units[rec.unit] = rec
    return usage


@dataclass
class UsageCheck:
    """The ledger held against the run's own records (module doc)."""

    rollouts_checked: int = 0
    steps_checked: int = 0
    not_checkable: int = 0  # rollout records whose rollout aged out of ROLLOUTS
    not_consumed: int = 0  # completed rollouts the orchestrator has not taken (not billed)
    problems: list[str] = field(default_factory=list)


async def _consumed_through(bus: Bus) -> int:
    """The ROLLOUTS sequence through which the orchestrator acknowledged every message."""
    try:
        info = await bus.js.consumer_info(bus.subjects.stream_name("ROLLOUTS"), "orchestrator")
    except nats.js.errors.NotFoundError:
        return 0
    return int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0


def batch_tokens(batch: batch_pb2.Batch) -> tuple[int, int]:
    """(non-padding tokens, loss tokens) of a stored batch, counted from its micro-batches."""
    tokens = loss = 0
    for mb in batch.micro_batches:
        cu = np.frombuffer(mb.cu_seqlens.data, dtype=np.int32)
        tokens += int(cu[-1]) if cu.size else 0
        mask = np.frombuffer(mb.loss_mask.data, dtype=np.uint8)
        loss += int(mask.sum())
    return tokens, loss


async def check_usage(bus: Bus, store: ObjectStore, usage: Usage) -> UsageCheck:
    """Compare ``usage`` with ROLLOUTS and the stored batches of trained steps."""
    check = UsageCheck()
    seen: set[str] = set()
    floor = await _consumed_through(bus)
    for raw in await bus.stored("ROLLOUTS"):
        done = await bus.decode_stored("ROLLOUTS", raw, rollout_pb2.RolloutCompleted)
        r = done.rollout
        unit = f"rollout/{r.rollout_id}"
        if unit in seen:  # one rollout stored twice would be a ROLLOUTS problem: billed once
            continue
        seen.add(unit)
        rec = usage.units.get(unit)
        if rec is None:
            if raw.seq > floor:  # not consumed (yet): the orchestrator records what it takes
                check.not_consumed += 1
            else:
                check.problems.append(f"{unit} was consumed but is not in the usage ledger")
            continue
        want = (1, r.timing.prompt_tokens, r.timing.sampled_tokens)
        got = (rec.rollouts, rec.prompt_tokens, rec.sampled_tokens)
        if got != want:
            check.problems.append(
                f"{unit}: the ledger says (rollouts, prompt, sampled) = {got}, ROLLOUTS {want}"
            )
        check.rollouts_checked += 1
    check.not_checkable = sum(1 for u in usage.units if u.startswith("rollout/")) - len(
        seen & usage.units.keys()
    )
    last = await bus.last("POLICY", bus.subjects.policy_published, policy_pb2.PolicyPublished)
    trained_through = last.policy_version if last is not None else 0
    steps = {u for u in usage.units if u.startswith("step/")}
    for step in range(1, trained_through + 1):
        unit = f"step/{step}"
        key = f"batches/step{step:06d}"
        try:
            data = await asyncio.to_thread(store.get_bytes, key)
        except ObjectNotFoundError:
            check.problems.append(f"{unit}: trained, but its batch {key} is not in the store")
            continue
        held = batch_tokens(decode_message(batch_pb2.Batch, data, where=key))
        rec = usage.units.get(unit)
        if rec is None:
            check.problems.append(f"{unit} was trained but is not in the usage ledger")
            continue
        if (rec.trained_tokens, rec.loss_tokens) != held:
            check.problems.append(
                f"{unit}: the ledger says (tokens, loss tokens) = "
                f"{(rec.trained_tokens, rec.loss_tokens)}, its batch holds {held}"
            )
        check.steps_checked += 1
        steps.discard(unit)
    for unit in sorted(steps):
        check.problems.append(f"{unit} is in the usage ledger but no policy of it was published")
    return check


def format_usage(ledgers: Iterable[Usage]) -> str:
    """A table: one line per run, then the sums per tenant when there are several runs."""
    ledgers = list(ledgers)
    head = (f"{'run':<16} {'tenant':<12} {'rollouts':>9} {'prompt tok':>11} {'sampled tok':>12} "
            f"{'steps':>6} {'trained tok':>12} {'loss tok':>10} {'trainer s':>10}")  # fmt: skip

    def line(name: str, tenant: str, rows: list[Usage]) -> str:
        def t(n: str) -> float:
            return sum(u.total(n) for u in rows)

        return (f"{name:<16} {tenant:<12} {t('rollouts'):>9.0f} {t('prompt_tokens'):>11.0f} "
                f"{t('sampled_tokens'):>12.0f} {sum(u.steps for u in rows):>6d} "
                f"{t('trained_tokens'):>12.0f} {t('loss_tokens'):>10.0f} "
                f"{sum(u.trainer_s for u in rows):>10.1f}")  # fmt: skip

    out = [head] + [line(u.run, u.tenant, [u]) for u in ledgers]
    tenants: dict[str, list[Usage]] = {}
    for u in ledgers:
        tenants.setdefault(u.tenant, []).append(u)
    if len(ledgers) > 1:
        out.append("per tenant:")
        out += [line("", name, rows) for name, rows in sorted(tenants.items())]
    return "\n".join(out)


async def open_ledger(cfg: Any, check: bool) -> tuple[Usage, UsageCheck | None]:
    """The ledger (and its check) of the run ``cfg`` (a ServiceConfig) describes. With
    nats.url unset: a finished local run's bus, served from its folder for the read."""
    from treadle.services.errors import ConfigError
    from treadle.services.nats_server import EmbeddedNats
    from treadle.services.objectstore import open_store

    run_dir = cfg.run.run_dir
    nats_cfg = cfg.nats
    server = None
    if nats_cfg.url is None:
        store_dir = nats_cfg.embedded_store_dir or run_dir / "nats"
        if not store_dir.is_dir():
            raise ConfigError(
                f"nats.url is not set and {store_dir} holds no local run's bus: name the run's "
                "NATS server (nats.url, with its admin credentials)"
            )
        creds = run_dir / "credentials"
        secure = (creds / "nats-server.conf").is_file()
        server = EmbeddedNats(store_dir, run_dir / "logs" / "nats-usage.log",
                              config_file=creds / "nats-server.conf" if secure else None)  # fmt: skip
        url = await asyncio.to_thread(server.start)
        update: dict[str, Any] = {"url": url}
        if secure:
            update |= {"credentials": creds / "nats" / "admin.nk", "tls_ca": creds / "ca.pem"}
        nats_cfg = nats_cfg.model_copy(update=update)
    try:
        store = await asyncio.to_thread(open_store, cfg.object_store, cfg.run.name, run_dir)
        bus = await Bus.connect(nats_cfg, cfg.run.name, store=store, name="treadle-usage",
                                role="admin")  # fmt: skip
        try:
            usage = await read_usage(bus)
            return usage, (await check_usage(bus, store, usage)) if check else None
        finally:
            await bus.close()
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)


def main(argv: list[str], run_files: list[Path], check: bool) -> int:
    """`treadle usage`: the ledger of the configured run, or of each run file (read alone,
    as a hosted deployment reads them); exit 1 when --check finds a difference."""
    from treadle.services.config import ConfigSources, gather, split_argv, validate
    from treadle.services.registry import known_sections
    from treadle.services.sections import ServiceConfig

    configs = [validate(ServiceConfig, gather(ConfigSources(files=[p]), environ={}),
                        known_sections()) for p in run_files]  # fmt: skip
    if argv or not run_files:
        configs.insert(0, validate(ServiceConfig, gather(split_argv(argv)), known_sections()))
    ledgers, failed = [], False
    for cfg in configs:
        usage, checked = asyncio.run(open_ledger(cfg, check))
        ledgers.append(usage)
        if checked is not None:
            state = "differs" if checked.problems else "matches"
            print(f"{usage.run}: the ledger {state} the run's records ({checked.rollouts_checked} "
                  f"rollouts, {checked.steps_checked} steps checked; {checked.not_consumed} "
                  f"completed rollouts not consumed, {checked.not_checkable} aged out)")  # fmt: skip
            for problem in checked.problems:
                print(f"  {problem}")
            failed |= bool(checked.problems)
        if usage.undecodable:
            print(f"{usage.run}: {usage.undecodable} usage records could not be read")
            failed = True
    print(format_usage(ledgers))
    return 1 if failed else 0
