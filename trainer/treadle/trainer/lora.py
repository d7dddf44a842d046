"""LoRA adapters on the policy: which projections get one, how the model config is
converted (TorchTitan's ``LoRAConverter``), and the adapter's PEFT layout.

    [trainer.lora] target_modules (HF names: q_proj, ..., down_proj)
        ─▶ plan_lora: each name ─▶ the family's TorchTitan Linear (wq, ..., w2) in every
           decoder layer, found by sending that Linear's weight through the family's
           state-dict adapter (``to_hf``): its HF name, and any row permutation the
           adapter applies (Llama's q/k RoPE layout) — B's rows must follow it
        ─▶ apply_lora: TorchTitan's LoRAConverter on the model config before build
           (target Linears ─▶ LoRALinear with a frozen base; every other module frozen)
        ─▶ peft_state_dict / save_peft: ``base_model.model.<hf module>.lora_A.weight``
           [rank, in] and ``.lora_B.weight`` [out, rank] + adapter_config.json

What TorchTitan's components give and what is added here:
- ``LoRAConverter`` (config-tree walk, frozen base, adapter sharding under TP) and its
  ``LoRALinear`` (A kaiming-uniform, B zeros, output scaled by alpha / rank) are used as
  they are. They match target modules by TorchTitan's own names; users name HF
  projections (what PEFT and vLLM read), mapped here.
- K and V: TorchTitan's QKVLinear builds both from one config (``wkv``), so the
  converter cannot give k_proj an adapter without v_proj; ``SplitQKVLinear`` gives each
  its own config first.
- Dropout: TorchTitan's LoRALinear has none, so a subclass adds PEFT's ``lora_dropout``
  (on the adapter's input only) when ``dropout > 0``; at 0 TorchTitan's class is used
  unchanged.
- Initial values: A and B are set from full tensors drawn by ``initial_adapters`` (same
  distribution as TorchTitan's init), so step 0 does not depend on the number of ranks.
- A target name the model lacks is an error listing the model's projections (the
  converter only logs a warning).
- TorchTitan has no PEFT export; its HF state-dict adapters drop ``lora_*`` keys.

Shapes: r = rank, in/out = the base projection's features.
Not here: checkpointing (``trainer.py``: the adapter and its optimizer state only),
publication (``trainer.py``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torchtitan.components.lora import LoRAConverter, _get_lora_cls
from torchtitan.models.common.attention import BaseQKVLinear, QKVLinear
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.model_spec import ModelSpec

from treadle.services.errors import ConfigError
from treadle.trainer.models.hf import save_safetensors
from treadle.trainer.spec import LoraSection

ADAPTER_FORMAT = "peft-lora"  # PolicyPublished.format / manifest "format" of an adapter
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's module names

_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class Projection:
    """One target projection, the same in every decoder layer."""

    hf_name: str  # "q_proj"
    hf_module: str  # "model.layers.{}.self_attn.q_proj" (format with the layer index)
    titan_module: str  # "layers.{}.attention.qkv_linear.wq"
    row_order: torch.Tensor | None  # [out] int64: HF row i = TorchTitan row row_order[i]


@dataclass(frozen=True)
class LoraPlan:
    """What a run's adapter covers and how it is scaled."""

    section: LoraSection
    projections: tuple[Projection, ...]  # the targets, in target_modules order

    @property
    def titan_names(self) -> list[str]:
        """Last FQN segment of each target Linear (what LoRAConverter matches)."""
        return [p.titan_module.rsplit(".", 1)[-1] for p in self.projections]

    def describe(self) -> dict[str, Any]:
        """The adapter's identity (checkpoint manifests compare it on resume)."""
        s = self.section
        return {"rank": s.rank, "alpha": s.alpha, "target_modules": list(s.target_modules)}


class SplitQKVLinear(QKVLinear):
    """TorchTitan's QKVLinear with one config per projection. QKVLinear builds ``wk`` and
    ``wv`` from one shared ``wkv`` config, so LoRAConverter (which rewrites configs)
    could only give both an adapter or neither; here each has its own config (modules,
    names and state-dict keys unchanged; ``wkv`` is kept but unused)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QKVLinear.Config):
        wk: Linear.Config
        wv: Linear.Config

    def __init__(self, config: Config):
        BaseQKVLinear.__init__(self, config)
        self.wq = config.wq.build()
        self.wk = config.wk.build()
        self.wv = config.wv.build()


def _split_qkv(model_config: Any) -> None:
    """Replace every QKVLinear config in ``model_config`` (in place) by SplitQKVLinear's."""
    for _, cfg, parent, attr in list(model_config.traverse(QKVLinear.Config)):
        if isinstance(cfg, SplitQKVLinear.Config):
            continue
        kw = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init}
        split = SplitQKVLinear.Config(**kw, wk=replace(cfg.wkv), wv=replace(cfg.wkv))
        assert parent is not None
        assert not isinstance(parent, list)
        assert isinstance(attr, str)
        setattr(parent, attr, split)


