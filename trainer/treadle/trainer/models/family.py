"""What a model family provides to the trainer (each ``models/<family>/__init__.py``
defines one ``FAMILY``; ``models/__init__.py`` registers them by name)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.models.common.param_init import skip_param_init
from torchtitan.protocols.model_spec import ModelSpec

from treadle.trainer.models.attention import AttentionBackend
from treadle.trainer.models.hf import HFModelConfig

# Parameter init of projection layers: skipped, every weight is loaded from the checkpoint
SKIP_INIT: dict[str, Callable[..., object]] = {"weight": skip_param_init, "bias": skip_param_init}


@dataclass(frozen=True)
class ModelFamily:
    """One decoder family: how to recognise its HF checkpoints and build its ModelSpec."""

    name: str  # registry key, e.g. "qwen3"; `[trainer] family` may name it
    architectures: tuple[str, ...]  # HF config.json "architectures" it accepts
    model_types: tuple[str, ...]  # HF config.json "model_type" values it accepts
    model_spec: Callable[[HFModelConfig, AttentionBackend], ModelSpec]
