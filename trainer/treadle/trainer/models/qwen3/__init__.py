"""Qwen3 family: ``Qwen3ForCausalLM`` checkpoints on TorchTitan's Qwen3 model, its
parallelize function (FSDP2) and its HF state-dict adapter."""

from __future__ import annotations

from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from treadle.trainer.models.attention import AttentionBackend
from treadle.trainer.models.family import ModelFamily
from treadle.trainer.models.hf import HFModelConfig
from treadle.trainer.models.qwen3.model import model_config


def model_spec(hf: HFModelConfig, attention: AttentionBackend) -> ModelSpec:
    """TorchTitan's ModelSpec for Qwen3, with the model config of ``hf``."""
    return ModelSpec(
        name="qwen3",
        flavor=f"hf:{hf.folder.name}",
        model=model_config(hf, attention),
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=Qwen3StateDictAdapter,
    )


FAMILY = ModelFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    model_spec=model_spec,
)
