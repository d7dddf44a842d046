"""The chassis every Treadle service stands on.

Owns: configuration loading, the NATS JetStream bus and its subjects, the object
store, gRPC bootstrap (health, reflection, deadlines, retries), codecs between
protobuf and numpy, telemetry and logging setup, process supervision, the service
host lifecycle and the ``treadle`` CLI. Owns no RL logic: rollouts, batches and
weights are carried here, never interpreted.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("treadle-services")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"
