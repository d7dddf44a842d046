"""Each service carries only its own dependencies (DESIGN.md section 2)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib

import pytest

from testkit.paths import REPO_ROOT

pytestmark = pytest.mark.integration

DISTRIBUTIONS = ["proto", "services", "env_runner", "orchestrator", "inference", "trainer"]
HEAVY = ("torch", "vllm", "transformers", "torchtitan")


def imported_heavy_modules(*modules: str) -> list[str]:
    code = (
        "import importlib, sys\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        f"print(' '.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return proc.stdout.split()


def test_packaging_heavy_modules_are_installed_here() -> None:
    # otherwise the import tests below could not fail
    assert importlib.util.find_spec("torch") is not None
    assert imported_heavy_modules("torch") == ["torch"]


@pytest.mark.parametrize(
    "module",
    [
        "treadle.env_runner",
        "treadle.env_runner.service",
        "treadle.orchestrator",
        "treadle.orchestrator.service",
        "treadle.services.host",
        "treadle.services.cli",
        "treadle.services.launcher",
        "treadle.services.inference_client",
        "treadle.inference.service",  # vLLM runs in a child process, never in the service's
    ],
)
def test_packaging_light_services_never_import_torch_or_vllm(module: str) -> None:
    assert imported_heavy_modules(module) == []


def test_packaging_service_registry_stays_light() -> None:
    code = "from treadle.services.registry import installed_services; print(sorted(installed_services()))"
    assert imported_heavy_modules("treadle.services.registry") == []
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "['env_runner', 'inference', 'orchestrator', 'trainer']"


@pytest.mark.parametrize("folder", ["env_runner", "orchestrator", "services", "proto"])
def test_packaging_light_distributions_do_not_declare_heavy_deps(folder: str) -> None:
    project = tomllib.loads((REPO_ROOT / folder / "pyproject.toml").read_text())["project"]
    deps = [d.lower() for d in project.get("dependencies", [])]
    for extra in project.get("optional-dependencies", {}).values():
        deps += [d.lower() for d in extra]
    assert not [d for d in deps if d.startswith(("torch", "vllm", "torchtitan"))]


def test_packaging_namespace_has_no_init() -> None:
    # PEP 420: every distribution contributes to `treadle`, none owns it
    for folder in DISTRIBUTIONS:
        assert (REPO_ROOT / folder / "treadle").is_dir()
        assert not (REPO_ROOT / folder / "treadle" / "__init__.py").exists(), folder
