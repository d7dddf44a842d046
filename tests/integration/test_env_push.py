"""`treadle env push` and env runners installing pushed environments, pinned by hash: a
package from `treadle env init` is built, checked and stored; a runner installs it into
its own folder once and loads it; a wrong pin, a tampered wheel, a package that does not
build or does not import are refused with errors naming them. Real pip, real wheels."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import sys
from pathlib import Path

import pytest

from treadle.env_runner import pushed as pushed_mod
from treadle.env_runner.environments import Environment, load_environment
from treadle.env_runner.pushed import install_all
from treadle.env_runner.scaffold import init
from treadle.services.cli import main as cli_main
from treadle.services.errors import ConfigError, IntegrityError
from treadle.services.objectstore import LocalObjectStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

_names = itertools.count()


def push(tmp_path: Path, package: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli_main(["env", "push", str(package), "--run.name", "pushrun",
                     "--object_store.root", str(tmp_path / "store")])  # fmt: skip
    return code, capsys.readouterr().out


def new_env(tmp_path: Path) -> tuple[str, Path]:
    name = f"pushed_env_{next(_names)}_{tmp_path.name[-4:]}".replace("-", "_")
    return name, init(name, tmp_path / "src")


def test_env_push_then_a_runner_installs_and_serves_it_by_its_pin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    name, package = new_env(tmp_path)
    code, out = push(tmp_path, package, capsys)
    assert code == 0, out
    pin = re.search(r'pushed_envs = \["([^"]+)"\]', out).group(1)  # type: ignore[union-attr]
    assert re.fullmatch(rf"{name}@[0-9a-f]{{64}}", pin), pin
    store = LocalObjectStore(tmp_path / "store")
    cache = tmp_path / "runner-envs"
    path_before = list(sys.path)
    extra = install_all(store, [pin], cache)
    assert extra == {name: f"{name}:ENVIRONMENT"}
    env = load_environment(name, extra)
    assert isinstance(env, Environment)
    assert env.name == name
    module = sys.modules[name]
    site = cache / pin.split("@")[1] / "site"
    assert Path(str(module.__file__)).is_relative_to(site)  # from the pinned install only
    assert sys.path == [*path_before, str(site)]  # appended: the runner's own packages win
    # a second start installs nothing again
    monkeypatch.setattr(pushed_mod, "_pip", lambda *a: pytest.fail("pip ran again"))
    assert install_all(store, [pin], cache) == extra


def test_pushed_envs_refuse_wrong_pins_and_tampered_wheels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name, package = new_env(tmp_path)
    code, out = push(tmp_path, package, capsys)
    assert code == 0, out
    pin = re.search(r'pushed_envs = \["([^"]+)"\]', out).group(1)  # type: ignore[union-attr]
    store = LocalObjectStore(tmp_path / "store")
    with pytest.raises(ConfigError, match="is not a pin"):
        install_all(store, [name], tmp_path / "c0")
    other = f"{name}@{'0' * 64}"
    with pytest.raises(ConfigError, match="nothing was pushed under"):
        install_all(store, [other], tmp_path / "c1")
    # the stored wheel replaced by another build: the store's checksum refuses it
    sha = pin.split("@")[1]
    (wheel,) = (tmp_path / "store" / "envs" / name / sha).glob("*.whl")
    wheel.write_bytes(wheel.read_bytes() + b"\0")
    with pytest.raises(IntegrityError):
        install_all(store, [pin], tmp_path / "c2")
    # and with the manifest rewritten to match it, the pin still does not
    manifest = wheel.parent / "MANIFEST.json"
    doc = json.loads(manifest.read_text())
    for f in doc["files"]:
        f["sha256"] = hashlib.sha256(wheel.read_bytes()).hexdigest()
        f["size_bytes"] = wheel.stat().st_size
    manifest.write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="not the pinned one"):
        install_all(store, [pin], tmp_path / "c3")


def test_env_push_refuses_packages_that_do_not_build_or_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name, package = new_env(tmp_path)
    (package / name / "__init__.py").write_text("raise RuntimeError('broken on import')\n")
    code = cli_main(["env", "push", str(package), "--object_store.root", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not load: RuntimeError: broken on import" in err
    (package / "pyproject.toml").write_text("[project\nname = ")  # not TOML
    code = cli_main(["env", "push", str(package), "--object_store.root", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 2
    assert "pip failed" in err
    code = cli_main(["env", "push", str(tmp_path), "--object_store.root", str(tmp_path / "s")])
    assert "has no pyproject.toml" in capsys.readouterr().err
    assert not list((tmp_path / "s").rglob("*.whl"))  # nothing stored
