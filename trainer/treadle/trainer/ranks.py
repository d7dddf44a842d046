"""Rank 0 drives the other ranks: one order at a time over the process group.

    rank 0 (NATS, gRPC, fetches batches)              ranks 1..W-1 (no NATS, no gRPC)
      BatchReady N ─▶ checks, fetch Batch (sha256) ─▶ TRAIN(ready, batch) ─▶ train_step N
      checkpoint due (every N, rpc, stop) ─────────▶ CHECKPOINT ─────────▶ save_checkpoint
      waiting for a batch longer than BEAT_S ──────▶ NOOP (keeps their wait < the group timeout)
      stopping (after the last checkpoint) ────────▶ STOP ───────────────▶ exit 0

After an order both sides run the same code, so their collectives (FSDP all-gathers and
reduce-scatters, DCP, weight gathering) line up. Wire format: a broadcast of an int64
header ``[order, len(ready), len(batch)]``, then, when non-empty, one uint8 buffer
``ready ‖ batch`` (protobuf bytes as they came from the bus and the store; no pickle),
over ``control_group()`` (gloo). A broadcast that fails means a peer is gone: it raises
RankLostError.

Not here: the decisions (``service.py`` on rank 0), the work (``trainer.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from treadle.trainer.errors import RankLostError

if TYPE_CHECKING:  # torch loads with the first order: an idle trainer never needs it
    from treadle.trainer.distributed import Topology

BEAT_S = 60.0  # longest rank 0 stays silent while it waits for a batch


class Command(enum.IntEnum):
    NOOP = 0
    TRAIN = 1
    CHECKPOINT = 2
    STOP = 3


@dataclass(frozen=True)
class Order:
    command: Command
    ready: bytes = b""  # TRAIN: the BatchReady, serialized
    batch: bytes = b""  # TRAIN: the Batch payload (sha256-verified by rank 0)


def is_collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a process-group failure (a peer gone), not a bug or bad input."""
    import torch.distributed as dist

    if isinstance(e, RankLostError | dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("closed by peer", "reset by peer", "Broken pipe", "NCCL error")
    )


class OrderChannel:
    """Rank 0 sends, every other rank receives, in the same sequence."""

    def __init__(self, topology: Topology):
        self.topology = topology

    def send(self, order: Order) -> None:
        assert self.topology.is_main, "only rank 0 gives orders"
        if not self.topology.distributed:
            return
        import torch

        header = torch.tensor(
            [int(order.command), len(order.ready), len(order.batch)], dtype=torch.int64
        )
        self._broadcast(header, order.command.name)
        if order.ready or order.batch:
            body = torch.frombuffer(bytearray(order.ready + order.batch), dtype=torch.uint8)
            self._broadcast(body, order.command.name)

    def receive(self) -> Order:
        assert not self.topology.is_main, "rank 0 gives the orders"
        import torch

        header = torch.zeros(3, dtype=torch.int64)
        self._broadcast(header, "the next order")
        command, n_ready, n_batch = (int(x) for x in header)
        data = b""
        if n_ready + n_batch:
            body = torch.empty(n_ready + n_batch, dtype=torch.uint8)
            self._broadcast(body, Command(command).name)
            data = body.numpy().tobytes()
        return Order(Command(command), data[:n_ready], data[n_ready:])

    def _broadcast(self, tensor: Any, what: str) -> None:
        import torch.distributed as dist

        from treadle.trainer.distributed import control_group

        try:
            dist.broadcast(tensor, src=0, group=control_group())
        except RuntimeError as e:
            raise lost(e, f"exchanging {what}") from None


def lost(e: BaseException, doing: str) -> RankLostError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return RankLostError(
        f"a rank of the trainer job is gone ({doing}: {first}); the job stops, and a "
        "restart resumes from the newest checkpoint"
    )
