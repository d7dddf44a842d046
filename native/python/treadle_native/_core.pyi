"""Type stubs of the Rust extension module (checked with mypy.stubtest)."""

from collections.abc import Mapping, Sequence
from os import PathLike
from typing import Any, Literal, final

import numpy as np
import numpy.typing as npt

_Message = Mapping[str, Any]

__all__ = [
    "Bridge",
    "InvalidMessageError",
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

# --- rendering ------------------------------------------------------------------------------
@final
class Rendered:
    """A rendered conversation: token ids and per-token attribution, all of length n."""

    @property
    def text(self) -> str:
        """The rendered text (what the chat template produces)."""
    @property
    def token_ids(self) -> npt.NDArray[np.int32]:
        """Token ids [n]."""
    @property
    def message_index(self) -> npt.NDArray[np.int32]:
        """Index of the message each token belongs to [n]; -1 outside any message."""
    @property
    def loss_mask(self) -> npt.NDArray[np.uint8]:
        """1 where the model generates the token (assistant turns) [n]."""
    @property
    def is_content(self) -> npt.NDArray[np.uint8]:
        """1 where the token comes from caller-provided text, 0 for template scaffold [n]."""
    @property
    def prefix_stable(self) -> bool | None:
        """Generic (jinja) renderer: whether every prefix rendered as a prefix of the next."""
    def __len__(self) -> int: ...

@final
class Bridge:
    """Result of ``Renderer.bridge``: the ids to append, or why the template forbids it."""

    @property
    def ok(self) -> bool:
        """True when the conversation extends append-only."""
    @property
    def reason(self) -> str:
        """Why it cannot ("" when ok)."""
    @property
    def token_ids(self) -> npt.NDArray[np.int32]:
        """prev_ids followed by the appended ids (just prev_ids when not ok)."""
    @property
    def appended_ids(self) -> npt.NDArray[np.int32]:
        """The appended ids [k]."""
    @property
    def message_index(self) -> npt.NDArray[np.int32]:
        """Index into new_messages of each appended token [k]; -1 for inserted scaffold."""
    @property
    def loss_mask(self) -> npt.NDArray[np.uint8]:
        """Loss mask of the appended tokens [k]."""
    @property
    def is_content(self) -> npt.NDArray[np.uint8]:
        """Content flag of the appended tokens [k]."""
    @property
    def closed_turn(self) -> bool:
        """The sampled turn was truncated and its close token was appended."""
    @property
    def text(self) -> str:
        """The appended text."""
    def __bool__(self) -> bool: ...

@final
class ParsedToolCall:
    """One tool call parsed from a completion."""

    @property
    def name(self) -> str:
        """Tool name ("" when malformed)."""
    @property
    def arguments(self) -> str:
        """Arguments as JSON text of an object ("" when malformed)."""
    @property
    def status(self) -> Literal["ok", "malformed"]:
        """Whether the call parsed."""
    @property
    def raw_text(self) -> str:
        """The call's text exactly as sampled."""

@final
class Parsed:
    """Result of ``Renderer.parse``."""

    @property
    def content(self) -> str:
        """Visible answer text."""
    @property
    def reasoning(self) -> str | None:
        """Reasoning text, or None when the completion has no reasoning block."""
    @property
    def tool_calls(self) -> list[ParsedToolCall]:
        """Tool calls in order (malformed ones included)."""
    @property
    def stopped(self) -> bool:
        """The turn-close token was sampled (False: truncated)."""
    @property
    def num_tokens(self) -> int:
        """Tokens before the stop token."""
    @property
    def reasoning_truncated(self) -> bool:
        """A reasoning block was opened and never closed."""

@final
class Renderer:
    """Renders chats to token ids exactly as a model family's chat template + tokenizer do.

    ``family``: "qwen3", "qwen2.5", "llama3", "deepseek-r1", or "jinja" (any HF chat
    template). ``tokenizer``: a tokenizer.json file or a folder holding one.
    """

    def __new__(
        cls,
        family: str,
        tokenizer: str | PathLike[str],
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> Renderer: ...
    @property
    def family(self) -> str:
        """The family name."""
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce."""
    def render(
        self,
        messages: Sequence[_Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        *,
        enable_thinking: bool | None = None,
        date_string: str | None = None,
        tools_in_user_message: bool | None = None,
    ) -> Rendered:
        """Render one conversation."""
    def render_batch(
        self,
        conversations: Sequence[Sequence[_Message]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        *,
        enable_thinking: bool | None = None,
        date_string: str | None = None,
        tools_in_user_message: bool | None = None,
    ) -> list[Rendered]:
        """Render many conversations in parallel (GIL released)."""
    def bridge(
        self,
        prev_ids: npt.NDArray[np.integer[Any]] | Sequence[int],
        new_messages: Sequence[_Message],
        add_generation_prompt: bool = True,
        *,
        enable_thinking: bool | None = None,
    ) -> Bridge:
        """Extend ``prev_ids`` (ending with a sampled assistant turn) by ``new_messages``."""
    def parse(self, completion_ids: npt.NDArray[np.integer[Any]] | Sequence[int]) -> Parsed:
        """Parse sampled completion ids into content, reasoning and tool calls."""
