"""Third-party CLI agents for the tests that run them unmodified (npm packages, pinned),
installed once per machine under ~/.cache/treadle-test/agents: outside /work and /tmp,
which the sandbox replaces, so that a sandboxed rollout can mount the install."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(
    os.environ.get("TREADLE_TEST_AGENTS", Path.home() / ".cache" / "treadle-test" / "agents")
)
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.171.0"


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
