"""The training core: one trainer step from a BatchReady to published weights, and
checkpoints. Synchronous torch code; the service runs it in a worker thread.

    BatchReady(step N) ─▶ fetch Batch (sha256 verified) ─▶ check every micro-batch
        ├─ bad batch ─────────────────────────────────────────────┐ (skip: weights unchanged)
        └─ this rank's micro-batches: forward ─▶ loss/N ─▶ backward (accumulate)
             ─▶ clip ─▶ finite? ─▶ optimizer.step (else skip the update) ─▶ lr step
                                                                   ▼
        weights (HF names, safetensors) + config.json + probe ─▶ store policies/v<N:06d>
        (LoRA: the adapter only, PEFT layout: adapter_model.safetensors + adapter_config.json)

Shape legend: B = 1 micro-batch per forward, L = tokens per micro-batch.
Metrics are sums all-reduced over ranks, then divided (see ``StepStats``).
Not here: the bus, acks, gRPC (``service.py``); loss formulas (``losses.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torchtitan.distributed.utils import clip_grad_norm_

from treadle.proto.v1 import batch_pb2, common_pb2
from treadle.services import bus_time, telemetry
from treadle.services.codecs import decode_message
from treadle.services.errors import DecodeError, IntegrityError, ObjectNotFoundError
from treadle.services.export import policy_prefix
from treadle.services.objectstore import ObjectStore
from treadle.trainer import checkpoint, prefix
from treadle.trainer.batch import PackedMicroBatch, check_batch
from treadle.trainer.distributed import (
    Topology,
    all_gather_json,
    all_reduce_max,
    all_reduce_sum,
)
from treadle.trainer.errors import (
    BadBatchError,
    BatchPayloadError,
    NonFiniteError,
    TopologyError,
)
from treadle.trainer.lora import ADAPTER_FORMAT
from treadle.trainer.losses import TeacherTopK, token_losses
from treadle.trainer.models.hf import DTYPES
from treadle.trainer.policy import Policy, build_policy, resolve_device
from treadle.trainer.recipe import rl_recipe
from treadle.trainer.reference import build_reference, loss_extras
from treadle.trainer.spec import TrainerSection

log = logging.getLogger(__name__)

WEIGHTS_FORMAT = "hf-safetensors"

# StepStats sums, all-reduced as one vector
_SUMS = (
    "loss_sum", "entropy_sum", "num_masked", "ratio_sum", "num_clipped",
    "kl_sum", "num_on_policy", "lag_sum", "num_lagged", "tokens", "loss_tokens",
    "num_truncated", "num_seq_masked", "kl_ref_sum", "teacher_kl_sum", "num_teacher",
    "num_policy",
)  # fmt: skip


def teacher_term(
    mb: PackedMicroBatch, student_BLK: torch.Tensor | None, dev: torch.device
) -> TeacherTopK | None:
    """The top-k distillation term's inputs of ``mb`` (None when it carries no teacher)."""
    if mb.teacher_logprobs_LK is None or mb.teacher_weight_L is None:
        return None
    assert student_BLK is not None
    return TeacherTopK(
        student_BLK,
        torch.from_numpy(mb.teacher_logprobs_LK.copy())[None].to(dev),
        torch.from_numpy(mb.teacher_weight_L.copy())[None].to(dev),
    )


def _decode_batch(data: bytes, where: str) -> batch_pb2.Batch | BadBatchError:
    try:
        with bus_time.timed("decode"):
            return decode_message(batch_pb2.Batch, data, where=where)
    except DecodeError as e:
        return BadBatchError(str(e))


