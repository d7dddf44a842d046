"""Ports chosen for servers stay out of the kernel's ephemeral range, where an outgoing
connection could take them before the server binds."""

from __future__ import annotations

import itertools
import socket

import pytest

from treadle.services import ports


def test_free_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    lo, _ = ports._ephemeral_range()
    chosen = [ports.free_port() for _ in range(50)]
    assert len(set(chosen)) == 50
    for port in chosen:
        assert ports._LOWEST <= port < lo
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # the first random pick lands on the held port, the later ones on the ports above it
        # (one of those may be in use by another process too: it is skipped the same way)
        picks = itertools.chain([taken], itertools.count(taken + 1))
        calls: list[int] = []
        monkeypatch.setattr(ports, "_LOWEST", 1024)
        monkeypatch.setattr(ports, "_ephemeral_range", lambda: (65535, 65535))

        class Picker:
            def __init__(self, *_: object) -> None: ...

            def randrange(self, *_: int) -> int:
                calls.append(next(picks))
                return calls[-1]

        monkeypatch.setattr(ports.random, "Random", Picker)
        port = ports.free_port()
    assert calls[0] == taken
    assert port != taken
    assert port == calls[-1] > taken


def test_a_tiny_range_falls_back_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (ports._LOWEST + 10, 60999))
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
