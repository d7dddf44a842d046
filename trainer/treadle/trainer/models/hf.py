"""The Hugging Face side of a model folder: ``config.json`` as a typed view, and the
safetensors files that hold its weights.

Owns: reading and checking ``config.json`` (the fields every decoder family needs),
reading/writing safetensors state dicts. Not here: name mapping between HF and
TorchTitan parameter names (each family's TorchTitan state-dict adapter does that).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treadle.trainer.errors import ModelFolderError

CONFIG_NAME = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HFModelConfig:
    """What the trainer reads from a model folder's config.json."""

    folder: Path
    raw: dict[str, Any]  # config.json as loaded

    @classmethod
    def load(cls, folder: Path) -> HFModelConfig:
        """Read ``folder/config.json``; ModelFolderError (one line) when it is unusable."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ModelFolderError(
                f"trainer.model {folder} is not a folder: point it at a Hugging Face model "
                "folder holding config.json and *.safetensors"
            )
        path = folder / CONFIG_NAME
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelFolderError(
                f"trainer.model {folder} has no {CONFIG_NAME}: not a Hugging Face model folder"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFolderError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ModelFolderError(f"{path} must hold a JSON object")
        if not weight_files(folder):
            raise ModelFolderError(
                f"trainer.model {folder} holds no *.safetensors weights "
                "(the trainer loads safetensors only)"
            )
        return cls(folder, raw)

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def require(self, key: str) -> Any:
        """A field every family needs; ModelFolderError naming it when absent."""
        if key not in self.raw or self.raw[key] is None:
            raise ModelFolderError(f"{self.folder / CONFIG_NAME} lacks {key!r}")
        return self.raw[key]

    @property
    def model_type(self) -> str:
        return str(self.raw.get("model_type", ""))

    @property
    def architectures(self) -> list[str]:
        return [str(a) for a in self.raw.get("architectures") or []]

    @property
    def vocab_size(self) -> int:
        return int(self.require("vocab_size"))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the weights are stored in (``torch_dtype``, or ``dtype`` in newer files)."""
        name = self.raw.get("torch_dtype") or self.raw.get("dtype") or "float32"
        return DTYPES.get(str(name), torch.float32)


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files, sorted (shards in order)."""
    return sorted(folder.glob("*.safetensors"))


def load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``folder``, by HF name."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise ModelFolderError(f"cannot read weights {path}: {e}") from None
    return tensors


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write one safetensors file (contiguous CPU tensors, HF ``format: pt`` metadata)."""
    from safetensors.torch import save_file

    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(cpu, str(path), metadata={"format": "pt"})
