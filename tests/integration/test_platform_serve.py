"""`treadle platform serve`, the real command, and two tenants using it over gRPC: runs
submitted while others train (a built-in environment, and a package the tenant wrote and
sends), watched to their end, listed, cancelled; every refusal a tenant can cause; and one
tenant reaching nothing of the other's. The platform starts one nats-server, one vLLM
(LoRA) and one trainer for every run; each run gets its own users, store, orchestrator
and env runner while the others go on."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from testkit.chaos import build_model
from testkit.platform import write_env_tasks
from treadle.proto.v1 import platform_service_pb2 as pb
from treadle.proto.v1 import platform_service_pb2_grpc as pb_grpc
from treadle.services.rpc import ControlSecurity, check_health, open_channel
from treadle.services.supervisor import ManagedProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

SETTINGS = """
[orchestrator]
max_steps = {steps}
group_size = 4
groups_per_step = 2
max_groups_in_flight = 4
seed = {seed}
[orchestrator.sampling]
max_tokens = 16
[trainer.optim]
lr = 1e-3
"""
URLS: dict[str, str] = {}  # each run's inference URL as SubmitRun gave it
KEYS = {"acme": "acme-" + "a" * 40, "bolt": "bolt-" + "b" * 40, "tiny": "tiny-" + "c" * 40}
FORGED = "acme-" + "a" * 39 + "b"  # one character off acme's


@dataclass
class Served:
    proc: ManagedProcess
    root: Path
    addr: str
    ca: bytes
    tasks: dict[str, bytes]
    package: Path
    argv: list[str]

    def start(self, timeout_s: float = 900) -> None:
        """Start the platform (the command) and wait for its address."""
        addr_file = self.root / "deployment" / "platform.addr"
        addr_file.unlink(missing_ok=True)
        self.proc = ManagedProcess("platform", self.argv, self.root / "platform.log").start()
        deadline = time.monotonic() + timeout_s
        while not addr_file.is_file():
            if self.proc.poll() is not None:
                raise self.proc.failure("died during startup")
            assert time.monotonic() < deadline, "the platform did not come up"
            time.sleep(1)
        self.addr = addr_file.read_text().strip()
        self.ca = (self.root / "deployment" / "credentials" / "ca.pem").read_bytes()
        assert asyncio.run(check_health(self.addr, security=ControlSecurity(ca=self.ca)))

    def call(self, tenant: str | None, method: str, request: Any, timeout: float = 600) -> Any:
        async def go() -> Any:
            token = KEYS.get(tenant, FORGED) if tenant else None
            security = ControlSecurity(ca=self.ca, token=token)
            async with open_channel(self.addr, security=security,
                                    default_timeout_s=timeout) as channel:  # fmt: skip
                return await getattr(pb_grpc.PlatformStub(channel), method)(request)

        return self._alive(go)

    def _alive(self, go: Any) -> Any:
        """asyncio.run(go()); a platform that died meanwhile is the error (its exit code
        and last log lines), not the refused connection."""
        try:
            return asyncio.run(go())
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and self.proc.poll() is not None:
                raise self.proc.failure("died") from e
            raise

    def watch(self, tenant: str, run: str, timeout_s: float = 900) -> list[Any]:
        async def go() -> list[Any]:
            security = ControlSecurity(ca=self.ca)
            async with open_channel(self.addr, security=security) as channel:
                stream = pb_grpc.PlatformStub(channel).WatchRun(
                    pb.WatchRunRequest(run=run), timeout=timeout_s,
                    metadata=(("authorization", f"Bearer {KEYS[tenant]}"),),
                )  # fmt: skip
                return [state async for state in stream]

        return self._alive(go)

    def submit(self, tenant: str, name: str, env: str, *, steps: int = 2, seed: int = 0,
               config: str | None = None, wheel: bytes = b"") -> Any:  # fmt: skip
        request = pb.SubmitRunRequest(
            name=name, config=config or SETTINGS.format(steps=steps, seed=seed),
            tasks=self.tasks[env if env in self.tasks else "reverse_text"], env=env,
            env_wheel=wheel,
        )  # fmt: skip
        return self.call(tenant, "SubmitRun", request)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from treadle.env_runner.scaffold import init

    root = tmp_path_factory.mktemp("platform")
    model = build_model(root / "model")
    keys = root / "keys"
    keys.mkdir()
    tenants = {}
    for tenant, key in KEYS.items():
        (keys / tenant).write_text(key + "\n")
        tenants[tenant] = str(keys / tenant)
    config = root / "platform.toml"
    config.write_text(
        "[platform]\n"
        f'root = "{root / "deployment"}"\nmodel = "{model}"\nmax_model_len = 512\n'
        f"max_runs = 4\nlora_rank = 8\npoll_s = 0.5\n"
        f"tenants = {json.dumps(tenants).replace(':', ' =')}\n"
        "[platform.quotas.tiny]\ntrained_tokens = 50\n"
    )
    argv = [sys.executable, "-m", "treadle.services.cli", "platform", "serve", "@", str(config)]
    served = Served(ManagedProcess("platform", argv, root / "platform.log"), root, "", b"", {},
                    root, argv)  # fmt: skip
    try:
        served.start()
        tasks = {env: write_env_tasks(env, root / f"{env}.jsonl").read_bytes()
                 for env in ("reverse_text", "countdown")}  # fmt: skip
        package = init("laptop_env", root / "laptop")
        tasks["laptop_env"] = (package / "laptop_env" / "tasks.jsonl").read_bytes()
        served.tasks, served.package = tasks, package
        yield served
    finally:
        served.proc.stop(180)


def _run(platform: Served, tenant: str, name: str) -> Any:
    runs = platform.call(tenant, "ListRuns", pb.ListRunsRequest()).runs
    return next(r for r in runs if r.run == name)


def _status(e: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> tuple[grpc.StatusCode, str]:
    return e.value.code(), e.value.details() or ""


def test_two_tenants_train_runs_submitted_while_others_train(platform: Served) -> None:
    from treadle.env_runner.pushed import check_package

    first = platform.submit("acme", "rev", "reverse_text", steps=2, seed=1)
    assert first.phase == pb.RUN_PHASE_RUNNING, first
    assert first.inference_key
    assert first.inference_url.startswith("http://")
    assert (first.run, first.model) == ("rev", "acme--rev")  # each tenant's own names
    URLS["rev"] = first.inference_url
    wheel = check_package(platform.package)  # the tenant's own package, checked on its side
    second = platform.submit("bolt", "mine", "laptop_env", steps=2, seed=2, wheel=wheel)
    assert second.env_pin.startswith("laptop_env@")
    for tenant, run in (("acme", "rev"), ("bolt", "mine")):
        states = platform.watch(tenant, run)
        last = states[-1]
        assert last.phase == pb.RUN_PHASE_SUCCEEDED, states
        assert (last.trained_step, last.served_version) == (2, 2)
        assert [s.trained_step for s in states] == sorted(s.trained_step for s in states)
    # a run's key samples its own last adapter; another run's model is refused to it
    import httpx

    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}, "model": first.model}
    url = f"{first.inference_url}/inference/v1/generate"
    got = httpx.post(url, json=body, headers={"authorization": f"Bearer {first.inference_key}"},
                     timeout=60)  # fmt: skip
    assert got.status_code == 200, got.text
    body["model"] = second.model
    got = httpx.post(url, json=body, headers={"authorization": f"Bearer {first.inference_key}"},
                     timeout=60)  # fmt: skip
    assert got.status_code == 403
    # each tenant lists its own runs only
    mine = platform.call("bolt", "ListRuns", pb.ListRunsRequest())
    assert [r.run for r in mine.runs] == ["mine"]
    assert not mine.runs[0].inference_key  # the key travels in SubmitRun's answer only
    log = (platform.root / "deployment" / "logs" / "bolt--mine-env_runner.log").read_text()
    assert "pushed environment laptop_env installed in" in log


SPY = """
import sys as _sys
from pathlib import Path as _Path

