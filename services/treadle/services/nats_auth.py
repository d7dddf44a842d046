"""Who may do what on a run's bus: one NATS user per service role, and its permissions.

Every role is an allow list (everything else is refused by nats-server itself), scoped
to one run's subjects and streams (``S`` = ``treadle.<run>``, streams ``<BASE>_<run>``):

| role         | publishes to                                 | JetStream API                                  |
|--------------|----------------------------------------------|------------------------------------------------|
| env_runner   | S.rollouts.completed, S.metrics.env_runner   | pull + ack ROLLOUT_REQUESTS through consumers  |
|              | (replies to group-score requests only)       | the admin made (it creates none)               |
| orchestrator | S.rollouts.requested.>, S.batches.*,         | pull + ack ROLLOUTS; read ROLLOUTS, BATCHES,   |
|              | S.groups.score.*, S.metrics.orchestrator,    | POLICY messages; delete a BATCHES message;     |
|              | S.usage.orchestrator                         | its lease bucket (KV)                          |
| trainer      | S.policy.published, S.metrics.trainer,       | pull + ack + delete consumers of BATCHES;      |
|              | S.usage.trainer                              | purge BATCHES; read POLICY, USAGE              |
| inference    | S.metrics.inference                          | pull + ack POLICY; read POLICY (the newest),   |
|              |                                              | USAGE (a hosted run's quota);                  |
|              |                                              | write the replicas bucket (KV, announcements)  |
| admin        | nothing on S                                 | create/update the run's streams; create the    |
|              |                                              | env runners' consumers; pull + ack METRICS;    |
|              |                                              | read USAGE, ROLLOUTS, BATCHES, POLICY messages |

A role may also publish to the dead-letter subject (``S.deadletter.<stream>``) of each
stream it consumes or reads. Env runners and the orchestrator may read the replicas
bucket (``REPLICAS_<run>``, where inference replicas announce themselves): stream info
and single messages, no consumer.

Every role may also look up the run's streams (``STREAM.INFO``) and subscribes only to
its own reply subjects, ``_INBOX.<run>.<role>.>`` (clients set that inbox prefix, see
``inbox_prefix``), so no role reads another's replies or pulled messages. Stream
*deletion* is nobody's: a forged ``STREAM.DELETE`` is refused for every service user.

Known gap: a role that creates its own consumers (orchestrator, trainer, inference)
could give one a push deliver subject that another stream captures; what arrives there
is a message of a stream it reads, under that stream's type header, which consumers
refuse (dead-letter) as the wrong type. Env runners, which sit next to untrusted code,
create no consumers.

This module builds the table, the server's ``authorization`` block and a client's
connect options (``connect_options``); generating keys and files is ``credentials.py``,
running the server ``nats_server.py``.
"""

from __future__ import annotations

import json
import ssl
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from treadle.services.errors import ConfigError
from treadle.services.sections import NatsSection
from treadle.services.subjects import ROOT, Subjects

ROLES = ("inference", "trainer", "orchestrator", "env_runner", "admin")
JS_API = "$JS.API"
JS_ACK = "$JS.ACK"


