"""``treadle platform serve``: one shared deployment that tenants submit runs to (gRPC).

    treadle platform serve @ platform.toml
        ─▶ credentials (generate_shared: CA, control token, the deployment's own users)
        ─▶ nats-server (TLS, one user per run and role) ─▶ hosted inference and hosted
           trainer with no runs, accepting runs at runtime (HostedRuns), on the one base
        ─▶ the Platform service (TLS) on [platform] host:port; its address in
           <root>/platform.addr

    SubmitRun(name, config, tasks, env[, env_wheel])  tenant: the caller's key
        checked first, nothing made on a refusal: the name (free, well formed), the
        settings (only those a tenant may set, TENANT_SETTINGS; every file the run gets
        validates as its service's config), the tasks (JSONL objects), the environment
        (a built-in, or the wheel: a wheel that names its package)
        ─▶ the run's NATS users added, nats-server reloaded, its streams made
        ─▶ its store (root/stores/<run>); the wheel stored there, pinned by sha256
        ─▶ its files (root/runs/<run>/): trainer.toml, inference.toml, run.toml
        ─▶ HostedRuns.AddRun on the trainer and on inference (the other runs untouched)
        ─▶ its orchestrator and env runner, each as the run's own NATS user
        any failure on the way: what was made is undone (processes, hosted runs, users,
        streams, store) and the error goes to the tenant
    monitor (every second): each active run's processes, trainer step and served version;
        a process that died or a trainer run that failed (a quota, a bad batch) fails the
        run with its reason; max_steps trained and served: SUCCEEDED (the trainer lets the
        run go; inference keeps serving its last adapter to the run's key)
    CancelRun: processes stopped, the trainer checkpoints and lets the run go, inference
        unloads it; WatchRun: the state on each change until it ends

Tenants authenticate with their own key (``[platform] tenants``: name → key file;
``authorization: Bearer <key>``). A tenant sees only its own runs: another tenant's run
is NOT_FOUND, as is one that does not exist. Run names are each tenant's own (two tenants
may each have a run "rev", and no answer tells one of the other's); the deployment knows a
run as <tenant>--<name> (``run_id``): its users, streams, store, files and inference model.
SubmitRun's answer, and only it, carries
the run's inference key (kept in root/credentials/runs/<tenant>--<name>/inference.key).

What a tenant submits never names a path, a credential, a model or an import path of the
platform's host: those settings are the platform's (TENANT_SETTINGS lists what a tenant
may set). The tenant's environment code runs in its env runner, which starts in a
bubblewrap jail (``jail_argv``, ``platform.isolate_env_runners``) that shows it of the
platform's root only its own run's files, no other process and no capability; a root
platform runs it as the run's own unprivileged uid (``platform.env_runner_uids``). Its
control plane wants a token of its own run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import sys
import time
import tomllib
import zipfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import tomli_w
from pydantic import Field

from treadle.proto.v1 import (
    common_pb2,
    platform_service_pb2,
    platform_service_pb2_grpc,
)
from treadle.services import credentials
from treadle.services.config import ConfigSources, gather, split_argv, validate
from treadle.services.errors import BusRefusedError, ConfigError, TreadleError
from treadle.services.jailnet import control_path, relay_path, start_relay
from treadle.services.nats_server import EmbeddedNats
from treadle.services.ports import free_port
from treadle.services.registry import get_service, known_sections
from treadle.services.rpc import ControlSecurity, check_health, open_channel, start_server
from treadle.services.sections import StrictModel, nats_address
from treadle.services.supervisor import ManagedProcess, tail

log = logging.getLogger(__name__)

PB = platform_service_pb2
PLATFORM = "platform"  # the deployment's own namespace on the bus
RUN_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
TENANT_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9_]|-(?!-)){0,20}(?<!-)$")  # no "--", no "-" last
MAX_WHEEL_BYTES = 64 << 20
MAX_TASKS_BYTES = 64 << 20
TERMINAL = {PB.RUN_PHASE_SUCCEEDED, PB.RUN_PHASE_FAILED, PB.RUN_PHASE_CANCELLED}
HOSTED_RUNS = platform_service_pb2.DESCRIPTOR.services_by_name["HostedRuns"]
PLATFORM_SERVICE = platform_service_pb2.DESCRIPTOR.services_by_name["Platform"]

# What a tenant's config may set: section → keys (the rest is the platform's).
TENANT_SETTINGS: dict[str, set[str]] = {
    "orchestrator": {
        "max_steps", "group_size", "groups_per_step", "max_groups_in_flight",
        "max_async_level", "max_off_policy_steps", "algorithm", "seed", "seq_len",
    },
    "orchestrator.sampling": {"temperature", "top_p", "top_k", "max_tokens"},
    "orchestrator.filter": {
        "action", "zero_variance", "pass_reward", "min_pass_rate", "max_pass_rate",
    },
    "trainer.optim": {
        "name", "lr", "betas", "eps", "weight_decay", "grad_clip", "warmup_steps", "decay",
        "min_lr_factor",
    },
}  # fmt: skip


class PlatformSection(StrictModel):
    """[platform]: one shared deployment for many tenants' runs (``treadle platform``)."""

    root: Path = Path("platform")
    """Everything the platform keeps: credentials, stores, run files, logs, its state."""
    model: Path | None = None
    """The base model every run trains a LoRA adapter of (a Hugging Face folder)."""
    host: str = "127.0.0.1"
    """Address the Platform service listens on."""
    port: int = Field(0, ge=0, le=65535)
    """Its port (0: a free one; the address is written to <root>/platform.addr)."""
    inference_host: str = "127.0.0.1"
    """Address inference's HTTP API (where tenants' clients sample) listens on; 0.0.0.0:
    every interface."""
    inference_url: str = ""
    """The address tenants are told to sample their runs at (SubmitRun, ListRuns): the one
    they reach (a DNS name, a proxy in front). Empty: http://<inference_host>:<its port>,
    this machine's hostname for a wildcard host."""
    tenants: dict[str, Path] = Field(default_factory=dict)
    """Tenant name → file holding its key (16 characters at least, each its own)."""
    lora_rank: int = Field(8, ge=1)
    """Rank of every adapter on the base (the LoRA modules are built once)."""
    lora_alpha: float = Field(16.0, gt=0)
    max_runs: int = Field(4, ge=1)
    """Runs active at once (inference's max_loras); a submission beyond is refused."""
    max_steps: int = Field(1000, ge=1)
    """The most steps one run may ask for."""
    dtype: str = "float32"
    max_model_len: int = Field(1024, ge=16)
    quotas: dict[str, dict[Literal["trainer_s", "trained_tokens", "sampled_tokens"], float]] = (
        Field(default_factory=dict)
    )
    """Per tenant: what each of its runs may use ({trainer_s, trained_tokens,
    sampled_tokens}); a run at a limit fails with the limit named."""
    poll_s: float = Field(1.0, gt=0)
    """How often the platform looks at its runs."""
    isolate_env_runners: bool = True
    """Run each env runner (the process that runs a tenant's environment code) in a
    bubblewrap jail (``jail_argv``) that sees of the platform's root only its own run's
    files: no other run's credentials, no control token, no CA key, no other process.
    Off: env runners see every file the platform's user can read. A platform running as
    root runs each jailed env runner as its own unprivileged uid (env_runner_uids)."""
    env_runner_network: Literal["bus", "host"] = "bus"
    """What a jailed env runner reaches of the network: "bus", only the bus and inference
    (its own network namespace; the two are carried to it through unix sockets,
    ``treadle.services.jailnet``); "host": the host's network, every address on it (an
    environment that calls a service of its own needs this)."""
    env_runner_uids: int = Field(3_000_000, ge=1000)
    """A root platform's first env runner uid: run k's is this plus k. No user of the
    host may have these uids (a uid that has a user is skipped)."""


