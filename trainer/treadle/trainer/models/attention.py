"""Attention over packed documents: which TorchTitan inner attention a model uses, and
the masks that keep tokens from attending across document boundaries.

Shape legend: B = batch (micro-batches, 1 here), L = tokens per micro-batch (seq_len),
N = heads, H = head dim.

Backends:
- ``sdpa``: ``BlockCausalSDPA`` below, ``F.scaled_dot_product_attention`` per document:
  ``document_layout`` reads the documents off the position ids (a document starts where
  the position is 0), sorts them by length into a few buckets, and each bucket runs as
  one causal SDPA over a [documents, longest] batch gathered from the packed row. Cost
  is about Σ len(doc)² instead of L² — a 1024-token row of 50-token documents spends
  ~20x less in attention than with a full block-causal mask. Runs forward and backward
  on CPU; ``block_causal_mask`` is the reference it is tested against.
- ``flex`` / ``varlen``: TorchTitan's kernels (FlexAttention with a block mask,
  flash varlen with cu_seqlens), built by ``Decoder.get_attention_masks`` from the same
  positions. GPU only (their backward fails on CPU).

Not here: the model layers themselves (TorchTitan's GQAttention calls the inner
attention chosen here).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.protocols.module import Module

AttentionBackend = Literal["sdpa", "flex", "varlen"]


def block_causal_mask(positions_BL: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, 1, L, L]: True where query i may attend key j — j <= i and both in
    the same document (documents start where ``positions_BL`` is 0; padding positions are
    0 too, so each padding token is a document of one)."""
    doc_BL = torch.cumsum((positions_BL == 0).to(torch.int32), dim=1)
    same_doc_BLL = doc_BL[:, :, None] == doc_BL[:, None, :]
    L = positions_BL.shape[1]
    causal_LL = torch.ones(L, L, dtype=torch.bool, device=positions_BL.device).tril()
    return (same_doc_BLL & causal_LL)[:, None, :, :]


# at most this many length buckets per micro-batch (one SDPA call each per layer)
MAX_BUCKETS = 4


@dataclass(frozen=True)
class DocumentLayout:
    """Where each packed token goes in the per-bucket [documents, longest] batches, as
    index maps both ways, so that the gathers and their gradients are all plain index
    selects (no accumulating scatter: on CPU that was a quarter of the training step).

    For bucket b: ``gather[b]`` [D_b, M_b] holds flat token indices into the B*L packed
    tokens, or B*L (a zero row) for the padding after a shorter document;
    ``gather_inv[b]`` [B*L + 1] is each token's slot in gather[b].flatten(), or D_b*M_b
    where it is not in the bucket (and for the zero row). The buckets' outputs, flattened
    and concatenated, hold token t at ``take[t]`` [B*L]; ``take_inv`` [sum of D_b*M_b]
    is the token in each slot, or B*L for padding slots. Every packed token is in exactly
    one bucket.

    A bucket of segments that continue a shared prefix (``segment_layout``) also has
    ``prefix[b]`` [D_b, P_b], the flat indices of each row's prefix tokens (B*L after a
    shorter prefix), and ``mask[b]`` [D_b, 1, M_b, P_b + M_b]: a row's queries see its
    whole prefix and, causally, its own tokens. Other buckets have None in both.
    """

    gather: tuple[torch.Tensor, ...]
    gather_inv: tuple[torch.Tensor, ...]
    take: torch.Tensor
    take_inv: torch.Tensor
    prefix: tuple[torch.Tensor | None, ...] = ()
    mask: tuple[torch.Tensor | None, ...] = ()


def document_layout(positions_BL: torch.Tensor, max_buckets: int = MAX_BUCKETS) -> DocumentLayout:
    """The documents of ``positions_BL`` (a new one wherever the position is 0, and at
    every row start) bucketed by length so little compute goes to padding."""
    B, L = positions_BL.shape
    T = B * L
    dev = positions_BL.device
    starts_T = (positions_BL == 0).clone()
    starts_T[:, 0] = True
    start_D = torch.nonzero(starts_T.flatten()).flatten()
    len_D = torch.diff(start_D, append=torch.tensor([T], device=dev))
    return segment_layout(start_D, len_D, None, max_buckets)


