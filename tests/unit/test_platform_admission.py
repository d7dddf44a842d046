"""What a tenant may submit to `treadle platform` (settings, tasks, wheels, keys), and the
deployment's credentials growing and shrinking by run while nats-server runs."""

from __future__ import annotations

import asyncio
import io
import zipfile
from pathlib import Path

import pytest

from treadle.services.credentials import (
    add_shared_runs,
    create_streams,
    generate_shared,
    load_shared,
    remove_shared_run,
)
from treadle.services.errors import BusRefusedError, BusUnavailableError, ConfigError
from treadle.services.nats_server import EmbeddedNats
from treadle.services.platform import (
    PlatformSection,
    check_tasks,
    check_wheel,
    read_tenant_keys,
    tenant_settings,
)

GOOD = """
[orchestrator]
max_steps = 3
group_size = 4
algorithm = "grpo"
[orchestrator.sampling]
temperature = 0.8
[trainer.optim]
lr = 1e-4
betas = [0.9, 0.99]
"""


def test_a_tenant_sets_its_run_s_own_settings() -> None:
    got = tenant_settings(GOOD)
    assert got["orchestrator"] == {"max_steps": 3, "group_size": 4, "algorithm": "grpo"}
    assert got["orchestrator.sampling"] == {"temperature": 0.8}
    assert got["trainer.optim"] == {"lr": 1e-4, "betas": [0.9, 0.99]}


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[nats]\nurl = "nats://evil:4222"', "nats.url"),
        ('[nats]\ncredentials = "/root/other/admin.nk"', "nats.credentials"),
        ('[object_store]\nroot = "/srv/platform/stores/beta"', "object_store.root"),
        ('[run]\nname = "beta"', "run.name"),
        ('[run]\ntenant = "someone-else"', "run.tenant"),
        ('tasks = "/etc/shadow"', "orchestrator.tasks"),  # under [orchestrator]
        ('[orchestrator.eval]\ntasks = "/etc/shadow"', "orchestrator.eval.tasks"),
        ('[env_runner]\ninference_model = "beta"', "env_runner.inference_model"),
        ('[env_runner]\ninference_key_file = "/srv/beta.key"', "env_runner.inference_key_file"),
        ('[env_runner]\npushed_envs = ["x@00"]', "env_runner.pushed_envs"),
        ('[inference.hosted]\nkey_file = "/srv/beta.key"', "inference.hosted.key_file"),
        ('[trainer]\nmodel = "/models/other"', "trainer.model"),
        ("[trainer.lora]\nrank = 64", "trainer.lora.rank"),
        ("[trainer.loss]\nkl_coef = 0.1", "trainer.loss.kl_coef"),
        ('[control]\ntoken_file = "/x"', "control.token_file"),
        ('[orchestrator.teacher]\nurls = ["http://x"]', "orchestrator.teacher.urls"),
        ('inference_grpc = ["10.0.0.1:1"]', "orchestrator.inference_grpc"),
        ('renderer = "jinja"', "orchestrator.renderer"),
        ('mode = "sft"', "orchestrator.mode"),
    ],
)
def test_settings_of_the_platform_or_of_another_run_are_refused(text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=f"{named} is set by the platform"):
        tenant_settings("[orchestrator]\nmax_steps = 2\n" + text)
    with pytest.raises(ConfigError, match="top_level is set by the platform"):
        tenant_settings("top_level = 1\n[orchestrator]\nmax_steps = 2\n")


@pytest.mark.parametrize("value", ["my_pkg.algos:fn", "../../x", "os.system"])
def test_an_allowed_setting_naming_code_or_a_file_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="built-ins only"):
        tenant_settings(f'[orchestrator]\nmax_steps = 2\nalgorithm = "{value}"\n')


def test_a_run_without_max_steps_or_not_toml_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"orchestrator\.max_steps is not set"):
        tenant_settings("[orchestrator]\ngroup_size = 4\n")
    with pytest.raises(ConfigError, match="not TOML"):
        tenant_settings("[orchestrator\n")


