"""What the bus costs a process: seconds and operations per kind of bus work.

    op           counts
    encode       protobuf serialization of a message to publish, or of a batch payload
    decode       protobuf parsing of a delivered message, or of a batch payload
    publish      a JetStream publish until its ack (retries included)
    request      a core NATS request until its reply (group rewards)
    fetch        a pull consumer's fetch that returned messages (from the call: it includes
                 waiting for the first one to arrive, so it is an upper bound)
    ack          an ack the server confirmed (``ack_sync``)
    read         a direct stream read (``get_last_msg``: the policy version poll)
    claim_check  an object-store put or get of a payload that travels by reference (claim
                 checks, and the batch payload a BatchReady points to)

The counters are process-wide (a service has one bus) and cost two clock reads and a
lock per operation. They are exported as the OpenTelemetry counters ``treadle.bus.time``
(seconds) and ``treadle.bus.operations``, attribute ``treadle.bus.op``, when the process's
telemetry exports metrics; ``snapshot()`` reads them in-process.
``benchmarks/bus_cost.py`` puts them beside the step time.

Not here: tracing (spans of publish/process are the bus's own, ``bus.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from opentelemetry.metrics import CallbackOptions, Observation

from treadle.services import telemetry

OPS = ("encode", "decode", "publish", "request", "fetch", "ack", "read", "claim_check")

_lock = threading.Lock()  # payload codecs run in worker threads too
_seconds = dict.fromkeys(OPS, 0.0)
_counts = dict.fromkeys(OPS, 0)


def add(op: str, seconds: float, n: int = 1) -> None:
    """Count ``n`` operations of ``op`` that took ``seconds`` together."""
    with _lock:
        _seconds[op] += seconds
        _counts[op] += n


@contextmanager
def timed(op: str) -> Iterator[None]:
    """Count the block as one operation of ``op`` (also when it raises)."""
    assert op in _seconds, f"unknown bus op {op!r}"
    started = time.perf_counter()
    try:
        yield
    finally:
        add(op, time.perf_counter() - started)


def snapshot() -> dict[str, tuple[float, int]]:
    """(seconds, operations) per op so far in this process."""
    with _lock:
        return {op: (_seconds[op], _counts[op]) for op in OPS}


def _observe_seconds(options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(s, {"treadle.bus.op": op}) for op, (s, _) in snapshot().items()]


def _observe_counts(options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(n, {"treadle.bus.op": op}) for op, (_, n) in snapshot().items()]


_meter = telemetry.meter(__name__)
_meter.create_observable_counter(
    "treadle.bus.time", callbacks=[_observe_seconds], unit="s",
    description="seconds spent on bus work (encode, decode, publish, fetch, ack, ...)",
)  # fmt: skip
_meter.create_observable_counter(
    "treadle.bus.operations", callbacks=[_observe_counts], unit="{operation}",
    description="bus operations (encode, decode, publish, fetch, ack, ...)",
)  # fmt: skip
