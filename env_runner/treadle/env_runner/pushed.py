"""Environment packages pushed to a run's object store, installed by env runners pinned by
content hash.

    treadle env push DIR @ run.toml
        DIR (a pip-installable package, e.g. from `treadle env init`) ─▶ a wheel (pip wheel,
        no dependencies) ─▶ installed in a scratch folder and its entry loaded: it must be
        an Environment ─▶ object store envs/<name>/<sha256 of the wheel>/ (the wheel, and a
        manifest: name, entry, wheel) ─▶ prints the pin, "<name>@<sha256>"

    env runner, env_runner.pushed_envs = ["<name>@<sha256>", ...]
        ─▶ envs/<name>/<sha256>/ from the run's store (every file's sha256 checked against
           the manifest) ─▶ the wheel's own sha256 must be the pinned one (the pin, not the
           manifest, is what is trusted) ─▶ pip install --no-deps --target
           <env_runner.pushed_envs_dir>/<sha256>/site, then its declared dependencies
           except Treadle's own packages (the runner provides those) into the same folder
        ─▶ that folder is appended to sys.path; the entry is loaded as environment <name>

Each pinned version gets its own folder, installed once (an ``installed.json`` marks a
finished install; a half-finished one is redone): nothing of the runner's own Python
environment changes, and its own packages win over a pushed package's copies of them.
A pushed package whose modules the runner already imports from elsewhere, or two pushed
packages with a module of one name, are refused: one process cannot hold both.

Refused with an error naming the pin: a pin that is not ``name@<64 hex>``, nothing pushed
under it, a wheel whose sha256 is not the pin, a package that does not install (pip's
own words), an entry that does not import or is not an Environment of that name.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from treadle.services.errors import ConfigError, IntegrityError, ObjectNotFoundError
from treadle.services.objectstore import ObjectStore

log = logging.getLogger(__name__)

PREFIX = "envs"
PIN = re.compile(r"^([A-Za-z0-9_.-]+)@([0-9a-f]{64})$")
MARKER = "installed.json"


@dataclass(frozen=True)
class Pushed:
    """A pushed environment package."""

    name: str  # the environment's name (rollout requests name it)
    entry: str  # "module:attribute" of its Environment
    sha256: str  # of the wheel

    @property
    def pin(self) -> str:
        return f"{self.name}@{self.sha256}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _pip(args: list[str], what: str) -> None:
    """Run pip with this interpreter; a failure is a ConfigError with pip's last lines."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
        raise ConfigError(f"{what}: pip failed (exit {done.returncode}):\n{tail}")


