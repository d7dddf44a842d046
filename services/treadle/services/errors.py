"""Typed errors of the chassis, all under one base class.

Every message says what went wrong, where, and what to do; the CLI prints it as one
line without a traceback. Errors that stem from bad input also subclass ValueError.
"""

from __future__ import annotations


class TreadleError(Exception):
    """Base of every error Treadle raises on purpose."""


class ConfigError(TreadleError, ValueError):
    """A configuration file, env var or flag is malformed, unknown or invalid."""


class DecodeError(TreadleError, ValueError):
    """Bytes that should hold a Treadle message or array could not be decoded."""


class IntegrityError(TreadleError):
    """Stored bytes do not match the sha256 or size their reference promises."""


class ObjectNotFoundError(TreadleError, KeyError):
    """An object store key or manifest does not exist."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StoreUnavailableError(TreadleError):
    """The object store cannot be reached or rejected our credentials."""


class StoreUnreachableError(StoreUnavailableError):
    """The object store did not answer or could not do the operation for now (server down
    or restarting, a 5xx, a disk gone read-only): an outage that may pass. Stores retry
    it for ``ObjectStore.patience_s`` before raising it."""


class BusUnavailableError(TreadleError):
    """The NATS server cannot be reached or JetStream is not enabled."""


class BusRefusedError(BusUnavailableError):
    """The NATS server turned this client's credentials away: trying again will not help."""


class ServiceUnavailableError(TreadleError):
    """A service is not installed, not implemented yet, or not healthy."""


class ChildFailedError(TreadleError):
    """A supervised child process failed to start, became unhealthy or died."""


class DropMessage(TreadleError):
    """Raised by a bus handler to discard a message for good (no redelivery)."""


class PublishRejectedError(TreadleError):
    """JetStream refused a publish (stream full, no stream for the subject, ...)."""


class QuotaExceededError(TreadleError):
    """A run has used what its quota allows (hosted training): it stops; others go on."""