@dataclass
class StepStats:
    """Per-step sums (over loss tokens unless noted) and extremes."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_SUMS, 0.0))
    lag_min: float = math.inf
    lag_max: float = -math.inf
    updates: int = 0  # optimizer updates the step made (mini-batches with loss tokens)

    def add(self, other: StepStats) -> None:
        """Fold ``other`` (another mini-batch's stats) into these."""
        for key, value in other.sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.lag_min = min(self.lag_min, other.lag_min)
        self.lag_max = max(self.lag_max, other.lag_max)


def mini_batches(mbs: list[PackedMicroBatch], count: int) -> list[list[PackedMicroBatch]]:
    """``mbs`` (every rank's, each rank holding as many) split into at most ``count``
    mini-batches: each rank's micro-batches, in order, in parts of about equal count (the
    first parts one larger), part i of every rank together; fewer parts when a rank holds
    fewer micro-batches than ``count``."""
    by_rank: dict[int, list[PackedMicroBatch]] = {}
    for m in mbs:
        by_rank.setdefault(m.rank, []).append(m)
    per_rank = min((len(v) for v in by_rank.values()), default=0)
    n = max(1, min(count, per_rank))
    parts: list[list[PackedMicroBatch]] = [[] for _ in range(n)]
    for own in by_rank.values():
        size, extra = divmod(len(own), n)
        at = 0
        for i in range(n):
            take = size + (1 if i < extra else 0)
            parts[i].extend(own[at : at + take])
            at += take
    return parts


@dataclass(frozen=True)
class StepResult:
    """What one trainer step did."""

    step: int
    policy_version: int  # = step
    weights: common_pb2.ObjectRef | None  # manifest of the published weights (main rank)
    metrics: dict[str, float]
    skipped_reason: str  # "" when the batch was trained on; else why the step was skipped
    update_skipped_reason: str  # "" unless the optimizer update was skipped (non-finite)


def fixed_probe(vocab_size: int, length: int) -> list[int]:
    """A probe valid for any tokenizer: byte-level ids (< 256) in a fixed pattern."""
    span = max(2, min(vocab_size, 256))
    return [(37 * i + 11) % span for i in range(length)]


def probe_ids(mbs: list[PackedMicroBatch], length: int) -> list[int] | None:
    """The first ``length`` tokens of the first document (>= 2 tokens) of the first
    micro-batch; None when there is none."""
    for mb in mbs[:1]:
        cu = mb.cu_seqlens_D1
        for start, end in itertools.pairwise(cu):
            if end - start >= 2:
                stop = int(start) + min(length, int(end - start))
                return [int(t) for t in mb.input_ids_L[int(start) : stop]]
    return None


def check_autocast(dtype: torch.dtype | None, device: torch.device) -> None:
    """Warn when bfloat16 matmuls would be slower than float32 ones on this CPU (no
    AVX-512 BF16 or AMX: oneDNN emulates them)."""
    if dtype is None:
        return
    # Qwen3's q/k norms get bfloat16 input and float32 weights: torch's unfused RMSNorm
    # computes them (correctly) and says so on every new shape
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    if device.type != "cpu":
        return
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported",
                                                    "_is_amx_tile_supported")]  # fmt: skip
    if any(p is not None and p() for p in probes):
        return
    log.warning("[startup] trainer.autocast = 'bfloat16' on a CPU without AVX-512 BF16 or "
                "AMX: its bfloat16 matmuls are emulated, likely slower than float32 ones; "
                "trainer.autocast = 'off' turns it off")  # fmt: skip


