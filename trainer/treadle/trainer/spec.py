"""The trainer service's config class and spec (light: no torch import here — the
launcher imports every service's spec)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from treadle.proto.v1 import trainer_service_pb2, trainer_service_pb2_grpc
from treadle.services.registry import ServiceSpec
from treadle.services.sections import GrpcSection, ServiceConfig, StrictModel

DEFAULT_GRPC_PORT = 50062


class LossSection(StrictModel):
    """[trainer.loss]: the per-token loss (see treadle.trainer.losses for the formulas)."""

    kind: Literal["pg", "tis", "ppo", "sft"] = "pg"
    """'pg': importance-weighted policy gradient with a ratio-band token mask and a squared
    log-ratio penalty; 'tis': policy gradient with the importance weight truncated at
    tis_cap; 'ppo': clipped surrogate; 'sft': cross-entropy on loss tokens."""
    mask_ratio: float = Field(2.0, gt=1.0)
    """pg: a loss token counts only while 1/mask_ratio <= p_trainer/p_behaviour <= mask_ratio."""
    log_ratio_coef: float = Field(1e-3, ge=0.0)
    """pg: coefficient of the squared log-ratio penalty (log p_trainer - log p_behaviour)^2."""
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0)
    """ppo: the ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""
    tis_cap: float = Field(2.0, ge=1.0)
    """tis: the importance weight p_trainer/p_behaviour is truncated to at most this."""
    sequence_mask: Literal["off", "geometric", "mean"] = "off"
    """pg, tis, ppo: mask a whole sample when its sequence ratio -- the geometric mean
    ('geometric') or the mean ('mean') of p_trainer/p_behaviour over its loss tokens -- is
    outside [1/sequence_mask_ratio, sequence_mask_ratio]."""
    sequence_mask_ratio: float = Field(2.0, gt=1.0)
    """The band of sequence_mask."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Coefficient of a KL penalty to the reference policy (k3 estimator per loss token);
    0 = off. Above 0 the trainer holds a frozen copy of the reference weights (memory of
    one more model, one more forward per micro-batch)."""
    reference_model: Path | None = None
    """kl_coef > 0: Hugging Face folder of the reference policy; default trainer.model (the
    initial weights: a resumed run still compares with them, not with its checkpoint)."""

    @model_validator(mode="after")
    def _checks(self) -> LossSection:
        if self.kind == "sft" and self.sequence_mask != "off":
            raise ValueError(
                "trainer.loss.sequence_mask masks samples by their importance ratio; "
                "trainer.loss.kind = 'sft' has none: set sequence_mask = 'off'"
            )
        if self.reference_model is not None and self.kl_coef == 0:
            raise ValueError(
                "trainer.loss.reference_model is set but trainer.loss.kl_coef is 0: the "
                "reference would be unused (set kl_coef > 0, or remove reference_model)"
            )
        return self


class OptimSection(StrictModel):
    """[trainer.optim]: optimizer and learning-rate schedule (TorchTitan components)."""

    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer."""
    lr: float = Field(1e-6, gt=0.0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(1e-8, gt=0.0)
    """Adam epsilon."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay (AdamW)."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still
    reported)."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from lr/warmup_steps to lr."""
    decay: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: keep lr, or decay it to lr * min_lr_factor at trainer.max_steps."""
    min_lr_factor: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of a decaying lr, as a fraction of lr."""
    updates_per_step: int = Field(1, ge=1)
    """Optimizer updates per trainer step: each rank's micro-batches are split, in order,
    into this many mini-batches of about equal count (at most one a micro-batch), each
    its own per-token mean loss, gradient clip and update. The step still publishes one
    policy version; the lr schedule advances once a step. Later mini-batches see a policy
    that has moved since sampling: the importance corrections of ``trainer.loss`` apply
    (the ratio is to the behaviour logprobs), ``mismatch_kl`` only over tokens
    scored before the step's first update."""


