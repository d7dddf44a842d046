"""Treadle's Rust core: token-exact chat rendering, sequence packing and loss masks.

Everything here is implemented in Rust (``treadle_native._core``); this package only
re-exports it with typed stubs. Errors derive from ``TreadleNativeError`` (a ValueError).
"""

from treadle_native._core import (
    Bridge,
    InvalidMessageError,
    PackedBatch,
    Parsed,
    ParsedToolCall,
    Rendered,
    Renderer,
    SequenceTooLongError,
    ShapeError,
    TemplateError,
    TokenIdError,
    TokenizerError,
    TreadleNativeError,
    UnknownFamilyError,
    __version__,
    first_fit_decreasing,
    pack,
)

__all__ = [
    "Bridge",
    "InvalidMessageError",
    "PackedBatch",
    "Parsed",
    "ParsedToolCall",
    "Rendered",
    "Renderer",
    "SequenceTooLongError",
    "ShapeError",
    "TemplateError",
    "TokenIdError",
    "TokenizerError",
    "TreadleNativeError",
    "UnknownFamilyError",
    "__version__",
    "first_fit_decreasing",
    "pack",
]
