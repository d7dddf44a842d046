"""A jailed process's network: nothing but the addresses it is given, through unix sockets.

A program jailed with its own network namespace (bubblewrap ``--unshare-net``) has only a
loopback of its own. The platform gives it the bus and inference, and nothing else of the
host, this way:

    outside (the platform's loop)            inside the jail (this module, as its launcher)
    Relay(<dir>/tcp-4222.sock ─▶ 127.0.0.1:4222)  ◀── 127.0.0.1:4222 (its own loopback)
    the platform's health checks             ──▶ <dir>/in/control.sock ─▶ 127.0.0.1:7001

    python -m treadle.services.jailnet --dir DIR --connect HOST:PORT ... [--serve PORT]
        -- program args...

``--connect HOST:PORT``: listens on HOST:PORT in the jail and carries each connection to
``DIR/tcp-PORT.sock`` (the platform's relay to the real address, so a client inside keeps
its address, TLS names included). ``--serve PORT``: ``DIR/in/control.sock`` carries each
connection to the program's own port (the platform checks its health there). The program
runs as this process's child; its exit code is this process's, a SIGTERM is passed on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

CHUNK = 65536


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        pass


Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


def _joiner(
    open_other: Opener,
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def join(r1: asyncio.StreamReader, w1: asyncio.StreamWriter) -> None:
        try:
            r2, w2 = await open_other()
        except OSError:
            w1.close()
            return
        try:
            await asyncio.gather(_pipe(r1, w2), _pipe(r2, w1))
        finally:
            for w in (w1, w2):
                w.close()

    return join


def relay_path(folder: Path, port: int) -> Path:
    """The unix socket that carries the jail's connections to ``port`` out."""
    return folder / f"tcp-{port}.sock"


def control_path(folder: Path) -> Path:
    """The unix socket that carries connections in to the jailed program's port (in a
    folder of the jail's own: ``folder`` itself stays the platform's)."""
    return folder / "in" / "control.sock"


async def start_relay(sock: Path, host: str, port: int, uid: int | None = None) -> asyncio.Server:
    """Outside: connections to ``sock`` go on to ``host:port`` (only the jail's uid, or
    this user, may connect)."""
    if len(os.fsencode(sock)) > 107:
        raise OSError(f"{sock}: longer than a unix socket's path may be (107 bytes): "
                      "choose a shorter platform.root")  # fmt: skip
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    server = await asyncio.start_unix_server(
        _joiner(lambda: asyncio.open_connection(host, port)), path=str(sock)
    )
    if uid is not None:  # in a folder only the platform may change: no link to follow
        os.chown(sock, uid, uid)
    os.chmod(sock, 0o600)
    return server


async def _launch(folder: Path, connect: Sequence[str], serve: int | None, argv: list[str]) -> int:
    servers = []
    for target in connect:
        host, _, port = target.rpartition(":")
        sock = relay_path(folder, int(port))
        opener = functools.partial(asyncio.open_unix_connection, str(sock))
        servers.append(await asyncio.start_server(_joiner(opener), host, int(port)))
    if serve is not None:
        control = control_path(folder)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(control)
        servers.append(await asyncio.start_unix_server(
            _joiner(lambda: asyncio.open_connection("127.0.0.1", serve)), path=str(control)
        ))  # fmt: skip
    try:
        proc = await asyncio.create_subprocess_exec(*argv)
    except OSError as e:
        print(f"treadle jailnet: cannot start {argv[0]}: {e}", file=sys.stderr)
        return 127
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, proc.send_signal, sig)
    rc = await proc.wait()
    for server in servers:
        server.close()
    return 128 - rc if rc < 0 else rc


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print("usage: python -m treadle.services.jailnet [options] -- program ...", file=sys.stderr)
        return 2
    cut = args.index("--")
    p = argparse.ArgumentParser(prog="python -m treadle.services.jailnet")
    p.add_argument("--dir", type=Path, required=True, help="the folder of the unix sockets")
    p.add_argument("--connect", action="append", default=[], help="HOST:PORT the jail reaches")
    p.add_argument("--serve", type=int, help="the program's port the platform reaches")
    opts = p.parse_args(args[:cut])
    if not args[cut + 1 :]:
        p.error("no program after --")
    return asyncio.run(_launch(opts.dir, opts.connect, opts.serve, args[cut + 1 :]))


if __name__ == "__main__":
    sys.exit(main())