def test_tasks_are_json_objects_one_per_line() -> None:
    assert check_tasks(b'{"a": 1}\n\n{"b": 2}\n') == 2
    with pytest.raises(ConfigError, match="tasks:2: not valid JSON"):
        check_tasks(b'{"a": 1}\n{"b": \n')
    with pytest.raises(ConfigError, match="tasks:1: a task is a JSON object, not list"):
        check_tasks(b"[1, 2]\n")
    with pytest.raises(ConfigError, match="empty"):
        check_tasks(b"\n \n")


def _wheel(metadata: str | None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("pkg/__init__.py", "")
        if metadata is not None:
            z.writestr("pkg-1.0.dist-info/METADATA", metadata)
    return buf.getvalue()


def test_a_wheel_is_checked_for_its_form_only() -> None:
    assert check_wheel(_wheel("Name: my-env\nVersion: 0.1.0\n")) == "my_env-0.1.0-py3-none-any.whl"
    with pytest.raises(ConfigError, match="not a zip"):
        check_wheel(b"#!/bin/sh\nrm -rf /\n")
    with pytest.raises(ConfigError, match="METADATA"):
        check_wheel(_wheel(None))
    with pytest.raises(ConfigError, match="names no package"):
        check_wheel(_wheel("Name: ../../etc\nVersion: 1\n"))


def test_tenant_keys_are_long_and_each_tenant_s_own(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("a" * 32)
    (tmp_path / "b").write_text("b" * 32)
    section = PlatformSection(tenants={"acme": tmp_path / "a", "bolt": tmp_path / "b"})
    assert set(read_tenant_keys(section)) == {"acme", "bolt"}
    (tmp_path / "b").write_text("a" * 32 + "\n")
    with pytest.raises(ConfigError, match=r"platform\.tenants\.bolt: its key is another tenant's"):
        read_tenant_keys(section)
    (tmp_path / "b").write_text("short")
    with pytest.raises(ConfigError, match="shorter than 16"):
        read_tenant_keys(section)
    with pytest.raises(ConfigError, match=r"platform\.tenants\.zed"):
        read_tenant_keys(PlatformSection(tenants={"zed": tmp_path / "missing"}))


def test_tenants_are_told_the_inference_address_they_reach(tmp_path: Path) -> None:
    from treadle.services.platform import Platform, load_platform_config

    (tmp_path / "k").write_text("k" * 32)
    (tmp_path / "p.toml").write_text(
        f'[platform]\nmodel = "m"\ntenants = {{acme = "{tmp_path}/k"}}\n'
    )
    section = load_platform_config(["@", str(tmp_path / "p.toml")])
    platform = Platform(section)
    platform.ports["http"] = 8123
    assert platform.inference_url() == platform.local_inference_url() == "http://127.0.0.1:8123"
    section.inference_host = "0.0.0.0"  # every interface: tenants get this machine's name
    assert platform.inference_url() == f"http://{__import__('socket').gethostname()}:8123"
    assert platform.local_inference_url() == "http://127.0.0.1:8123"
    section.inference_url = "https://infer.example.org/"  # a proxy in front
    assert platform.inference_url() == "https://infer.example.org"
    assert platform.local_inference_url() == "http://127.0.0.1:8123"
    with pytest.raises(ConfigError, match=r"platform\.inference_url 'infer:1'"):
        load_platform_config(["@", str(tmp_path / "p.toml"), "--platform.inference_url", "infer:1"])


@pytest.mark.parametrize("tenant", ["a--b", "a-", "-a", "A", "a.b", "a" * 22, ""])
def test_a_tenant_name_keeps_run_names_apart(tmp_path: Path, tenant: str) -> None:
    (tmp_path / "k").write_text("k" * 32)
    with pytest.raises(ConfigError, match=r"is not a tenant name"):
        read_tenant_keys(PlatformSection(tenants={tenant: tmp_path / "k"}))


def test_run_names_are_each_tenant_s_own() -> None:
    """Every pair of valid (tenant, run name) gets its own deployment name, a valid
    run.name: tenants cannot collide by choosing names ("a-" + "b" vs "a" + "-b")."""
    import itertools

    from treadle.services.platform import RUN_NAME, TENANT_NAME, run_id
    from treadle.services.sections import check_name

    parts = ["a", "a-b", "b", "a_", "b-", "-b", "b--c", "a-b-c", "c", "x" * 21, "y" * 40]
    tenants = [t for t in parts if TENANT_NAME.match(t)]
    names = [n for n in parts if RUN_NAME.match(n)]
    assert "b-" not in tenants
    assert "b--c" not in tenants
    assert "x" * 21 in tenants
    ids = [run_id(t, n) for t, n in itertools.product(tenants, names)]
    assert len(set(ids)) == len(ids)
    for ident in ids:
        check_name(ident, "run.name")  # the longest too: 21 + 2 + 40 characters


@pytest.mark.integration
def test_a_run_s_users_join_and_leave_a_running_nats_server(tmp_path: Path) -> None:
    root = tmp_path / "credentials"
    platform = generate_shared(root, ["platform"])["platform"]
    server = EmbeddedNats(tmp_path / "store", tmp_path / "nats.log", config_file=platform.nats_conf)
    server.start()
    try:
        assert server.url
        asyncio.run(create_streams(platform, server.url))
        alpha = add_shared_runs(root, ["alpha"])["alpha"]
        with pytest.raises(ValueError, match="must be new"):
            add_shared_runs(root, ["alpha"])
        server.reload()  # returns once the server took it: no retry
        names = asyncio.run(create_streams(alpha, server.url))
        assert "ROLLOUTS_alpha" in names
        assert load_shared(root, "alpha").seed("admin") == alpha.seed("admin")
        kept = tmp_path / "alpha-admin.nk"  # a copy of the seed, as a leaked one would be
        kept.write_bytes(alpha.seed("admin").read_bytes())
        kept.chmod(0o600)
        remove_shared_run(root, "alpha")
        server.reload()
        leaked = type(alpha)(**{**alpha.__dict__, "seeds": {"admin": kept}})
        with pytest.raises((BusRefusedError, ConfigError), match="Authorization Violation"):
            asyncio.run(create_streams(leaked, server.url))  # a removed run's user
        asyncio.run(create_streams(platform, server.url))  # the others are untouched
        conf = platform.nats_conf.read_text()
        platform.nats_conf.write_text(conf + "\nthis is { not a config\n")
        with pytest.raises(BusUnavailableError, match=r"refused its new config .*Parse error"):
            server.reload()
        platform.nats_conf.write_text(conf)
        asyncio.run(create_streams(platform, server.url))  # it kept the config it had
    finally:
        server.stop()


def test_a_connected_client_whose_user_is_removed_stops_and_says_why(tmp_path: Path) -> None:
    """The server drops a removed user's connection and refuses its reconnects; nats.py
    would try forever and every operation waited a minute for a JetStream "that did not
    answer". The client stops and names the refusal: a consumer as it fetches, a publish,
    and a stream update; the seed file gone (the platform deleted it) the same way. A
    JetStream request the user may not make is refused by name at once as well."""
    from treadle.proto.v1 import metrics_pb2, rollout_pb2
    from treadle.services.bus import Bus
    from treadle.services.sections import NatsSection

    root = tmp_path / "credentials"
    generate_shared(root, ["platform"])
    server = EmbeddedNats(tmp_path / "store", tmp_path / "nats.log",
                          config_file=load_shared(root, "platform").nats_conf)  # fmt: skip
    server.start()
    try:
        assert server.url
        url = server.url
        runs = add_shared_runs(root, ["alpha", "beta"])
        server.reload()
        kept = tmp_path / "alpha-admin.nk"  # a copy: the seed file itself is deleted
        kept.write_bytes(runs["alpha"].seed("admin").read_bytes())
        kept.chmod(0o600)

        async def main() -> list[str]:
            buses = {
                "copy": await Bus.connect(NatsSection(url=url, credentials=kept,
                                                      tls_ca=runs["alpha"].ca), "alpha", role="admin"),
                "file": await Bus.connect(NatsSection(url=url, credentials=runs["beta"]
                                                      .seed("admin"), tls_ca=runs["beta"].ca),
                                          "beta", role="admin"),
            }  # fmt: skip
            for bus in buses.values():
                await bus.ensure_streams()
            with pytest.raises(
                BusRefusedError,
                match=r"NATS refused the admin user of run "
                r"alpha: permissions violation .*consumer\.\w+\.rollouts_alpha",
            ):
                await buses["copy"].consumer(  # the orchestrator's to make, not the admin's
                    "ROLLOUTS", "reader", buses["copy"].subjects.rollouts_completed,
                    rollout_pb2.RolloutCompleted,
                )  # fmt: skip
            consumer = await buses["copy"].consumer(
                "METRICS", "reader", buses["copy"].subjects.metrics_any, metrics_pb2.MetricsReport
            )
            stop = asyncio.Event()
            reading = asyncio.ensure_future(consumer.run(lambda m, d: asyncio.sleep(0), stop))
            remove_shared_run(root, "alpha")
            remove_shared_run(root, "beta")
            await asyncio.to_thread(server.reload)
            seen = []
            try:
                for fails in (
                    asyncio.wait_for(reading, 30),
                    buses["copy"].publish(buses["copy"].subjects.rollouts_completed,
                                          rollout_pb2.RolloutCompleted(), msg_id="x", timeout_s=2.0),
                    buses["file"].ensure_streams(),
                ):  # fmt: skip
                    with pytest.raises(BusRefusedError) as e:
                        await fails
                    seen.append(str(e.value))
            finally:
                stop.set()
                for bus in buses.values():
                    await bus.close()
            return seen

        reasons = asyncio.run(main())
        for reason in reasons[:2]:
            assert "no longer accepts this client (the server answers 'Authorization " in reason
        assert "beta/nats/admin.nk is gone" in reasons[2]
        assert all("user was removed" in reason for reason in reasons), reasons
        asyncio.run(create_streams(load_shared(root, "platform"), url))  # others untouched
    finally:
        server.stop()


def test_the_platform_and_long_commands_survive_a_closed_socket(tmp_path: Path) -> None:
    """`treadle`'s entrypoint makes SIGPIPE kill (for `| head`); the platform and the other
    long-running commands turn that off before anything else: it killed the platform,
    silently, when nats-server refused a connection the platform was writing to."""
    import signal

    from treadle.services.cli import main

    before = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        for argv in (["platform", "serve", "@", str(tmp_path / "none.toml")],
                     ["stack", "@", str(tmp_path / "none.toml")]):  # fmt: skip
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            assert main(argv) == 2  # the config is missing: after the disposition is set
            assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN, argv
    finally:
        signal.signal(signal.SIGPIPE, before)


SPY = """
import json, os, sys
from pathlib import Path
for path in sys.argv[1:]:
    try:
        text = Path(path).read_text()
        print("READ", path, repr(text))
    except OSError as e:
        print("DENIED", path, type(e).__name__)
for folder in (sys.argv[1].rsplit("/", 1)[0],):
    try:
        Path(folder, f"planted-{os.getuid()}-{os.getpid()}").write_text("x")
        print("WROTE", folder)
    except OSError as e:
        print("NOWRITE", folder, type(e).__name__)
caps = open("/proc/self/status").read().split("CapEff:")[1].split()[0]
print("UID", os.getuid(), "CAPS", caps)
print("PIDS", json.dumps(sorted(int(p) for p in os.listdir("/proc") if p.isdigit())))
"""


OTHER_UID = 64123  # the unprivileged platform (no user of this machine has it)


@pytest.mark.parametrize("mode", ["root", "unprivileged"])
def test_an_env_runner_jail_shows_only_its_own_run(mode: str) -> None:
    """The attack: code in the jail reads another run's seed, the control token, a tenant's
    key and the host's /etc/shadow; writes its own folder; looks for other processes. The
    same code outside the jail reads all of it (so the test can fail).

    root: the platform runs as root and the jail runs the code as its own uid, the secrets
    0600 root as the platform keeps them, its run file a copy that uid owns, and the jail's
    folder below one (0700) that other users may not pass. unprivileged: the platform runs
    as another user (bubblewrap makes its user namespace itself), every file readable by
    that user, so that only the jail hides them."""
    import json
    import os
    import pwd
    import shutil
    import subprocess
    import sys
    import tempfile

    from treadle.env_runner.runtimes.sandbox import bwrap_path
    from treadle.services.platform import jail_argv

    with pytest.raises(KeyError):
        pwd.getpwuid(OTHER_UID)
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("runs as root, with setpriv, to become another uid")
    python, prefix = sys.executable, []
    if mode == "unprivileged":
        if not os.path.exists("/usr/bin/python3"):
            pytest.skip("no /usr/bin/python3 an unprivileged user can run")
        if any(not p.stat().st_mode & 0o001 for p in Path(bwrap_path()).parents):
            pytest.skip(f"{bwrap_path()} is not reachable by an unprivileged user")
        python = "/usr/bin/python3"  # the spy needs only the standard library
        prefix = [setpriv, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
    base = Path(tempfile.mkdtemp(prefix="treadle-jail-"))  # 0700
    try:
        root = base / "platform"
        (root / "credentials" / "runs" / "beta" / "nats").mkdir(parents=True)
        (root / "runs" / "alpha").mkdir(parents=True)
        other = root / "credentials" / "runs" / "beta" / "nats" / "admin.nk"
        other.write_text("SUAbeta-seed")
        token = root / "credentials" / "control.token"
        token.write_text("the-control-token")
        mine = root / "runs" / "alpha" / "run.toml"
        mine.write_text("[run]\nname = 'alpha'\n")
        tenant_key = base / "keys" / "acme"
        tenant_key.parent.mkdir()
        tenant_key.write_text("acme-api-key")
        own = root / "runs" / "alpha"
        targets = [str(mine), str(other), str(token), str(tenant_key), "/etc/shadow"]
        if mode == "unprivileged":
            base.chmod(0o755)
            for path in base.rglob("*"):
                path.chmod(0o755 if path.is_dir() else 0o644)
            os.chown(own, OTHER_UID, OTHER_UID)
            targets.remove("/etc/shadow")  # not readable by that user outside either
            jail = jail_argv(hidden=[root], read=[mine], write=[own], masked=[tenant_key])
        else:
            for path in (other, token, mine, tenant_key):
                path.chmod(0o600)
            copy = base / "copy.toml"
            shutil.copyfile(mine, copy)
            os.chown(copy, OTHER_UID, OTHER_UID)
            os.chown(own, OTHER_UID, OTHER_UID)
            reach = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix, *sys.path)
                     if p and Path(p).is_dir()]  # fmt: skip
            jail = jail_argv(hidden=[root], read=[], write=[own], masked=[tenant_key],
                             uid=OTHER_UID, reach=reach, copies=[(copy, mine)], chdir=own)  # fmt: skip

        def spy(jailed: bool) -> str:
            argv = [*prefix, *(jail if jailed else []), python, "-c", SPY, *targets]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                                  check=False, cwd="/")  # fmt: skip
            assert done.returncode == 0, done.stderr
            return done.stdout

        outside = spy(jailed=False)
        assert "the-control-token" in outside
        assert "SUAbeta-seed" in outside
        assert "acme-api-key" in outside
        inside = spy(jailed=True)
        assert f"READ {mine}" in inside  # its own run file (root: the copy it owns)
        assert "the-control-token" not in inside
        assert "SUAbeta-seed" not in inside
        assert "acme-api-key" not in inside
        assert f"WROTE {own}" in inside  # its own folder
        pids = json.loads(inside.split("PIDS ")[1])
        if mode == "root":
            assert "READ /etc/shadow" in outside
            assert "DENIED /etc/shadow PermissionError" in inside  # not root in the jail
            assert f"UID {OTHER_UID} CAPS 0000000000000000" in inside
            assert len(pids) <= 4, pids  # bwrap's init, setpriv's exec: the spy
        else:
            assert f"DENIED {other} FileNotFoundError" in inside
            assert f"DENIED {token} FileNotFoundError" in inside
            # masked by /dev/null, which a bind mount (nodev) makes unopenable
            assert f"DENIED {tenant_key} PermissionError" in inside
            assert len(pids) <= 3, pids  # its own pid namespace: bwrap's init and the spy
    finally:
        shutil.rmtree(base, ignore_errors=True)