# Hugging Face names of the decoder layers' projections (what PEFT and vLLM call them)
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSection(StrictModel):
    """[trainer.lora]: train a LoRA adapter on the frozen base model instead of every
    weight. Each target projection W gets W x + (alpha / rank) * B A dropout(x), A
    [rank, in] and B [out, rank] trainable (B starts at zero: step 0 is the base model);
    the optimizer holds only A and B. Checkpoints hold the adapter and its optimizer state
    only; published policies and the final export are PEFT adapters
    (adapter_config.json + adapter_model.safetensors)."""

    enabled: bool = False
    """true: train a LoRA adapter; false: full fine-tuning (every weight)."""
    rank: int = Field(16, ge=1)
    """Rank r of A and B."""
    alpha: float = Field(32.0, gt=0.0)
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (PEFT's lora_dropout); 0 = none."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """Projections that get an adapter, by their Hugging Face name in every decoder layer
    (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj); a name the model lacks is
    an error at startup that lists the model's projections."""

    @model_validator(mode="after")
    def _checks(self) -> LoraSection:
        if not self.target_modules:
            raise ValueError("trainer.lora.target_modules is empty: name at least one projection")
        dups = sorted({m for m in self.target_modules if self.target_modules.count(m) > 1})
        if dups:
            raise ValueError(f"trainer.lora.target_modules names {dups} more than once")
        return self


class DistributedSection(StrictModel):
    """[trainer.distributed]: how many processes train, and where (torchrun's settings).

    World size = nproc_per_node × nnodes; global rank = node_rank × nproc_per_node +
    local rank. Above 1, ``treadle serve trainer`` starts the ranks through
    ``torch.distributed.run`` (FSDP2: NCCL on GPUs, gloo on CPUs); run the same command on
    every node with its own node_rank. Ignored (with a warning when it disagrees) when the
    process was already started by torchrun."""

    nproc_per_node: int = Field(1, ge=1)
    """Processes (ranks) on this node; one per GPU on a GPU node."""
    nnodes: int = Field(1, ge=1)
    """Nodes in the trainer job."""
    node_rank: int = Field(0, ge=0)
    """This node's index, 0 .. nnodes-1; node 0 holds global rank 0 (the rank that talks
    to NATS, publishes weights and checkpoints)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0 that every node can reach (torchrun's rendezvous)."""
    master_port: int = Field(29500, ge=1, le=65535)
    """Port of the rendezvous on master_addr."""
    shutdown_timeout_s: int = Field(300, ge=1)
    """Seconds the ranks get after SIGTERM (to checkpoint and stop) before SIGKILL."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _checks(self) -> DistributedSection:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"trainer.distributed.node_rank = {self.node_rank} but nnodes = {self.nnodes}: "
                "node ranks go from 0 to nnodes - 1"
            )
        return self


class HostedSection(StrictModel):
    """[trainer.hosted]: train several runs' LoRA adapters on one copy of the base model
    (hosted training). This process's [trainer] describes the base (model, family,
    attention, device, dtype, LoRA shape); each run's own TOML file gives its [run],
    [nats] (its credentials: it reaches only its own subjects), [object_store] (its
    prefix) and [trainer] (seed, optimizer, loss, checkpoints, which must fit the base).
    Steps of different runs take turns; the run that has used the least trainer time
    goes next."""

    runs: list[Path] = Field(default_factory=list)
    """Run config files (TOML), one per run; empty: this trainer trains its own run (unless
    accept_runs)."""
    accept_runs: bool = False
    """Keep serving and accept runs at runtime through the HostedRuns RPCs (AddRun,
    RemoveRun), as under ``treadle platform serve``; ``runs`` may then be empty. The
    process then runs until it is stopped, not until its runs end; a run that ended stays
    listed (GetStatus) until it is removed."""
    weights: dict[str, float] = Field(default_factory=dict)
    """Share of trainer time per run name (default 1 each): a run of weight 2 gets twice
    the time of a run of weight 1 when both have batches waiting (with accept_runs: also
    runs added later)."""
    quotas: dict[str, dict[Literal["trainer_s", "trained_tokens"], float]] = Field(
        default_factory=dict
    )
    """What each run may use in all, by run name: {trainer_s = ..., trained_tokens = ...}
    (its usage ledger's trainer seconds and trained tokens; the use before a restart
    counts). A run at a limit stops with an error naming it; the others go on. With
    accept_runs: also runs added later (AddRun's own quota comes first)."""

    @model_validator(mode="after")
    def _checks(self) -> HostedSection:
        bad = {k: v for k, v in self.weights.items() if not v > 0}
        if bad:
            raise ValueError(f"trainer.hosted.weights must be > 0: {bad}")
        bad_q = {k: v for k, v in self.quotas.items() if any(not x > 0 for x in v.values())}
        if bad_q:
            raise ValueError(f"trainer.hosted.quotas must be > 0: {bad_q}")
        dups = sorted({str(p) for p in self.runs if self.runs.count(p) > 1})
        if dups:
            raise ValueError(f"trainer.hosted.runs names {dups} more than once")
        return self

    @property
    def enabled(self) -> bool:
        """Whether this trainer hosts runs on a shared base (run files, or runs added at
        runtime)."""
        return bool(self.runs) or self.accept_runs


class TrainerSection(StrictModel):
    """[trainer]: settings of the trainer service."""

    model: Path | None = None
    """Hugging Face model folder (config.json + *.safetensors) the run starts from."""
    family: str = "auto"
    """Model family ('qwen3', 'llama3'); 'auto' picks it from config.json."""
    base_model: str | None = None
    """Name of the starting model in PolicyPublished.base_model; default: trainer.model."""
    attention: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    """Attention over packed documents: 'auto' = flex on CUDA, sdpa (block-causal mask) on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model trains; 'auto' = CUDA when visible."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype while training; published weights use it too."""
    autocast: Literal["off", "bfloat16"] = "off"
    """'bfloat16': mixed precision. The forward and backward's matrix multiplies run in
    bfloat16 (torch autocast) while parameters, gradients, optimizer state, token
    logprobs, the loss and the published probe stay in ``dtype``: about 1.5x the
    training step on a CPU with AVX-512 BF16 or AMX (on one without, bfloat16 is
    emulated and slower: a warning at startup), at bfloat16's precision
    (``mismatch_kl`` shows how far the trainer's logprobs then are from what inference
    sampled). 'off': the matmuls run in ``dtype``."""
    share_prompts: bool = True
    """Compute a prompt once for all of a step's samples of it (a group's): the documents
    of an update that open with the same tokens are put in the same micro-batches and
    their common prompt computed once, the rest of each attending to it
    (``treadle.trainer.prefix``). Same logprobs, loss and gradients up to float
    summation order, fewer tokens computed (reverse-text, 8 samples a prompt: about 40 %
    fewer). With ``sdpa`` attention only (the CPU default); flex and varlen compute
    every copy."""
    loss: LossSection = Field(default_factory=LossSection)
    """The loss."""
    optim: OptimSection = Field(default_factory=OptimSection)
    """Optimizer and schedule."""
    lora: LoraSection = Field(default_factory=LoraSection)
    """LoRA adapter training (off: full fine-tuning)."""
    max_steps: int = Field(0, ge=0)
    """Stop (with a checkpoint) after this trainer step; 0 = run until stopped."""
    checkpoint_every: int = Field(10, ge=0)
    """Checkpoint every N steps (also on Stop and SIGTERM); 0 = only on Stop/SIGTERM."""
    checkpoint_dir: Path | None = None
    """Local staging folder of checkpoints; default <run_dir>/trainer/checkpoints."""
    keep_local_checkpoints: int = Field(2, ge=1)
    """Local checkpoint folders kept after upload (the object store: keep_checkpoints)."""
    keep_checkpoints: int = Field(0, ge=0)
    """Checkpoints kept in the object store: the newest N complete ones, older ones are
    deleted after each checkpoint; 0 = keep all."""
    keep_policies: int = Field(0, ge=0)
    """Published policies kept in the object store: the newest N, plus each one whose step
    has a checkpoint there (a resume and ``treadle export --step`` need those); older ones
    are deleted after each step. 0 = keep all (every step's weights: plan the disk for
    it). An inference server that falls more than N versions behind logs that it cannot
    fetch a deleted one and loads the next."""
    probe_tokens: int = Field(16, ge=2)
    """Tokens of the probe sequence published with each policy for inference to verify."""
    seed: int = 0
    """Seed of torch's RNGs at a fresh start (resumes restore the checkpointed RNG states)."""
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    """Ranks and nodes of the trainer job (torchrun)."""
    grpc: GrpcSection = Field(default_factory=lambda: GrpcSection(port=DEFAULT_GRPC_PORT))
    """Control-plane endpoint (TrainerControl + health), served by rank 0 only."""
    hosted: HostedSection = Field(default_factory=HostedSection)
    """Several runs on one shared base (see its section); off by default."""

    @model_validator(mode="after")
    def _checks(self) -> TrainerSection:
        if self.device == "cpu" and self.attention in ("flex", "varlen"):
            raise ValueError(
                f"trainer.attention = {self.attention!r} needs CUDA (its backward fails on "
                "CPU); use 'sdpa' or 'auto' with trainer.device = 'cpu'"
            )
        if self.keep_policies == 1:
            raise ValueError(
                "trainer.keep_policies = 1 would delete the version inference is still "
                "loading as soon as the next one is published: keep 2 or more (0 = all)"
            )
        if self.optim.decay != "constant" and self.max_steps == 0:
            raise ValueError(
                f"trainer.optim.decay = {self.optim.decay!r} decays towards trainer.max_steps: "
                "set trainer.max_steps, or use decay = 'constant'"
            )
        return self


class TrainerConfig(ServiceConfig):
    """Everything the trainer service reads: the shared sections and [trainer]."""

    trainer: TrainerSection = Field(default_factory=TrainerSection)


SPEC = ServiceSpec(
    name="trainer",
    summary="optimises the policy with TorchTitan components and publishes weights",
    config_cls=TrainerConfig,
    module="treadle.trainer",
    control=trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerControl"],
    stub=trainer_service_pb2_grpc.TrainerControlStub,
)