class PlatformConfig(StrictModel):
    platform: PlatformSection = Field(default_factory=PlatformSection)


def load_platform_config(argv: Sequence[str]) -> PlatformSection:
    cfg = validate(PlatformConfig, gather(split_argv(argv)), known_sections())
    section = cfg.platform
    if section.model is None:
        raise ConfigError("platform.model is not set: name the base model folder")
    if not section.tenants:
        raise ConfigError("platform.tenants is empty: give each tenant a key file")
    if section.inference_url and not re.match(r"^https?://[^/\s]+(/\S*)?$",
                                              section.inference_url):  # fmt: skip
        raise ConfigError(f"platform.inference_url {section.inference_url!r}: an http:// or "
                          "https:// URL")  # fmt: skip
    unknown = sorted(set(section.quotas) - set(section.tenants))
    if unknown:
        raise ConfigError(f"platform.quotas names tenants {unknown} that platform.tenants has not")
    return section


def read_tenant_keys(section: PlatformSection) -> dict[str, bytes]:
    """Tenant → sha256 of its key (ConfigError naming the tenant's file)."""
    digests: dict[str, bytes] = {}
    for tenant, path in section.tenants.items():
        if not TENANT_NAME.match(tenant):
            raise ConfigError(f"platform.tenants: {tenant!r} is not a tenant name (1-21 of "
                              "a-z, 0-9, '_', '-'; no '--', not ending in '-')")  # fmt: skip
        try:
            key = path.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"platform.tenants.{tenant}: {path}: {e.strerror or e}") from None
        if len(key) < 16:
            raise ConfigError(f"platform.tenants.{tenant}: {path} holds a key shorter than 16")
        digest = hashlib.sha256(key.encode()).digest()
        if digest in digests.values():
            raise ConfigError(f"platform.tenants.{tenant}: its key is another tenant's too")
        digests[tenant] = digest
    return digests


# --- what a tenant submits -----------------------------------------------------------------
def _flat(doc: dict[str, Any], prefix: str = "") -> list[tuple[str, str, Any]]:
    """(section, key, value) of a TOML document, sections dotted ("orchestrator.sampling")."""
    out: list[tuple[str, str, Any]] = []
    for key, value in doc.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}.{key}" if prefix else key)
        else:
            out.append((prefix, key, value))
    return out


