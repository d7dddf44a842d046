"""Type stubs of the Rust extension module (checked with mypy.stubtest)."""

import numpy as np
import numpy.typing as npt

__all__ = ["SequenceTooLongError", "TreadleNativeError", "__version__", "first_fit_decreasing"]
__version__: str

class TreadleNativeError(ValueError):
    """Base class of every error raised by treadle_native."""

class SequenceTooLongError(TreadleNativeError):
    """A sample does not fit in seq_len tokens."""

def first_fit_decreasing(lengths: npt.NDArray[np.int64], seq_len: int) -> npt.NDArray[np.uint32]:
    """Bin index of every sample when packing ``lengths`` into bins of ``seq_len`` tokens,
    first fit in decreasing length order."""
