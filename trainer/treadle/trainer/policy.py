"""The policy model: built from a family's TorchTitan ModelSpec, loaded from and saved
to Hugging Face safetensors through the family's TorchTitan state-dict adapter, and
evaluated as per-token log-probabilities over packed micro-batches.

Shape legend: B = micro-batches in one forward (1), L = tokens per micro-batch,
V = vocabulary, P = probe tokens.

Conventions: ``logprobs_BL[:, t]`` is log p(input_ids[t] | tokens before t in the same
document) — the same position as the token's ``behaviour_logprobs`` — and 0 at t = 0.
At a document start the value is meaningless (it reads the previous document's last
logits) and the batch validation guarantees no loss applies there.

With ``trainer.lora`` enabled the model carries LoRA adapters on a frozen base
(``lora.py``); the HF weights it loads and ``hf_state_dict`` are the base's, the adapter
is saved in PEFT's layout by ``save_adapter``.

Not here: losses (``losses.py``), optimisation (``trainer.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.utils import set_default_dtype

from treadle.trainer.distributed import Topology, parallelize
from treadle.trainer.errors import ModelFolderError
from treadle.trainer.lora import (
    LoraPlan,
    apply_lora,
    initial_adapters,
    parameter_counts,
    plan_lora,
    save_peft,
)
from treadle.trainer.models import ModelFamily, resolve_family
from treadle.trainer.models.attention import AttentionBackend, attention_masks, resolve_backend
from treadle.trainer.models.hf import (
    CONFIG_NAME,
    DTYPES,
    HFModelConfig,
    load_safetensors,
    save_safetensors,
)
from treadle.trainer.spec import LoraSection

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class TokenScores:
    """What one forward gives the loss (float32; row 0 of each document scores nothing)."""

    logprobs_BL: torch.Tensor  # log p(token t | tokens before t), at the batch's temperature
    entropy_BL: torch.Tensor | None  # of the distribution that predicted token t (no grad)
    topk_logprobs_BLK: torch.Tensor | None  # log p(given ids at t | before t), untempered


@dataclass
class Policy:
    """A built, loaded policy model and what it came from."""

    model: Any  # TorchTitan Decoder (FSDP2-wrapped under torchrun)
    spec: ModelSpec
    family: ModelFamily
    hf: HFModelConfig
    adapter: Any  # the family's TorchTitan StateDictAdapter
    attention: AttentionBackend
    device: torch.device
    dtype: torch.dtype
    topology: Topology
    lora: LoraPlan | None = None  # the adapter's plan when trainer.lora is enabled

    # --- evaluation -------------------------------------------------------------------
    def token_logprobs(
        self,
        input_ids_BL: torch.Tensor,
        positions_BL: torch.Tensor,
        *,
        with_entropy: bool,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprobs_BL, entropy_BL or None), float32; see the module docstring for the
        position convention. ``entropy_BL`` (no gradient) is the entropy of the
        distribution that predicted each token. ``temperature`` scores tokens under
        softmax(logits / temperature), the distribution inference sampled them from."""
        got = self.scores(
            input_ids_BL, positions_BL, with_entropy=with_entropy, temperature=temperature
        )
        return got.logprobs_BL, got.entropy_BL

    def scores(
        self,
        input_ids_BL: torch.Tensor,
        positions_BL: torch.Tensor,
        *,
        with_entropy: bool,
        temperature: float = 1.0,
        topk_ids_BLK: torch.Tensor | None = None,
        layout: Any = None,
    ) -> TokenScores:
        """``token_logprobs``' two, and with ``topk_ids_BLK`` the logprobs of those ids at
        each position (row t: log p(ids[t, j] | tokens before t), untempered, as a teacher's
        prompt logprobs are; row 0 is 0), with gradient. ``layout``: the attention's
        masks when the row is not plain packed documents (``treadle.trainer.prefix``);
        by default those of ``positions_BL``."""
        masks = layout
        if masks is None:
            masks = attention_masks(self.model, self.attention, positions_BL)
        logits_BLV = self.model(input_ids_BL, positions_BL, masks)
        raw_BLV = logits_BLV[:, :-1].float()  # position t predicts token t + 1
        pred_BLV = raw_BLV / temperature if temperature != 1.0 else raw_BLV
        target_BL = input_ids_BL[:, 1:].long()
        lse_BL = torch.logsumexp(pred_BLV, dim=-1)
        picked_BL = pred_BLV.gather(-1, target_BL.unsqueeze(-1)).squeeze(-1)
        zero_B1 = torch.zeros_like(lse_BL[:, :1])
        logprobs_BL = torch.cat([zero_B1, picked_BL - lse_BL], dim=1)
        entropy_BL = None
        if with_entropy:
            with torch.no_grad():
                p_BLV = torch.softmax(pred_BLV.detach(), dim=-1)
                ent_BL = lse_BL.detach() - (p_BLV * pred_BLV.detach()).sum(-1)
                entropy_BL = torch.cat([zero_B1.detach(), ent_BL], dim=1)
        topk_BLK = None
        if topk_ids_BLK is not None:
            raw_lse_BL = lse_BL if pred_BLV is raw_BLV else torch.logsumexp(raw_BLV, dim=-1)
            top_BLK = raw_BLV.gather(-1, topk_ids_BLK[:, 1:].long()) - raw_lse_BL.unsqueeze(-1)
            topk_BLK = torch.cat([torch.zeros_like(top_BLK[:, :1]), top_BLK], dim=1)
        return TokenScores(logprobs_BL, entropy_BL, topk_BLK)

    @torch.no_grad()
    def probe(self, token_ids: list[int]) -> list[float]:
        """log p(token_ids[i+1] | token_ids[..i]) for i < P-1, float32, one document."""
        ids_BP = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        pos_BP = torch.arange(len(token_ids), device=self.device)[None, :]
        was_training = self.model.training
        self.model.eval()
        try:
            logprobs_BP, _ = self.token_logprobs(ids_BP, pos_BP, with_entropy=False)
        finally:
            self.model.train(was_training)
        return [float(x) for x in logprobs_BP[0, 1:].to(torch.float32).cpu()]

    # --- weights ----------------------------------------------------------------------
    def load_hf_weights(self, folder: Path) -> None:
        """Load HF safetensors from ``folder`` through the state-dict adapter (strict)."""
        hf_sd = load_safetensors(folder)
        titan_sd = self.adapter.from_hf(hf_sd)
        titan_sd = {k: v.to(self.dtype) for k, v in titan_sd.items()}
        if self.lora is not None:  # not in the folder: initial values (seeded by trainer.seed)
            titan_sd |= initial_adapters(self.model, torch.initial_seed())
        try:
            set_model_state_dict(
                self.model, titan_sd, options=StateDictOptions(full_state_dict=True, strict=True)
            )
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0]
            raise ModelFolderError(
                f"weights in {folder} do not fit {self.family.name} as configured by "
                f"{folder / CONFIG_NAME}: {first}"
            ) from None

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights under HF names, on CPU; collective under FSDP."""
        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        hf_sd: dict[str, torch.Tensor] = self.adapter.to_hf(dict(full))
        return hf_sd

    def hf_config_json(self) -> bytes:
        """The source config.json with ``torch_dtype`` set to the published dtype."""
        raw = dict(self.hf.raw)
        name = next(n for n, d in DTYPES.items() if d == self.dtype)
        raw["torch_dtype"] = name
        if "dtype" in raw:
            raw["dtype"] = name
        return json.dumps(raw, indent=2, sort_keys=True).encode()

    def save_adapter(self, folder: Path, base_model: str) -> dict[str, Path]:
        """LoRA: write the adapter in PEFT's layout into ``folder`` (main rank writes; every
        rank must call it under FSDP). Returns the written files by name."""
        assert self.lora is not None, "save_adapter needs trainer.lora.enabled"
        return save_peft(self.lora, self.model, folder, base_model, is_main=self.topology.is_main)

    def save_hf(self, folder: Path) -> dict[str, Path]:
        """Write model.safetensors + config.json into ``folder`` (main rank writes; every
        rank must call it under FSDP). Returns the written files by name."""
        hf_sd = self.hf_state_dict()
        files: dict[str, Path] = {}
        if self.topology.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            save_safetensors(hf_sd, folder / WEIGHTS_NAME)
            (folder / CONFIG_NAME).write_bytes(self.hf_config_json())
            files = {WEIGHTS_NAME: folder / WEIGHTS_NAME, CONFIG_NAME: folder / CONFIG_NAME}
        return files


def resolve_device(requested: str, topology: Topology) -> torch.device:
    """``auto`` -> the local CUDA device when there is one, else CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ModelFolderError("trainer.device = 'cuda' but no CUDA device is visible")
        return torch.device("cuda", topology.local_rank)
    return torch.device("cpu")