def tenant_settings(text: str) -> dict[str, dict[str, Any]]:
    """The tenant's settings, by section; ConfigError naming the first one it may not set."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: not TOML ({e})") from None
    out: dict[str, dict[str, Any]] = {}
    for section, key, value in _flat(doc):
        allowed = TENANT_SETTINGS.get(section)
        where = f"{section}.{key}" if section else key
        if allowed is None or key not in allowed:
            may = "; ".join(f"{s}: {', '.join(sorted(k))}" for s, k in TENANT_SETTINGS.items())
            raise ConfigError(f"config: {where} is set by the platform, not a run (a run may "
                              f"set {may})")  # fmt: skip
        if isinstance(value, str) and (":" in value or "/" in value or "." in value):
            raise ConfigError(f"config: {where} = {value!r}: a run names built-ins only here "
                              "(no import paths or files of the platform's host)")  # fmt: skip
        out.setdefault(section, {})[key] = value
    if "max_steps" not in out.get("orchestrator", {}):
        raise ConfigError("config: orchestrator.max_steps is not set (how long the run trains)")
    return out


def check_tasks(data: bytes) -> int:
    """The number of tasks in a JSONL file's bytes; ConfigError naming the line."""
    if not data.strip():
        raise ConfigError("tasks: empty (a JSONL file, one task object per line)")
    if len(data) > MAX_TASKS_BYTES:
        raise ConfigError(f"tasks: {len(data)} bytes, more than {MAX_TASKS_BYTES}")
    count = 0
    for number, line in enumerate(data.decode("utf-8", errors="strict").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ConfigError(f"tasks:{number}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"tasks:{number}: a task is a JSON object, not {type(row).__name__}")
        count += 1
    return count


def check_wheel(data: bytes) -> str:
    """The wheel file name of a submitted environment package (ConfigError when it is not
    a wheel). Only its form is checked here; the run's env runner installs and loads it."""
    if len(data) > MAX_WHEEL_BYTES:
        raise ConfigError(f"env_wheel: {len(data)} bytes, more than {MAX_WHEEL_BYTES}")
    import io

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = z.namelist()
            meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
            if meta is None or meta.count("/") != 1:
                raise ConfigError("env_wheel: no .dist-info/METADATA: not a wheel")
            fields = dict(
                line.split(": ", 1)
                for line in z.read(meta).decode("utf-8", "replace").splitlines()
                if ": " in line
            )
    except zipfile.BadZipFile:
        raise ConfigError("env_wheel: not a wheel (not a zip file)") from None
    name, version = fields.get("Name", ""), fields.get("Version", "")
    if not re.match(r"^[A-Za-z0-9_.-]+$", name) or not re.match(r"^[A-Za-z0-9_.+!-]+$", version):
        raise ConfigError(f"env_wheel: its METADATA names no package ({name!r} {version!r})")
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def blocked_ancestor(path: Path) -> Path | None:
    """The highest folder above ``path`` that other users may not pass through (no o+x)."""
    for parent in reversed(path.parents):
        try:
            if not parent.stat().st_mode & 0o001:
                return parent
        except OSError:
            return None
    return None


def jail_argv(
    hidden: Sequence[Path], read: Sequence[Path], write: Sequence[Path],
    masked: Sequence[Path] = (), *, uid: int | None = None, reach: Sequence[Path] = (),
    copies: Sequence[tuple[Path, Path]] = (), chdir: Path | None = None, network: bool = True,
) -> list[str]:  # fmt: skip
    """The bubblewrap command line that runs a program with the host's files read-only,
    ``hidden`` folders empty but for ``read`` (read-only) and ``write`` (writable) paths in
    them and ``copies`` ((file, where): a file bound read-only at another path), ``masked``
    files empty (wherever they are), its own pid namespace (no other process to see or
    signal), a new session, and death with its parent. ``network``: the host's network
    (it reaches the bus and inference like any client, with its own credentials); off: a
    network namespace of its own, only a loopback (``treadle.services.jailnet`` carries
    what it may reach).

    ``uid`` (a root platform): the program runs as that unprivileged uid, not as root (root
    without capabilities still owns, and reads, every root file of the host: /etc/shadow,
    /root). bubblewrap, as root, makes the mounts; ``setpriv`` then drops to the uid with no
    capabilities, no supplementary groups and no way to gain any (no_new_privs, an empty
    bounding set). A folder the uid may not pass through on the way to a path it must
    reach (``reach``: its interpreter and packages; and every other path here) is replaced
    by an empty one, with those paths bound back in it. Its own pid namespace and /proc
    then come from a second bubblewrap, run as that uid in a user namespace of its own:
    a /proc that root's bubblewrap mounts has read-only mounts over parts of it, which
    lets no sandbox the program starts (an environment's code execution) mount a /proc of
    its own; one mounted in the uid's namespace has none. Until that second bubblewrap
    runs (no program of the run's yet), /proc is the host's. Without ``uid``: no
    capabilities (a program of a root platform keeps uid 0 on files)."""
    from treadle.env_runner.runtimes.sandbox import bwrap_path

    # no tmpfs over /tmp: the interpreter and the checkout it runs may live there (CI's
    # clone did); the program's own temporary folder is one of ``write`` (TMPDIR)
    # as root with a uid to drop to: the host's /proc (writable, for the second bubblewrap
    # to write its uid map), replaced before the program runs
    proc = ["--proc", "/proc"] if uid is None else ["--bind", "/proc", "/proc"]
    argv = [bwrap_path(), "--ro-bind", "/", "/", "--dev", "/dev", *proc]
    tmpfs: set[Path] = set()
    made: set[Path] = set()

    def mount(option: str, source: Path | str, where: Path) -> None:
        # the folders on the way inside an empty one: 0755 (bubblewrap's own are 0700)
        for folder in reversed(where.parents):
            if folder not in made and any(t in folder.parents for t in tmpfs):
                argv.extend(["--perms", "0755", "--dir", str(folder)])
                made.add(folder)
        if option == "--tmpfs":
            argv.extend([option, str(where)])
            tmpfs.add(where)
            made.difference_update({m for m in made if where in m.parents})
        else:
            argv.extend([option, str(source), str(where)])

    blocked: set[Path] = set()
    if uid is not None:
        every = [*reach, *hidden, *read, *write, *(where for _, where in copies)]
        blocked = {a for a in map(blocked_ancestor, every) if a is not None}
    for folder in sorted(blocked, key=lambda p: len(p.parts)):
        mount("--tmpfs", "", folder)
    for path in reach:
        if any(folder in path.parents for folder in blocked):
            mount("--ro-bind", path, path)
    for folder in hidden:
        mount("--tmpfs", "", folder)
    for path in read:
        mount("--ro-bind", path, path)
    for path in write:
        mount("--bind", path, path)
    for source, where in copies:
        mount("--ro-bind", source, where)
    for path in masked:
        mount("--ro-bind", "/dev/null", path)
    if chdir is not None:
        argv += ["--chdir", str(chdir)]
    argv += ["--unshare-pid", "--unshare-ipc", "--new-session", "--die-with-parent"]
    if not network:
        argv.append("--unshare-net")
    if uid is None:
        return [*argv, "--cap-drop", "ALL", "--"]
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise ConfigError("setpriv (util-linux) is not installed: a root platform runs each "
                          "env runner as its own user with it (platform.isolate_env_runners)")  # fmt: skip
    # the second bubblewrap keeps every mount of the first as it is (read-only stays so)
    inner = [bwrap_path(), "--dev-bind", "/", "/", "--unshare-user", "--unshare-pid",
             "--proc", "/proc", "--die-with-parent"]  # fmt: skip
    if chdir is not None:
        inner += ["--chdir", str(chdir)]
    return [*argv, "--", setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", "--", *inner, "--"]  # fmt: skip


# --- runs --------------------------------------------------------------------------------
def run_id(tenant: str, name: str) -> str:
    """The deployment's name of a tenant's run (its NATS users and subjects, streams,
    store, files, inference model): each tenant names its runs in its own namespace, and
    no name tells one tenant anything of another's runs. Unambiguous: a tenant name holds
    no "--" and does not end in "-"."""
    return f"{tenant}--{name}"


@dataclass
class Run:
    """One run on the platform and what the platform knows of it."""

    name: str  # run_id(tenant, label): the deployment's name
    tenant: str
    max_steps: int
    env: str
    label: str = ""  # the tenant's name of it (empty: a run of a platform before namespaces)
    uid: int = 0  # its env runner's, on a root platform (platform.env_runner_uids)
    pin: str = ""
    phase: int = PB.RUN_PHASE_STARTING
    trained: int = 0
    served: int = 0
    message: str = "starting"
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    relays: list[asyncio.Server] = field(default_factory=list)  # its jail's network
    ports: dict[str, int] = field(default_factory=dict)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # the tenant's
    on_trainer: bool = False
    on_inference: bool = False

    def state(self) -> Any:
        return PB.RunState(
            run=self.label or self.name, tenant=self.tenant,
            phase=self.phase,  # type: ignore[arg-type]
            trained_step=self.trained, served_version=self.served, max_steps=self.max_steps,
            message=self.message, model=self.name, env_pin=self.pin,
        )  # fmt: skip

    def record(self) -> dict[str, Any]:
        keep = ("name", "tenant", "max_steps", "env", "label", "uid", "pin", "phase",
                "trained", "served", "message", "settings")  # fmt: skip
        return {k: getattr(self, k) for k in keep}


class PlatformError(TreadleError):
    """A submission or call refused, with the gRPC status to answer it with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Platform:
    """The deployment: nats-server, hosted inference and trainer, and the runs on them."""

    def __init__(self, section: PlatformSection, python: str = sys.executable):
        self.section = section
        self.root = section.root.resolve()
        self.python = python
        self.keys = read_tenant_keys(section)
        self.runs: dict[str, Run] = {}
        self.server: EmbeddedNats | None = None
        self.creds: credentials.RunCredentials | None = None
        self.security = ControlSecurity()
        self.procs: dict[str, ManagedProcess] = {}
        self.ports: dict[str, int] = {}
        self.changed = asyncio.Condition()
        self.admit = asyncio.Lock()  # one admission or cancellation at a time

    # --- the deployment ------------------------------------------------------------------
    @property
    def cred_root(self) -> Path:
        return self.root / "credentials"

    def log_file(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def _state_file(self) -> Path:
        return self.root / "runs.json"

    async def start(self) -> None:
        """Credentials, nats-server, hosted inference and trainer, healthy."""
        credentials.private_dir(self.root)
        if (self.cred_root / credentials.SHARED_MARK).is_file():
            self.creds = credentials.load_shared(self.cred_root, PLATFORM)
        else:
            self.creds = credentials.generate_shared(self.cred_root, [PLATFORM])[PLATFORM]
        self.security = ControlSecurity(
            cert=self.creds.cert.read_bytes(), key=self.creds.key.read_bytes(),
            ca=self.creds.ca.read_bytes(), token=self.creds.token.read_text().strip(),
        )  # fmt: skip
        self._load_state()
        if self.drop_uid:
            self._check_model_readable()
        self.server = EmbeddedNats(self.root / "nats", self.log_file("nats-server"),
                                   config_file=self.creds.nats_conf)  # fmt: skip
        # started from this thread: a child gets SIGKILL when the thread that started it
        # ends (supervisor.py), and worker threads are not the platform's to keep
        self.server.start()
        await credentials.create_streams(self.creds, self._url())
        self._choose_ports()
        await asyncio.gather(
            self._start_host("inference", self._inference_argv()),
            self._start_host("trainer", self._trainer_argv()),
        )
        log.info("[startup] platform: base %s, tenants %s", self.section.model,
                 ", ".join(self.keys))  # fmt: skip
        for run in list(self.runs.values()):
            if run.phase in (PB.RUN_PHASE_STARTING, PB.RUN_PHASE_RUNNING, PB.RUN_PHASE_SUCCEEDED):
                await self._resume(run)

    async def _resume(self, run: Run) -> None:
        """A run of the platform's last process, on the new trainer and inference: an
        active one resumes from its checkpoint and streams (its orchestrator and env runner
        restart), a finished one is served again to its key. Its files are written anew
        (the bus's and inference's addresses changed)."""
        folder, store_root = self.root / "runs" / run.name, self.root / "stores" / run.name
        if self.drop_uid and not run.uid:  # of a platform that ran env runners as root
            run.uid = self._next_uid()
        try:
            creds = credentials.load_shared(self.cred_root, run.name)
            files = self._write_files(run, creds, run.settings, folder, store_root,
                                      folder / "tasks.jsonl", self._runner(run, folder))  # fmt: skip
            if run.phase == PB.RUN_PHASE_SUCCEEDED:
                request = PB.AddRunRequest(run_file=str(files["inference"]))
                await self._hosted("inference", "AddRun", request, 300)
                run.on_inference = True
            else:
                await self._start_run(run, creds, files)
                run.message = f"resumed at step {run.trained} after the platform restarted"
        except (TreadleError, KeyError, grpc.aio.AioRpcError) as e:
            why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            if run.phase == PB.RUN_PHASE_SUCCEEDED:
                log.warning("run %s: its last adapter is not served again: %s", run.name, why)
            else:
                await self._fail(run, f"not resumed after the platform restarted: {why}")
        log.info("run %s of tenant %s after the restart: %s", run.name, run.tenant, run.message)
        self._save_state()

    def _choose_ports(self) -> None:
        """The platform's, inference's (HTTP and gRPC) and the trainer's ports: those of
        its last start (<root>/ports.json), so that tenants and run files keep their
        addresses over a restart; free ones the first time (platform.port: given)."""
        path = self.root / "ports.json"
        kept = json.loads(path.read_text()) if path.is_file() else {}
        for name in ("platform", "inference", "trainer", "http"):
            self.ports[name] = int(kept.get(name) or free_port())
        if self.section.port:
            self.ports["platform"] = self.section.port
        path.write_text(json.dumps(self.ports) + "\n")

    def _url(self) -> str:
        assert self.server is not None
        assert self.server.url
        return self.server.url

    def _control_flags(self) -> list[str]:
        assert self.creds is not None
        c = self.creds
        return ["--control.tls_cert", str(c.cert), "--control.tls_key", str(c.key),
                "--control.tls_ca", str(c.ca), "--control.token_file", str(c.token)]  # fmt: skip

    def _host_flags(self, service: str) -> list[str]:
        assert self.creds is not None
        return [
            self.python, "-m", f"treadle.{service}", "--run.name", PLATFORM,
            "--run.output_dir", str(self.root / "out"),
            "--object_store.root", str(self.root / "stores" / PLATFORM),
            "--nats.url", self._url(), "--nats.credentials", str(self.creds.seed(service)),
            "--nats.tls_ca", str(self.creds.ca), "--nats.manage_streams", "false",
            f"--{service}.hosted.accept_runs", "true", *self._control_flags(),
        ]  # fmt: skip

    def _inference_argv(self) -> list[str]:
        s = self.section
        return [
            *self._host_flags("inference"), "--inference.model", str(s.model),
            "--inference.dtype", s.dtype, "--inference.max_model_len", str(s.max_model_len),
            "--inference.http_host", s.inference_host, "--inference.http_port",
            str(self.ports["http"]),
            "--inference.grpc.port", str(self.ports["inference"]),
            "--inference.lora.enabled", "true", "--inference.lora.max_lora_rank", str(s.lora_rank),
            "--inference.lora.max_loras", str(s.max_runs),
        ]  # fmt: skip

    def _trainer_argv(self) -> list[str]:
        s = self.section
        return [
            *self._host_flags("trainer"), "--trainer.model", str(s.model),
            "--trainer.device", "cpu", "--trainer.grpc.port", str(self.ports["trainer"]),
            *self._lora_flags(),
        ]  # fmt: skip

    def _lora_flags(self) -> list[str]:
        s = self.section
        return ["--trainer.lora.enabled", "true", "--trainer.lora.rank", str(s.lora_rank),
                "--trainer.lora.alpha", str(s.lora_alpha)]  # fmt: skip

    async def _start_host(self, name: str, argv: list[str]) -> None:
        proc = ManagedProcess(name, argv, self.log_file(name)).start()
        self.procs[name] = proc
        await self._healthy(proc, f"127.0.0.1:{self.ports[name]}", 900)

    async def _healthy(self, proc: ManagedProcess, target: str, timeout_s: float,
                       security: ControlSecurity | None = None) -> None:  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not await check_health(target, security=security or self.security):
            if proc.poll() is not None:
                raise proc.failure("died during startup")
            if time.monotonic() > deadline:
                raise proc.failure(f"not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(0.5)

    def address(self) -> str:
        return f"{self.section.host}:{self.ports['platform']}"

    async def stop(self) -> None:
        for run in self.runs.values():
            for proc in run.procs.values():
                await asyncio.to_thread(proc.stop, 30)
        for name in ("trainer", "inference"):
            if name in self.procs:
                await asyncio.to_thread(self.procs[name].stop, 120)
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        self._save_state()

    # --- state ---------------------------------------------------------------------------
    def _save_state(self) -> None:
        tmp = self._state_file().with_suffix(".tmp")
        tmp.write_text(json.dumps([r.record() for r in self.runs.values()], indent=1))
        tmp.replace(self._state_file())

    def _load_state(self) -> None:
        """Runs of an earlier platform process (``start`` resumes the active ones)."""
        if not self._state_file().is_file():
            return
        for rec in json.loads(self._state_file().read_text()):
            run = Run(**rec)
            self.runs[run.name] = run

    async def _notify(self) -> None:
        self._save_state()
        async with self.changed:
            self.changed.notify_all()

    # --- admission -----------------------------------------------------------------------
    def find(self, tenant: str, name: str) -> Run | None:
        """The tenant's run it calls ``name``."""
        return next((r for r in self.runs.values()
                     if r.tenant == tenant and (r.label or r.name) == name), None)  # fmt: skip

    def _check(self, tenant: str, req: Any) -> tuple[dict[str, dict[str, Any]], int, str]:
        """(settings, task count, wheel file name) of a submission, or PlatformError."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not RUN_NAME.match(req.name):
            raise PlatformError(bad, f"name {req.name!r}: 1-40 of a-z, 0-9, '_', '-', starting "
                                     "with a letter or digit")  # fmt: skip
        ident = run_id(tenant, req.name)
        if self.find(tenant, req.name) or (self.cred_root / "runs" / ident).exists():
            raise PlatformError(grpc.StatusCode.ALREADY_EXISTS,
                                f"you have a run {req.name!r} already")  # fmt: skip
        active = [r for r in self.runs.values() if r.phase not in TERMINAL]
        if len(active) >= self.section.max_runs:
            raise PlatformError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the platform runs {len(active)} runs, its most "
                                f"(platform.max_runs); try again when one ends")  # fmt: skip
        try:
            settings = tenant_settings(req.config)
            steps = settings["orchestrator"]["max_steps"]
            if not isinstance(steps, int) or not 1 <= steps <= self.section.max_steps:
                raise ConfigError(f"config: orchestrator.max_steps = {steps!r}: 1 to "
                                  f"{self.section.max_steps} on this platform")  # fmt: skip
            seq_len = settings["orchestrator"].get("seq_len", self.section.max_model_len)
            if not isinstance(seq_len, int) or seq_len > self.section.max_model_len:
                raise ConfigError(f"config: orchestrator.seq_len = {seq_len!r}: at most "
                                  f"{self.section.max_model_len} on this platform")  # fmt: skip
            n_tasks = check_tasks(req.tasks)
            wheel = check_wheel(req.env_wheel) if req.env_wheel else ""
            if not re.match(r"^[A-Za-z0-9_]+$", req.env):
                raise ConfigError(f"env {req.env!r}: an environment name (letters, digits, _)")
            if not wheel:
                from treadle.env_runner.environments import BUILTIN

                if req.env not in BUILTIN:
                    raise ConfigError(f"env {req.env!r} is not a built-in environment "
                                      f"({', '.join(sorted(BUILTIN))}); send its package "
                                      "(env_wheel) to use your own")  # fmt: skip
            if req.env_entry and not re.match(r"^[A-Za-z0-9_.]+(:[A-Za-z0-9_]+)?$", req.env_entry):
                raise ConfigError(f"env_entry {req.env_entry!r}: 'module:ATTRIBUTE'")
        except ConfigError as e:
            raise PlatformError(bad, str(e)) from None
        except UnicodeDecodeError as e:
            raise PlatformError(bad, f"tasks: not UTF-8 ({e.reason})") from None
        return settings, n_tasks, wheel

    async def submit(self, tenant: str, req: Any) -> Run:
        """Admit a run (module doc). A refusal before its streams exist leaves nothing of
        it; a failure after (a service refused it, a process did not start) leaves it
        FAILED with the reason, its processes stopped and its users removed, and its name
        taken (its streams may hold messages a new run of that name must not find)."""
        async with self.admit:
            settings, n_tasks, wheel = self._check(tenant, req)
            run = Run(run_id(tenant, req.name), tenant, settings["orchestrator"]["max_steps"],
                      req.env, label=req.name, uid=self._next_uid(), settings=settings)  # fmt: skip
            creds, files = await self._prepare(run, req, settings, wheel)
            self.runs[run.name] = run
            try:
                await self._start_run(run, creds, files)
            except (TreadleError, grpc.aio.AioRpcError) as e:
                why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                await self._fail(run, f"not started: {why}")
                await self._notify()
                raise PlatformError(grpc.StatusCode.FAILED_PRECONDITION, run.message) from None
            run.message = f"started: {n_tasks} tasks, env {run.env}"
            await self._notify()
            log.info("run %s of tenant %s admitted (%s)", run.name, tenant, run.message)
            return run

    def inference_url(self) -> str:
        """Where tenants' clients sample their runs' adapters (platform.inference_url)."""
        if self.section.inference_url:
            return self.section.inference_url.rstrip("/")
        host = self.section.inference_host
        if host in ("0.0.0.0", "::", ""):
            import socket

            host = socket.gethostname()
        return f"http://{f'[{host}]' if ':' in host else host}:{self.ports['http']}"

    def local_inference_url(self) -> str:
        """Where the platform's own processes (env runners) reach inference."""
        host = self.section.inference_host
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.ports['http']}"

    def inference_key(self, run: Run) -> str:
        """The key the run's clients send there."""
        key = credentials.load_shared(self.cred_root, run.name).inference_key
        assert key is not None
        return key.read_text().strip()

    async def _prepare(
        self, run: Run, req: Any, settings: dict[str, Any], wheel: str
    ) -> tuple[credentials.RunCredentials, dict[str, Path]]:
        """The run's users (not yet on the server), store, wheel and files, each file
        validated as its services read it; a refusal removes them all again."""
        creds = credentials.add_shared_runs(self.cred_root, [run.name])[run.name]
        folder = credentials.private_dir(self.root / "runs" / run.name)
        store_root = self.root / "stores" / run.name
        try:
            tasks = folder / "tasks.jsonl"
            tasks.write_bytes(req.tasks)
            if wheel:
                run.pin = await asyncio.to_thread(self._store_wheel, store_root, req, wheel)
            runner = self._runner(run, folder)
            files = self._write_files(run, creds, settings, folder, store_root, tasks, runner)
            self._validate_files(files)
        except BaseException:
            credentials.remove_shared_run(self.cred_root, run.name)
            for path in (folder, store_root):
                shutil.rmtree(path, ignore_errors=True)
            raise
        return creds, files

    async def _start_run(
        self, run: Run, creds: credentials.RunCredentials, files: dict[str, Path]
    ) -> None:
        """Its users on the server, its streams, the hosted trainer and inference, then its
        orchestrator and env runner, each healthy."""
        assert self.server is not None
        await asyncio.to_thread(self.server.reload)
        await self._create_streams(creds, run.env)
        quota = self._quota(run.tenant)
        trainer = await self._hosted(
            "trainer", "AddRun", PB.AddRunRequest(run_file=str(files["trainer"]), quota=quota), 300
        )
        run.on_trainer = True
        request = PB.AddRunRequest(run_file=str(files["inference"]), quota=quota)
        served = await self._hosted("inference", "AddRun", request, 300)
        run.on_inference = True
        run.trained, run.served = trainer.step, served.step
        for service in ("orchestrator", "env_runner"):
            run.ports[service] = free_port()
            argv = [self.python, "-m", f"treadle.{service}", "@", str(files["run"]),
                    "--nats.credentials", str(creds.seed(service)),
                    f"--{service}.grpc.port", str(run.ports[service])]  # fmt: skip
            env = None
            security = self.security
            if service == "orchestrator":  # polls inference's version: the control plane's
                argv += self._control_flags()  # TLS and token (the env runner gets neither)
            else:  # its control plane: a token of its own (its neighbours' code reaches the
                token = self._runner_token(run)  # port; the platform's token is not theirs)
                argv += ["--control.token_file", str(token)]
                security = ControlSecurity(token=token.read_text().strip())
            target = f"127.0.0.1:{run.ports[service]}"
            if service == "env_runner" and self.section.isolate_env_runners:  # tenant code
                net = await self._jail_network(run) if self.netns else None
                if net is not None:
                    argv = [self.python, "-m", "treadle.services.jailnet", "--dir", str(net),
                            "--connect", f"127.0.0.1:{nats_address(self._url())[1]}",
                            "--connect", f"127.0.0.1:{self.ports['http']}",
                            "--serve", str(run.ports[service]), "--", *argv]  # fmt: skip
                    target = f"unix:{control_path(net)}"
                argv = self._jail(run, creds, files["run"], token, net) + argv
                tmp = str(self.root / "runs" / run.name / "tmp")
                env = {**os.environ, "HOME": tmp, "TMPDIR": tmp}
            proc = ManagedProcess(f"{run.name}-{service}", argv,
                                  self.log_file(f"{run.name}-{service}"), env=env).start()  # fmt: skip
            run.procs[service] = proc
            await self._healthy(proc, target, 300, security)
        run.phase = PB.RUN_PHASE_RUNNING

    def _check_model_readable(self) -> None:
        """The env runners (their own uids) read the tokenizer from the model folder."""
        assert self.section.model is not None
        weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf")  # the trainer's, inference's
        for path in [self.section.model, *self.section.model.rglob("*")]:
            if path.suffix in weights:
                continue
            mode = path.stat().st_mode
            if not mode & (0o005 if path.is_dir() else 0o004):
                raise ConfigError(f"platform.model: {path} is not readable by other users; "
                                  "the env runners run as their own users and read the "
                                  "tokenizer from it (chmod o+rX)")  # fmt: skip

    @property
    def drop_uid(self) -> bool:
        """Env runners run as their own uids: jailed, by a root platform."""
        return self.section.isolate_env_runners and os.geteuid() == 0

    def _next_uid(self) -> int:
        if not self.drop_uid:
            return 0
        import pwd

        uid = max([r.uid for r in self.runs.values()] + [self.section.env_runner_uids]) + 1
        while True:
            try:
                pwd.getpwuid(uid)  # a user of the host: not this run's
            except KeyError:
                return uid
            uid += 1

    def _runner_token(self, run: Run) -> Path:
        """The token of the run's env runner's control plane (made once)."""
        path = self.cred_root / "runs" / run.name / "env_runner.token"
        if not path.is_file():
            credentials.write_secret(path, credentials.new_token() + "\n")
        return path

    @property
    def netns(self) -> bool:
        """Jailed env runners have a network of their own (platform.env_runner_network)."""
        return self.section.isolate_env_runners and self.section.env_runner_network == "bus"

    async def _jail_network(self, run: Run) -> Path:
        """The run's relays to the bus and inference, in a folder its jail gets
        (``treadle.services.jailnet``); closed with the run's processes. The folder is the
        platform's (nothing in it can be swapped for a link); only its ``in`` folder, where
        the launcher puts the socket to the env runner's control plane, is the run's."""
        for server in run.relays:
            server.close()
        net = credentials.private_dir(self.root / "runs" / run.name / "net")
        net.chmod(0o755)
        inside = self._runner_dir(run, net / "in")
        uid = run.uid if self.drop_uid else None
        host = self.local_inference_url().removeprefix("http://").rpartition(":")[0]
        nats_host, nats_port = nats_address(self._url())
        run.relays = [
            await start_relay(relay_path(net, nats_port), nats_host, nats_port, uid),
            await start_relay(relay_path(net, self.ports["http"]), host.strip("[]"),
                              self.ports["http"], uid),
        ]  # fmt: skip
        assert control_path(net).parent == inside
        return net

    def _runner_dir(self, run: Run, path: Path) -> Path:
        """A folder the run's env runner writes (its uid's on a root platform): made by
        the platform, filled by the run alone (nothing in it is the platform's to follow)."""
        credentials.private_dir(path)
        if self.drop_uid:
            os.chown(path, run.uid, run.uid, follow_symlinks=False)
        return path

    def _jail(
        self, run: Run, creds: credentials.RunCredentials, run_file: Path, token: Path,
        net: Path | None = None,
    ) -> list[str]:  # fmt: skip
        """The bubblewrap prefix of a run's env runner: what it may read and write of the
        platform's root (``jail_argv``). It writes only folders that are its own and that
        no other process of the platform reads or writes through (its pushed packages,
        its temporary folder, its side of the network folder): not the run's output
        folder, where the trainer (the platform's user) writes, nor its store (read-only:
        the pushed wheel, the trainer's manifests). On a root platform it runs as the
        run's uid, with copies of its secrets only that uid can read, bound where the
        originals are (which stay the platform's)."""
        assert self.section.model is not None
        assert creds.inference_key is not None
        folder = self.root / "runs" / run.name
        pushed = self._runner_dir(run, folder / "pushed")
        tmp = self._runner_dir(run, folder / "tmp")
        store = credentials.private_dir(self.root / "stores" / run.name)
        model = self.section.model.resolve()
        secrets = [run_file, creds.ca, creds.seed("env_runner"), creds.inference_key, token]
        masked = [p.resolve() for p in self.section.tenants.values()]  # their API keys
        write = [pushed, tmp]
        read = [model, store]
        if net is not None:
            read.append(net)
            write.append(control_path(net).parent)
        if not self.drop_uid:
            return jail_argv(hidden=[self.root], read=[*secrets, *read], write=write,
                             masked=masked, network=net is None)  # fmt: skip
        store.chmod(0o755)  # its objects are written 0644 (object_store.shared_read)
        copies = credentials.private_dir(folder / "jail")
        pairs = []
        for n, secret in enumerate(secrets):
            copy = copies / f"{n}-{secret.name}"
            shutil.copyfile(secret, copy)
            os.chown(copy, run.uid, run.uid)
            os.chmod(copy, 0o400)
            pairs.append((copy, secret))
        # the interpreter and its packages (not the platform's working folder, which sys.path
        # names for `python -m`: the env runner starts in its own)
        here = Path.cwd().resolve()
        paths = dict.fromkeys(Path(p).resolve() for p in [sys.prefix, sys.base_prefix, *sys.path]
                              if p)  # fmt: skip
        reach = [q for q in paths if q.is_dir() and q != here]
        return jail_argv(hidden=[self.root], read=read, write=write, masked=masked,
                         uid=run.uid, reach=[*reach, model], copies=pairs, chdir=tmp,
                         network=net is None)  # fmt: skip

    async def _create_streams(self, creds: credentials.RunCredentials, env: str) -> None:
        """The run's streams as its admin user, once nats-server took the reload."""
        for attempt in range(50):
            try:
                await credentials.create_streams(creds, self._url(), [env])
                return
            except BusRefusedError:  # the new user is not known yet: the reload is in progress
                if attempt == 49:
                    raise
                await asyncio.sleep(0.1)

    def _runner(self, run: Run, folder: Path) -> dict[str, Any]:
        """The env runner's environment settings: a built-in, or the pinned package."""
        if not run.pin:
            return {"envs": [run.env]}
        return {"envs": [run.env], "pushed_envs": [run.pin],
                "pushed_envs_dir": str(folder / "pushed")}  # fmt: skip

    def _store_wheel(self, store_root: Path, req: Any, wheel: str) -> str:
        import tempfile

        from treadle.env_runner.pushed import store_wheel
        from treadle.services.objectstore import LocalObjectStore

        with tempfile.TemporaryDirectory(prefix="treadle-submit-") as tmp:
            path = Path(tmp) / wheel
            path.write_bytes(req.env_wheel)
            entry = req.env_entry or f"{req.env}:ENVIRONMENT"
            store = LocalObjectStore(store_root, shared_read=self.drop_uid)
            return store_wheel(store, path, req.env, entry).pin

    def _write_files(
        self, run: Run, creds: credentials.RunCredentials, settings: dict[str, dict[str, Any]],
        folder: Path, store_root: Path, tasks: Path, runner: dict[str, Any],
    ) -> dict[str, Path]:  # fmt: skip
        """The run's trainer.toml, inference.toml and run.toml (orchestrator, env runner)."""
        s = self.section
        orch = dict(settings.get("orchestrator", {}))
        seed = int(orch.get("seed", 0))

        def common(role: str) -> dict[str, Any]:
            return {
                "run": {"name": run.name, "tenant": run.tenant,
                        "output_dir": str(self.root / "out")},
                "nats": {"url": self._url(), "credentials": str(creds.seed(role)),
                         "tls_ca": str(creds.ca), "manage_streams": False},
                "object_store": {"root": str(store_root), "shared_read": self.drop_uid},
            }  # fmt: skip

        assert creds.inference_key is not None
        docs: dict[str, dict[str, Any]] = {
            "trainer": {**common("trainer"), "trainer": {
                "model": str(s.model), "device": "cpu", "max_steps": run.max_steps, "seed": seed,
                "checkpoint_every": max(1, min(50, run.max_steps)),
                "lora": {"enabled": True, "rank": s.lora_rank, "alpha": s.lora_alpha},
                "optim": settings.get("trainer.optim", {}),
            }},
            "inference": {**common("inference"),
                          "inference": {"hosted": {"key_file": str(creds.inference_key)}}},
            "run": {**common("orchestrator"), "orchestrator": {
                "max_async_level": 1, "seq_len": s.max_model_len, **orch,
                "env": run.env, "tasks": str(tasks), "status_poll_s": 0.5,
                "inference_grpc": [f"127.0.0.1:{self.ports['inference']}"],
                "sampling": settings.get("orchestrator.sampling", {}),
                "filter": settings.get("orchestrator.filter", {}),
            }, "env_runner": {
                **runner, "tokenizer": str(s.model),
                "inference_url": self.local_inference_url(),
                "inference_model": run.name, "inference_key_file": str(creds.inference_key),
                "max_model_len": s.max_model_len,
            }},
        }  # fmt: skip
        out = {}
        for name, doc in docs.items():
            path = folder / f"{name}.toml"
            credentials.write_secret(path, tomli_w.dumps(doc))
            out[name] = path
        return out

    def _validate_files(self, files: dict[str, Path]) -> None:
        """Every file as its services read it: a bad setting fails here, before anything
        starts, naming the setting (the file's path is the platform's and is not shown)."""
        for name, services in (("trainer", ["trainer"]), ("inference", ["inference"]),
                               ("run", ["orchestrator", "env_runner"])):  # fmt: skip
            for service in services:
                cls = get_service(service).config_cls
                try:
                    validate(cls, gather(ConfigSources(files=[files[name]]), environ={}),
                             known_sections())  # fmt: skip
                except ConfigError as e:
                    text = str(e).replace(str(files[name]), "config")
                    raise PlatformError(grpc.StatusCode.INVALID_ARGUMENT, text) from None

    def _quota(self, tenant: str) -> Any:
        q = self.section.quotas.get(tenant, {})
        return PB.HostedQuota(trainer_s=q.get("trainer_s", 0.0),
                              trained_tokens=int(q.get("trained_tokens", 0)),
                              sampled_tokens=int(q.get("sampled_tokens", 0)))  # fmt: skip

    async def _hosted(self, service: str, method: str, request: Any, deadline_s: float) -> Any:
        """HostedRuns.<method> of the hosted trainer or inference."""
        async with open_channel(f"127.0.0.1:{self.ports[service]}", [HOSTED_RUNS],
                                security=self.security) as channel:  # fmt: skip
            stub = platform_service_pb2_grpc.HostedRunsStub(channel)
            return await getattr(stub, method)(request, timeout=deadline_s)

    async def _status(self, service: str, run: str) -> Any:
        spec = get_service(service)
        async with open_channel(f"127.0.0.1:{self.ports[service]}", [spec.control],
                                security=self.security) as channel:  # fmt: skip
            return await spec.stub(channel).GetStatus(common_pb2.GetStatusRequest(run=run),
                                                      timeout=10)  # fmt: skip

    async def _release(self, run: Run, reason: str, *, inference: bool) -> None:
        """Stop the run's processes; the trainer lets it go (checkpointing it); inference
        too when asked."""
        for proc in reversed(list(run.procs.values())):
            await asyncio.to_thread(proc.stop, 30)
        for server in run.relays:
            server.close()
        run.relays = []
        if run.on_trainer:
            await self._hosted("trainer", "RemoveRun",
                               PB.RemoveRunRequest(run=run.name, reason=reason), 600)  # fmt: skip
            run.on_trainer = False
        if inference and run.on_inference:
            await self._hosted("inference", "RemoveRun",
                               PB.RemoveRunRequest(run=run.name, reason=reason), 120)  # fmt: skip
            run.on_inference = False

    # --- the runs' lives -----------------------------------------------------------------
    async def cancel(self, run: Run, reason: str) -> None:
        async with self.admit:
            if run.phase in TERMINAL:
                return
            run.message = f"cancelling: {reason}" if reason else "cancelling"
            await self._notify()
            await self._release(run, reason or "cancelled by its tenant", inference=True)
            run.phase = PB.RUN_PHASE_CANCELLED
            run.message = f"cancelled at step {run.trained}" + (f": {reason}" if reason else "")
            await self._notify()

    async def monitor(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for name in ("inference", "trainer"):
                if self.procs[name].poll() is not None:
                    raise self.procs[name].failure("died")
            for run in list(self.runs.values()):
                if run.phase == PB.RUN_PHASE_RUNNING and not self.admit.locked():
                    await self._look(run)
            try:
                await asyncio.wait_for(stop.wait(), self.section.poll_s)
            except TimeoutError:
                pass

    async def _look(self, run: Run) -> None:
        before = (run.phase, run.trained, run.served, run.message)
        try:
            trainer = await self._status("trainer", run.name)
            inference = await self._status("inference", run.name)
        except grpc.aio.AioRpcError as e:
            run.message = f"status unavailable: {e.details()}"
        else:
            run.trained, run.served = trainer.step, inference.policy_version
            if trainer.info.state == common_pb2.SERVICE_STATE_FAILED:
                await self._fail(run, f"trainer: {trainer.info.message}")
            elif run.trained >= run.max_steps and run.served >= run.max_steps:
                await self._release(run, "trained", inference=False)
                run.phase = PB.RUN_PHASE_SUCCEEDED
                run.message = f"trained {run.trained} steps; inference serves {run.name}-v" \
                              f"{run.served} to the run's key"  # fmt: skip
            else:
                run.message = f"step {run.trained}/{run.max_steps}, serving v{run.served}"
        for service, proc in run.procs.items():
            if run.phase != PB.RUN_PHASE_RUNNING:
                break
            code = proc.poll()
            if code is None or (service == "orchestrator" and code == 0):
                continue  # running, or its last batch is out (the trainer follows)
            lines = [ln for ln in tail(proc.log_file, 40).splitlines()
                     if "error" in ln.lower()][-3:]  # fmt: skip
            await self._fail(run, f"{service} exited with code {code}: "
                                  + (" | ".join(lines) or "see its log"))  # fmt: skip
        if (run.phase, run.trained, run.served, run.message) != before:
            await self._notify()

    async def _fail(self, run: Run, why: str) -> None:
        """The run FAILED with ``why``: its processes stopped, the trainer and inference
        let it go."""
        from treadle.services.redact import redact

        run.phase = PB.RUN_PHASE_FAILED
        run.message = redact(why).replace(str(self.root), "<platform>")
        log.warning("run %s failed: %s", run.name, run.message)
        try:
            await self._release(run, "failed", inference=True)
        except grpc.aio.AioRpcError as e:
            log.warning("run %s: releasing it: %s", run.name, e.details())

    async def watch(self, run: Run) -> AsyncIterator[Any]:
        last = None
        while True:
            state = run.state()
            if state != last:
                yield state
                last = state
            if run.phase in TERMINAL:
                return
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait(), 5.0)
                except TimeoutError:
                    pass


# --- the gRPC service ---------------------------------------------------------------------
class PlatformServicer(platform_service_pb2_grpc.PlatformServicer):
    """Platform (platform_service.proto), each call as the tenant its key names."""

    def __init__(self, platform: Platform):
        self.platform = platform

    async def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        key = given.removeprefix("Bearer ").strip() if isinstance(given, str) else ""
        digest = hashlib.sha256(key.encode()).digest()
        found = ""
        for tenant, expected in self.platform.keys.items():
            if hmac.compare_digest(digest, expected) and key:
                found = tenant
        if not found:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "send your tenant key (authorization: Bearer <key>)")  # fmt: skip
        return found

    async def _own(self, name: str, context: grpc.aio.ServicerContext) -> Run:
        run = self.platform.find(await self._tenant(context), name)
        if run is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"you have no run {name!r}")
        assert run is not None
        return run

    async def SubmitRun(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        tenant = await self._tenant(context)
        try:
            run = await self.platform.submit(tenant, request)
        except PlatformError as e:
            await context.abort(e.code, str(e))
        state = self._public(run)
        state.inference_key = self.platform.inference_key(run)
        return state

    async def ListRuns(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        tenant = await self._tenant(context)
        runs = [self._public(r) for r in self.platform.runs.values() if r.tenant == tenant]
        return PB.ListRunsResponse(runs=runs)

    def _public(self, run: Run) -> Any:
        state = run.state()
        state.inference_url = self.platform.inference_url()
        return state

    async def WatchRun(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        run = await self._own(request.run, context)
        async for state in self.platform.watch(run):
            state.inference_url = self.platform.inference_url()
            await context.write(state)

    async def CancelRun(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        run = await self._own(request.run, context)
        await self.platform.cancel(run, request.reason)
        return run.state()


async def serve(section: PlatformSection, stop: asyncio.Event) -> None:
    platform = Platform(section)
    try:
        await platform.start()
        assert platform.creds is not None
        security = ControlSecurity(cert=platform.security.cert, key=platform.security.key)
        server = await start_server(
            section.host, platform.ports["platform"],
            [(platform_service_pb2_grpc.add_PlatformServicer_to_server,
              PlatformServicer(platform), PLATFORM_SERVICE)],
            security=security,
        )  # fmt: skip
        await server.set_serving(True)
        (platform.root / "platform.addr").write_text(platform.address() + "\n")
        print(f"platform serving on {platform.address()} (TLS: CA {platform.creds.ca})",
              flush=True)  # fmt: skip
        try:
            await platform.monitor(stop)
        except BaseException as e:
            log.error("the platform stops: %s: %s", type(e).__name__, e)
            raise
        finally:
            await server.stop(5)
    finally:
        log.info("[shutdown] stopping every run's processes, the trainer, inference, nats")
        await platform.stop()


# --- the command ---------------------------------------------------------------------------
def _client_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="treadle platform",
        description="A shared deployment many tenants train runs on: `serve` runs it; the "
        "other commands are a tenant's (they need --addr, --ca and --key-file).",
    )
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sv = sub.add_parser("serve", help="run the platform: @ platform.toml [--platform.key V]")
    sv.add_argument("config", nargs=argparse.REMAINDER, help="@ platform.toml and flags")
    for name, help_ in (("submit", "submit a run"), ("list", "list your runs"),
                        ("watch", "follow a run until it ends"), ("cancel", "cancel a run")):  # fmt: skip
        c = sub.add_parser(name, help=help_)
        c.add_argument("--addr", required=True, help="HOST:PORT of the platform")
        c.add_argument("--ca", type=Path, required=True, help="the platform's CA (PEM)")
        c.add_argument("--key-file", type=Path, required=True, help="your tenant key's file")
        if name != "list":
            c.add_argument("run", help="the run's name")
        if name == "submit":
            c.add_argument("--config", type=Path, required=True, help="the run's TOML settings")
            c.add_argument("--tasks", type=Path, required=True, help="its tasks (JSONL)")
            c.add_argument("--env", required=True, help="a built-in environment, or the "
                           "package's environment name with --package")  # fmt: skip
            c.add_argument("--package", type=Path, help="an environment package folder (built "
                           "into a wheel and checked here first)")  # fmt: skip
            c.add_argument("--entry", help="its Environment, module:ATTR")
            c.add_argument("--watch", action="store_true", help="then follow it")
        if name == "cancel":
            c.add_argument("--reason", default="")
    return p


def _show(state: Any) -> str:
    phase = PB.RunPhase.Name(state.phase).removeprefix("RUN_PHASE_").lower()
    return (f"{state.run:<20} {phase:<10} step {state.trained_step}/{state.max_steps} "
            f"served v{state.served_version}  {state.message}")  # fmt: skip


async def _client(args: argparse.Namespace) -> int:
    key = args.key_file.read_text(encoding="utf-8").strip()
    security = ControlSecurity(ca=args.ca.read_bytes(), token=key)
    async with open_channel(args.addr, [PLATFORM_SERVICE], security=security,
                            default_timeout_s=600) as channel:  # fmt: skip
        stub = platform_service_pb2_grpc.PlatformStub(channel)
        try:
            if args.action == "list":
                for state in (await stub.ListRuns(PB.ListRunsRequest())).runs:
                    print(_show(state))
                return 0
            if args.action == "cancel":
                print(
                    _show(
                        await stub.CancelRun(PB.CancelRunRequest(run=args.run, reason=args.reason))
                    )
                )
                return 0
            if args.action == "submit":
                wheel = b""
                if args.package is not None:
                    from treadle.env_runner.pushed import check_package

                    wheel = check_package(args.package, args.entry)
                request = PB.SubmitRunRequest(
                    name=args.run, config=args.config.read_text(), tasks=args.tasks.read_bytes(),
                    env=args.env, env_wheel=wheel, env_entry=args.entry or "",
                )  # fmt: skip
                state = await stub.SubmitRun(request)
                print(_show(state))
                print(f"its model: {state.model} at {state.inference_url}/v1 with the key "
                      f"{state.inference_key}")  # fmt: skip
                if not args.watch:
                    return 0
            last = None
            # a streaming call: the channel's interceptor adds the key to unary calls only
            auth = (("authorization", f"Bearer {key}"),)
            watch = stub.WatchRun(PB.WatchRunRequest(run=args.run), metadata=auth, timeout=None)
            async for state in watch:
                print(_show(state), flush=True)
                last = state
            return 0 if last is not None and last.phase == PB.RUN_PHASE_SUCCEEDED else 1
        except grpc.aio.AioRpcError as e:
            print(f"treadle platform: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1


def main(argv: Sequence[str]) -> int:
    args = _client_parser().parse_args(argv)
    if args.action != "serve":
        return asyncio.run(_client(args))
    import signal

    # a socket whose peer went away is an error to handle (EPIPE), not the end of every
    # tenant's runs: `treadle`'s entrypoint restores SIGPIPE's default for short commands
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    section = load_platform_config(args.config)
    import faulthandler

    faulthandler.enable()  # a crash of the process that holds every run leaves its trace
    from treadle.services.logs import setup_logging

    setup_logging("platform")

    async def run() -> None:
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # a hangup (its terminal closed) does not take every tenant's runs down with it
        loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP ignored (SIGTERM stops)")
        await serve(section, stop)

    asyncio.run(run())
    return 0