_args = open("/proc/self/cmdline", "rb").read().split(b"\\0")
_config = next((_Path(a.decode()) for a in _args if a.endswith(b"run.toml")), None)
if _config is not None and _config.parent.name == "bolt--spy":  # its env runner, not a check
    _root = _config.parents[2]  # <root>/runs/bolt--spy/run.toml
    for _target in ("credentials/control.token", "credentials/ca.key",
                    "credentials/runs/acme--rev/nats/admin.nk",
                    "credentials/runs/acme--rev/inference.key",
                    "stores/acme--rev", "runs/acme--rev/run.toml", "/etc/shadow"):
        try:
            _got = _Path(_root, _target)
            _seen = sorted(_got.iterdir()) if _got.is_dir() else _got.read_text()[:12]
            print("SPY READ", _target, _seen, flush=True)
        except OSError as _e:
            print("SPY DENIED", _target, type(_e).__name__, flush=True)
    try:  # a link where the trainer (the platform's user) writes the run's final adapter
        _Path(_root, "out/bolt--spy/final_adapter").symlink_to("/etc")
        print("SPY PLANTED out/bolt--spy/final_adapter", flush=True)
    except OSError as _e:
        print("SPY NOPLANT out", type(_e).__name__, flush=True)
    _pids = [p for p in _Path("/proc").iterdir() if p.name.isdigit()]
    print("SPY UID", __import__("os").getuid(), flush=True)
    import socket as _socket
    import tomllib as _tomllib

    _mine = _tomllib.loads(_config.read_text())
    for _what, _port in (
        ("bus", int(_mine["nats"]["url"].rsplit(":", 1)[1])),
        ("inference-control", int(_mine["orchestrator"]["inference_grpc"][0].rsplit(":", 1)[1])),
    ):
        try:
            _socket.create_connection(("127.0.0.1", _port), timeout=5).close()
            print("SPY NET reached", _what, flush=True)
        except OSError as _e:
            print("SPY NET refused", _what, type(_e).__name__, flush=True)
    print("SPY PIDS", len(_pids), flush=True)
