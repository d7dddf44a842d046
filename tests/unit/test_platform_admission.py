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
from treadle.services.errors import BusRefusedError, ConfigError
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
        server.reload()
        for _ in range(50):  # the reload is asynchronous
            try:
                names = asyncio.run(create_streams(alpha, server.url))
                break
            except (BusRefusedError, ConfigError):
                asyncio.run(asyncio.sleep(0.1))
        assert "ROLLOUTS_alpha" in names
        assert load_shared(root, "alpha").seed("admin") == alpha.seed("admin")
        kept = tmp_path / "alpha-admin.nk"  # a copy of the seed, as a leaked one would be
        kept.write_bytes(alpha.seed("admin").read_bytes())
        kept.chmod(0o600)
        remove_shared_run(root, "alpha")
        server.reload()
        leaked = type(alpha)(**{**alpha.__dict__, "seeds": {"admin": kept}})
        refused = ""
        for _ in range(50):
            try:
                asyncio.run(create_streams(leaked, server.url))
                asyncio.run(asyncio.sleep(0.1))
            except (BusRefusedError, ConfigError) as e:
                refused = str(e)
                break
        assert "Authorization Violation" in refused, "a removed run's user still connects"
        asyncio.run(create_streams(platform, server.url))  # the others are untouched
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
        Path(folder, "planted").write_text("x")
        print("WROTE", folder)
    except OSError as e:
        print("NOWRITE", folder, type(e).__name__)
print("PIDS", json.dumps(sorted(int(p) for p in os.listdir("/proc") if p.isdigit())))
"""


def test_an_env_runner_jail_shows_only_its_own_run(tmp_path: Path) -> None:
    """The attack: code in the jail reads another run's seed, the control token, a tenant's
    key; writes its own folder and another's; looks for other processes. The same code
    outside the jail reads all of it (so the test can fail)."""
    import json
    import subprocess
    import sys

    from treadle.services.platform import jail_argv

    root = tmp_path / "platform"
    (root / "credentials" / "runs" / "beta" / "nats").mkdir(parents=True)
    (root / "runs" / "alpha").mkdir(parents=True)
    other = root / "credentials" / "runs" / "beta" / "nats" / "admin.nk"
    other.write_text("SUAbeta-seed")
    token = root / "credentials" / "control.token"
    token.write_text("the-control-token")
    mine = root / "runs" / "alpha" / "run.toml"
    mine.write_text("[run]\nname = 'alpha'\n")
    tenant_key = tmp_path / "keys" / "acme"
    tenant_key.parent.mkdir()
    tenant_key.write_text("acme-api-key")
    targets = [str(mine), str(other), str(token), str(tenant_key)]
    jail = jail_argv(hidden=[root], read=[mine], write=[root / "runs" / "alpha"],
                     masked=[tenant_key])  # fmt: skip

    def spy(prefix: list[str]) -> str:
        done = subprocess.run([*prefix, sys.executable, "-c", SPY, *targets],
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    outside = spy([])
    assert "READ" in outside
    assert "the-control-token" in outside
    assert "SUAbeta-seed" in outside
    inside = spy(jail)
    assert f"READ {mine}" in inside
    assert f"DENIED {other} FileNotFoundError" in inside
    assert f"DENIED {token} FileNotFoundError" in inside
    # masked: empty (here under /tmp, which the jail replaces: not there at all)
    assert f"READ {tenant_key} ''" in inside or f"DENIED {tenant_key}" in inside
    assert "the-control-token" not in inside
    assert "SUAbeta-seed" not in inside
    assert "acme-api-key" not in inside
    assert f"WROTE {root / 'runs' / 'alpha'}" in inside  # its own folder
    pids = json.loads(inside.split("PIDS ")[1])
    assert len(pids) <= 3, pids  # its own pid namespace: bwrap's init and the spy