def build_wheel(package_dir: Path, out_dir: Path) -> Path:
    """The package in ``package_dir`` as a wheel in ``out_dir`` (its dependencies left out).
    Built without isolation when its build backend is importable here (no network)."""
    if not (package_dir / "pyproject.toml").is_file():
        raise ConfigError(f"{package_dir} is not a Python package: it has no pyproject.toml")
    args = ["wheel", "--no-deps", "--wheel-dir", str(out_dir), str(package_dir)]
    if _backend_importable(package_dir):
        args.insert(1, "--no-build-isolation")
    _pip(args, f"building {package_dir}")
    wheels = sorted(out_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise ConfigError(f"building {package_dir} gave {len(wheels)} wheels, expected one")
    return wheels[0]


def _backend_importable(package_dir: Path) -> bool:
    import tomllib

    try:
        doc = tomllib.loads((package_dir / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    backend = str(doc.get("build-system", {}).get("build-backend", "setuptools.build_meta"))
    try:
        importlib.import_module(backend.split(":")[0])
    except ImportError:
        return False
    return True


def _requirements(wheel: Path) -> list[str]:
    """The wheel's declared dependencies, except Treadle's own packages."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", errors="replace")
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if ";" in req and "extra ==" in req.split(";", 1)[1]:
            continue  # an optional extra
        dist = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if not dist.startswith("treadle-"):
            out.append(req)
    return out


def _install(wheel: Path, site: Path, what: str) -> None:
    shutil.rmtree(site, ignore_errors=True)
    _pip(["install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)], what)
    deps = _requirements(wheel)
    if deps:
        _pip(["install", "--no-compile", "--target", str(site), *deps],
             f"{what}: installing its dependencies {deps}")  # fmt: skip


def _load(entry: str, site: Path, name: str, where: str) -> None:
    """Import ``entry`` from ``site`` (appended to sys.path) and check it is environment
    ``name`` (empty: any name)."""
    from treadle.env_runner.environments import Environment

    module_name, _, attr = entry.partition(":")
    top = module_name.split(".")[0]
    known = sys.modules.get(top)
    if known is not None and not _inside(known, site):
        raise ConfigError(
            f"{where}: module {top!r} is already imported from {getattr(known, '__file__', '?')}: "
            "a pushed package cannot replace a module the runner holds (rename its package)"
        )
    if str(site) not in sys.path:
        sys.path.append(str(site))
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
        env = getattr(module, attr or "ENVIRONMENT")
    except Exception as e:  # an environment's import can raise anything
        raise ConfigError(f"{where}: {entry} does not load: {type(e).__name__}: {e}") from None
    if not _inside(module, site):
        raise ConfigError(f"{where}: {module_name} was imported from {module.__file__}, not "
                          f"from the pushed package: another package provides it")  # fmt: skip
    if not isinstance(env, Environment):
        raise ConfigError(f"{where}: {entry} is a {type(env).__name__}, not an Environment")
    if name and env.name != name:
        raise ConfigError(f"{where}: {entry} is environment {env.name!r}, not {name!r}")


def _inside(module: object, site: Path) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and Path(path).resolve().is_relative_to(site.resolve())


def push(store: ObjectStore, package_dir: Path, entry: str | None = None) -> Pushed:
    """Build, check and store the environment package in ``package_dir`` (module doc).
    ``entry`` defaults to "<the folder's name>:ENVIRONMENT"."""
    with tempfile.TemporaryDirectory(prefix="treadle-push-") as tmp:
        wheel, env_name, entry = _build_checked(package_dir, entry, Path(tmp))
        return store_wheel(store, wheel, env_name, entry)


def check_package(package_dir: Path, entry: str | None = None) -> bytes:
    """The wheel of the package in ``package_dir``, built and its entry loaded as ``push``
    does, for a submission to a platform (``treadle platform submit --package``)."""
    with tempfile.TemporaryDirectory(prefix="treadle-push-") as tmp:
        wheel, _, _ = _build_checked(package_dir, entry, Path(tmp))
        return wheel.read_bytes()


def _build_checked(package_dir: Path, entry: str | None, tmp: Path) -> tuple[Path, str, str]:
    """(wheel, environment name, entry): built into ``tmp`` and loaded in a child."""
    package_dir = package_dir.resolve()
    entry = entry or f"{package_dir.name}:ENVIRONMENT"
    if ":" not in entry:
        entry = f"{entry}:ENVIRONMENT"
    wheel = build_wheel(package_dir, tmp / "dist")
    site = tmp / "site"
    _pip(["install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
         f"installing {wheel.name}")  # fmt: skip
    return wheel, _check_in_child(entry, site), entry


def store_wheel(store: ObjectStore, wheel: Path, env_name: str, entry: str) -> Pushed:
    """Store a wheel as environment ``env_name`` (its ``entry``) under its sha256, without
    loading it here: the env runner that installs it checks that the entry is that
    environment (a platform does not run a tenant's code in its own process)."""
    sha = sha256_of(wheel)
    store.publish_dir(
        f"{PREFIX}/{env_name}/{sha}", {wheel.name: wheel},
        {"name": env_name, "entry": entry, "sha256": sha, "wheel": wheel.name},
    )  # fmt: skip
    return Pushed(env_name, entry, sha)


def _check_in_child(entry: str, site: Path) -> str:
    """Load ``entry`` from ``site`` in a fresh interpreter (this process keeps nothing of
    it); returns the environment's name."""
    code = "import sys; from treadle.env_runner.pushed import check_main; check_main(sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, entry, str(site)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if done.returncode != 0 or "name" not in answer:
        why = answer.get("error") or done.stderr.strip()[-500:] or f"exit {done.returncode}"
        raise ConfigError(f"the pushed package does not load: {why}")
    return str(answer["name"])


def check_main(argv: list[str]) -> None:
    """The child of ``_check_in_child``: prints {"name"} of ENTRY loaded from SITE, or
    {"error"} (exit 1)."""
    entry, site = argv
    try:
        _load(entry, Path(site), "", "push")
    except ConfigError as e:
        print(json.dumps({"error": str(e).removeprefix("push: ")}))
        sys.exit(1)
    module, _, attr = entry.partition(":")
    print(
        json.dumps({"name": getattr(importlib.import_module(module), attr or "ENVIRONMENT").name})
    )


def parse_pin(pin: str) -> tuple[str, str]:
    m = PIN.match(pin)
    if m is None:
        raise ConfigError(
            f"env_runner.pushed_envs: {pin!r} is not a pin: expected '<name>@<sha256>' (64 "
            "hex digits), as `treadle env push` prints it"
        )
    return m.group(1), m.group(2)


def install(store: ObjectStore, pin: str, cache: Path) -> Pushed:
    """Fetch, verify, install (once per pin) and load the pushed environment ``pin``."""
    name, sha = parse_pin(pin)
    where = f"env_runner.pushed_envs {pin[: len(name) + 13]}..."
    dest = cache / sha
    site = dest / "site"
    marker = dest / MARKER
    if marker.is_file():
        done = json.loads(marker.read_text(encoding="utf-8"))
        pushed = Pushed(done["name"], done["entry"], sha)
        log.info("[startup] pushed environment %s: installed already (%s)", name, site)
    else:
        try:
            manifest = store.read_manifest(f"{PREFIX}/{name}/{sha}")
        except ObjectNotFoundError:
            raise ConfigError(f"{where}: nothing was pushed under {store.uri(f'{PREFIX}/{name}/{sha}')}"
                              " (`treadle env push` prints the pins it stores)") from None  # fmt: skip
        meta = manifest.metadata
        shutil.rmtree(dest / "dist", ignore_errors=True)
        store.fetch_dir(f"{PREFIX}/{name}/{sha}", dest / "dist")
        wheel = dest / "dist" / str(meta.get("wheel", ""))
        got = sha256_of(wheel) if wheel.is_file() else "no wheel"
        if got != sha:
            raise IntegrityError(f"{where}: the stored wheel's sha256 is {got}, not the pinned one")
        _install(wheel, site, where)
        pushed = Pushed(name, str(meta["entry"]), sha)
        marker.write_text(json.dumps({"name": name, "entry": pushed.entry}), encoding="utf-8")
        log.info("[startup] pushed environment %s installed in %s", name, site)
    _load(pushed.entry, site, name, where)
    return pushed


def install_all(store: ObjectStore, pins: list[str], cache: Path) -> dict[str, str]:
    """Every pin installed and loaded: environment name -> entry."""
    out: dict[str, str] = {}
    for pin in pins:
        name, _ = parse_pin(pin)
        if name in out:
            raise ConfigError(f"env_runner.pushed_envs pins environment {name!r} twice")
        out[name] = install(store, pin, cache).entry
    return out
