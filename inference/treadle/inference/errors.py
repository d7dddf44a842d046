"""Typed errors of the inference service, under the chassis' ``TreadleError``.

Each message says what failed, where, and what to do. How they reach callers
(``service.py``): InferenceAdmin maps them and the chassis' errors to gRPC status codes,
and the POLICY consumer drops a message whose update can never succeed (bad checksum,
manifest or verification) and lets the bus redeliver the rest.
"""

from __future__ import annotations

from treadle.services.errors import ChildFailedError, TreadleError


class InferenceError(TreadleError):
    """Base of the inference service's own errors."""


class EngineError(InferenceError):
    """vLLM refused or failed an admin call (pause, reload, version, probe)."""


class EngineStartError(ChildFailedError, InferenceError):
    """vLLM did not start or died; the message carries the end of its log."""


class ManifestError(InferenceError, ValueError):
    """A published policy's manifest is unusable: wrong version, format or probe."""


class StaleVersionError(InferenceError, ValueError):
    """An update asks for a policy version older than the one being served."""


class VerificationError(InferenceError):
    """Served logprobs of the probe sequence do not match the published ones."""


class NotServingError(InferenceError):
    """The service has no model (inference.model unset) or is shutting down."""
