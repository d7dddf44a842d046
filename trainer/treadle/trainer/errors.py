"""Typed errors of the trainer, all under ``TreadleError``.

Each message says what went wrong, where, and what to do; the service logs it as one
line. Errors that stem from bad input (model folder, batch) also subclass ValueError.
Not here: chassis errors (bus, object store, config), which live in ``treadle.services``.
"""

from __future__ import annotations

from treadle.services.errors import TreadleError


class TrainerError(TreadleError):
    """Base of every error the trainer raises on purpose."""


class ModelFolderError(TrainerError, ValueError):
    """``[trainer] model`` is missing, incomplete, or not a model family the trainer knows."""


class BadBatchError(TrainerError, ValueError):
    """A Batch's tensors are inconsistent (lengths, dtypes, boundaries, token ids).

    The step is skipped: its weights are published unchanged as the step's version."""


class BatchPayloadError(TrainerError):
    """A BatchReady's payload cannot be used (sha256 mismatch, missing object, wrong step).

    Fatal for the trainer: the message stays unacked in the stream."""


class TopologyError(TrainerError, ValueError):
    """The batch was packed for another number of ranks than this trainer runs with."""


class NonFiniteError(TrainerError):
    """A loss, gradient or weight is NaN or infinite."""


class CheckpointError(TrainerError):
    """A checkpoint cannot be written or read back."""


class RankLostError(TrainerError):
    """Another rank of the trainer job is gone (killed, crashed, unreachable).

    The job stops; a restart resumes from the newest checkpoint. BatchReady messages of
    the steps after it are still in the stream and are trained again, once."""
