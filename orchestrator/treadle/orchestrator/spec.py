"""The orchestrator service's config class and spec (light: no heavy imports here)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from treadle.orchestrator.tasks import load_tasks
from treadle.proto.v1 import orchestrator_service_pb2, orchestrator_service_pb2_grpc
from treadle.services.errors import ConfigError
from treadle.services.registry import ServiceSpec
from treadle.services.sections import GrpcSection, ServiceConfig, StrictModel, check_name

log = logging.getLogger(__name__)

DEFAULT_GRPC_PORT = 50063


class SamplingSection(StrictModel):
    """[orchestrator.sampling]: how env runners sample from the policy."""

    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Keep the top_k tokens (0 = disabled)."""
    max_tokens: int = Field(256, ge=1)
    """Sampled tokens per model call."""


class FilterSection(StrictModel):
    """[orchestrator.filter]: online difficulty filtering of completed groups
    (treadle.orchestrator.filtering)."""

    action: Literal["keep", "drop", "resample"] = "keep"
    """What a refused group does: 'keep' trains it anyway (refusals are only counted),
    'drop' trains the step without it, 'resample' replaces it by a new group before the
    step's batch is cut."""
    zero_variance: bool = True
    """Refuse a group whose trainable rollouts all got the same reward (every baseline
    advantage would be 0)."""
    pass_reward: float = 1.0
    """A rollout passes when its reward is >= this (for the pass-rate band)."""
    min_pass_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Refuse a group whose fraction of passing rollouts is below this."""
    max_pass_rate: float = Field(1.0, ge=0.0, le=1.0)
    """Refuse a group whose fraction of passing rollouts is above this."""
    max_refused_in_a_row: int = Field(256, ge=1)
    """'resample': stop with a clear error after this many refused groups in a row (the
    tasks are all too easy or too hard for the policy)."""

    @model_validator(mode="after")
    def _checks(self) -> FilterSection:
        if self.min_pass_rate > self.max_pass_rate:
            raise ValueError(
                f"orchestrator.filter.min_pass_rate = {self.min_pass_rate} is above "
                f"max_pass_rate = {self.max_pass_rate}: no group could be trained"
            )
        return self


class EvalSamplingSection(StrictModel):
    """[orchestrator.eval.sampling]: how evaluation rollouts sample; unset fields take
    [orchestrator.sampling]'s value, except temperature (greedy unless set)."""

    temperature: float = Field(0.0, ge=0)
    """Sampling temperature (0 = greedy). Use > 0 with rollouts_per_task > 1 for a
    meaningful pass@k."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling mass (default: orchestrator.sampling.top_p)."""
    top_k: int | None = Field(None, ge=0)
    """Keep the top_k tokens, 0 = disabled (default: orchestrator.sampling.top_k)."""
    max_tokens: int | None = Field(None, ge=1)
    """Sampled tokens per model call (default: orchestrator.sampling.max_tokens)."""

    def resolved(self, training: SamplingSection) -> SamplingSection:
        """The sampling settings eval rollouts are requested with."""
        return SamplingSection(
            temperature=self.temperature,
            top_p=training.top_p if self.top_p is None else self.top_p,
            top_k=training.top_k if self.top_k is None else self.top_k,
            max_tokens=training.max_tokens if self.max_tokens is None else self.max_tokens,
        )


