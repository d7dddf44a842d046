"""Type stubs of the Rust extension module (checked with mypy.stubtest)."""

from collections.abc import Mapping, Sequence
from os import PathLike
from typing import Any, Literal, TypeVar, final

import numpy as np
import numpy.typing as npt

_Message = Mapping[str, Any]

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
    "_render_template",
    "first_fit_decreasing",
    "pack",
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
        """Generic (jinja) renderer: whether every prefix rendered as a prefix of the next.
        When not, messages are attributed by a second render with their content and
        reasoning marked (exact where the markers leave the text unchanged), else by
        searching for each message's content."""
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
        """Index into new_messages of each appended token [k]; -1 for inserted scaffold (the
        generic renderer counts what closes the sampled turn as the first new message's)."""
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
    """Renders chats to token ids exactly as a model's chat template + tokenizer do.

    ``family``: "auto" (a family port when the model's chat template is one the port is
    proven equal to, else the generic renderer), "qwen3", "qwen2.5", "llama3",
    "deepseek-r1" (an error when the model's template is not one the port is proven
    equal to, unless ``force``), or "jinja" (the generic renderer: any HF chat template).
    ``tokenizer``: a tokenizer.json file or the model folder holding one; the chat
    template is found there as transformers finds it (chat_template.jinja,
    additional_chat_templates/, tokenizer_config.json) unless ``chat_template`` gives a
    template's text or the name of one of the folder's templates. ``loss_mask`` (generic
    renderer): "auto", "sampled" or "generation" (transformers' assistant_masks).

    Bad input raises, never crashes: a malformed message (unknown role, invalid tool-call
    JSON, lone surrogates, lists/dicts nested deeper than 100 levels per message or tool
    schema -- the message dict counting as one -- or a value that contains itself)
    raises ``InvalidMessageError`` naming the message and field (``messages[3].content``);
    the same in a tool schema ``TreadleNativeError``; a token id outside the vocabulary
    ``TokenIdError`` with its position; a value that is not JSON-like ``TypeError``.
    """

    def __new__(
        cls,
        family: str,
        tokenizer: str | PathLike[str],
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        force: bool = False,
        loss_mask: str = "auto",
    ) -> Renderer: ...
    @property
    def family(self) -> str:
        """The family name ("jinja" for the generic renderer)."""
    @property
    def selection(self) -> str:
        """Why this renderer was chosen (one line, for startup logs)."""
    @property
    def template_sha256(self) -> str | None:
        """sha256 of the chat template (line endings and one trailing newline normalized)."""
    @property
    def loss_mask_convention(self) -> str | None:
        """Generic renderer: "sampled" or "generation"; None for the family ports."""
    @property
    def stop_ids(self) -> npt.NDArray[np.int32]:
        """Ids that end an assistant turn, int32 [k]."""
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
        **template_kwargs: Any,
    ) -> Rendered:
        """Render one conversation; extra keyword arguments are template variables."""
    def render_batch(
        self,
        conversations: Sequence[Sequence[_Message]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        *,
        enable_thinking: bool | None = None,
        date_string: str | None = None,
        tools_in_user_message: bool | None = None,
        **template_kwargs: Any,
    ) -> list[Rendered]:
        """Render many conversations in parallel (GIL released)."""
    def bridge(
        self,
        prev_ids: npt.NDArray[np.integer[Any]] | Sequence[int],
        new_messages: Sequence[_Message],
        add_generation_prompt: bool = True,
        *,
        prev_messages: Sequence[_Message] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool | None = None,
        **template_kwargs: Any,
    ) -> Bridge:
        """Extend ``prev_ids`` (ending with a sampled assistant turn) by ``new_messages``;
        the generic renderer needs ``prev_messages`` (what ``prev_ids`` render) and ``tools``."""
    def parse(self, completion_ids: npt.NDArray[np.integer[Any]] | Sequence[int]) -> Parsed:
        """Parse sampled completion ids into content, reasoning and tool calls."""

# Element types PackedBatch.unpack accepts; the flat result has the same one.
_UnpackT = TypeVar("_UnpackT", np.float32, np.float64, np.int32, np.int64, np.uint8)

@final
class PackedBatch:
    """Every micro-batch of one trainer step, made by ``pack``.

    Micro-batch ``m`` belongs to rank ``rank[m]`` at position ``index[m]``; micro-batches
    are ordered by (rank, index) and every rank has ``micro_batches_per_rank`` of them,
    the last ones possibly padding (zero documents). All arrays are read-only. Shapes:
    M = num_micro_batches, S = num_samples.
    """

    # per token, [M, seq_len]
    @property
    def input_ids(self) -> npt.NDArray[np.int32]:
        """int32 [M, seq_len]: token ids, pad_token_id on padding."""
    @property
    def position_ids(self) -> npt.NDArray[np.int32]:
        """int32 [M, seq_len]: 0 at each document start, counting up; 0 on padding."""
    @property
    def loss_mask(self) -> npt.NDArray[np.uint8]:
        """uint8 [M, seq_len]: 1 where the loss applies."""
    @property
    def advantages(self) -> npt.NDArray[np.float32]:
        """float32 [M, seq_len]: advantage, 0 where loss_mask = 0."""
    @property
    def behaviour_logprobs(self) -> npt.NDArray[np.float32]:
        """float32 [M, seq_len]: sampling logprob, 0 where loss_mask = 0."""
    @property
    def policy_versions(self) -> npt.NDArray[np.int32]:
        """int32 [M, seq_len]: sampling policy version as given; -1 on padding."""
    # per document, ragged: flat arrays with [M + 1] offsets
    @property
    def cu_seqlens(self) -> npt.NDArray[np.int32]:
        """int32 [M + S]: document boundaries of every micro-batch, concatenated."""
    @property
    def cu_seqlens_offsets(self) -> npt.NDArray[np.int64]:
        """int64 [M + 1]: where each micro-batch's cu_seqlens start in ``cu_seqlens``."""
    @property
    def sample_index(self) -> npt.NDArray[np.int32]:
        """int32 [S]: the sample of each document, micro-batch by micro-batch."""
    @property
    def sample_index_offsets(self) -> npt.NDArray[np.int64]:
        """int64 [M + 1]: where each micro-batch's documents start in ``sample_index``."""
    # per micro-batch, [M]
    @property
    def rank(self) -> npt.NDArray[np.int32]:
        """int32 [M]: data-parallel rank of each micro-batch."""
    @property
    def index(self) -> npt.NDArray[np.int32]:
        """int32 [M]: position of each micro-batch among its rank's."""
    @property
    def num_docs(self) -> npt.NDArray[np.int32]:
        """int32 [M]: documents per micro-batch, 0 for padding micro-batches."""
    @property
    def num_tokens_used(self) -> npt.NDArray[np.int32]:
        """int32 [M]: non-padding tokens per micro-batch."""
    @property
    def num_loss_tokens(self) -> npt.NDArray[np.int32]:
        """int32 [M]: tokens with loss_mask = 1 per micro-batch."""
    # per sample, [S]
    @property
    def sample_micro_batch(self) -> npt.NDArray[np.int64]:
        """int64 [S]: micro-batch holding each sample."""
    @property
    def sample_offset(self) -> npt.NDArray[np.int64]:
        """int64 [S]: token offset of each sample inside its micro-batch."""
    @property
    def sample_num_tokens(self) -> npt.NDArray[np.int64]:
        """int64 [S]: tokens kept of each sample (after truncation)."""
    @property
    def sample_truncated(self) -> npt.NDArray[np.bool_]:
        """bool [S]: whether each sample was cut to seq_len."""
    @property
    def sample_num_tokens_dropped(self) -> npt.NDArray[np.int64]:
        """int64 [S]: tokens removed from each sample by truncation, 0 if none."""
    # sizes
    @property
    def seq_len(self) -> int:
        """Tokens per micro-batch."""
    @property
    def num_ranks(self) -> int:
        """Data-parallel ranks the batch was packed for."""
    @property
    def num_micro_batches(self) -> int:
        """Micro-batches over all ranks, padding included (M)."""
    @property
    def micro_batches_per_rank(self) -> int:
        """Micro-batches of every rank (the same on each)."""
    @property
    def num_samples(self) -> int:
        """Samples packed (S)."""
    def rank_micro_batches(self, rank: int) -> npt.NDArray[np.int64]:
        """Ids of the micro-batches of ``rank``, in the order the rank steps through them."""
    def micro_batch_cu_seqlens(self, micro_batch: int) -> npt.NDArray[np.int32]:
        """cu_seqlens (int32 [num_docs + 1]) of one micro-batch, a read-only view."""
    def micro_batch_sample_index(self, micro_batch: int) -> npt.NDArray[np.int32]:
        """sample_index (int32 [num_docs]) of one micro-batch, a read-only view."""
    def unpack(
        self, values: npt.NDArray[_UnpackT]
    ) -> tuple[npt.NDArray[_UnpackT], npt.NDArray[np.int64]]:
        """Per-token ``values`` shaped [M, seq_len] back per sample: ``(flat, lengths)``,
        the kept tokens of sample 0, then of sample 1, ..., and ``sample_num_tokens``."""

def pack(
    lengths: npt.NDArray[np.int64],
    token_ids: npt.NDArray[np.int32],
    loss_mask: npt.NDArray[np.uint8],
    advantages: npt.NDArray[np.float32],
    behaviour_logprobs: npt.NDArray[np.float32],
    policy_versions: npt.NDArray[np.int32],
    *,
    seq_len: int,
    num_ranks: int = 1,
    cost: Literal["tokens", "flops"] = "tokens",
    hidden_size: int | None = None,
    truncation: Literal["right", "error"] = "right",
    pad_token_id: int = 0,
    parallel: bool = True,
) -> PackedBatch:
    """Pack samples (flat per-token arrays plus ``lengths``) into micro-batches of
    ``seq_len`` tokens balanced over ``num_ranks`` data-parallel ranks.

    ``advantages`` is per token ([T]) or per sample ([S], broadcast). Samples longer than
    ``seq_len`` are cut (``truncation="right"``, flagged) or raise SequenceTooLongError
    (``"error"``). Wrong dtypes raise TypeError, disagreeing lengths ShapeError."""

# --- testing --------------------------------------------------------------------------------
def _render_template(template: str, context: dict[str, Any]) -> str:
    """Render ``template`` with ``context`` in the generic renderer's Jinja environment
    (private: for differential tests against transformers' Jinja2)."""