class Trainer:
    """A policy, its optimizer and LR schedule, and the step counter."""

    def __init__(
        self,
        section: TrainerSection,
        store: ObjectStore,
        *,
        checkpoint_dir: Path,
        topology: Topology | None = None,
        policy: Policy | None = None,
    ):
        """``policy``: a model to train instead of building one from ``section`` (runs on
        a shared base, ``tenancy.py``: the caller checked that it is ``section``'s)."""
        if section.model is None:
            raise ValueError("trainer.model is not set")
        self.section = section
        self.store = store
        self.topology = topology or Topology()
        self.checkpoint_dir = checkpoint_dir
        self.device = resolve_device(section.device, self.topology)
        torch.manual_seed(section.seed)
        self.policy: Policy = policy or build_policy(
            section.model,
            family=section.family,
            attention=section.attention,
            device=self.device,
            dtype=DTYPES[section.dtype],
            topology=self.topology,
            lora=section.lora,
        )
        self.recipe = rl_recipe(section, self.device.type)
        parts = [self.policy.model]
        self.optimizers = self.recipe.optimizer.build(model_parts=parts)
        self.lr_schedulers = self.recipe.lr_scheduler.build(
            optimizers=self.optimizers, training_steps=self.recipe.training_steps
        )
        self.step = 0  # last completed trainer step (= last published policy version)
        self.last_checkpoint_step = -1
        self.base_model = section.base_model or str(section.model)
        # the KL penalty's frozen reference (None unless trainer.loss.kl_coef > 0)
        self.reference = build_reference(section, self.policy, self.device, self.topology)
        # mixed precision: the forward's matmuls in bfloat16 (None: in the parameters' dtype)
        self.autocast = None if section.autocast == "off" else DTYPES[section.autocast]
        check_autocast(self.autocast, self.device)

    @property
    def weights_format(self) -> str:
        """PolicyPublished.format of what this trainer publishes."""
        return WEIGHTS_FORMAT if self.policy.lora is None else ADAPTER_FORMAT

    def _lora_identity(self) -> dict[str, Any] | None:
        return None if self.policy.lora is None else self.policy.lora.describe()

    # --- state ------------------------------------------------------------------------
    def _model_options(self) -> StateDictOptions:
        # LoRA: the adapter only (the frozen base is rebuilt from trainer.model)
        return StateDictOptions(ignore_frozen_params=self.policy.lora is not None)

    def _state(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.policy.model, options=self._model_options()),
            "optimizer": self.optimizers.state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "train_state": {"step": torch.tensor(self.step, dtype=torch.int64)},
        }

    def save_checkpoint(self) -> common_pb2.ObjectRef | None:
        """Checkpoint the current step locally and publish it (manifest last); every rank
        calls it, the main rank returns the manifest ref."""
        self._check_finite_weights("checkpoint")
        started = time.monotonic()
        folder = self.checkpoint_dir / checkpoint.step_dir_name(self.step)
        checkpoint.save_local(folder, self._state(), self.topology)
        ref = checkpoint.publish(
            self.store,
            folder,
            self.step,
            {
                "policy_version": self.step,
                "world_size": self.topology.world_size,
                "family": self.policy.family.name,
                "base_model": self.base_model,
                "lora": self._lora_identity(),
            },
            self.topology,
        )
        if self.topology.local_rank == 0:
            checkpoint.prune_local(self.checkpoint_dir, self.section.keep_local_checkpoints)
        self.last_checkpoint_step = self.step
        log.info("checkpoint of step %d written in %.2fs", self.step, time.monotonic() - started)
        return ref

    def resume(self) -> int:
        """Restore the newest complete checkpoint in the object store; returns its step
        (0 and nothing restored when there is none)."""
        # one download per node (its local rank 0), into a folder of that node's own
        found = None
        folder_name = "restore-{}" + (
            f"-node{self.topology.node_rank}" if self.topology.num_nodes > 1 else ""
        )
        if self.topology.local_rank == 0:
            found = checkpoint.fetch_newest(self.store, self.checkpoint_dir, folder_name)
        if self.topology.distributed:
            # every node must restore the same step (and nobody reads before its node's
            # download is done: the gather waits for every rank)
            mine = (found[0] if found else -1) if self.topology.local_rank == 0 else None
            steps = {s for s in all_gather_json(mine, self.topology) if s is not None}
            if len(steps) != 1:
                raise checkpoint.CheckpointError(
                    f"the nodes found different newest checkpoints {sorted(steps)}: each "
                    "node's local rank 0 reads the same object store; check it"
                )
            step = steps.pop()
            found = None
            if step >= 0:
                name = folder_name.format(checkpoint.step_dir_name(step))
                found = (step, self.checkpoint_dir / name)
        if found is None:
            log.info(
                "[startup] no checkpoint in the object store: starting from %s", self.base_model
            )
            return 0
        step, folder = found
        self._check_resumable(step)
        state = self._state()
        checkpoint.load_local(folder, state, self.topology)
        lora = self.policy.lora is not None
        loaded = set_model_state_dict(
            self.policy.model,
            state["model"],
            options=StateDictOptions(ignore_frozen_params=lora, strict=not lora),
        )
        # LoRA: the base's (frozen) weights are not in the checkpoint; every adapter must be
        lost = [k for k in loaded.missing_keys if ".lora_" in k]
        if lost:
            raise checkpoint.CheckpointError(
                f"checkpoint {folder} lacks adapter weights {lost[:3]}"
            )
        self.optimizers.load_state_dict(state["optimizer"])
        with warnings.catch_warnings():  # LambdaLR recomputes its lr while loading
            warnings.filterwarnings("ignore", message=".*get_last_lr.*")
            self.lr_schedulers.load_state_dict(state["lr_scheduler"])
        restored = int(state["train_state"]["step"])
        if restored != step:
            raise checkpoint.CheckpointError(
                f"checkpoint {folder} holds step {restored}, its folder says {step}"
            )
        self.step = self.last_checkpoint_step = step
        log.info("[startup] resumed from checkpoint of step %d", step)
        return step

    def _check_resumable(self, step: int) -> None:
        """CheckpointError unless the checkpoint of ``step`` holds what this run trains: the
        full weights, or a LoRA adapter of the same shape and scale on the same base."""
        meta = self.store.read_manifest(checkpoint.store_prefix(step)).metadata
        theirs, mine = meta.get("lora"), self._lora_identity()
        where = f"checkpoint of step {step} ({checkpoint.store_prefix(step)})"
        fix = ("start a new run (another run.name / output folder), or set trainer.lora as "
               "that run had it")  # fmt: skip
        if theirs is None and mine is not None:
            raise checkpoint.CheckpointError(
                f"{where} holds full weights but trainer.lora is enabled: {fix} (to train an "
                "adapter on a fine-tuned model, point trainer.model at its exported folder)"
            )
        if theirs is not None and mine is None:
            raise checkpoint.CheckpointError(
                f"{where} holds a LoRA adapter {theirs} but trainer.lora is disabled: {fix}"
            )
        if theirs is not None and theirs != mine:
            raise checkpoint.CheckpointError(
                f"{where} holds a LoRA adapter {theirs}, this run trains {mine}: {fix}"
            )
        if theirs is not None and meta.get("base_model") != self.base_model:
            raise checkpoint.CheckpointError(
                f"{where} holds a LoRA adapter of base model {meta.get('base_model')!r}, this "
                f"run's base is {self.base_model!r} (an adapter fits only its own base): set "
                "trainer.model (or trainer.base_model, when the same model moved) to it, or "
                "start a new run"
            )

    # --- one step ---------------------------------------------------------------------
    def check_ready(self, ready: Any) -> None:
        """Raise unless BatchReady ``ready`` is the next step, packed for this job's ranks."""
        step = int(ready.step)
        if step != self.step + 1:
            raise ValueError(f"train_step({step}) after step {self.step}: steps go in order")
        if ready.num_ranks != self.topology.world_size:
            raise TopologyError(
                f"BatchReady of step {step} was packed for {ready.num_ranks} ranks, this "
                f"trainer runs {self.topology.world_size}: set orchestrator.num_ranks to "
                "match"
            )

    def fetch_batch_bytes(self, ready: Any) -> bytes:
        """The payload of ``ready`` (sha256 verified); BatchPayloadError when it cannot be had."""
        try:
            with bus_time.timed("claim_check"):
                return self.store.get_bytes(ready.data)
        except IntegrityError as e:
            raise BatchPayloadError(f"batch of step {ready.step}: {e}") from None
        except ObjectNotFoundError as e:
            raise BatchPayloadError(f"batch of step {ready.step}: {e}") from None
        except ValueError as e:  # a URI of another store
            raise BatchPayloadError(f"batch of step {ready.step}: {e}") from None

    def fetch_batch(self, ready: Any) -> batch_pb2.Batch | BadBatchError:
        """The Batch of ``ready`` (sha256 verified); a BadBatchError (returned, not
        raised) when its bytes are not a Batch."""
        return _decode_batch(self.fetch_batch_bytes(ready), ready.data.uri)

    def train_step(self, ready: Any, data: bytes | None = None) -> StepResult:
        """Train on the batch of BatchReady ``ready`` (step = self.step + 1) and publish
        the new weights as policy version ``ready.step``. ``data``: the batch payload
        when the caller fetched it (every rank of a job gets rank 0's bytes); fetched
        from the store otherwise."""
        started = time.monotonic()
        step = int(ready.step)
        self.check_ready(ready)
        if data is None:
            data = self.fetch_batch_bytes(ready)
        fetched = _decode_batch(data, ready.data.uri)
        skipped = ""
        mbs: list[PackedMicroBatch] = []
        try:
            if isinstance(fetched, BadBatchError):
                raise fetched
            mbs = check_batch(
                fetched,
                step=step,
                num_ranks=self.topology.world_size,
                vocab_size=self.policy.hf.vocab_size,
            )
            per_rank = {r: sum(1 for m in mbs if m.rank == r) for r in range(ready.num_ranks)}
            if len(set(per_rank.values())) != 1 or not mbs:
                raise BadBatchError(f"ranks hold different numbers of micro-batches: {per_rank}")
        except BadBatchError as e:
            skipped = str(e)
            log.error("step %d skipped (weights published unchanged): bad batch: %s", step, e)
        lr = float(self.lr_schedulers.schedulers[0].get_last_lr()[0])
        metrics: dict[str, float] = {"lr": lr}
        update_skipped = ""
        train_s = 0.0
        if not skipped:
            t0 = time.monotonic()
            temperature = float(ready.temperature) if ready.temperature > 0 else 1.0
            stats, grad_norm, update_skipped = self._optimize(step, mbs, temperature)
            train_s = time.monotonic() - t0
            metrics |= self._metrics(stats, grad_norm, train_s)
        else:
            self.optimizers.zero_grad()
        with warnings.catch_warnings():  # a skipped update still advances the schedule
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer")
            self.lr_schedulers.step()
        self.step = step
        metrics["step_skipped"] = 1.0 if skipped else 0.0
        metrics["update_skipped"] = 1.0 if (skipped or update_skipped) else 0.0
        ids = probe_ids(mbs, self.section.probe_tokens) or fixed_probe(
            self.policy.hf.vocab_size, self.section.probe_tokens
        )
        t1 = time.monotonic()
        with telemetry.tracer(__name__).start_as_current_span("publish_weights"):
            weights = self.publish_weights(step, ids)
        metrics["publish_s"] = time.monotonic() - t1
        metrics["step_time_s"] = time.monotonic() - started
        return StepResult(step, step, weights, metrics, skipped, update_skipped)

    def _optimize(
        self, step: int, mbs: list[PackedMicroBatch], temperature: float = 1.0
    ) -> tuple[StepStats, float, str]:
        """Forward/backward over this rank's micro-batches, then the optimizer update, once
        per mini-batch (``optim.updates_per_step``); tokens are scored at the batch's
        sampling ``temperature``. Returns the step's stats, the mean gradient norm over the
        updates and why updates were skipped ("" when none was)."""
        self.policy.model.train()
        self.optimizers.zero_grad()
        stats = StepStats()
        if sum(m.num_loss_tokens for m in mbs) == 0:  # global: every rank's
            return stats, 0.0, "no loss tokens in the batch"
        parts = mini_batches(mbs, self.section.optim.updates_per_step)
        norms: list[float] = []
        reasons: list[str] = []
        for i, part in enumerate(parts):
            num_loss_tokens = sum(m.num_loss_tokens for m in part)
            if num_loss_tokens == 0:  # every rank sees the same global part
                continue
            # until an update is made the weights are those published as step - 1
            unmoved = len(norms) == len(reasons)
            part_stats = self._backward(step, part, temperature, num_loss_tokens, unmoved)
            where = f"update {i + 1}/{len(parts)}: " if len(parts) > 1 else ""
            norm, reason = self._update(step, part_stats, num_loss_tokens, where)
            norms.append(norm)
            if reason:
                reasons.append(where + reason)
            stats.add(part_stats)
        stats.updates = len(norms)
        return stats, sum(norms) / max(len(norms), 1), "; ".join(reasons)

    def _backward(
        self,
        step: int,
        part: list[PackedMicroBatch],
        temperature: float,
        num_loss_tokens: int,
        unmoved: bool,
    ) -> StepStats:
        """Forward/backward over this rank's micro-batches of ``part`` (gradients
        accumulated; the loss a per-token mean over the part's ``num_loss_tokens``, global);
        their stats, all-reduced. Mismatch KL is taken only when ``unmoved`` (no update made
        yet this step)."""
        stats = StepStats()
        scale = 1.0 / num_loss_tokens  # FSDP sums gradients over ranks
        trained_version = step - 1 if unmoved else None
        dev = self.device
        # spans per micro-batch and for the update (a GPU's are launch times: no sync added)
        tracer = telemetry.tracer(__name__)
        # sdpa takes any length: the padding after the last document is not computed
        # (the documents stay as packed; flex/varlen keep seq_len, one compiled shape)
        trim = self.policy.attention == "sdpa"
        mine = [m for m in part if m.rank == self.topology.rank]
        share = trim and self.section.share_prompts
        if share:  # a prompt's samples in one micro-batch (as many as before: FSDP ranks)
            mine = prefix.regroup(mine)
        for mb in mine:
            if trim:
                mb = mb.trimmed()
            shared = prefix.share_prefixes(mb) if share else None
            ids_BL = torch.from_numpy(mb.input_ids_L.astype("int64"))[None].to(dev)
            pos_BL = torch.from_numpy(mb.position_ids_L.astype("int64"))[None].to(dev)
            mask_BL = torch.from_numpy(mb.loss_mask_L.astype(bool))[None].to(dev)
            adv_BL = torch.from_numpy(mb.advantages_L.copy())[None].to(dev)
            blp_BL = torch.from_numpy(mb.behaviour_logprobs_L.copy())[None].to(dev)
            ver_BL = torch.from_numpy(mb.policy_versions_L.astype("int64"))[None].to(dev)
            with (
                tracer.start_as_current_span(
                    "forward", attributes={"treadle.num_tokens": int(ids_BL.shape[1])}
                ),
                self._autocast(),
            ):
                top_ids_BLK = (
                    None if mb.teacher_ids_LK is None
                    else torch.from_numpy(mb.teacher_ids_LK.astype("int64"))[None].to(dev)
                )  # fmt: skip
                scores = prefix.scores(
                    self.policy, ids_BL, pos_BL, shared, with_entropy=True,
                    temperature=temperature, topk_ids_BLK=top_ids_BLK,
                )  # fmt: skip
                logprobs_BL, entropy_BL = scores.logprobs_BL, scores.entropy_BL
                extras = loss_extras(
                    self.section, self.reference, mb, ids_BL, pos_BL, temperature, shared
                )
                terms = token_losses(
                    self.section.loss, logprobs_BL, blp_BL, adv_BL, mask_BL,
                    teacher=teacher_term(mb, scores.topk_logprobs_BLK, dev),
                    sampled_BL=ver_BL >= 0, **extras,
                )  # fmt: skip
            with tracer.start_as_current_span("backward"):
                (terms.loss_sum * scale).backward()
            assert entropy_BL is not None
            with torch.no_grad():
                self._accumulate(
                    stats, mb, terms, logprobs_BL, blp_BL, entropy_BL, mask_BL, ver_BL, step,
                    trained_version,
                )  # fmt: skip
        self._reduce(stats)
        return stats

    def _update(
        self, step: int, stats: StepStats, num_loss_tokens: int, where: str
    ) -> tuple[float, str]:
        """Clip the accumulated gradients and step the optimizer, unless the loss or the
        gradient norm is not finite (then the gradients are dropped); the gradient norm
        and why the update was skipped ("" when it was not)."""
        with telemetry.tracer(__name__).start_as_current_span("optimizer") as span:
            params = [p for p in self.policy.model.parameters() if p.grad is not None]
            max_norm = self.section.optim.grad_clip or math.inf
            grad_norm = float(clip_grad_norm_(params, max_norm, foreach=True))
            loss = stats.sums["loss_sum"] / num_loss_tokens
            reason = ""
            if not math.isfinite(loss):
                reason = f"loss is {loss}"
            elif not math.isfinite(grad_norm):
                reason = f"gradient norm is {grad_norm}"
            span.set_attribute("treadle.update_skipped", bool(reason))
            if reason:
                log.warning(
                    "step %d: %soptimizer update skipped, weights unchanged: %s",
                    step, where, reason,
                )  # fmt: skip
            else:
                self.optimizers.step()
            self.optimizers.zero_grad()
        return grad_norm, reason

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's matmuls in ``trainer.autocast``'s dtype (the backward follows the
        dtypes the forward recorded); nothing with autocast off."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    @staticmethod
    def _accumulate(
        stats: StepStats,
        mb: PackedMicroBatch,
        terms: Any,
        logprobs_BL: torch.Tensor,
        blp_BL: torch.Tensor,
        entropy_BL: torch.Tensor,
        mask_BL: torch.Tensor,
        ver_BL: torch.Tensor,
        step: int,
        trained_version: int | None,
    ) -> None:
        s = stats.sums
        s["loss_sum"] += float(terms.loss_sum.detach())
        s["num_masked"] += float(terms.num_masked)
        s["ratio_sum"] += float(terms.ratio_sum)
        s["num_clipped"] += float(terms.num_clipped)
        s["num_truncated"] += float(terms.num_truncated)
        s["num_seq_masked"] += float(terms.num_seq_masked)
        s["kl_ref_sum"] += float(terms.kl_ref_sum)
        s["teacher_kl_sum"] += float(terms.teacher_kl_sum)
        s["num_teacher"] += float(terms.num_teacher)
        s["num_policy"] += float(terms.num_policy)
        s["entropy_sum"] += float(entropy_BL[mask_BL].sum())
        s["tokens"] += float(mb.num_tokens_used)
        s["loss_tokens"] += float(mask_BL.sum())
        # mismatch KL(behaviour || trainer) on exactly-on-policy tokens, k3 estimator
        if trained_version is not None:
            on_BL = mask_BL & (ver_BL == trained_version)
            log_rho = (logprobs_BL.detach() - blp_BL)[on_BL]
            s["kl_sum"] += float((torch.expm1(log_rho) - log_rho).sum())
            s["num_on_policy"] += float(on_BL.sum())
        lag = (step - ver_BL)[mask_BL & (ver_BL >= 0)].to(torch.float64)
        if lag.numel():
            s["lag_sum"] += float(lag.sum())
            s["num_lagged"] += float(lag.numel())
            stats.lag_min = min(stats.lag_min, float(lag.min()))
            stats.lag_max = max(stats.lag_max, float(lag.max()))

    def _reduce(self, stats: StepStats) -> None:
        if not self.topology.distributed:
            return
        vec = torch.tensor([stats.sums[k] for k in _SUMS], dtype=torch.float64)
        all_reduce_sum(vec, self.topology)
        stats.sums = dict(zip(_SUMS, vec.tolist(), strict=True))
        ext = torch.tensor([-stats.lag_min, stats.lag_max], dtype=torch.float64)
        all_reduce_max(ext, self.topology)
        stats.lag_min, stats.lag_max = -float(ext[0]), float(ext[1])

    def _metrics(self, stats: StepStats, grad_norm: float, train_s: float) -> dict[str, float]:
        s = stats.sums
        n = max(s["loss_tokens"], 1.0)
        n_policy = max(s["num_policy"], 1.0)  # n but the demonstrations' tokens
        out = {
            "loss": s["loss_sum"] / n,
            "grad_norm": grad_norm,
            "entropy": s["entropy_sum"] / n,
            "masked_fraction": s["num_masked"] / n_policy,
            "ratio_mean": s["ratio_sum"] / n_policy,
            "tokens": s["tokens"],
            "loss_tokens": s["loss_tokens"],
            "tokens_per_s": s["tokens"] / train_s if train_s > 0 else 0.0,
            "train_s": train_s,
            "on_policy_tokens": s["num_on_policy"],
        }
        loss = self.section.loss
        if loss.kind == "ppo":
            out["clip_fraction"] = s["num_clipped"] / n_policy
        if loss.kind == "tis":
            out["truncated_fraction"] = s["num_truncated"] / n_policy
        if loss.sequence_mask != "off":
            out["seq_masked_fraction"] = s["num_seq_masked"] / n_policy
        if loss.kl_coef > 0:
            out["kl_ref"] = s["kl_ref_sum"] / n_policy
        if self.section.optim.updates_per_step > 1:
            out["optimizer_updates"] = float(stats.updates)
        if s["num_policy"] < s["loss_tokens"]:
            out["demo_tokens"] = s["loss_tokens"] - s["num_policy"]
        if s["num_teacher"] > 0:
            out["teacher_topk_kl"] = s["teacher_kl_sum"] / s["num_teacher"]
        if s["num_on_policy"] > 0:
            out["mismatch_kl"] = s["kl_sum"] / s["num_on_policy"]
        if s["num_lagged"] > 0:
            out["policy_lag_mean"] = s["lag_sum"] / s["num_lagged"]
            out["policy_lag_min"] = stats.lag_min
            out["policy_lag_max"] = stats.lag_max
        return out

    # --- weights ----------------------------------------------------------------------
    def _check_finite_weights(self, what: str) -> None:
        bad = torch.zeros(1, dtype=torch.float64)
        with torch.no_grad():
            for p in self.policy.model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                if not bool(torch.isfinite(local).all()):
                    bad += 1
        all_reduce_sum(bad, self.topology)
        if float(bad) > 0:
            raise NonFiniteError(
                f"refusing to {what}: {int(bad)} parameter tensors hold NaN/inf at step {self.step}"
            )

    def publish_weights(self, policy_version: int, probe_token_ids: list[int]) -> Any:
        """Publish the current weights as ``policies/v<N:06d>`` (manifest last): the full
        weights, or with LoRA the adapter only (PEFT layout; the probe is the base plus
        the adapter). Every rank calls it, the main rank returns the manifest ref."""
        self._check_finite_weights("publish weights")
        probe = self.policy.probe(probe_token_ids)
        staging = self.checkpoint_dir.parent / "policies" / f"v{policy_version:06d}"
        if self.policy.lora is None:
            files = self.policy.save_hf(staging)
        else:
            files = self.policy.save_adapter(staging, self.base_model)
        if not self.topology.is_main:
            return None
        metadata: dict[str, Any] = {
            "policy_version": policy_version,
            "format": self.weights_format,
            "base_model": self.base_model,
            "family": self.policy.family.name,
            "dtype": self.section.dtype,
            "probe": {"token_ids": probe_token_ids, "logprobs": probe},
        }
        if self.policy.lora is not None:
            metadata["lora"] = self._lora_identity()
        try:
            return self.store.publish_dir(policy_prefix(policy_version), files, metadata=metadata)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