class EvalSection(StrictModel):
    """[orchestrator.eval]: evaluation during training (treadle.orchestrator.evaluation).
    Every ``every_steps`` steps the held-out ``tasks`` run against the policy inference
    serves; the results are a metrics row of ``eval/`` keys at that step and the rollouts
    in the object store's ``eval/step-<N>.jsonl``. Eval rollouts are never trained."""

    every_steps: int = Field(0, ge=0)
    """Evaluate after every this many trainer steps (and after the last step); 0 = off."""
    tasks: Path | None = None
    """JSONL file of held-out tasks (required when every_steps > 0)."""
    num_tasks: int | None = Field(None, ge=1)
    """Evaluate the first N tasks of the file (default: all)."""
    rollouts_per_task: int = Field(1, ge=1)
    """k rollouts per task; pass@1 .. pass@k are reported."""
    env: str | None = None
    """Environment the eval rollouts run in (default: orchestrator.env; with several
    environments and orchestrator.env unset, the first of orchestrator.envs); the env
    runners must serve it."""
    at_start: bool = True
    """Also evaluate the initial policy (step 0) before any training step lands."""
    pass_reward: float = 1.0
    """A rollout passes (for pass@k) when its reward is >= this."""
    sampling: EvalSamplingSection = Field(default_factory=EvalSamplingSection)
    """Sampling of eval rollouts (default: greedy, the rest as orchestrator.sampling)."""

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0

    @model_validator(mode="after")
    def _checks(self) -> EvalSection:
        if not self.enabled:
            return self
        if self.tasks is None:
            raise ValueError(
                f"orchestrator.eval.every_steps = {self.every_steps} needs orchestrator.eval.tasks "
                "(a JSONL file of held-out tasks)"
            )
        if self.env is not None:
            check_name(self.env, "orchestrator.eval.env")
        try:
            num = len(load_tasks(self.tasks))
        except ConfigError as e:
            raise ValueError(f"orchestrator.eval.tasks: {e}") from None
        if self.num_tasks is not None and self.num_tasks > num:
            raise ValueError(
                f"orchestrator.eval.num_tasks = {self.num_tasks}, but {self.tasks} holds "
                f"{num} tasks"
            )
        return self


