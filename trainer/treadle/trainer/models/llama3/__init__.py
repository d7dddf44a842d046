"""Llama 3 family: ``LlamaForCausalLM`` checkpoints on TorchTitan's Llama 3 model, its
parallelize function (FSDP2) and its HF state-dict adapter."""

from __future__ import annotations

from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from treadle.trainer.models.attention import AttentionBackend
from treadle.trainer.models.family import ModelFamily
from treadle.trainer.models.hf import HFModelConfig
from treadle.trainer.models.llama3.model import model_config


def model_spec(hf: HFModelConfig, attention: AttentionBackend) -> ModelSpec:
    """TorchTitan's ModelSpec for Llama 3, with the model config of ``hf``."""
    return ModelSpec(
        name="llama3",
        flavor=f"hf:{hf.folder.name}",
        model=model_config(hf, attention),
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=Llama3StateDictAdapter,
    )


FAMILY = ModelFamily(
    name="llama3",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    model_spec=model_spec,
)
