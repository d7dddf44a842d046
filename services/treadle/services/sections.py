"""Config sections shared by every service, and the base of each service's config class.

Each service defines exactly one config class: ``ServiceConfig`` plus a field named
after the service holding its own section (e.g. ``trainer: TrainerSection``). Loading
mechanics (files, env vars, flags, error messages) live in ``config.py``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors, field docstrings are docs."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)


def check_name(value: str, what: str) -> str:
    """Names that become NATS subject tokens: letters, digits, '_' and '-' only."""
    if not NAME_RE.match(value):
        raise ValueError(
            f"{what} {value!r} must be 1-64 characters of letters, digits, '_' or '-' "
            "(it becomes a NATS subject token)"
        )
    return value


NATS_DEFAULT_PORTS = {"nats": 4222, "tls": 4222, "ws": 80, "wss": 443}
"""The URL schemes the NATS client speaks, and the port each means when a URL names none."""


def nats_address(url: str) -> tuple[str, int]:
    """(host, port) of the one NATS server ``url`` names: ``[scheme://][user[:pw]@]host[:port]``
    with a scheme of NATS_DEFAULT_PORTS (none: nats://). ValueError saying what is wrong
    (the message leaves the URL out: it may hold a password; the config error quotes it
    masked)."""
    if not url.strip():
        raise ValueError("names no host")
    if any(c.isspace() for c in url):
        raise ValueError("contains whitespace")
    if "," in url:
        raise ValueError("is a list: give one server URL")
    scheme = url.split("://", 1)[0].lower() if "://" in url else "nats"
    if scheme not in NATS_DEFAULT_PORTS:
        raise ValueError(
            f"scheme {scheme!r} is not one of {', '.join(s + '://' for s in NATS_DEFAULT_PORTS)}"
        )
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
    except ValueError as e:
        raise ValueError(f"not a URL ({e})") from None
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or (port is None and parts.netloc.rpartition("@")[2].endswith(":")):
        raise ValueError("the port must be a number in 1-65535")
    if not parts.hostname:
        raise ValueError("names no host")
    return parts.hostname, port or NATS_DEFAULT_PORTS[scheme]


class RunSection(StrictModel):
    """[run]: identity of the run and where it writes."""

    name: str = "treadle"
    """Run name; scopes NATS subjects and streams, and names the output folder."""
    output_dir: Path = Path("outputs")
    """Runs write logs, metrics and local storage under <output_dir>/<name>/."""
    tenant: str = ""
    """Who the run is billed to on a shared deployment (every usage record carries it;
    `treadle usage` sums by it). Empty: the run's name."""

    @property
    def billed_to(self) -> str:
        """The tenant usage records carry."""
        return self.tenant or self.name

    startup_wait_s: float = Field(0.0, ge=0)
    """Seconds a service keeps trying, with backoff, to reach NATS and the object store
    when it starts (0: it exits at once with the reason). Meanwhile its gRPC health is
    NOT_SERVING and its GetStatus says what it waits for and why. Containers whose
    dependencies start beside them set it (compose/compose.yaml)."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "run.name")

    @property
    def run_dir(self) -> Path:
        """Folder of this run's outputs."""
        return self.output_dir / self.name


class NatsSection(StrictModel):
    """[nats]: the data-plane bus (NATS JetStream)."""

    url: str | None = None
    """Server URL, e.g. nats://127.0.0.1:4222: one server, scheme nats://, tls://, ws:// or
    wss:// (none: nats://), port 1-65535 (none: the scheme's). Unset: the local launcher
    starts an embedded nats-server; a service started alone (`treadle serve`) then refuses
    to start."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Seconds to wait for the first connection before failing with a clear error."""
    claim_check_threshold_bytes: int = Field(256 * 1024, ge=1)
    """Messages larger than this travel through the object store as an ObjectRef."""
    ack_wait_s: float = Field(30.0, gt=0)
    """Seconds a consumer may hold a message without an ack or in-progress heartbeat."""
    max_deliver: int = Field(5, ge=1)
    """Deliveries of one message before it is given up (terminated and logged)."""
    duplicate_window_s: float = Field(3600.0, gt=0)
    """Window in which a repeated Nats-Msg-Id is dropped by the server as a duplicate."""
    max_pending_rollout_requests: int = Field(100_000, ge=1)
    """Capacity of the ROLLOUT_REQUESTS work queue; publishes beyond it are refused."""
    rollouts_max_age_s: float = Field(7 * 24 * 3600.0, gt=0)
    """How long completed rollouts stay in the ROLLOUTS stream."""
    embedded_store_dir: Path | None = None
    """JetStream store of the embedded server; default <run_dir>/nats."""
    credentials: Path | None = None
    """NKey seed file (mode 0600) of this service's NATS user; `treadle stack`/`rl` hand
    each child its own. Unset: connect anonymously (only an open server accepts that)."""
    tls_ca: Path | None = None
    """CA certificate (PEM) that signed the server's certificate: connect over TLS and
    verify it. Also turned on by a tls:// URL (then the system's CAs verify)."""
    tls_cert: Path | None = None
    """Client certificate (PEM) for servers that require mutual TLS; needs tls_key."""
    tls_key: Path | None = None
    """Key (PEM, mode 0600) of tls_cert."""
    manage_streams: bool = True
    """Create or update the run's streams at startup. A service whose NATS user may not
    (every role but admin) sets it false; the streams must then exist already."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None:
            nats_address(v)
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> NatsSection:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("nats.tls_cert and nats.tls_key go together (mutual TLS)")
        return self


class ObjectStoreSection(StrictModel):
    """[object_store]: where large payloads, weights and checkpoints live."""

    backend: Literal["local", "s3"] = "local"
    """'local' (a directory) or 's3' (MinIO, AWS S3, SeaweedFS, ... through the minio client)."""
    root: Path | None = None
    """Local backend: the directory; default <run_dir>/store."""
    shared_read: bool = False
    """Local backend: objects readable by every user who can reach the directory (0644);
    off: by the writing user alone (0600). The platform sets it for the runs whose env
    runner runs as its own unprivileged user."""
    endpoint: str | None = None
    """S3 backend: host:port (or http(s)://host:port) of the S3 API."""
    bucket: str = "treadle"
    """S3 backend: bucket; created when missing if create_bucket is true."""
    prefix: str | None = None
    """S3 backend: key prefix of this run inside the bucket; default '<run.name>/'."""
    access_key: str | None = None
    """S3 backend: access key id."""
    secret_key: SecretStr | None = None
    """S3 backend: secret key (never printed)."""
    region: str | None = None
    """S3 backend: region, if the server needs one."""
    secure: bool = False
    """S3 backend: use https."""
    create_bucket: bool = True
    """S3 backend: create the bucket on first use when it does not exist."""
    timeout_s: float = Field(60.0, gt=0)
    """S3 backend: read timeout of one request, seconds."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """S3 backend: connect timeout, seconds."""
    max_retries: int = Field(2, ge=0)
    """S3 backend: retries of a failed request (connection errors, 5xx)."""

    @model_validator(mode="after")
    def _s3_needs(self) -> ObjectStoreSection:
        if self.backend == "s3":
            missing = [
                k for k in ("endpoint", "access_key", "secret_key") if getattr(self, k) is None
            ]
            if missing:
                raise ValueError(
                    f"backend 's3' needs object_store.{', object_store.'.join(missing)} "
                    "(or TREADLE_OBJECT_STORE__<KEY> env vars)"
                )
        return self


class TelemetrySection(StrictModel):
    """[telemetry]: OpenTelemetry traces and metrics."""

    otlp_endpoint: str | None = None
    """OTLP/gRPC collector, e.g. http://127.0.0.1:4317. Unset: no export (or traces_file)."""
    traces_file: Path | None = None
    """Write finished spans as JSON lines to this file (when no OTLP endpoint is set);
    '{service}' in the path becomes the service name, one file per process."""
    metrics_interval_s: float = Field(10.0, gt=0)
    """Seconds between metric exports to the OTLP endpoint."""
    sample_ratio: float = Field(1.0, ge=0, le=1)
    """Fraction of traces recorded (parent-based)."""
    messaging_spans: bool = False
    """A span for every bus publish and every delivery handled (OpenTelemetry's messaging
    producer/consumer spans, with the publish and ack times). Off: the trace context still
    travels in the message headers and the handler's own spans (rollout, batch, train_step)
    join the publisher's trace; on: two more spans per message, ~40 % more spans per
    rollout."""
    engine_traces: bool = True
    """With an OTLP endpoint: vLLM exports its own request spans there too, joined to the
    rollouts' traces. false: only Treadle's spans (the inference service's included)."""
    tensorboard: bool = False
    """Also write every service's metrics as TensorBoard scalars to <run dir>/tensorboard.
    Written by the process that follows METRICS (`treadle rl`/`sft`); needs
    treadle-services[tensorboard]."""
    wandb: bool = False
    """Also log every service's metrics to a Weights & Biases run named after the run
    (files in <run dir>/wandb). Written by `treadle rl`/`sft`; needs treadle-services[wandb]."""
    wandb_project: str = "treadle"
    """W&B project of the run."""
    wandb_entity: str | None = None
    """W&B entity (user or team); unset: the logged-in default."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode; unset: W&B's own choice (WANDB_MODE, else online). 'offline' keeps the run
    in <run dir>/wandb for `wandb sync`."""


class LogSection(StrictModel):
    """[log]: stdlib logging of every service."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Minimum level written."""
    format: Literal["text", "json"] = "text"
    """'text' for people, 'json' (one object per line) for log pipelines."""


class GrpcSection(StrictModel):
    """The control-plane endpoint of one service (inside the service's section)."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 to accept remote callers."""
    port: int = Field(0, ge=0, le=65535)
    """Port to bind; 0 picks a free one (logged at startup)."""
    shutdown_grace_s: float = Field(5.0, ge=0)
    """Seconds in-flight rpcs get to finish on shutdown."""


class ControlSection(StrictModel):
    """[control]: security of the gRPC control plane, as server and as client.

    `treadle stack`/`rl` hand each child the run's files (credentials.py); a service
    started by hand with none of them serves and calls in plaintext, without a token."""

    tls_cert: Path | None = None
    """Certificate (PEM) this service's gRPC server presents, and its client certificate
    when servers require one; with tls_key it serves TLS only."""
    tls_key: Path | None = None
    """Key (PEM, mode 0600) of tls_cert."""
    tls_ca: Path | None = None
    """CA (PEM) that verifies the servers this service calls (TLS channels), and the
    clients of its own server when require_client_cert is set."""
    require_client_cert: bool = False
    """Mutual TLS: the server accepts only clients with a certificate signed by tls_ca."""
    token_file: Path | None = None
    """File (mode 0600) holding the bearer token: the server refuses control RPCs
    without it (health checks stay open), clients send it."""

    @model_validator(mode="after")
    def _pairs(self) -> ControlSection:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("control.tls_cert and control.tls_key go together")
        return self


class ServiceConfig(StrictModel):
    """Base of every service's config class: the shared sections."""

    run: RunSection = Field(default_factory=RunSection)
    nats: NatsSection = Field(default_factory=NatsSection)
    control: ControlSection = Field(default_factory=ControlSection)
    object_store: ObjectStoreSection = Field(default_factory=ObjectStoreSection)
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection)
    log: LogSection = Field(default_factory=LogSection)


SHARED_SECTIONS = tuple(ServiceConfig.model_fields)