NET_PROBE = """
import socket, sys
for port in map(int, sys.argv[1:]):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"ping")
            s.shutdown(socket.SHUT_WR)
            print("REACHED", port, s.recv(100).decode(), flush=True)
    except OSError as e:
        print("REFUSED", port, type(e).__name__, flush=True)
"""


def test_a_jail_without_the_host_s_network_reaches_what_it_is_given(tmp_path: Path) -> None:
    """Two servers on the host's loopback; the jail (its own network namespace) is given
    one of them through the relay and its launcher (treadle.services.jailnet): it reaches
    that one at its own address, and not the other."""
    import sys

    from treadle.services.jailnet import relay_path, start_relay
    from treadle.services.platform import jail_argv

    async def go() -> str:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"pong:" + await reader.read(100))
            await writer.drain()
            writer.close()

        given = await asyncio.start_server(echo, "127.0.0.1", 0)
        other = await asyncio.start_server(echo, "127.0.0.1", 0)
        ports = [s.sockets[0].getsockname()[1] for s in (given, other)]
        net = tmp_path / "net"
        net.mkdir()
        relay = await start_relay(relay_path(net, ports[0]), "127.0.0.1", ports[0])
        outside = await asyncio.create_subprocess_exec(
            sys.executable, "-c", NET_PROBE, *map(str, ports), stdout=asyncio.subprocess.PIPE
        )
        assert (await outside.communicate())[0].decode().count("REACHED") == 2  # can fail
        jail = jail_argv(hidden=[], read=[], write=[net], network=False)
        proc = await asyncio.create_subprocess_exec(
            *jail, sys.executable, "-m", "treadle.services.jailnet", "--dir", str(net),
            "--connect", f"127.0.0.1:{ports[0]}", "--", sys.executable, "-c", NET_PROBE,
            *map(str, ports), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        for server in (given, other, relay):
            server.close()
        return out.decode()

    out = asyncio.run(go())
    lines = out.splitlines()
    assert lines[0].startswith("REACHED"), out
    assert lines[0].endswith("pong:ping"), out
    assert lines[1].startswith("REFUSED"), out


NESTED = """
import asyncio, json, os, sys, tempfile
from pathlib import Path
from treadle.env_runner.runtimes.sandbox import (Sandbox, SandboxLimits, python_executable,
                                                 python_runtime)
work = Path(tempfile.mkdtemp(dir=sys.argv[1]))
code = "import os; print(os.getuid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
limits = SandboxLimits(wall_s=30, cpu_s=10, memory_bytes=512 << 20, processes=16)
r = asyncio.run(Sandbox(work, limits, ro_paths=python_runtime()).run(
    [python_executable(), "-c", code]))
print("STATUS", r.status.value, r.message, r.stderr.decode()[-2000:])
print("INNER", r.stdout.decode().strip())
print("OUTER", json.dumps(sorted(int(p) for p in os.listdir("/proc") if p.isdigit())))
"""

# what the sandbox of an unprivileged runner runs (``Sandbox.bwrap_argv`` as not root), for a
# platform user that may not reach this checkout's interpreter: the standard library only
NESTED_PLAIN = """
import json, os, subprocess, sys
code = "import os; print(os.getuid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
argv = [sys.argv[2], "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-user",
        "--unshare-pid", "--unshare-net", "--proc", "/proc", "--die-with-parent", "--",
        sys.executable, "-c", code]
r = subprocess.run(argv, capture_output=True, text=True, check=False)
print("STATUS", "ok" if r.returncode == 0 else r.returncode, r.stderr[-2000:])
print("INNER", r.stdout.strip())
print("OUTER", json.dumps(sorted(int(p) for p in os.listdir("/proc") if p.isdigit())))
"""


@pytest.mark.parametrize("mode", ["root", "unprivileged"])
def test_an_env_runner_jail_runs_the_environment_s_own_sandbox(mode: str) -> None:
    """An environment that runs the model's code does so in its own sandbox (bubblewrap,
    a user and pid namespace and a /proc of its own) from inside the env runner's jail:
    the env runner's real ``Sandbox`` starts there and its program runs, alone in its
    namespace. root: the jail drops to the run's uid (its /proc is mounted by a second
    bubblewrap as that uid, which a nested one may mount again); unprivileged: the platform
    itself runs as another user."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from treadle.env_runner.runtimes.sandbox import bwrap_path
    from treadle.services.platform import jail_argv

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("runs as root, with setpriv, to become another uid")
    reach = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix, *sys.path)
             if p and Path(p).is_dir()]  # fmt: skip
    prefix: list[str] = []
    program = [sys.executable, "-c", NESTED]
    if mode == "unprivileged":
        if not os.path.exists("/usr/bin/python3"):
            pytest.skip("no /usr/bin/python3 an unprivileged user can run")
        if any(not p.stat().st_mode & 0o001 for p in Path(bwrap_path()).parents):
            pytest.skip(f"{bwrap_path()} is not reachable by an unprivileged user")
        prefix = [setpriv, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
        program = ["/usr/bin/python3", "-c", NESTED_PLAIN]
    base = Path(tempfile.mkdtemp(prefix="treadle-nested-"))
    try:
        own = base / "run"
        own.mkdir()
        os.chown(own, OTHER_UID, OTHER_UID)
        if mode == "unprivileged":
            base.chmod(0o755)
            jail = jail_argv(hidden=[], read=[], write=[own])
        else:
            jail = jail_argv(hidden=[base], read=[], write=[own], uid=OTHER_UID, reach=reach,
                             chdir=own)  # fmt: skip
        done = subprocess.run([*prefix, *jail, *program, str(own), bwrap_path()],
                              capture_output=True, text=True, timeout=120, check=False,
                              cwd="/", env={**os.environ, "TMPDIR": str(own)})  # fmt: skip
        assert done.returncode == 0, done.stderr
        out = done.stdout
        assert "STATUS ok" in out, out
        uid, inner = out.split("INNER ")[1].split("\n")[0].split(" ", 1)
        assert int(uid) == OTHER_UID  # the jail's uid runs it (an unprivileged runner)
        assert len(json.loads(inner)) <= 3, inner  # alone in the sandbox's pid namespace
        outer = json.loads(out.split("OUTER ")[1])
        assert len(outer) <= 6, outer  # and the jail's own namespace holds only the run
    finally:
        shutil.rmtree(base, ignore_errors=True)