def build_policy(
    model_dir: Path,
    *,
    family: str = "auto",
    attention: str = "auto",
    device: torch.device,
    dtype: torch.dtype,
    topology: Topology | None = None,
    lora: LoraSection | None = None,
) -> Policy:
    """Build the model of ``model_dir`` with TorchTitan and load its HF weights; with an
    enabled ``lora`` section, the base is frozen and the target projections get adapters."""
    topology = topology or Topology()
    hf = HFModelConfig.load(model_dir)
    fam = resolve_family(hf, family)
    backend = resolve_backend(attention, device)
    spec = fam.model_spec(hf, backend)
    plan = None
    if lora is not None and lora.enabled:
        plan = plan_lora(spec, lora)
        spec = apply_lora(spec, plan)
    with torch.device("meta"), set_default_dtype(dtype):
        model = spec.model.build()
    if topology.distributed:
        model = parallelize(model, spec.parallelize_fn, topology, dtype, device.type)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    assert spec.state_dict_adapter is not None
    adapter = spec.state_dict_adapter(spec.model, None)
    policy = Policy(model, spec, fam, hf, adapter, backend, device, dtype, topology, plan)
    policy.load_hf_weights(model_dir)
    model.train()
    log.info(
        "[startup] model %s: family %s, %d layers, vocab %d, attention %s, %s on %s",
        model_dir, fam.name, len(spec.model.layers), hf.vocab_size, backend,
        str(dtype).removeprefix("torch."), device,
    )  # fmt: skip
    if plan is not None:
        trainable, total = parameter_counts(model)
        s = plan.section
        log.info(
            "[startup] LoRA rank %d, alpha %g, dropout %g on %s: %d trainable parameters "
            "of %d (%.2f%%), the base is frozen",
            s.rank, s.alpha, s.dropout, ", ".join(s.target_modules), trainable, total,
            100 * trainable / max(total, 1),
        )  # fmt: skip
    return policy