@dataclass(frozen=True)
class Permissions:
    """Allow lists of one NATS user (nats-server denies anything not listed)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    """May publish to the reply subject of a request it received (once), nothing else."""

    def to_conf(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "publish": {"allow": list(self.publish)},
            "subscribe": {"allow": list(self.subscribe)},
        }
        if self.allow_responses:
            doc["allow_responses"] = {"max": 1}
        return doc


def inbox_prefix(run: str, role: str) -> str:
    """Reply-subject prefix of a client of ``role`` (the only inboxes it may subscribe to)."""
    return f"_INBOX.{run}.{role}"


def _pull(stream: str, *, create: bool = True) -> list[str]:
    """Look up a durable pull consumer of ``stream`` (and create one, with ``create``),
    fetch from it, ack its messages."""
    made = [f"{JS_API}.CONSUMER.CREATE.{stream}.>", f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.*"]
    return [
        *(made if create else []),
        f"{JS_API}.CONSUMER.INFO.{stream}.*",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.*",
        f"{JS_ACK}.{stream}.>",
    ]


def work_queue_durable(env: str) -> str:
    """The durable consumer through which env runners pull environment ``env``'s requests.

    Env runners may not create consumers (a consumer's config names a deliver subject,
    and a push consumer delivering into another stream's subject would be a publish the
    permissions never see), so the admin user makes these for them
    (``make_work_queue_consumers``)."""
    return f"env-runner-{env}"


async def make_work_queue_consumers(admin_bus: Any, envs: Sequence[str]) -> list[str]:
    """Create (as admin) the work-queue consumers of ``envs``, exactly as an env runner's
    ``Bus.consumer`` would; returns their names."""
    from treadle.proto.v1 import rollout_pb2

    names = []
    for env in envs:
        name = work_queue_durable(env)
        consumer = await admin_bus.consumer(
            "ROLLOUT_REQUESTS", name, admin_bus.subjects.rollouts_requested(env),
            rollout_pb2.RolloutRequested,
        )  # fmt: skip
        await consumer.sub.unsubscribe()  # the consumer stays on the server
        names.append(name)
    return names


def _read(stream: str) -> list[str]:
    """Read single messages of ``stream`` (by sequence or last per subject)."""
    return [f"{JS_API}.STREAM.MSG.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}.>"]


def stream_names(run: str) -> list[str]:
    """Every stream of the run (as ``Subjects.streams`` defines them)."""
    return [spec.name for spec in Subjects(run).streams(NatsSection())]


# stream bases each role consumes (pull + ack) and reads single messages of; a role may
# also keep what it could not decode on those streams' dead-letter subjects
_CONSUMES = {
    "env_runner": ("ROLLOUT_REQUESTS",),  # through consumers the admin made
    "orchestrator": ("ROLLOUTS",),
    "trainer": ("BATCHES",),
    "inference": ("POLICY",),
    "admin": ("METRICS",),
}
_READS = {
    "admin": ("USAGE", "ROLLOUTS", "BATCHES", "POLICY"),  # `treadle usage` and its check
    "orchestrator": ("ROLLOUTS", "BATCHES", "POLICY"),
    "trainer": ("POLICY", "USAGE"),  # a hosted run's quota counts its use before
    # the newest PolicyPublished at startup (catch-up); a hosted run's quota reads USAGE
    "inference": ("POLICY", "USAGE"),
}


def permissions(run: str, role: str) -> Permissions:
    """The permissions of ``role`` on run ``run`` (see the module table)."""
    if role not in ROLES:
        raise ValueError(f"unknown NATS role {role!r}; roles are {', '.join(ROLES)}")
    s = Subjects(run)
    stream = s.stream_name
    pub = [f"{JS_API}.STREAM.INFO.{name}" for name in stream_names(run)]
    sub = [f"{inbox_prefix(run, role)}.>"]
    allow_responses = False
    if role != "admin":
        pub.append(s.metrics(role))
    if role in ("orchestrator", "trainer"):  # the usage ledger: rollouts, steps
        pub.append(s.usage(role))
    for base in _CONSUMES[role]:
        pub += [*_pull(stream(base), create=role != "env_runner"), s.dead_letter(base)]
    if role == "admin":
        pub += _pull(stream("ROLLOUT_REQUESTS"))  # makes the env runners' consumers
    for base in _READS.get(role, ()):
        pub += [*_read(stream(base)), s.dead_letter(base)]
    replicas = f"KV_{s.replicas_bucket}"
    if role in ("env_runner", "orchestrator"):  # discovery reads announcements
        pub += [f"{JS_API}.STREAM.INFO.{replicas}", *_read(replicas)]
    if role == "env_runner":
        pub.append(s.rollouts_completed)
        sub.append(f"{ROOT}.{run}.groups.score.*")
        allow_responses = True  # answers group-score requests, and nothing else
    elif role == "orchestrator":
        kv = s.lease_bucket
        pub += [
            s.rollouts_requested_any,
            s.batches_any,
            f"{JS_API}.STREAM.MSG.DELETE.{stream('BATCHES')}",  # an undecodable batch of its own
            f"{ROOT}.{run}.groups.score.*",
            # the run's lease (a JetStream key-value bucket)
            f"$KV.{kv}.>",
            f"{JS_API}.STREAM.INFO.KV_{kv}",
            f"{JS_API}.STREAM.CREATE.KV_{kv}",
            *_read(f"KV_{kv}"),
        ]
    elif role == "inference":  # announces itself (discovery.py)
        pub += [
            f"$KV.{s.replicas_bucket}.*",
            f"{JS_API}.STREAM.INFO.{replicas}",
            f"{JS_API}.STREAM.CREATE.{replicas}",
            *_read(replicas),
        ]
    elif role == "trainer":
        batches = stream("BATCHES")
        pub += [
            s.policy_published,
            f"{JS_API}.CONSUMER.DELETE.{batches}.*",
            f"{JS_API}.STREAM.PURGE.{batches}",
        ]
    elif role == "admin":  # the launcher: creates the streams, follows METRICS
        pub += [f"{JS_API}.STREAM.{op}.{name}" for name in stream_names(run)
                for op in ("CREATE", "UPDATE")]  # fmt: skip
        pub.append(f"{JS_API}.INFO")
        # `treadle usage --check`: how far the orchestrator has consumed ROLLOUTS
        pub.append(f"{JS_API}.CONSUMER.INFO.{stream('ROLLOUTS')}.orchestrator")
    return Permissions(tuple(dict.fromkeys(pub)), tuple(sub), allow_responses)


@dataclass
class NatsUser:
    """One user of the server's authorization block."""

    nkey: str
    """Public nkey (``U...``); the seed stays with the service."""
    permissions: Permissions
    role: str = ""
    run: str = ""


