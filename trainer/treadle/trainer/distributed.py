"""Process topology: one plain process, or one rank of a torchrun job with FSDP2.

    torchrun env (WORLD_SIZE > 1) ─▶ init_process_group (nccl on CUDA, gloo on CPU)
        ─▶ ParallelDims(dp_shard = world_size) ─▶ the family's TorchTitan parallelize_fn
           (FSDP2 over the "fsdp" mesh; no TP/CP/PP, no compile, no activation checkpointing)

Without a torchrun environment (or with WORLD_SIZE = 1) the model stays a plain module.
On NCCL jobs a second, gloo process group (``control_group``) carries the small CPU
messages ranks exchange besides the model's collectives (rank 0's orders, checkpoint file
lists): CPU tensors, and a peer that died is reported at once instead of hanging.
Not here: what a rank trains (its micro-batches are chosen by ``MicroBatch.rank``), what
rank 0 tells the others (``ranks.py``), starting the ranks (``launch.py``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this process sits."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0  # torchrun's GROUP_RANK
    local_world_size: int = 1  # ranks on this node

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


_CONTROL_GROUP: Any = None  # gloo group beside an NCCL default group (None: the default group)


def device_type(requested: str) -> str:
    """'cuda' or 'cpu' for ``trainer.device`` (auto = CUDA when visible)."""
    return "cuda" if requested != "cpu" and torch.cuda.is_available() else "cpu"


def init_topology(device_type: str) -> Topology:
    """Join the torchrun process group when there is one; a plain Topology otherwise."""
    global _CONTROL_GROUP
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Topology()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    node_rank = int(os.environ.get("GROUP_RANK", rank // max(1, local_world_size)))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
        if backend != "gloo":
            _CONTROL_GROUP = dist.new_group(backend="gloo")  # every rank, same point
        log.info(
            "[startup] rank %d/%d (local rank %d on node %d) joined the process group (%s)",
            rank, world_size, local_rank, node_rank, backend,
        )  # fmt: skip
    return Topology(rank, world_size, local_rank, node_rank, local_world_size)


def control_group() -> Any:
    """The process group for CPU messages between ranks (see the module docstring)."""
    return _CONTROL_GROUP


def all_gather_json(value: Any, topology: Topology) -> list[Any]:
    """Every rank's JSON-serializable ``value``, by rank (no pickle on the wire)."""
    if not topology.distributed:
        return [value]
    data = json.dumps(value).encode()
    group = control_group()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(topology.world_size)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(n) for n in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.zeros(longest, dtype=torch.uint8) for _ in range(topology.world_size)]
    dist.all_gather(everyone, mine, group=group)
    return [
        json.loads(buf[: int(n)].numpy().tobytes()) for buf, n in zip(everyone, sizes, strict=True)
    ]


def parallelize(
    model: Any, parallelize_fn: Any, topology: Topology, dtype: torch.dtype, device_type: str
) -> Any:
    """FSDP2 through the family's TorchTitan parallelize function (data parallel only)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, parallel_dims
    from torchtitan.distributed import utils as dist_utils

    # TorchTitan builds its device mesh on the accelerator it detected at import ("cuda"
    # when there is none); a CPU (gloo) job needs a CPU mesh
    parallel_dims.device_type = device_type
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, topology.world_size)
    dims.build_mesh()
    precision = "bfloat16" if dtype == torch.bfloat16 else "float32"
    training = TrainingConfig(mixed_precision_param=precision)
    model = parallelize_fn(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(enable=False),
        ac_config=None,
        dump_folder="",
    )
    # gradients are SUMMED over ranks (the loss is already a global per-token mean, and
    # gloo has no PREMUL_SUM for FSDP's default averaging)
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def all_reduce_sum(values: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Sum ``values`` over ranks (identity in a single process)."""
    if topology.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_reduce_max(values: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Max of ``values`` over ranks (identity in a single process)."""
    if topology.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def barrier(topology: Topology) -> None:
    if topology.distributed:
        dist.barrier()
