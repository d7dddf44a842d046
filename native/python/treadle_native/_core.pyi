"""Type stubs of the Rust extension module (checked with mypy.stubtest)."""

import numpy as np
import numpy.typing as npt

__all__ = [
    "InvalidMessageError",
    "SequenceTooLongError",
    "ShapeError",
    "TemplateError",
    "TokenIdError",
    "TokenizerError",
    "TreadleNativeError",
    "UnknownFamilyError",
    "__version__",
    "first_fit_decreasing",
]
__version__: str

# --- errors ---------------------------------------------------------------------------------
class TreadleNativeError(ValueError):
    """Base class of every error raised by treadle_native."""

class SequenceTooLongError(TreadleNativeError):
    """A sample does not fit in seq_len tokens."""

class ShapeError(TreadleNativeError):
    """Arrays that must have matching lengths do not."""

class UnknownFamilyError(TreadleNativeError):
    """No renderer family of that name exists."""

class TokenizerError(TreadleNativeError):
    """The tokenizer file cannot be loaded, or does not fit the family."""

class InvalidMessageError(TreadleNativeError):
    """A chat message is malformed (role, fields, tool calls)."""

class TokenIdError(TreadleNativeError):
    """A token id is outside the tokenizer's vocabulary."""

class TemplateError(TreadleNativeError):
    """A chat template failed to compile or render."""

# --- packing --------------------------------------------------------------------------------
def first_fit_decreasing(lengths: npt.NDArray[np.int64], seq_len: int) -> npt.NDArray[np.uint32]:
    """Bin index of every sample when packing ``lengths`` into bins of ``seq_len`` tokens,
    first fit in decreasing length order."""