@dataclass
class ServerAuth:
    """The authorization part of a nats-server config: users and, optionally, TLS."""

    users: list[NatsUser] = field(default_factory=list)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    verify_clients: bool = False
    """Mutual TLS: clients must present a certificate signed by ``tls_ca``."""

    def to_conf(self) -> str:
        """nats-server config text (JSON is valid in its config syntax)."""
        doc: dict[str, object] = {}
        if self.users:
            doc["authorization"] = {
                "users": [
                    {"nkey": u.nkey, "permissions": u.permissions.to_conf()} for u in self.users
                ]
            }
        if self.tls_cert and self.tls_key:
            tls: dict[str, object] = {"cert_file": self.tls_cert, "key_file": self.tls_key}
            if self.tls_ca:
                tls["ca_file"] = self.tls_ca
            if self.verify_clients:
                tls["verify"] = True
            tls["timeout"] = 5
            doc["tls"] = tls
        return _conf_text(doc)


def _conf_text(doc: Mapping[str, object]) -> str:
    # nats-server reads JSON objects as config; "$JS..." strings must not be read as
    # variable references, which quoting (JSON strings are quoted) already prevents
    return "\n".join(f"{k}: {json.dumps(v, indent=2)}" for k, v in doc.items()) + "\n"


def connect_options(cfg: NatsSection, url: str, run: str, role: str | None) -> dict[str, Any]:
    """``nats.connect`` keyword arguments for a client of ``role``: its nkey seed file,
    TLS (with the run's CA, and a client certificate under mutual TLS), and the inbox
    prefix its user may subscribe to. A missing or too widely readable seed file is a
    ConfigError naming it."""
    opts: dict[str, Any] = {}
    if cfg.credentials is not None:
        path = cfg.credentials
        try:
            mode = path.stat().st_mode
        except OSError as e:
            raise ConfigError(f"nats.credentials {path}: cannot read it ({e.strerror})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"nats.credentials {path} is readable by other users (mode {stat.S_IMODE(mode):o}); "
                "chmod 600 it"
            )
        opts["nkeys_seed"] = str(path)
        if role is not None:
            opts["inbox_prefix"] = inbox_prefix(run, role)
    if cfg.tls_ca is not None or cfg.tls_cert is not None or url.startswith("tls://"):
        try:
            ctx = ssl.create_default_context(
                cafile=str(cfg.tls_ca) if cfg.tls_ca is not None else None
            )
            if cfg.tls_cert is not None and cfg.tls_key is not None:
                ctx.load_cert_chain(str(cfg.tls_cert), str(cfg.tls_key))
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"nats TLS files (tls_ca/tls_cert/tls_key) are unusable: {e}"
            ) from None
        opts["tls"] = ctx
    return opts