def _buckets(order: torch.Tensor, max_buckets: int) -> list[torch.Tensor]:
    """Equal-count buckets over the length-sorted segments ``order``; one when few."""
    n = len(order)
    nb = max(1, min(max_buckets, n // 4 or 1))
    bounds = [round(i * n / nb) for i in range(nb + 1)]
    return [order[bounds[b] : bounds[b + 1]] for b in range(nb) if bounds[b + 1] > bounds[b]]


def segment_layout(
    start_E: torch.Tensor,
    len_E: torch.Tensor,
    prefix_E: torch.Tensor | None,
    max_buckets: int = MAX_BUCKETS,
) -> DocumentLayout:
    """The layout of a row tiled by segments (segment e: tokens ``start_E[e]`` to
    ``start_E[e] + len_E[e]``, in order, covering every token once). A segment with
    ``prefix_E[e] = p >= 0`` continues segment p: its tokens attend to all of p's and,
    causally, to its own (``treadle.trainer.prefix``: a group's samples of one prompt,
    the prompt computed once); others (-1, or ``prefix_E`` None) attend causally within
    themselves. Plain and continuing segments are bucketed by length apart."""
    dev = start_E.device
    E = len(start_E)
    T = int(start_E[-1] + len_E[-1]) if E else 0
    seg_T = torch.repeat_interleave(torch.arange(E, device=dev), len_E)
    offset_T = torch.arange(T, device=dev) - start_E[seg_T]
    order_E = torch.argsort(len_E, stable=True)
    if prefix_E is None:
        groups = _buckets(order_E, max_buckets)
        continuing = [False] * len(groups)
    else:
        plain = _buckets(order_E[prefix_E[order_E] < 0], max_buckets)
        rest = _buckets(order_E[prefix_E[order_E] >= 0], max_buckets)
        groups, continuing = plain + rest, [False] * len(plain) + [True] * len(rest)
    gathers, gather_invs, take_invs = [], [], []
    prefixes: list[torch.Tensor | None] = []
    masks: list[torch.Tensor | None] = []
    take = torch.empty(T, dtype=torch.int64, device=dev)
    base = 0
    for segs, cont in zip(groups, continuing, strict=True):
        longest = int(len_E[segs].max())
        size = len(segs) * longest
        slot_E = torch.full((E,), -1, dtype=torch.int64, device=dev)
        slot_E[segs] = torch.arange(len(segs), device=dev)
        tok_T = torch.nonzero(slot_E[seg_T] >= 0).flatten()
        flat_T = slot_E[seg_T[tok_T]] * longest + offset_T[tok_T]
        gather = torch.full((size,), T, dtype=torch.int64, device=dev)
        gather[flat_T] = tok_T
        inv = torch.full((T + 1,), size, dtype=torch.int64, device=dev)
        inv[tok_T] = flat_T
        gathers.append(gather.view(len(segs), longest))
        gather_invs.append(inv)
        take[tok_T] = base + flat_T
        take_invs.append(gather)  # padding slots hold T
        base += size
        if not cont:
            prefixes.append(None)
            masks.append(None)
            continue
        assert prefix_E is not None
        pre = prefix_E[segs]
        plen = len_E[pre]
        P = int(plen.max())
        j_P = torch.arange(P, device=dev)
        seen_DP = j_P < plen[:, None]
        prefixes.append(torch.where(seen_DP, start_E[pre][:, None] + j_P, T))
        causal = torch.ones(longest, longest, dtype=torch.bool, device=dev).tril()
        masks.append(
            torch.cat(
                [
                    seen_DP[:, None, None, :].expand(len(segs), 1, longest, P),
                    causal.expand(len(segs), 1, longest, longest),
                ],
                dim=-1,
            )
        )
    return DocumentLayout(
        tuple(gathers), tuple(gather_invs), take, torch.cat(take_invs), tuple(prefixes),
        tuple(masks),
    )  # fmt: skip


class _Take(torch.autograd.Function):
    """``x.index_select(0, idx)`` where each row of ``x`` is selected at most once (rows
    selected more often are constants whose gradient is dropped): its gradient is a select
    too, ``inv`` giving each row's place in the output or len(idx) for none."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inv)
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inv,) = ctx.saved_tensors
        padded = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
        return padded.index_select(0, inv), None, None


def _take(x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return _Take.apply(x, idx, inv)


class BlockCausalSDPA(Module):
    """Inner attention: causal SDPA per document over the buckets of a
    ``DocumentLayout`` (see the module docstring); equal to SDPA under
    ``block_causal_mask``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: torch.Tensor,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, DocumentLayout):
            raise TypeError("BlockCausalSDPA needs the DocumentLayout of document_layout()")
        layout = attention_masks
        B, L, N, H = q_BLNH.shape
        out_dtype = q_BLNH.dtype
        on_cpu = q_BLNH.device.type == "cpu"
        if on_cpu and out_dtype == torch.bfloat16:
            # float32 attention on CPU, also under autocast (which would cast SDPA's
            # inputs to bfloat16): torch's CPU SDPA backward takes ~4x as long in
            # bfloat16 as in float32 (benchmarks/trainer_bench.py --autocast --profile)
            q_BLNH, k_BLNH, v_BLNH = q_BLNH.float(), k_BLNH.float(), v_BLNH.float()

        def padded(x_BLNH: torch.Tensor) -> torch.Tensor:
            x_TNH = x_BLNH.reshape(B * L, x_BLNH.shape[2], H)
            return torch.cat([x_TNH, x_TNH.new_zeros(1, *x_TNH.shape[1:])])

        q_TNH, k_TNH, v_TNH = padded(q_BLNH), padded(k_BLNH), padded(v_BLNH)
        parts = []
        nb = len(layout.gather)
        prefixes = layout.prefix or (None,) * nb
        masks = layout.mask or (None,) * nb
        for gather_DM, inv, pre_DP, mask in zip(
            layout.gather, layout.gather_inv, prefixes, masks, strict=True
        ):
            D, M = gather_DM.shape
            idx = gather_DM.flatten()
            # [D, M, N, H] -> SDPA over [D, N, M, H]; padding sits after each document,
            # so causal attention never lets a real query see it
            q, k, v = (
                _take(x_TNH, idx, inv).view(D, M, x_TNH.shape[1], H)
                for x_TNH in (q_TNH, k_TNH, v_TNH)
            )
            if pre_DP is not None:
                # the rows' shared prefixes, selected once per row (a prefix's keys and
                # values serve several rows: their gradients add up)
                P = pre_DP.shape[1]
                k, v = (
                    torch.cat(
                        [x_TNH.index_select(0, pre_DP.flatten()).view(D, P, *x_TNH.shape[1:]), x], 1
                    )
                    for x_TNH, x in ((k_TNH, k), (v_TNH, v))
                )
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            with torch.autocast("cpu", enabled=False) if on_cpu else contextlib.nullcontext():
                out_DNMH = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                    enable_gqa=enable_gqa,
                )  # fmt: skip
            parts.append(out_DNMH.transpose(1, 2).reshape(D * M, N, H))
        out = _take(torch.cat(parts), layout.take, layout.take_inv).view(B, L, N, H)
        return out.to(out_dtype)