class TeacherSection(StrictModel):
    """[orchestrator.teacher]: the teacher of on-policy distillation
    (treadle.orchestrator.teacher): another inference deployment, sharing the student's
    tokenizer, that scores the student's sampled tokens for the algorithms that ask for
    ``teacher_logprobs`` or ``teacher_topk`` ('distill', 'grpo+distill', 'distill-topk',
    'grpo+distill-topk', or a plug-in). Off while ``urls`` and
    ``checkpoint`` are unset. ``checkpoint``: `treadle rl` starts the teacher's inference
    itself (a fixed model beside the student's); ``urls``: a teacher served elsewhere (e.g.
    `treadle serve inference` with the teacher's model and ``follow_policy = false``).
    Self-distillation (``self_distill = true``): the teacher is the policy itself, scoring
    the student's tokens after each branch's prompt rendered with the environment's
    privileged context (``Environment(privileged=...)``, e.g. the answer)."""

    urls: list[str] = Field(default_factory=list)
    """HTTP base URL(s) of the teacher's inference server(s) (vLLM's OpenAI server with
    /v1/completions, or at least its token route /inference/v1/generate, e.g. a Treadle
    inference service); several: calls go round robin, a retry to the next one."""
    checkpoint: Path | None = None
    """A local model folder (the teacher's weights and tokenizer) that the launcher serves
    as the teacher: `treadle rl` starts an inference service of its own on it (vLLM, fixed:
    it never loads the policy's weights, ``inference.follow_policy = false``), beside the
    student's, with [inference]'s engine settings, and sets ``urls`` and ``model`` to it.
    An orchestrator started alone cannot start it: serve the model and set ``urls``."""
    self_distill: bool = False
    """The teacher is the policy being trained, given the environment's privileged context
    in its prompt: served by the student's own inference (``student_url``, which `treadle
    rl` sets) unless ``urls`` name other servers of the same policy. Needs environments
    with ``privileged`` context (a group without it stops the run, naming the environment)."""
    model: str | None = None
    """The teacher's served model name, sent with each request and named in errors
    (default: the server's only model)."""
    student_url: str | None = None
    """HTTP base URL of the student's inference server, which the startup tokenizer check
    compares the teacher with. `treadle rl` sets it to the inference it starts."""
    check_tokenizer: bool = True
    """Before the run starts, prove that teacher and student share one tokenizer and
    vocabulary (probe texts tokenized alike, token ids detokenized alike, the student's
    last token id in the teacher's vocabulary); a mismatch stops the run with an error
    naming both. false: trust it (logged as a warning at startup)."""
    timeout_s: float = Field(120.0, gt=0)
    """Deadline of one teacher call (one request: the call's sequences' prompt logprobs)."""
    max_retries: int = Field(2, ge=0)
    """A teacher call that fails (unreachable, timed out, an answer against the contract)
    is retried this many times; then its group is refused (counted, not trained). A request
    the teacher refuses (HTTP 4xx) is not retried."""
    max_sequences_per_call: int = Field(64, ge=1)
    """Sequences (samples) sent in one teacher call: one /v1/completions request."""
    max_tokens_per_call: int = Field(65536, ge=16)
    """Tokens sent together in one teacher call (a longer sequence is a call of its own)."""
    max_calls_in_flight: int = Field(4, ge=1)
    """Teacher calls outstanding at once."""
    top_k: int = Field(8, ge=1, le=20)
    """Algorithms that ask for ``teacher_topk`` ('distill-topk', 'grpo+distill-topk'): the
    teacher's ``top_k`` most likely tokens at each sampled token (vLLM's prompt logprobs;
    a vLLM answers at most its ``--max-logprobs``, 20 unless set)."""
    score_ahead: bool = True
    """Score each group as soon as it completes, while the trainer trains and other groups
    sample (the batch is then cut without waiting for the teacher). false: when its batch
    is cut (self-distillation's teacher is then the newest policy served by then)."""

    @field_validator("checkpoint")
    @classmethod
    def _model_folder(cls, v: Path | None) -> Path | None:
        if v is None:
            return None
        path = v.expanduser()
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise ValueError(
                f"{str(v)!r} is not a local model folder (config.json and *.safetensors "
                "weights): the teacher's inference serves it"
            )
        return path.resolve()

    @field_validator("urls", mode="before")
    @classmethod
    def _one_or_more(cls, v: object) -> object:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @property
    def enabled(self) -> bool:
        return bool(self.urls) or self.self_distill or self.checkpoint is not None

    @property
    def servers(self) -> list[str]:
        """The teacher's endpoints: ``urls``, else (self-distillation) the student's."""
        if self.urls:
            return list(self.urls)
        return [self.student_url] if self.self_distill and self.student_url else []

    @model_validator(mode="after")
    def _checks(self) -> TeacherSection:
        for what, url in [*(("urls", u) for u in self.urls), ("student_url", self.student_url)]:
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"orchestrator.teacher.{what}: {url!r} is not an http(s):// URL (the "
                    "teacher's HTTP port, where vLLM serves /inference/v1/generate)"
                )
        if self.checkpoint is not None and self.self_distill:
            raise ValueError(
                "orchestrator.teacher.checkpoint names another model as the teacher, "
                "self_distill = true makes the policy its own: set one or the other"
            )
        student = _endpoint(self.student_url) if self.student_url else None
        for url in self.urls:
            if (not self.self_distill and self.model is None and student is not None
                    and _endpoint(url) == student):  # fmt: skip
                raise ValueError(
                    f"orchestrator.teacher.urls: {url!r} is the student's own inference server "
                    f"(student_url {self.student_url!r}): the teacher would be the policy being "
                    "trained, its logprobs the student's, every distillation advantage 0. Point "
                    "urls at the teacher's own deployment, name another model that server "
                    "serves (orchestrator.teacher.model, e.g. the base of a LoRA run), or set "
                    "self_distill = true to teach the policy with privileged context"
                )
        return self


def _endpoint(url: str) -> tuple[str, str, int | None, str]:
    """An http(s) URL as (scheme, host, port, path), so that two spellings of one server
    compare equal: the host's case, a default port, "localhost" for 127.0.0.1, a trailing /."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    host = "127.0.0.1" if host == "localhost" else host
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:  # a port that is not a number: compared as written
        return (parts.scheme, host, None, url)
    return (parts.scheme, host, port, parts.path.rstrip("/"))


class DemosSection(StrictModel):
    """[orchestrator.demos]: demonstrations in an RL run. Every batch the run cuts also
    carries ``samples_per_step`` conversations of a chat dataset (e.g. a teacher's answers
    kept by rejection sampling: `treadle rl` with ``[sft_data] env`` set samples them first
    and points ``data`` at them), trained by cross-entropy on what the assistant says, in
    the same optimizer step as the sampled tokens (demos.py)."""

    data: Path | None = None
    """The conversations: a messages JSONL file or a local Hugging Face dataset (as
    ``treadle sft`` reads, chat_data.py); every row is checked and rendered with
    orchestrator.tokenizer before the run starts. Unset: no demonstrations."""
    samples_per_step: int = Field(32, ge=1)
    """Conversations added to each batch (a seeded shuffle, epoch after epoch)."""
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Weight of the cross-entropy per demonstrated token, in the step's per-token mean
    beside the sampled tokens' terms."""

    @property
    def enabled(self) -> bool:
        return self.data is not None


