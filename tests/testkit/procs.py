"""Process helpers for tests."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie stays when pid 1 does not reap)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status
