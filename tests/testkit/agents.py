"""Third-party CLI agents for the tests that run them unmodified (npm packages and a PyPI
package in a virtualenv of its own, pinned), installed once per machine under
~/.cache/treadle-test/agents: outside /work and /tmp, which the sandbox replaces, so that a
sandboxed rollout can mount the install."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(
    os.environ.get("TREADLE_TEST_AGENTS", Path.home() / ".cache" / "treadle-test" / "agents")
)
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.171.0"
OPENCODE = "opencode-ai@1.18.33"
MINI_SWE_AGENT = "mini-swe-agent==2.4.6"
VERIFIERS = "verifiers==0.3.1"  # pins mcp<2, which Treadle's own environment does not take


def npm_install(package: str, binary: str) -> Path | None:
    """``node_modules/.bin/<binary>`` of ``package`` (installed on first use); None where
    npm is missing. A failed install raises with npm's output."""
    npm = shutil.which("npm")
    if npm is None:
        return None
    prefix = ROOT / package.lstrip("@").replace("/", "-")
    exe = prefix / "node_modules" / ".bin" / binary
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not exe.exists():
            r = subprocess.run(
                [npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix), package],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if r.returncode != 0 or not exe.exists():
                raise RuntimeError(f"npm install {package} failed ({r.returncode}):\n{r.stderr[-2000:]}")  # fmt: skip
    return exe


def claude_code() -> Path | None:
    return npm_install(CLAUDE_CODE, "claude")


def codex() -> Path | None:
    return npm_install(CODEX, "codex")


def opencode() -> Path | None:
    return npm_install(OPENCODE, "opencode")


def pip_install(requirement: str, binary: str) -> Path | None:
    """``<venv>/bin/<binary>`` of ``requirement`` installed into a virtualenv of its own
    (on first use, with the uv beside this interpreter, else pip); None where neither can
    make one. A failed install raises with the installer's output."""
    prefix = ROOT / requirement.replace("==", "-")
    exe = prefix / "bin" / binary
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    uv = Path(sys.executable).parent / "uv"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(prefix.parent / f".{prefix.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not exe.exists():
            if uv.exists():
                steps = [[str(uv), "venv", "-q", str(prefix), "--python", str(base)],
                         [str(uv), "pip", "install", "-q", "--python", str(prefix / "bin" / "python"), requirement]]  # fmt: skip
            else:
                steps = [[str(base), "-m", "venv", str(prefix)],
                         [str(prefix / "bin" / "python"), "-m", "pip", "install", "-q", requirement]]  # fmt: skip
            for step in steps:
                r = subprocess.run(step, capture_output=True, text=True, timeout=900)
                if r.returncode != 0:
                    raise RuntimeError(f"{' '.join(step[:3])} {requirement} failed ({r.returncode}):\n{r.stderr[-2000:]}")  # fmt: skip
            if not exe.exists():
                raise RuntimeError(f"{requirement} installed no {binary}")
    return exe


def mini_swe_agent() -> Path | None:
    return pip_install(MINI_SWE_AGENT, "mini")
