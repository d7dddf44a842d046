"""Free loopback ports for servers started by the launcher and by tests."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_handed_out: set[int] = set()

# Ports below this are registered services; ports are chosen between it and the kernel's
# ephemeral range.
_LOWEST = 10000


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it assigns itself (``bind`` to 0, outgoing connections)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (never the same one twice in this process).

    The port is chosen *outside* the kernel's ephemeral range: a port the kernel handed out
    through ``bind(0)`` can be taken again by any outgoing connection (from this process or
    another) between being chosen here and the server binding it, which made a service fail
    to start with "address already in use". Below the ephemeral range only a program that
    names the port explicitly can collide, and the choice is random per process so that
    parallel choosers rarely pick the same one. Where that range is too small, the kernel
    chooses."""
    lo, _ = _ephemeral_range()
    rng = random.Random(os.getpid() ^ random.getrandbits(32))
    if lo - _LOWEST >= 1000:
        for _ in range(200):
            port = rng.randrange(_LOWEST, lo)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError("could not find a free port")


def is_listening(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