def inner_attention_config(backend: AttentionBackend) -> Module.Config:
    """The TorchTitan inner-attention config of ``backend``."""
    if backend == "sdpa":
        return BlockCausalSDPA.Config()
    if backend == "flex":
        return FlexAttention.Config()
    if backend == "varlen":
        return VarlenAttention.Config()
    raise ValueError(f"unknown attention backend {backend!r}: use sdpa, flex or varlen")


def resolve_backend(requested: str, device: torch.device) -> AttentionBackend:
    """``auto`` -> flex on CUDA, sdpa elsewhere; explicit choices are checked."""
    if requested == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if requested in ("flex", "varlen") and device.type != "cuda":
        raise ValueError(
            f"trainer.attention = {requested!r} needs a CUDA device (its backward fails on "
            f"{device.type}); use 'sdpa' or 'auto'"
        )
    if requested not in ("sdpa", "flex", "varlen"):
        raise ValueError(f"unknown attention backend {requested!r}")
    return requested  # type: ignore[return-value]


def attention_masks(model: Any, backend: AttentionBackend, positions_BL: torch.Tensor) -> Any:
    """The ``attention_masks`` argument of the model's forward for ``positions_BL``."""
    if backend == "sdpa":
        return document_layout(positions_BL)
    return model.get_attention_masks(positions_BL)