def _layer_linears(spec: ModelSpec) -> dict[str, Linear.Config]:
    """TorchTitan module path template ("layers.{}.feed_forward.w1") -> config, for the
    Linear layers of decoder layer 0 (every layer has the same ones)."""
    out: dict[str, Linear.Config] = {}
    for fqn, cfg, _, _ in spec.model.traverse(Linear.Config):
        if fqn.startswith("layers.0."):
            out[_LAYER.sub("layers.{}.", fqn)] = cfg
    return out


def _to_hf(
    spec: ModelSpec, adapter: Any, titan_module: str, cfg: Linear.Config
) -> tuple[str, torch.Tensor | None] | None:
    """(HF module template, row order or None) of one Linear, or None when the
    family's state-dict adapter has no HF name for it."""
    out_f, in_f = int(cfg.out_features), int(cfg.in_features)
    # row indices as a [out, in] weight (expanded: no memory unless the adapter copies)
    rows_OI = torch.arange(out_f, dtype=torch.int64)[:, None].expand(out_f, in_f)
    hf = adapter.to_hf({titan_module.format(0) + ".weight": rows_OI})
    if len(hf) != 1:
        return None
    ((key, moved_OI),) = hf.items()
    if not key.endswith(".weight") or tuple(moved_OI.shape) != (out_f, in_f):
        return None
    order = moved_OI[:, 0].clone()
    if not bool((moved_OI == order[:, None]).all()) or not torch.equal(
        order.sort().values, torch.arange(out_f)
    ):
        raise ConfigError(
            f"{spec.name}: its state-dict adapter transforms {titan_module} in a way other "
            "than reordering rows; LoRA cannot export an adapter for it"
        )
    template = re.sub(r"\.0\.", ".{}.", key.removesuffix(".weight"), count=1)
    identity = torch.equal(order, torch.arange(out_f))
    return template, None if identity else order


def plan_lora(spec: ModelSpec, section: LoraSection) -> LoraPlan:
    """Map ``section.target_modules`` (HF names) onto the model of ``spec``;
    ConfigError naming the model's projections when one is not among them."""
    assert spec.state_dict_adapter is not None
    _split_qkv(spec.model)
    adapter = spec.state_dict_adapter(spec.model, None)
    found: dict[str, Projection] = {}
    for titan_module, cfg in _layer_linears(spec).items():
        mapped = _to_hf(spec, adapter, titan_module, cfg)
        if mapped is None:
            continue
        hf_module, order = mapped
        hf_name = hf_module.rsplit(".", 1)[-1]
        found[hf_name] = Projection(hf_name, hf_module, titan_module, order)
    unknown = [m for m in section.target_modules if m not in found]
    if unknown:
        raise ConfigError(
            f"trainer.lora.target_modules: {', '.join(unknown)} "
            f"{'is not a projection' if len(unknown) == 1 else 'are not projections'} of "
            f"this {spec.name} model; its decoder layers' linear modules are "
            f"{', '.join(found)}"
        )
    return LoraPlan(section, tuple(found[m] for m in section.target_modules))


def _dropout_lora_cls(parent_cls: Any) -> type:
    """TorchTitan's LoRA class for ``parent_cls`` plus dropout on the adapter's input."""
    if parent_cls in _DROPOUT_CLASSES:
        return _DROPOUT_CLASSES[parent_cls]
    lora_cls: Any = _get_lora_cls(parent_cls)

    class DropoutLoRALinear(lora_cls):
        @dataclass(kw_only=True, slots=True)
        class Config(lora_cls.Config):
            dropout: float

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.lora_dropout = nn.Dropout(config.dropout)

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            base_out = parent_cls.forward(self, input)
            lora_out = self.lora_b(self.lora_a(self.lora_dropout(input)))
            return base_out + self._lora_scaling * lora_out

    DropoutLoRALinear.__name__ = DropoutLoRALinear.__qualname__ = (
        f"DropoutLoRA{parent_cls.__name__}"
    )
    _DROPOUT_CLASSES[parent_cls] = DropoutLoRALinear
    return DropoutLoRALinear


_DROPOUT_CLASSES: dict[type, type] = {}


