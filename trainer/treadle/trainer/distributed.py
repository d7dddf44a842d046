"""Process topology: one plain process, or one rank of a torchrun job with FSDP2.

    torchrun env (WORLD_SIZE > 1) ─▶ init_process_group (nccl on CUDA, gloo on CPU)
        ─▶ ParallelDims(dp_shard = world_size) ─▶ the family's TorchTitan parallelize_fn
           (FSDP2 over the "fsdp" mesh; no TP/CP/PP, no compile, no activation checkpointing)

Without a torchrun environment (or with WORLD_SIZE = 1) the model stays a plain module.
Not here: what a rank trains (its micro-batches are chosen by ``MicroBatch.rank``).
"""

from __future__ import annotations

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

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_topology(device_type: str) -> Topology:
    """Join the torchrun process group when there is one; a plain Topology otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Topology()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
        log.info("[startup] rank %d/%d joined the process group (%s)", rank, world_size, backend)
    return Topology(rank=rank, world_size=world_size, local_rank=local_rank)


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
