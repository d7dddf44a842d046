"""What a published LoRA adapter must be before the engine sees it.

A ``peft-lora`` policy directory holds ``adapter_config.json`` (PEFT: ``r``,
``lora_alpha``, ``target_modules``, ``base_model_name_or_path``) and
``adapter_model.safetensors``, whose tensors are named
``base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r]. ``check_adapter`` refuses, with a ``ManifestError`` that
says why and what to set, an adapter:

- of another base model: its declared base is not the one served (by name, or by path
  when both are folders), or a tensor's shape or layer does not fit the served model's
  config.json (a base of another size loads into vLLM's LoRA slots wrongly or not at all);
- of a rank above ``inference.lora.max_lora_rank`` (vLLM holds no larger adapter).

Only the header of the safetensors file is read (its tensors stay on disk). Not here:
loading (``engine.py``) and the switch to it (``updater.py``).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.inference.errors import ManifestError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_MAX_HEADER = 64 << 20


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter."""

    rank: int  # r: rows of every A, columns of every B
    alpha: float  # scale numerator (output scaled by alpha / r)
    target_modules: tuple[str, ...]  # HF projection names
    base_model: str  # base_model_name_or_path of adapter_config.json


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header (no tensor is read)."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
        return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ManifestError(f"{path} is not a readable safetensors file: {e}") from None


def projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """HF projection name -> (in_features, out_features) of a decoder layer."""
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"the served model's config.json lacks {e}") from None
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def same_base(declared: str, served_model: Path, base_name: str | None) -> bool:
    """Whether an adapter declaring ``declared`` as its base fits the served model."""
    if base_name is not None and declared == base_name:
        return True
    if declared == str(served_model):
        return True
    try:
        return Path(declared).expanduser().resolve() == served_model.resolve()
    except (OSError, ValueError):
        return False


def check_adapter(
    folder: Path,
    *,
    where: str,
    served_model: Path,
    served_config: dict[str, Any],
    max_rank: int,
    base_name: str | None,
    published_base: str = "",
) -> AdapterInfo:
    """Validate the adapter in ``folder`` against the served base (module doc)."""
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ManifestError(f"{where}: {ADAPTER_CONFIG} is unreadable: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ManifestError(f"{where}: {ADAPTER_CONFIG} is not a PEFT LoRA config")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise ManifestError(f"{where}: {ADAPTER_CONFIG} needs r >= 1 and lora_alpha")
    if rank > max_rank:
        raise ManifestError(
            f"{where}: the adapter has rank {rank}, above this server's maximum "
            f"inference.lora.max_lora_rank = {max_rank}: restart inference with a larger "
            "max_lora_rank, or train a smaller rank"
        )
    declared = str(config.get("base_model_name_or_path") or published_base)
    wanted = base_name or str(served_model)
    for name in {declared, published_base} - {""}:
        if not same_base(name, served_model, base_name):
            raise ManifestError(
                f"{where}: the adapter was trained on base model {name!r}, but this server "
                f"serves {wanted!r}: an adapter fits only its own base (set "
                "inference.lora.base_model when the same model is named differently)"
            )
    shapes = safetensors_shapes(folder / ADAPTER_WEIGHTS)
    if not shapes:
        raise ManifestError(f"{where}: {ADAPTER_WEIGHTS} holds no tensors")
    expected = projection_shapes(served_config)
    num_layers = int(served_config.get("num_hidden_layers", 0))
    targets = set()
    for name, shape in sorted(shapes.items()):
        m = _TENSOR.match(name)
        if m is None or m.group(3) not in expected:
            raise ManifestError(
                f"{where}: tensor {name!r} is not a LoRA weight of a decoder layer's "
                f"projection ({', '.join(expected)})"
            )
        layer, proj, kind = int(m.group(1)), m.group(3), m.group(4)
        if layer >= num_layers:
            raise ManifestError(
                f"{where}: tensor {name!r} is for layer {layer}, but the served base has "
                f"{num_layers} layers: the adapter belongs to another base model"
            )
        fan_in, fan_out = expected[proj]
        want = [rank, fan_in] if kind == "A" else [fan_out, rank]
        if shape != want:
            raise ManifestError(
                f"{where}: tensor {name!r} has shape {shape}, the served base needs {want} "
                f"(rank {rank}): the adapter belongs to another base model"
            )
        targets.add(proj)
    return AdapterInfo(rank, float(alpha), tuple(sorted(targets)), declared)