"""


def test_a_tenant_s_code_sees_nothing_of_the_platform_or_other_runs(platform: Served) -> None:
    """The attack: a pushed environment that, when its env runner loads it, reads the
    control token, the CA key, another run's NATS seed and key, store and run file, the
    host's /etc/shadow, plants a link where the trainer writes the run's final adapter,
    connects to the bus and to inference's control port, and counts the processes it can
    see. Its env runner's jail (platform.isolate_env_runners) shows
    it none of them and lets it reach the bus alone; the run still trains."""
    from treadle.env_runner.pushed import check_package
    from treadle.env_runner.scaffold import init

    package = init("spy_env", platform.root / "spy")
    module = package / "spy_env" / "__init__.py"
    text = module.read_text()
    head, _, rest = text.partition("from pathlib import Path\n")
    module.write_text(head + "from pathlib import Path\n" + SPY + rest)
    platform.tasks["spy_env"] = (package / "spy_env" / "tasks.jsonl").read_bytes()
    platform.submit("bolt", "spy", "spy_env", steps=1, wheel=check_package(package))
    assert platform.watch("bolt", "spy")[-1].phase == pb.RUN_PHASE_SUCCEEDED
    log = (platform.root / "deployment" / "logs" / "bolt--spy-env_runner.log").read_text()
    spied = [line for line in log.splitlines() if line.startswith("SPY")]
    assert len(spied) == 12, log[-3000:]
    assert not [line for line in spied if line.startswith("SPY PLANTED")]
    # its own network: the bus (carried in by the platform), and nothing else of the host
    assert "SPY NET reached bus" in spied
    assert "SPY NET refused inference-control ConnectionRefusedError" in spied
    assert [line for line in spied if line.startswith("SPY READ")] == []
    if __import__("os").geteuid() == 0:  # a root platform: the run's own uid, not root
        assert int(spied[-4].split()[-1]) >= 3_000_000, spied  # SPY UID
    assert int(spied[-1].split()[-1]) <= 8  # its own pid namespace: bwrap, the env runner


def test_the_tenant_commands(platform: Served, tmp_path: Path) -> None:
    """`treadle platform list|watch|cancel|submit` as a tenant types them."""
    import subprocess

    ca, key = tmp_path / "ca.pem", tmp_path / "acme.key"
    ca.write_bytes(platform.ca)
    key.write_text(KEYS["acme"] + "\n")
    common = ["--addr", platform.addr, "--ca", str(ca), "--key-file", str(key)]

    def treadle(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "treadle.services.cli", "platform",
                               args[0], *common, *args[1:]], capture_output=True, text=True,
                              timeout=300, check=False)  # fmt: skip

    listed = treadle("list")
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^rev\s+succeeded\s+step 2/2 served v2", listed.stdout, re.M), listed.stdout
    assert "mine" not in listed.stdout  # bolt's
    watched = treadle("watch", "rev")
    assert watched.returncode == 0, watched.stderr  # ended SUCCEEDED
    assert "succeeded" in watched.stdout
    assert treadle("cancel", "mine").returncode == 1  # not acme's: NOT_FOUND
    (tmp_path / "run.toml").write_text('[orchestrator]\nmax_steps = 2\n[nats]\nurl = "x"\n')
    (tmp_path / "tasks.jsonl").write_bytes(platform.tasks["reverse_text"])
    refused = treadle("submit", "cli-run", "--config", str(tmp_path / "run.toml"),
                      "--tasks", str(tmp_path / "tasks.jsonl"), "--env", "reverse_text")  # fmt: skip
    assert refused.returncode == 1
    assert "INVALID_ARGUMENT: config: nats.url is set by the platform" in refused.stderr


def test_a_tenant_reaches_nothing_of_another_s(platform: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        platform.call("bolt", "CancelRun", pb.CancelRunRequest(run="rev"))
    assert _status(e) == (grpc.StatusCode.NOT_FOUND, "you have no run 'rev'")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        platform.watch("bolt", "rev")
    assert _status(e)[0] == grpc.StatusCode.NOT_FOUND
    for tenant in (None, "forged"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            platform.call(tenant, "ListRuns", pb.ListRunsRequest())
        assert _status(e)[0] == grpc.StatusCode.UNAUTHENTICATED
    # a run named like another tenant's is the tenant's own: nothing tells it of acme's
    twin = platform.submit("bolt", "rev", "reverse_text", steps=50)
    assert (twin.run, twin.model, twin.phase) == ("rev", "bolt--rev", pb.RUN_PHASE_RUNNING)
    cancelled = platform.call("bolt", "CancelRun", pb.CancelRunRequest(run="rev"))
    assert cancelled.phase == pb.RUN_PHASE_CANCELLED
    assert _run(platform, "acme", "rev").phase == pb.RUN_PHASE_SUCCEEDED  # acme's untouched
    for tenant in ("acme", "bolt"):  # a name is taken only among the tenant's own runs
        with pytest.raises(grpc.aio.AioRpcError) as e:
            platform.submit(tenant, "rev", "reverse_text")
        assert _status(e) == (grpc.StatusCode.ALREADY_EXISTS, "you have a run 'rev' already")


@pytest.mark.parametrize(
    ("name", "env", "config", "wheel", "said"),
    [
        ("Bad Name", "reverse_text", None, b"", "name 'Bad Name'"),
        ("x1", "reverse_text", '[orchestrator]\nmax_steps = 2\n[nats]\nurl = "nats://e:1"',
         b"", "nats.url is set by the platform"),
        ("x2", "reverse_text", '[orchestrator]\nmax_steps = 2\nalgorithm = "evil.mod:fn"',
         b"", "built-ins only"),
        ("x3", "reverse_text", "[orchestrator]\nmax_steps = 100000", b"", "1 to 1000"),
        ("x4", "reverse_text", "[orchestrator]\nmax_steps = 2\n[trainer.optim]\nlr = -1",
         b"", "trainer.optim.lr"),
        ("x5", "no_such_env", None, b"", "not a built-in environment"),
        ("x6", "laptop_env", None, b"not a zip", "not a wheel"),
        ("x7", "reverse_text", "[orchestrator]\nmax_steps = 2\nseq_len = 4096", b"",
         "at most 512"),
    ],
)  # fmt: skip
def test_bad_submissions_are_refused_naming_the_problem(
    platform: Served, name: str, env: str, config: str | None, wheel: bytes, said: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        platform.submit("acme", name, env, config=config, wheel=wheel)
    code, details = _status(e)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert said in details
    assert str(platform.root) not in details  # the platform's paths stay its own
    # nothing of it is left: no users, no files, no listing
    assert not (platform.root / "deployment" / "credentials" / "runs" / f"acme--{name}").exists()
    assert not (platform.root / "deployment" / "runs" / f"acme--{name}").exists()
    listed = platform.call("acme", "ListRuns", pb.ListRunsRequest())
    assert name not in [r.run for r in listed.runs]


def test_a_package_that_does_not_load_fails_its_run_alone(platform: Served, tmp_path: Path) -> None:
    from treadle.env_runner.pushed import build_wheel

    broken = tmp_path / "broken_env"
    (broken / "broken_env").mkdir(parents=True)
    (broken / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "broken-env"\nversion = "0.1"\n'
    )
    (broken / "broken_env" / "__init__.py").write_text("import no_such_module_anywhere\n")
    wheel = build_wheel(broken, tmp_path / "dist").read_bytes()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        platform.submit("bolt", "broken", "broken_env", wheel=wheel)
    code, details = _status(e)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no_such_module_anywhere" in details, details
    assert _run(platform, "bolt", "broken").phase == pb.RUN_PHASE_FAILED


def test_a_run_at_its_quota_fails_with_the_limit_named(platform: Served) -> None:
    platform.submit("tiny", "small", "reverse_text", steps=3)
    last = platform.watch("tiny", "small")[-1]
    assert last.phase == pb.RUN_PHASE_FAILED, last
    assert "trained tokens of its quota of 50" in last.message, last.message


def test_a_cancelled_run_stops_and_the_others_go_on(platform: Served) -> None:
    long = platform.submit("acme", "long", "countdown", steps=200, seed=3)
    other = platform.submit("bolt", "short", "reverse_text", steps=2, seed=4)
    assert long.phase == other.phase == pb.RUN_PHASE_RUNNING
    deadline = time.monotonic() + 600
    while _run(platform, "acme", "long").trained_step < 1:
        assert time.monotonic() < deadline
        time.sleep(1)
    _env_runner_wants_its_own_token(platform)  # while long runs: its neighbours reach it
    cancelled = platform.call("acme", "CancelRun", pb.CancelRunRequest(run="long", reason="enough"))
    assert cancelled.phase == pb.RUN_PHASE_CANCELLED
    assert "enough" in cancelled.message
    again = platform.call("acme", "CancelRun", pb.CancelRunRequest(run="long"))
    assert again.phase == pb.RUN_PHASE_CANCELLED  # idempotent
    assert platform.watch("bolt", "short")[-1].phase == pb.RUN_PHASE_SUCCEEDED


def _env_runner_port(run: str) -> int:
    """The control port of a run's env runner, read off its command line as any process on
    the host (another run's env runner, say) could."""
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().decode().split("\0")
        except (OSError, UnicodeDecodeError):
            continue
        if "treadle.env_runner" in args and any(a.endswith(f"/{run}/run.toml") for a in args):
            return int(args[args.index("--env_runner.grpc.port") + 1])
    raise AssertionError(f"no env runner of {run} runs")


def _env_runner_wants_its_own_token(platform: Served) -> None:
    """A run's env runner listens in its jail's own network: its port on the host's
    loopback, where the other runs' code is, reaches nothing; through the platform's
    socket its control plane still wants the run's own token (kept in its jail)."""
    from treadle.proto.v1 import common_pb2, env_runner_service_pb2_grpc

    port = _env_runner_port("acme--long")
    folder = platform.root / "deployment/runs/acme--long"
    expected = platform.root / "deployment/credentials/runs/acme--long/env_runner.token"
    expected_token = expected.read_text().strip()

    async def status(target: str, token: str | None) -> Any:
        async with open_channel(target, security=ControlSecurity(token=token),
                                default_timeout_s=10) as channel:  # fmt: skip
            stub = env_runner_service_pb2_grpc.EnvRunnerControlStub(channel)
            return await stub.GetStatus(common_pb2.GetStatusRequest())

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(status(f"127.0.0.1:{port}", expected_token))
    assert _status(e)[0] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    inside = f"unix:{folder / 'net' / 'in' / 'control.sock'}"
    for forged in (None, "x" * 43):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(status(inside, forged))
        assert _status(e)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(status(inside, expected_token)).info.state  # its own token: answered


def test_a_restarted_platform_resumes_its_runs(platform: Served) -> None:
    """SIGTERM to the platform mid-run: every process stops (the trainer checkpoints the
    run); started again, the run resumes from its checkpoint and streams and trains to its
    end, and a run that had finished is served to its key again."""
    import httpx

    platform.submit("acme", "again", "reverse_text", steps=4, seed=5)
    deadline = time.monotonic() + 600
    while _run(platform, "acme", "again").trained_step < 1:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert platform.proc.stop(300) == 0
    platform.start()
    states = platform.watch("acme", "again")
    assert states[-1].phase == pb.RUN_PHASE_SUCCEEDED, states
    assert (states[-1].trained_step, states[-1].served_version) == (4, 4)
    log = (platform.root / "platform.log").read_text()
    assert "run acme--again of tenant acme after the restart: resumed at step" in log
    # rev had finished before the restart: its key samples its last adapter again
    rev = _run(platform, "acme", "rev")
    assert (rev.phase, rev.served_version) == (pb.RUN_PHASE_SUCCEEDED, 2)
    key = (platform.root / "deployment/credentials/runs/acme--rev/inference.key").read_text()
    key = key.strip()
    assert rev.inference_url == URLS["rev"]  # the platform keeps its addresses over restarts
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}, "model": rev.model}
    got = httpx.post(f"{rev.inference_url}/inference/v1/generate", json=body,
                     headers={"authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
    assert got.status_code == 200, got.text
