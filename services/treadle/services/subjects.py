"""Every NATS subject and JetStream stream of Treadle, built in this one module.

No other module writes a subject as a literal: they ask ``Subjects(run)``. Streams are
scoped per run (``ROLLOUTS_<run>``) so several runs can share one NATS deployment.

| stream             | subjects                                 | retention              |
|--------------------|------------------------------------------|------------------------|
| ROLLOUT_REQUESTS   | treadle.<run>.rollouts.requested.<env>   | work queue, DiscardNew |
| ROLLOUTS           | treadle.<run>.rollouts.completed         | limits (max age)       |
| BATCHES            | treadle.<run>.batches.<step>             | limits (purged by the trainer after a checkpoint) |
| POLICY             | treadle.<run>.policy.published           | last value per subject |
| METRICS            | treadle.<run>.metrics.<service>          | limits (max age)       |
| DEAD_LETTERS       | treadle.<run>.deadletter.<stream>        | limits (max age, capped in messages and bytes) |

and two JetStream key-value buckets: ``LEASES_<run>`` (``orchestrator`` key: the lease
that keeps a run to one orchestrator) and ``REPLICAS_<run>`` (one key per inference
replica that announces itself, ``discovery.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from treadle.services.sections import NatsSection, check_name

ROOT = "treadle"


class Retention(Enum):
    """How a stream keeps messages (maps to JetStream retention + discard settings)."""

    WORK_QUEUE = "work_queue"  # removed once acked; DiscardNew when full
    LIMITS = "limits"  # kept until max_age / purge
    LAST_VALUE = "last_value"  # only the newest message per subject


@dataclass(frozen=True)
class StreamSpec:
    """What a JetStream stream must look like (the bus creates or updates it)."""

    name: str
    subjects: tuple[str, ...]
    retention: Retention
    max_msgs: int = -1  # -1 = unlimited
    max_age_s: float = 0.0  # 0 = unlimited
    duplicate_window_s: float = 120.0
    max_bytes: int = -1  # -1 = unlimited; when full the oldest messages go


# a flood of poison must not fill the disk: the dead-letter stream keeps the newest
DEAD_LETTER_MAX_MSGS = 100_000
DEAD_LETTER_MAX_BYTES = 64 << 20  # bytes; JetStream reserves it on disk per run


@dataclass(frozen=True)
class Subjects:
    """Subjects and streams of one run."""

    run: str

    def __post_init__(self) -> None:
        check_name(self.run, "run name")

    @property
    def _base(self) -> str:
        return f"{ROOT}.{self.run}"

    def rollouts_requested(self, env: str) -> str:
        """Where the orchestrator publishes RolloutRequested for environment ``env``."""
        return f"{self._base}.rollouts.requested.{check_name(env, 'environment name')}"

    @property
    def rollouts_requested_any(self) -> str:
        """Wildcard over every environment's requests."""
        return f"{self._base}.rollouts.requested.>"

    @property
    def rollouts_completed(self) -> str:
        """Where env runners publish RolloutCompleted."""
        return f"{self._base}.rollouts.completed"

    def groups_score(self, env: str) -> str:
        """Core-NATS request subject: the orchestrator asks env runners for group rewards."""
        return f"{self._base}.groups.score.{check_name(env, 'environment name')}"

    def batches(self, step: int) -> str:
        """Where the orchestrator publishes BatchReady of trainer step ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return f"{self._base}.batches.{step}"

    @property
    def batches_any(self) -> str:
        """Wildcard over every step's batch."""
        return f"{self._base}.batches.*"

    @property
    def policy_published(self) -> str:
        """Where the trainer publishes PolicyPublished."""
        return f"{self._base}.policy.published"

    def metrics(self, service: str) -> str:
        """Where a service publishes its MetricsReport."""
        return f"{self._base}.metrics.{check_name(service, 'service name')}"

    @property
    def metrics_any(self) -> str:
        """Wildcard over every service's metrics."""
        return f"{self._base}.metrics.*"

    def usage(self, service: str) -> str:
        """Where a service records its billable work (UsageRecord, the usage ledger)."""
        return f"{self._base}.usage.{check_name(service, 'service name')}"

    @property
    def usage_any(self) -> str:
        """Wildcard over every service's usage records."""
        return f"{self._base}.usage.*"

    def dead_letter(self, stream_base: str) -> str:
        """Where consumers of stream ``stream_base`` (e.g. "ROLLOUTS") keep what they could
        not decode or refused: the original bytes and headers plus why."""
        return f"{self._base}.deadletter.{check_name(stream_base.lower(), 'stream name')}"

    @property
    def dead_letter_any(self) -> str:
        """Wildcard over every stream's dead letters."""
        return f"{self._base}.deadletter.*"

    @property
    def lease_bucket(self) -> str:
        """JetStream key-value bucket of the run's leases (one orchestrator per run)."""
        return f"LEASES_{self.run}"

    @property
    def replicas_bucket(self) -> str:
        """JetStream key-value bucket where inference replicas announce themselves."""
        return f"REPLICAS_{self.run}"

    def stream_name(self, base: str) -> str:
        """Per-run stream name, e.g. ROLLOUTS_myrun."""
        return f"{base}_{self.run}"

    def streams(self, cfg: NatsSection) -> list[StreamSpec]:
        """The streams of DESIGN.md section 4 (and METRICS) with their retention settings."""
        dup = cfg.duplicate_window_s
        return [
            StreamSpec(
                self.stream_name("ROLLOUT_REQUESTS"),
                (self.rollouts_requested_any,),
                Retention.WORK_QUEUE,
                max_msgs=cfg.max_pending_rollout_requests,
                duplicate_window_s=dup,
            ),
            StreamSpec(
                self.stream_name("ROLLOUTS"),
                (self.rollouts_completed,),
                Retention.LIMITS,
                max_age_s=cfg.rollouts_max_age_s,
                duplicate_window_s=dup,
            ),
            StreamSpec(
                self.stream_name("BATCHES"),
                (self.batches_any,),
                Retention.LIMITS,
                duplicate_window_s=dup,
            ),
            StreamSpec(
                self.stream_name("POLICY"),
                (self.policy_published,),
                Retention.LAST_VALUE,
                duplicate_window_s=dup,
            ),
            StreamSpec(
                self.stream_name("METRICS"),
                (self.metrics_any,),
                Retention.LIMITS,
                max_age_s=cfg.rollouts_max_age_s,
                duplicate_window_s=dup,
            ),
            StreamSpec(  # the usage ledger: kept as long as the run's data
                self.stream_name("USAGE"),
                (self.usage_any,),
                Retention.LIMITS,
                duplicate_window_s=dup,
            ),
            StreamSpec(
                self.stream_name("DEAD_LETTERS"),
                (self.dead_letter_any,),
                Retention.LIMITS,
                max_msgs=DEAD_LETTER_MAX_MSGS,
                max_age_s=cfg.rollouts_max_age_s,
                duplicate_window_s=dup,
                max_bytes=DEAD_LETTER_MAX_BYTES,
            ),
        ]
