"""Trainer-like PEFT adapters for the inference tests: random A and B on a model folder,
published with a probe computed on the merged weights (W + alpha/r · B A, PEFT's rule)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from testkit.inference import PROBE_IDS, reference_logprobs
from treadle.inference.adapter import projection_shapes
from treadle.proto.v1 import common_pb2
from treadle.services.objectstore import ObjectStore

TARGETS = ("q_proj", "v_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def make_adapter(
    base: Path,
    dst: Path,
    *,
    rank: int,
    seed: int,
    scale: float = 0.5,
    alpha: float = 16.0,
    base_model: str | None = None,
    targets: Sequence[str] = TARGETS,
) -> Path:
    """A PEFT adapter folder for ``base`` (a non-zero B, so it changes the logprobs)."""
    from safetensors.numpy import save_file

    config = json.loads((base / "config.json").read_text())
    shapes = projection_shapes(config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[proj]}.{proj}"
            a = rng.normal(0, 1 / np.sqrt(fan_in), (rank, fan_in))
            tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, scale, (fan_out, rank)).astype(
                np.float32
            )
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    doc = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": 0.0, "target_modules": sorted(targets), "bias": "none",
        "base_model_name_or_path": str(base) if base_model is None else base_model,
    }  # fmt: skip
    (dst / "adapter_config.json").write_text(json.dumps(doc, indent=2))
    return dst


def merged_copy(base: Path, adapter: Path, dst: Path) -> Path:
    """``base`` with ``adapter`` merged in (W + alpha/r · B A): the reference model."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    weights = load_file(str(base / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        w = weights[name].astype(np.float64) + scaling * (b.astype(np.float64) @ a)
        weights[name] = w.astype(np.float32)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(base / "config.json", dst / "config.json")
    return dst


def publish_adapter(
    store: ObjectStore,
    version: int,
    adapter: Path,
    merged: Path,
    base_model: str,
    probe_ids: Sequence[int] = PROBE_IDS,
) -> common_pb2.ObjectRef:
    """What a LoRA trainer publishes after step ``version``: the adapter and its probe."""
    probe = {"token_ids": list(probe_ids), "logprobs": reference_logprobs(merged, probe_ids)}
    files = {n: adapter / n for n in ("adapter_config.json", "adapter_model.safetensors")}
    return store.publish_dir(
        f"policies/v{version:06d}",
        files,
        {"policy_version": version, "format": "peft-lora", "base_model": base_model,
         "probe": probe},
    )  # fmt: skip
