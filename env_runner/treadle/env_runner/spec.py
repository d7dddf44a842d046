"""The env runner service's config class and spec (light: no heavy imports here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from treadle.proto.v1 import env_runner_service_pb2, env_runner_service_pb2_grpc
from treadle.services.registry import ServiceSpec
from treadle.services.sections import GrpcSection, ServiceConfig, StrictModel, check_name

DEFAULT_GRPC_PORT = 50064


class EnvRunnerSection(StrictModel):
    """[env_runner]: settings of an env runner."""

    grpc: GrpcSection = Field(default_factory=lambda: GrpcSection(port=DEFAULT_GRPC_PORT))
    """Control-plane endpoint (EnvRunnerControl + health)."""
    envs: list[str] = Field(default_factory=lambda: ["reverse_text"])
    """Environments this runner serves (it pulls their rollout requests)."""
    environments: dict[str, str] = Field(default_factory=dict)
    """Extra environments: name -> "module:attribute" of an object with prompt() and reward()."""
    pushed_envs: list[str] = Field(default_factory=list)
    """Environments pushed to the run's object store (``treadle env push``), pinned:
    "<name>@<sha256>" each. Installed once per pin into pushed_envs_dir, loaded, and
    served (added to envs) (``treadle.env_runner.pushed``)."""
    pushed_envs_dir: Path | None = None
    """Where pushed environments are installed, one folder per pin; default
    <run_dir>/env_runner/envs."""
    group_rewards: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)
    """Built-in group rewards added to environments, by environment name: a list of
    tables, each with ``kind`` ("conciseness", "pairwise_judge" or "ranking_judge"),
    ``weight`` (default 1) and that reward's keyword arguments
    (``treadle.env_runner.group_rewards``), e.g. ``[[env_runner.group_rewards.countdown]]``
    with ``kind = "conciseness"`` and ``weight = 0.1``. Applied by ``treadle eval`` and,
    in RL, by the env runners serving the environment."""
    runtimes: dict[str, Any] = Field(default_factory=dict)
    """Where each environment's programs run, overriding the environment's own runtime,
    by environment name: a kind ("local", "sandbox", "container", or "module:Class") or a
    table with ``kind`` and that runtime's settings (``limits`` a table of SandboxLimits
    fields; a container's ``image``, ``engine``, ...), e.g.
    ``[env_runner.runtimes.python_code]`` with ``kind = "container"`` and ``image = "..."``
    (``treadle.env_runner.runtimes``). Applied by ``treadle eval`` and the env runners."""
    inference_url: str = "http://127.0.0.1:8000"
    """Base URL of the inference service's HTTP API (token-in/token-out generate route)."""
    inference_urls: list[str] = Field(default_factory=list)
    """Several inference replicas: the base URL of each (set this or inference_url, not
    both). Model calls go to the replica with the fewest outstanding requests, a rollout's
    turns stay on one replica, a call a replica could not run moves to another, and a
    replica whose answers fail the probe leaves rotation (``treadle.services.inference_pool``).
    ``treadle stack``/``rl`` set it when ``launcher.inference_replicas`` > 1."""
    inference_discovery: bool = False
    """Also use the inference replicas announced in the run's NATS bucket (inference
    services with ``[inference] announce = true``, ``treadle.services.discovery``): they
    join and leave the pool as they come and go; with it, inference_url/inference_urls may
    be left empty (calls wait for a replica until their deadline)."""
    inference_probe_interval_s: float = Field(30.0, ge=0)
    """Several replicas: how often each replica in rotation is probed (its probe logprobs
    against the ones the trainer published with the version it claims); 0 = never (a
    replica out of rotation is still checked before it returns)."""
    inference_probe_tolerance: float = Field(0.1, gt=0)
    """Several replicas: largest accepted mean |served - published| probe logprob, nats
    (0.1 accepts bfloat16 serving; another model or version moves it by far more)."""
    inference_model: str | None = None
    """On an inference deployment hosting several runs (``inference.hosted``): this run's
    model name there, its run name. Unset: the served policy."""
    inference_key_file: Path | None = None
    """File holding this run's key on a hosted inference deployment (sent as
    ``Authorization: Bearer``); such a server refuses requests without it."""
    renderer: str = "auto"
    """Chat renderer: "auto" (a family port when the model's chat template is one it is
    proven equal to, else the generic renderer), a port name ("qwen3", "qwen2.5",
    "llama3", "deepseek-r1" -- an error when it does not match the model's template), or
    "jinja" (the generic renderer)."""
    renderer_force: bool = False
    """Use the named port even on a template it is not proven equal to (logged loudly)."""
    tokenizer: Path | None = None
    """tokenizer.json (or the model folder) of the served model; required."""
    max_concurrency: int = Field(8, ge=1)
    """Rollouts run at once."""
    group_call_window_s: float = Field(0.02, ge=0, le=10)
    """The first model calls of a group's rollouts with equal prompts go to inference as
    one request (n samples; siblings.py); a call waits at most this long for siblings
    that have not made theirs. 0 = every call alone."""
    inference_timeout_s: float = Field(300.0, gt=0)
    """Deadline of one generate call, seconds."""
    inference_attempts: int = Field(3, ge=1)
    """Attempts of a generate call that fails to reach inference before the rollout errors."""
    interception_host: str = "127.0.0.1"
    """Where the interception server listens (started only for harnesses that are separate
    programs talking to the model over the OpenAI API)."""
    interception_port: int = Field(0, ge=0, le=65535)
    """Its port (0 = a free one)."""
    max_model_len: int | None = Field(None, ge=1)
    """The context length inference serves (its ``max_model_len``); model calls fit in it
    and in the model's own (config.json). ``treadle stack``/``rl`` set it from
    ``inference.max_model_len``."""
    enable_thinking: bool | None = None
    """Qwen3: template variable enable_thinking for the generation prompt (None = template default)."""

    @property
    def replica_urls(self) -> list[str]:
        """The listed inference replicas' base URLs (inference_urls, else inference_url
        alone; with discovery, only what was set explicitly)."""
        if self.inference_discovery and "inference_url" not in self.model_fields_set:
            return list(self.inference_urls)
        return list(self.inference_urls) or [self.inference_url]

    @model_validator(mode="after")
    def _replicas(self) -> EnvRunnerSection:
        if self.inference_urls and "inference_url" in self.model_fields_set:
            raise ValueError("set env_runner.inference_urls or env_runner.inference_url, not both")
        bare = [u.rstrip("/") for u in self.inference_urls]
        if len(set(bare)) != len(bare):
            raise ValueError(f"env_runner.inference_urls repeats a URL: {self.inference_urls}")
        bad = [u for u in self.inference_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"env_runner.inference_urls: {bad[0]!r} is not an http(s):// URL")
        return self

    @field_validator("group_rewards")
    @classmethod
    def _group_rewards(cls, v: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
        from treadle.env_runner.group_rewards import from_spec

        for env, specs in v.items():
            for i, spec in enumerate(specs):
                try:
                    from_spec(spec)  # built to check it, thrown away
                except ValueError as e:
                    raise ValueError(f"env_runner.group_rewards.{env}[{i}]: {e}") from None
        return v

    @field_validator("runtimes")
    @classmethod
    def _runtimes(cls, v: dict[str, Any]) -> dict[str, Any]:
        from treadle.env_runner.runtimes import make_runtime

        for env, spec in v.items():
            try:
                make_runtime(spec)  # built to check it, thrown away
            except ValueError as e:
                raise ValueError(f"env_runner.runtimes.{env}: {e}") from None
        return v

    @field_validator("envs")
    @classmethod
    def _envs(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("env_runner.envs must name at least one environment")
        return [check_name(e, "environment name") for e in v]


class EnvRunnerConfig(ServiceConfig):
    """Everything the env runner reads: the shared sections and [env_runner]."""

    env_runner: EnvRunnerSection = Field(default_factory=EnvRunnerSection)


SPEC = ServiceSpec(
    name="env_runner",
    summary="runs environments (task set x harness x runtime) and publishes rollouts",
    config_cls=EnvRunnerConfig,
    module="treadle.env_runner",
    control=env_runner_service_pb2.DESCRIPTOR.services_by_name["EnvRunnerControl"],
    stub=env_runner_service_pb2_grpc.EnvRunnerControlStub,
)