class EnvSection(StrictModel):
    """[orchestrator.envs.<env>]: one environment of the run, with settings that override
    the run's. A run with several environments lists each here with its ``tasks`` (and
    ``weight``); a table without ``tasks`` only overrides the algorithm of the run's one
    environment (orchestrator.env)."""

    tasks: Path | None = None
    """JSONL file of this environment's tasks. Set on any table: the run's environments
    are the tables listed here, each sampled from its own task file with its own cursor
    (orchestrator.tasks is then unset)."""
    weight: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Sampling weight (> 0, default 1): each new group runs in this environment with
    probability weight / (sum of the run's weights)."""
    algorithm: str | None = None
    """This environment's algorithm (default: orchestrator.algorithm)."""
    algorithm_args: dict[str, Any] | None = None
    """Keyword arguments of this environment's algorithm (default: orchestrator.algorithm_args
    when the algorithm is the run's, else none)."""


@dataclass(frozen=True)
class RunEnv:
    """One environment of an RL run, as dispatch sees it."""

    name: str
    tasks: Path | None  # its JSONL task file (None: not configured yet, an error at run start)
    weight: float  # its share of new groups, relative to the run's other weights (> 0)
    setting: str  # the setting that names its task file, for errors


class OrchestratorSection(StrictModel):
    """[orchestrator]: the asynchronous RL loop (or the SFT data feed)."""

    grpc: GrpcSection = Field(default_factory=lambda: GrpcSection(port=DEFAULT_GRPC_PORT))
    """Control-plane endpoint (OrchestratorControl + health)."""
    mode: Literal["rl", "sft"] = "rl"
    """'rl': dispatch rollouts and build batches from them; 'sft': build batches from a dataset."""
    env: str = "reverse_text"
    """Environment name the rollouts run in (the env runners must serve it). With several
    environments (orchestrator.envs.<env>.tasks) it need not be set; when set, it must be
    one of them, and it is the default of orchestrator.eval.env."""
    tasks: Path | None = None
    """JSONL file of tasks (one JSON object per line; an 'id' field is used when present).
    RL: the task set sampled from. SFT: the conversations trained on ('messages' and
    optional 'tools' per row): a JSONL file or a local Hugging Face dataset (a save_to_disk
    folder, a folder of data files, a .parquet/.arrow file; needs the 'datasets' extra),
    every row checked before training (treadle.orchestrator.chat_data)."""
    max_steps: int = Field(100, ge=1)
    """Trainer steps to produce batches for; the orchestrator stops after the last one."""
    group_size: int = Field(8, ge=1)
    """Rollouts per task (the group that shares an advantage baseline)."""
    groups_per_step: int = Field(4, ge=1)
    """Groups (tasks) whose rollouts make up one trainer step's batch."""
    max_groups_in_flight: int = Field(8, ge=1)
    """Groups dispatched and not yet complete, at most (continuous batching)."""
    max_async_level: int = Field(1, ge=0)
    """Rollouts for step s may use a policy at most this many versions older than s - 1."""
    max_off_policy_steps: int = Field(2, ge=0)
    """Samples whose oldest token is older than this (vs step s - 1) are dropped and counted."""
    algorithm: str = "grpo"
    """How a completed group becomes per-token advantages: a built-in ('grpo': group-mean
    baseline, 'rloo': leave-one-out baseline, 'sft': 1) or a 'package.module:function'
    path (treadle.orchestrator.algorithms)."""
    algorithm_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the algorithm, e.g. {normalize = true} for grpo (divide by the
    group's reward standard deviation)."""
    envs: dict[str, EnvSection] = Field(default_factory=dict)
    """The run's environments when there are several ([orchestrator.envs.<env>] with tasks,
    weight, and optionally algorithm, algorithm_args), in the order listed; without any
    ``tasks`` there: per-environment overrides of the one environment, orchestrator.env."""
    filter: FilterSection = Field(default_factory=FilterSection)
    """Online difficulty filtering of completed groups."""
    seq_len: int = Field(2048, ge=16)
    """Tokens per micro-batch (samples longer than this are truncated and flagged)."""
    num_ranks: int = Field(1, ge=1)
    """Trainer data-parallel ranks to pack for."""
    sft_samples_per_step: int = Field(32, ge=1)
    """SFT: conversations per trainer step."""
    pad_token_id: int = Field(0, ge=0)
    """Token id written on padding positions."""
    seed: int = 0
    """Seed of the task shuffling (and, with several environments, of each group's
    environment draw)."""
    renderer: str = "auto"
    """SFT: chat renderer -- "auto" (a family port only for a chat template it is proven
    equal to, else the generic renderer), a port name, or "jinja"."""
    renderer_force: bool = False
    """SFT: use the named port even on a template it is not proven equal to (logged loudly)."""
    tokenizer: Path | None = None
    """SFT: tokenizer.json (or model folder) the conversations are rendered with."""
    inference_grpc: list[str] = Field(default_factory=list)
    """RL: host:port of the inference service's control plane (policy version for the
    gate); a list with several replicas: the gate uses the oldest version any replica
    that answers serves. Empty: the gate assumes inference follows the trainer."""
    inference_wait_s: float = Field(0.0, ge=0)
    """RL: before its first dispatch, wait up to this long for one of ``inference_grpc``
    to serve a policy (its status READY; a starting service answers STARTING); the
    launcher sets it when it starts the orchestrator while inference is still starting.
    Then dispatch regardless. 0: dispatch at once."""
    inference_discovery: bool = False
    """RL: also ask the inference replicas announced in the run's NATS bucket
    (``[inference] announce = true``) for their policy version, as they come and go;
    while none is listed or announced, the gate assumes inference follows the trainer."""
    rollout_timeout_s: float = Field(600.0, gt=0)
    """Wall-clock budget of one rollout, passed to env runners."""
    warn_unserved_env_s: float | None = Field(None, ge=0)
    """Warn (naming it) when no rollout of an environment has completed this many seconds
    after its first request: no env runner may be serving it. Default: rollout_timeout_s
    + 60, by when even a rollout that ran out of time has completed. 0: never."""
    group_reward_timeout_s: float = Field(120.0, gt=0)
    """How long a complete group waits for an env runner to compute its group rewards
    (environments without group rewards answer at once: nobody serves the request)."""
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    """Sampling settings sent with every rollout request."""
    eval: EvalSection = Field(default_factory=EvalSection)
    """Evaluation during training on held-out tasks (off unless eval.every_steps > 0)."""
    teacher: TeacherSection = Field(default_factory=TeacherSection)
    """The teacher of on-policy distillation (off unless teacher.checkpoint, teacher.urls
    or teacher.self_distill is set)."""
    demos: DemosSection = Field(default_factory=DemosSection)
    """Demonstrations trained by cross-entropy in every RL batch (off unless demos.data
    is set)."""
    status_poll_s: float = Field(0.5, gt=0)
    """How often the policy version served by inference is polled."""
    lease_ttl_s: float = Field(10.0, ge=1)
    """One orchestrator per run: the lease it renews in NATS expires this long after its
    holder stops renewing (a crashed orchestrator's restart waits at most this much longer)."""
    vocab_size: int | None = Field(None, ge=1)
    """RL: the policy model's vocabulary size; rollouts with a token id at or above it are
    refused before batching. `treadle stack`/`rl` set it from trainer.model's (else
    inference.model's) config.json. Unset: only negative ids are refused here, and the
    trainer skips a batch whose ids fall outside its vocabulary."""

    @field_validator("inference_grpc", mode="before")
    @classmethod
    def _one_or_more(cls, v: object) -> object:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old in ("advantage", "normalize_advantage"):
                if old in data:
                    raise ValueError(
                        f"orchestrator.{old} was replaced: set orchestrator.algorithm = "
                        "'grpo' (or 'rloo', 'sft', 'package.module:function') and "
                        "orchestrator.algorithm_args = {normalize = true} for a normalized GRPO"
                    )
        return data

    @property
    def lists_envs(self) -> bool:
        """The run's environments are the [orchestrator.envs.<env>] tables (any has tasks),
        rather than orchestrator.env alone."""
        return any(e.tasks is not None for e in self.envs.values())

    def run_envs(self) -> list[RunEnv]:
        """The environments new groups are drawn from, in the order configured."""
        if not self.lists_envs:
            return [RunEnv(self.env, self.tasks, 1.0, "orchestrator.tasks")]
        return [
            RunEnv(
                name,
                e.tasks,
                1.0 if e.weight is None else e.weight,
                f"orchestrator.envs.{name}.tasks",
            )
            for name, e in self.envs.items()
        ]

    @property
    def env_names(self) -> list[str]:
        """Names of the run's training environments, in the order configured."""
        return [e.name for e in self.run_envs()]

    @property
    def default_env(self) -> str:
        """The environment orchestrator.eval.env defaults to: orchestrator.env, or with
        several environments and orchestrator.env unset, the first one listed."""
        if self.lists_envs and "env" not in self.model_fields_set:
            return self.env_names[0]
        return self.env

    def served_envs(self) -> list[str]:
        """Every environment this orchestrator requests rollouts of (the env runners must
        serve each): the training environments, then the eval environment if it is another."""
        names = self.env_names
        if self.mode == "rl" and self.eval.enabled:
            names += [self.eval.env or self.default_env]
        return list(dict.fromkeys(names))

    def algorithm_setting(self, env: str) -> tuple[str, dict[str, Any], str]:
        """(algorithm, its args, the setting that chose them) of environment ``env``."""
        over = self.envs.get(env) or EnvSection()
        if over.algorithm is None:  # the run's algorithm
            if over.algorithm_args is None:
                return self.algorithm, dict(self.algorithm_args), "orchestrator.algorithm"
            return (
                self.algorithm,
                dict(over.algorithm_args),
                f"orchestrator.envs.{env}.algorithm_args",
            )
        return over.algorithm, dict(over.algorithm_args or {}), f"orchestrator.envs.{env}.algorithm"

    def resolve_algorithms(self) -> dict[str, Any]:
        """env -> its resolved ``algorithms.Algorithm`` (ConfigError naming the setting)."""
        from treadle.orchestrator.algorithms import resolve  # numpy, user code: not at import

        out = {}
        for env in self.env_names:
            name, args, where = self.algorithm_setting(env)
            out[env] = resolve(name, args, where)
        return out

    def wants_teacher(self) -> bool:
        """Whether an algorithm of this run asks for teacher logprobs."""
        return any(a.asks_teacher for a in self.resolve_algorithms().values())

    @model_validator(mode="after")
    def _checks(self) -> OrchestratorSection:
        check_name(self.env, "orchestrator.env")
        for env in self.envs:
            check_name(env, f"orchestrator.envs.{env}")
        if self.lists_envs:
            self._check_listed_envs()
        else:
            for env, section in self.envs.items():
                if env != self.env:
                    raise ValueError(
                        f"orchestrator.envs.{env}: this run's environment is {self.env!r} "
                        "(orchestrator.env); to run several environments give each of them "
                        "its task file, orchestrator.envs.<env>.tasks"
                    )
                if section.weight is not None:
                    log.warning("orchestrator.envs.%s.weight is ignored: the run has one "
                                "environment (orchestrator.envs.<env>.tasks lists several)",
                                env)  # fmt: skip
        if self.mode == "rl":
            wants_teacher = False
            for env, algo in self.resolve_algorithms().items():
                if self.group_size < algo.min_rollouts:
                    raise ValueError(
                        f"{algo.setting} = {algo.name!r} (environment {env!r}) needs groups of "
                        f"at least {algo.min_rollouts} rollouts; orchestrator.group_size is "
                        f"{self.group_size}"
                    )
                if algo.asks_teacher:
                    wants_teacher = True
                    if not self.teacher.enabled:
                        raise ValueError(
                            f"{algo.setting} = {algo.name!r} (environment {env!r}) needs a "
                            "teacher: set orchestrator.teacher.checkpoint to the teacher's "
                            "model folder (`treadle rl` serves it), orchestrator.teacher.urls "
                            "to the teacher's inference HTTP URL(s), or "
                            "orchestrator.teacher.self_distill = true"
                        )
            if self.teacher.enabled and not wants_teacher:
                log.warning("orchestrator.teacher is set but no algorithm of this run asks for "
                            "a teacher's signal (e.g. orchestrator.algorithm = 'distill'): the "
                            "teacher is not used")  # fmt: skip
            elif wants_teacher and self.sampling.temperature != 1.0:
                log.warning("orchestrator.sampling.temperature = %s with a teacher: the student's "
                            "logprobs are of the tempered distribution, the teacher's are not; "
                            "the reverse-KL estimate is biased (distill at temperature 1)",
                            self.sampling.temperature)  # fmt: skip
        if self.demos.enabled:
            if self.mode != "rl":
                raise ValueError(
                    f"orchestrator.demos.data = {str(self.demos.data)!r}: demonstrations go "
                    f"into RL batches (orchestrator.mode = 'rl'), not {self.mode!r}; an SFT "
                    "run trains orchestrator.tasks"
                )
            if self.tokenizer is None:
                raise ValueError(
                    "orchestrator.demos.data needs orchestrator.tokenizer (the policy's "
                    "tokenizer folder, as env_runner.tokenizer) to render the demonstrations"
                )
        if self.eval.enabled and self.mode != "rl":
            raise ValueError(
                f"orchestrator.eval.every_steps = {self.eval.every_steps}: evaluation during "
                f"training runs in RL runs (orchestrator.mode = 'rl'), not {self.mode!r}"
            )
        if self.max_groups_in_flight < self.groups_per_step and self.max_async_level > 0:
            raise ValueError("max_groups_in_flight must be >= groups_per_step")
        return self

    def _check_listed_envs(self) -> None:
        """Several environments ([orchestrator.envs.<env>] with tasks): every table is one
        of them with a task file that loads; orchestrator.tasks unset, orchestrator.env (if
        set) one of them."""
        if self.mode != "rl":
            raise ValueError(
                "orchestrator.envs.<env>.tasks: several environments are for RL runs "
                f"(orchestrator.mode = 'rl'), not {self.mode!r}; an SFT run reads orchestrator.tasks"
            )
        no_tasks = [env for env, e in self.envs.items() if e.tasks is None]
        if no_tasks:
            raise ValueError(
                f"orchestrator.envs.{no_tasks[0]} has no tasks, but other environments of "
                "orchestrator.envs do: with several environments each needs its task file "
                f"(orchestrator.envs.{no_tasks[0]}.tasks)"
            )
        if self.tasks is not None:
            raise ValueError(
                f"orchestrator.tasks = {str(self.tasks)!r} and orchestrator.envs.<env>.tasks "
                "are both set: a run has one environment (orchestrator.env, orchestrator.tasks) "
                "or several, each with its own task file (orchestrator.envs.<env>.tasks)"
            )
        if "env" in self.model_fields_set and self.env not in self.envs:
            raise ValueError(
                f"orchestrator.env = {self.env!r} is none of the run's environments "
                f"(orchestrator.envs: {', '.join(self.envs)}); leave it unset or name one of them"
            )
        for run_env in self.run_envs():
            assert run_env.tasks is not None
            try:
                load_tasks(run_env.tasks)
            except ConfigError as e:
                raise ValueError(f"{run_env.setting}: {e}") from None


class OrchestratorConfig(ServiceConfig):
    """Everything the orchestrator service reads: the shared sections and [orchestrator]."""

    orchestrator: OrchestratorSection = Field(default_factory=OrchestratorSection)


SPEC = ServiceSpec(
    name="orchestrator",
    summary="runs the asynchronous RL loop: dispatch, group, score, pack, publish batches",
    config_cls=OrchestratorConfig,
    module="treadle.orchestrator",
    control=orchestrator_service_pb2.DESCRIPTOR.services_by_name["OrchestratorControl"],
    stub=orchestrator_service_pb2_grpc.OrchestratorControlStub,
)