class _Converter(LoRAConverter):
    """LoRAConverter whose adapters apply dropout when the section asks for it."""

    def __init__(self, config: LoRAConverter.Config, dropout: float) -> None:
        super().__init__(config)
        self.dropout = dropout

    def _make_lora_config(self, cfg: Linear.Config) -> Any:
        if self.dropout == 0:
            return super()._make_lora_config(cfg)
        assert cfg._owner is not None
        cls: Any = _dropout_lora_cls(cfg._owner)
        return cls.Config(
            **{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init},
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
        )


def apply_lora(spec: ModelSpec, plan: LoraPlan) -> ModelSpec:
    """``spec`` with its model config converted: target Linears carry adapters, every
    other parameter is frozen (requires_grad False once built)."""
    s = plan.section
    config = LoRAConverter.Config(rank=s.rank, alpha=s.alpha, target_modules=plan.titan_names)
    converted = _Converter(config, s.dropout).convert(spec.model)
    return replace(spec, model=converted)


def _projection_of(plan: LoraPlan, module_fqn: str) -> tuple[Projection, str]:
    layer = _LAYER.match(module_fqn)
    assert layer is not None, module_fqn
    template = _LAYER.sub("layers.{}.", module_fqn)
    for p in plan.projections:
        if p.titan_module == template:
            return p, layer.group(1)
    raise AssertionError(f"adapter on {module_fqn} is not in the plan")


def peft_state_dict(plan: LoraPlan, model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's full (unsharded) tensors under PEFT's names, on CPU; collective
    under FSDP (every rank calls it)."""
    titan = get_model_state_dict(
        model,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True),
    )
    out: dict[str, torch.Tensor] = {}
    for key, value in titan.items():
        module_fqn, _, leaf = key.rpartition(".lora_")
        assert leaf in ("a.weight", "b.weight"), f"trainable parameter {key} is not an adapter's"
        proj, layer = _projection_of(plan, module_fqn)
        assert isinstance(value, torch.Tensor), key
        tensor = value.detach()
        if leaf == "b.weight" and proj.row_order is not None:  # B [out, r] rows follow W's
            tensor = tensor[proj.row_order]
        name = "lora_A" if leaf == "a.weight" else "lora_B"
        out[f"{PEFT_PREFIX}{proj.hf_module.format(layer)}.{name}.weight"] = tensor.contiguous()
    return dict(sorted(out.items()))


def adapter_config(plan: LoraPlan, base_model: str) -> dict[str, Any]:
    """PEFT's adapter_config.json for ``plan`` (a LoraConfig, causal LM)."""
    s = plan.section
    alpha: float | int = int(s.alpha) if float(s.alpha).is_integer() else s.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": s.rank,
        "lora_alpha": alpha,
        "lora_dropout": s.dropout,
        "target_modules": sorted(s.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft(
    plan: LoraPlan, model: nn.Module, folder: Path, base_model: str, *, is_main: bool
) -> dict[str, Path]:
    """Write adapter_model.safetensors + adapter_config.json into ``folder`` (the main
    rank writes; every rank must call it under FSDP). Returns the files by name."""
    tensors = peft_state_dict(plan, model)
    if not is_main:
        return {}
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, folder / ADAPTER_WEIGHTS_NAME)
    config = json.dumps(adapter_config(plan, base_model), indent=2, sort_keys=True)
    (folder / ADAPTER_CONFIG_NAME).write_text(config + "\n")
    return {ADAPTER_WEIGHTS_NAME: folder / ADAPTER_WEIGHTS_NAME,
            ADAPTER_CONFIG_NAME: folder / ADAPTER_CONFIG_NAME}  # fmt: skip


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full initial values of every adapter parameter, by TorchTitan name: A [r, in]
    kaiming-uniform (a = sqrt(5), PEFT's and TorchTitan's init: U(-1/sqrt(in), 1/sqrt(in))),
    B [out, r] zeros. Drawn on CPU from a generator of ``seed`` in name order, so the
    initial adapter is the same on any number of ranks (TorchTitan's own init draws each
    rank's shard from the rank's RNG)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, p in sorted(model.named_parameters()):
        if ".lora_a." in name:
            bound = 1.0 / math.sqrt(p.shape[1])
            a_RI = torch.rand(tuple(p.shape), generator=gen, dtype=torch.float64) * 2 - 1
            out[name] = (a_RI * bound).to(p.dtype)
        elif ".lora_b." in name:
            out[name] = torch.zeros(tuple(p.shape), dtype=p.dtype)
    return out


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (global sizes, also under FSDP)."""
    trainable = total = 0
    for p in model.parameters():
        n = math.prod(p.shape)
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total
