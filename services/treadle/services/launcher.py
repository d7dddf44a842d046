"""The local launcher: one command starts the whole stack on one machine.

    embedded nats-server (unless nats.url is set)
      └─▶ inference + trainer ─▶ orchestrator + env_runner   (the job's services in two
          stages, each stage's side by side: ``start_stages``)
          each: `python -m <service> @ <run files> --nats.url .. --<svc>.grpc.port .. <wiring>`,
          a stage healthy (gRPC health SERVING) before the next starts; an ``rl`` launch
          starts the second once the trainer is (``inference_started_later``)
      └─▶ follow METRICS: outputs/<run>/metrics.jsonl + one progress line per trainer step

Jobs: ``stack`` (every installed service, runs until Ctrl-C), ``rl`` (all four; done
when the trainer finishes its last step), ``sft`` (trainer + orchestrator in SFT mode).
Wiring the launcher adds: inference's HTTP port, the env runners' inference URL and
the orchestrator's inference control address, all on free loopback ports (with
``launcher.inference_replicas`` > 1: one inference service per replica, started side by
side, and every replica's URL and control address); and, unless
the run sets it, the orchestrator's vocab_size from the policy model's config.json
(trainer.model, else inference.model), so rollouts with token ids outside the
vocabulary are refused before batching.

On a machine without a GPU, ``rl`` splits the CPUs (see ``cpu_split_env``): the trainer
gets half to itself, vLLM and the lighter services share the other half. Both vLLM and
the trainer are CPU-bound, and two OpenMP pools on the same cores stall each other
(reverse-text on 2 cores: 4.1 s per step shared, 3.5 s split).

Security (``launcher.secure``, on by default): each launch writes the run's credentials
(``credentials.py``: a CA and certificate, a control token, one NATS user per role) to
``outputs/<run>/credentials/`` (0700, files 0600), starts the embedded nats-server with
TLS and those users only, creates the streams as the admin user, and hands each child
its own files by path in its environment. gRPC servers then serve TLS and want the
token. Secrets given as flags (``--object_store.secret_key``, a URL with a password)
reach children as ``TREADLE_*`` environment variables, never on their command line.

Children log to ``outputs/<run>/logs/<name>.log`` (0600); the resolved config (secrets
masked) goes to ``outputs/<run>/config.toml`` and the stack's pids/ports to ``stack.json``.
When a child dies the launcher stops the others and exits non-zero with that child's
last log lines; Ctrl-C stops everything in reverse order.

Not here: what the services do once up (the RL loop lives in the orchestrator).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from treadle.proto.v1 import common_pb2
from treadle.services.bus import Bus
from treadle.services.config import (
    ENV_LEVEL_SEP,
    ENV_PREFIX,
    ConfigSources,
    gather,
    to_toml,
    validate,
)
from treadle.services.credentials import RunCredentials, generate, private_dir, write_secret
from treadle.services.errors import ChildFailedError, ConfigError
from treadle.services.host import CPUS_ENV
from treadle.services.metric_sinks import close_sinks, open_run_sinks
from treadle.services.model_folder import vocab_size as model_vocab_size
from treadle.services.nats_auth import make_work_queue_consumers
from treadle.services.nats_server import EmbeddedNats
from treadle.services.ports import free_port
from treadle.services.redact import (
    is_secret_key,
    redact_urls,
    register_config_secrets,
    url_password,
)
from treadle.services.registry import (
    KNOWN_SERVICES,
    LAUNCHER_SECTION,
    ServiceSpec,
    installed_services,
    known_sections,
)
from treadle.services.rpc import ControlSecurity, check_health, configure_clients, open_channel
from treadle.services.sections import ControlSection, NatsSection, ServiceConfig, StrictModel
from treadle.services.supervisor import ManagedProcess, Supervisor

log = logging.getLogger(__name__)


class LauncherSection(StrictModel):
    """[launcher]: how the local launcher runs the stack."""

    services: list[str] | None = None
    """Services to start, e.g. ["env_runner"]; default: every installed service."""
    health_timeout_s: float = Field(120.0, gt=0)
    """Seconds a child may take to report SERVING before the launch fails (N inference
    replicas start side by side and get N times as long)."""
    stop_grace_s: float = Field(15.0, ge=0)
    """Seconds a child gets after SIGTERM before SIGKILL."""
    secure: bool = True
    """Generate the run's credentials: the embedded nats-server requires TLS and one nkey
    user per service (with its permissions), gRPC serves TLS and wants a token. false:
    an open bus and a plaintext control plane, for debugging only."""
    inference_replicas: int = Field(1, ge=1)
    """rl/stack: inference replicas to start, each its own service and vLLM on its own
    ports; env runners spread model calls over them and the orchestrator's gate follows
    the oldest version any of them serves. On a CPU machine they share the CPUs: two
    replicas on 2 cores exercise the replica routing and failover, they do not go faster.
    On a GPU machine each would try to take the same GPU: start replicas there with
    `treadle serve inference` per device instead."""
    split_cpus: bool = True
    """rl on a machine without a GPU: give vLLM and the trainer half of the CPUs each
    (OpenMP threads, vLLM's core binding) instead of both using all of them. Off when
    OMP_NUM_THREADS or VLLM_CPU_OMP_THREADS_BIND is already set."""
    helper_cpus: Literal["all", "generation", "training"] = "all"
    """With split_cpus: where the orchestrator and the env runners run: on any CPU (the
    kernel places them where there is room), on vLLM's CPUs only, or on the trainer's.
    On 2 cores "all" made steps 1.17-1.22x faster than "generation" (benchmarks/
    cpu_schedule.py): generation sets the pace, and the trainer's CPU has room while it
    waits for a batch."""
    teacher_cpus: Literal["generation", "training"] = "generation"
    """With split_cpus, where the distillation teacher that `treadle rl` serves
    (``[orchestrator.teacher] checkpoint``) runs: on vLLM's CPUs, beside the student's
    sampling, or on the trainer's (vLLM's threads bound there: left alone, vLLM binds the
    first cores). On 2 cores "generation" trained 1.14x the steps of "training" in the same
    time (69.7 vs 61.3, 3 seeds, benchmarks/distillation.py --teacher-cpus
    training,generation): on the trainer's CPU the teacher's calls lengthen every trainer
    step (3.06 vs 2.52 s); on generation's they cost the student's sampling less."""


class LauncherConfig(ServiceConfig):
    """Config of the local launcher (`treadle rl`, `treadle sft`, `treadle stack`)."""

    launcher: LauncherSection = Field(default_factory=LauncherSection)


@dataclass
class Launched:
    spec: ServiceSpec
    pid: int
    target: str
    name: str = ""  # the child's name (inference replicas: inference-1, inference-2, ...)

    def __post_init__(self) -> None:
        self.name = self.name or self.spec.name


# services of each job (order = start order); "stack" runs every installed service
JOB_SERVICES = {
    "rl": ["inference", "trainer", "orchestrator", "env_runner"],
    "sft": ["trainer", "orchestrator"],
}


# started first, side by side: neither needs the other, and the trainer's start (imports,
# model build: about 9 s on 2 cores) then hides behind vLLM's (about 30 s)
FIRST_STAGE = ("inference", "trainer")


def start_stages(names: list[str]) -> list[list[str]]:
    """The order the launcher starts ``names`` in, as stages whose services start side by
    side, each stage once the one before is healthy: inference and the trainer first, then
    the rest (the orchestrator asks inference for the version it serves and the env
    runners call it, so they start once it answers -- or see ``inference_started_later``)."""
    first = [n for n in names if n in FIRST_STAGE]
    rest = [n for n in names if n not in FIRST_STAGE]
    return [stage for stage in (first, rest) if stage]


def inference_started_later(job: str, names: list[str], *, replicas: int, teacher: bool) -> bool:
    """Whether an ``rl`` launch starts its second stage once the trainer is healthy,
    while inference is still starting (vLLM takes longest; the orchestrator and env
    runners then start on the trainer's idle CPU instead of after vLLM): its orchestrator
    waits for inference to answer before it dispatches (``orchestrator.inference_wait_s``),
    and env runners call inference only for what is dispatched. Not with several replicas
    (an env runner could call one still starting) nor a launched teacher (the
    orchestrator checks its tokenizer before anything else)."""
    return (
        job == "rl"
        and {"inference", "trainer", "orchestrator"} <= set(names)
        and replicas == 1
        and not teacher
    )


# settings a job cannot run without (they have no embedded default: a model, a task file)
JOB_REQUIRES = {
    "rl": [
        ("inference", "model"),
        ("trainer", "model"),
        ("orchestrator", "tasks"),
        ("env_runner", "tokenizer"),
    ],
    "sft": [("trainer", "model"), ("orchestrator", "tasks"), ("orchestrator", "tokenizer")],
}


def _check_required(job: str, configs: list[tuple[ServiceSpec, ServiceConfig]]) -> None:
    by_name = {spec.name: cfg for spec, cfg in configs}
    missing = [
        f"{section}.{key}"
        for section, key in JOB_REQUIRES.get(job, [])
        if section in by_name and not _is_set(getattr(by_name[section], section), key)
    ]
    if missing:
        hint = ""
        if job == "rl" and "orchestrator.tasks" in missing:
            hint = "; several environments: orchestrator.envs.<env>.tasks for each instead"
        raise ConfigError(
            f"the {job} job needs {', '.join(missing)} (set them in a run file or as "
            f"--section.key flags; examples/reverse-text/{job}.toml shows a complete one{hint})"
        )


def _is_set(section: Any, key: str) -> bool:
    """A required setting is set (an orchestrator's task file: or one per environment, which
    the orchestrator's config allows in RL runs only)."""
    if getattr(section, key, None) is not None:
        return True
    return key == "tasks" and bool(getattr(section, "lists_envs", False))


def inference_lora_flags(configs: list[tuple[ServiceSpec, ServiceConfig]]) -> list[str]:
    """Flags that let the inference service of a launch serve the adapters its trainer
    publishes (trainer.lora.enabled): [inference.lora] enabled, and max_lora_rank at least
    the trainer's rank. Empty when the launch does not start both or the trainer trains
    every weight; a ConfigError when [inference.lora] was set to refuse them."""
    by_name: dict[str, Any] = {spec.name: spec_cfg for spec, spec_cfg in configs}
    if "inference" not in by_name or "trainer" not in by_name:
        return []
    lora = getattr(by_name["trainer"].trainer, "lora", None)
    serving = getattr(by_name["inference"].inference, "lora", None)
    if not getattr(lora, "enabled", False) or serving is None:
        return []
    assert lora is not None
    if "enabled" in serving.model_fields_set and not serving.enabled:
        raise ConfigError(
            "trainer.lora.enabled = true publishes LoRA adapters, but inference.lora.enabled "
            "= false would refuse every one: drop inference.lora.enabled (the launcher sets it)"
        )
    if "max_lora_rank" in serving.model_fields_set and serving.max_lora_rank < lora.rank:
        raise ConfigError(
            f"trainer.lora.rank = {lora.rank} is above inference.lora.max_lora_rank = "
            f"{serving.max_lora_rank}: inference would refuse every adapter; raise it or drop "
            "it (the launcher sets it)"
        )
    rank = (
        max(lora.rank, serving.max_lora_rank)
        if "max_lora_rank" in serving.model_fields_set
        else lora.rank
    )
    flags = ["--inference.lora.enabled", "true", "--inference.lora.max_lora_rank", str(rank)]
    base_model = getattr(by_name["trainer"].trainer, "base_model", None)
    if base_model is not None and serving.base_model is None:
        flags += ["--inference.lora.base_model", base_model]
    return flags


@dataclass(frozen=True)
class TeacherDeployment:
    """The distillation teacher a launch serves itself (``[orchestrator.teacher]
    checkpoint``): an inference service of its own on that model, fixed."""

    checkpoint: Path
    served_model_name: str

    def flags(self, http_port: int) -> list[str]:
        """The teacher's own settings, after the launch's config (which is the student's
        [inference]: its engine settings apply, its model, adapters and replica
        announcements do not)."""
        return ["--inference.model", str(self.checkpoint),
                "--inference.served_model_name", self.served_model_name,
                "--inference.http_port", str(http_port),
                "--inference.follow_policy", "false",
                "--inference.lora.enabled", "false",
                "--inference.announce", "false"]  # fmt: skip


def teacher_deployment(
    job: str, configs: list[tuple[ServiceSpec, ServiceConfig]], *, warn: bool = True
) -> TeacherDeployment | None:
    """The teacher this launch starts: ``[orchestrator.teacher] checkpoint`` of an RL
    orchestrator whose algorithm asks for teacher logprobs; None when there is none to
    start (with ``warn``, a checkpoint nothing uses is logged); a ConfigError when the
    launch cannot start it as asked."""
    by_name: dict[str, Any] = {spec.name: spec_cfg for spec, spec_cfg in configs}
    section = getattr(by_name.get("orchestrator"), "orchestrator", None)
    teacher = getattr(section, "teacher", None)
    if section is None or teacher is None or teacher.checkpoint is None:
        return None
    if teacher.urls:
        raise ConfigError(
            "orchestrator.teacher: checkpoint (a teacher this launch serves) and urls (a "
            "teacher served elsewhere) are both set: set one of them"
        )
    mode = job if job in JOB_SERVICES else section.mode
    if mode != "rl" or not section.wants_teacher():
        if not warn:
            return None
        log.warning("[startup] orchestrator.teacher.checkpoint is set but no algorithm of this "
                    "%s launch asks for teacher logprobs: the teacher is not started", job)  # fmt: skip
        return None
    if "inference" not in by_name:
        raise ConfigError(
            "orchestrator.teacher.checkpoint: the launcher starts the teacher as an inference "
            "service beside the launch's own, and this launch starts no inference service; "
            "add inference to launcher.services, or serve the teacher and set "
            "orchestrator.teacher.urls"
        )
    return TeacherDeployment(teacher.checkpoint, teacher.model or "teacher")


def resolve(
    sources: ConfigSources, job: str = "stack"
) -> tuple[LauncherConfig, list[tuple[ServiceSpec, ServiceConfig]]]:
    """Validate the launcher's config and every selected service's config up front."""
    raw = gather(sources)
    cfg = validate(LauncherConfig, raw, known_sections())
    installed = installed_services()
    if job in JOB_SERVICES:
        names = JOB_SERVICES[job]
    else:
        names = cfg.launcher.services if cfg.launcher.services is not None else list(installed)
    specs = []
    for name in names:
        if name not in installed:
            where = f"the {job} job needs" if job in JOB_SERVICES else "launcher.services:"
            if name in KNOWN_SERVICES:
                raise ConfigError(
                    f"{where} {name!r}, which is not installed (`pip install {KNOWN_SERVICES[name]}`)"
                )
            raise ConfigError(
                f"launcher.services: unknown service {name!r}; services are {', '.join(KNOWN_SERVICES)}"
            )
        specs.append(installed[name])
    # every service's config is validated before anything starts
    configs = [(spec, validate(spec.config_cls, raw, known_sections())) for spec in specs]
    _check_required(job, configs)
    inference_lora_flags(configs)  # a contradiction stops the launch before it starts
    teacher_deployment(job, configs, warn=False)  # likewise a teacher it cannot start
    _check_run_dir(cfg)
    return cfg, configs


def _check_run_dir(cfg: ServiceConfig) -> None:
    """The run folder can be a folder: the nearest part of it that exists is one."""
    run_dir = cfg.run.run_dir
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            if not path.is_dir():
                raise ConfigError(
                    f"run.output_dir = {str(cfg.run.output_dir)!r}: {path} is a file, so the "
                    f"run folder {run_dir} cannot be created"
                )
            return


def _make_run_dir(cfg: ServiceConfig) -> Path:
    """Create the run folder and its logs folder (0700); a ConfigError when it cannot be."""
    try:
        return private_dir(cfg.run.run_dir / "logs")
    except OSError as e:
        raise ConfigError(
            f"run.output_dir = {str(cfg.run.output_dir)!r}: cannot create the run folder "
            f"{cfg.run.run_dir} ({e.strerror})"
        ) from None


def resolved_toml(cfg: LauncherConfig, specs: list[tuple[ServiceSpec, ServiceConfig]]) -> str:
    """The whole resolved config of a launch (shared sections + each service's own
    section), secrets masked: what `--dry-run` prints and `outputs/<run>/config.toml` keeps."""
    parts = [to_toml(cfg)] + [to_toml(spec_cfg, only=[spec.name]) for spec, spec_cfg in specs]
    return "\n".join(parts)


async def _status_line(launched: Launched) -> str:
    """State and message reported by the service's GetStatus."""
    async with open_channel(
        launched.target, [launched.spec.control], default_timeout_s=3.0
    ) as channel:
        stub = launched.spec.stub(channel)
        status = await stub.GetStatus(common_pb2.GetStatusRequest())
    state = common_pb2.ServiceState.Name(status.info.state).removeprefix("SERVICE_STATE_")
    return f"{state}{': ' + status.info.message if status.info.message else ''}"


def _section_fields(spec: ServiceSpec) -> set[str]:
    """Field names of a service's own config section (for wiring flags it understands)."""
    section = spec.config_cls.model_fields[spec.name].annotation
    return set(getattr(section, "model_fields", {}))


def orchestrator_vocab_size(specs: list[tuple[ServiceSpec, ServiceConfig]]) -> int | None:
    """The vocabulary size to hand the orchestrator: the policy model's (trainer.model,
    else inference.model), unless the orchestrator's config sets one (kept, with a
    warning when it differs) or no model folder of this launch tells it."""
    by_name: dict[str, Any] = {spec.name: spec_cfg for spec, spec_cfg in specs}
    if "orchestrator" not in by_name:
        return None
    known, source = None, ""
    for name in ("trainer", "inference"):
        model = getattr(getattr(by_name.get(name), name, None), "model", None)
        if model is not None and (known := model_vocab_size(model)) is not None:
            source = f"{name}.model"
            break
    configured = getattr(by_name["orchestrator"].orchestrator, "vocab_size", None)
    if configured is not None:
        if known is not None and configured != known:
            log.warning(
                "[startup] orchestrator.vocab_size = %d, but %s has a vocabulary of %d: "
                "token ids are checked against %d",
                configured, source, known, configured,
            )  # fmt: skip
        return None
    if known is not None:
        log.info(
            "[startup] orchestrator.vocab_size = %d (%s): rollouts with token ids outside "
            "it are refused", known, source,
        )  # fmt: skip
    return known


def orchestrator_num_ranks(specs: list[tuple[ServiceSpec, ServiceConfig]]) -> int | None:
    """The trainer ranks the orchestrator packs each batch for: the world size of the
    trainer this launch starts (trainer.distributed), unless the orchestrator's config sets
    num_ranks (kept when equal; a ConfigError when not, since the trainer would refuse
    every batch) or the launch starts no trainer."""
    by_name: dict[str, Any] = {spec.name: spec_cfg for spec, spec_cfg in specs}
    if "orchestrator" not in by_name or "trainer" not in by_name:
        return None
    distributed = getattr(by_name["trainer"].trainer, "distributed", None)
    world = getattr(distributed, "world_size", None)
    orchestrator = by_name["orchestrator"].orchestrator
    if not isinstance(world, int) or not hasattr(orchestrator, "num_ranks"):
        return None
    if "num_ranks" in orchestrator.model_fields_set:
        if orchestrator.num_ranks != world:
            raise ConfigError(
                f"orchestrator.num_ranks = {orchestrator.num_ranks}, but the trainer runs "
                f"{world} ranks (trainer.distributed: nproc_per_node x nnodes): the trainer "
                "would refuse every batch; drop orchestrator.num_ranks (the launcher sets it) "
                "or make them equal"
            )
        return None
    if world != orchestrator.num_ranks:
        log.info("[startup] orchestrator.num_ranks = %d (trainer.distributed)", world)
        return world
    return None


def env_runner_envs(specs: list[tuple[ServiceSpec, ServiceConfig]]) -> list[str] | None:
    """The environments to hand the env runner this launch starts: every environment the
    orchestrator requests rollouts of (its training environments, then its eval
    environment), unless env_runner.envs is set (kept; a ConfigError when it lacks one of
    them, whose requests nobody would take) or the launch starts not both, or the runner
    already serves exactly those."""
    by_name: dict[str, Any] = {spec.name: spec_cfg for spec, spec_cfg in specs}
    if "orchestrator" not in by_name or "env_runner" not in by_name:
        return None
    orchestrator = by_name["orchestrator"].orchestrator
    served = getattr(orchestrator, "served_envs", None)
    if served is None or getattr(orchestrator, "mode", "rl") != "rl":
        return None
    if getattr(orchestrator, "tasks", None) is None and not orchestrator.lists_envs:
        return None  # an orchestrator with nothing to dispatch (e.g. a `treadle stack` for eval)
    wanted: list[str] = served()
    runner = by_name["env_runner"].env_runner
    if "envs" in runner.model_fields_set:
        missing = [env for env in wanted if env not in runner.envs]
        if missing:
            raise ConfigError(
                f"env_runner.envs = {list(runner.envs)} does not serve {', '.join(missing)}, "
                "which the orchestrator requests rollouts of (orchestrator.env / "
                "orchestrator.envs / orchestrator.eval.env): no env runner of this launch would "
                "take those requests; add them to env_runner.envs or drop env_runner.envs (the "
                "launcher sets it)"
            )
        return None
    if wanted == list(runner.envs):
        return None
    log.info("[startup] env_runner.envs = %s (the orchestrator's environments)", wanted)
    return wanted


def _wiring(
    spec: ServiceSpec,
    job: str,
    ports: dict[str, Any],
    *,
    vocab_size: int | None = None,
    num_ranks: int | None = None,
    runner_envs: list[str] | None = None,
) -> list[str]:
    """Flags that connect a service to the others started by this launcher
    (``vocab_size``: from ``orchestrator_vocab_size``; ``num_ranks``: from
    ``orchestrator_num_ranks``; ``runner_envs``: from ``env_runner_envs``)."""
    fields = _section_fields(spec)
    argv: list[str] = []
    if spec.name == "env_runner" and "envs" in fields and runner_envs:
        argv += ["--env_runner.envs", _toml_list(runner_envs)]
    if spec.name == "inference" and "http_port" in fields:
        argv += ["--inference.http_port", str(ports["inference_http"])]
    urls, targets = ports.get("inference_urls", []), ports.get("inference_grpcs", [])
    if spec.name == "env_runner" and "inference_url" in fields and len(urls) == 1:
        argv += ["--env_runner.inference_url", urls[0]]
    elif spec.name == "env_runner" and "inference_urls" in fields and len(urls) > 1:
        argv += ["--env_runner.inference_urls", _toml_list(urls)]
    if (
        spec.name == "env_runner"
        and "max_model_len" in fields
        and ports.get("inference_max_model_len")
    ):
        # the context the engine serves: a model call asking past it is refused by vLLM
        argv += ["--env_runner.max_model_len", str(ports["inference_max_model_len"])]
    if spec.name == "orchestrator":
        if "inference_grpc" in fields and targets:
            argv += ["--orchestrator.inference_grpc", _toml_list(targets)]
        if job in JOB_SERVICES and "mode" in fields:
            argv += ["--orchestrator.mode", job]
        if vocab_size is not None and "vocab_size" in fields:
            argv += ["--orchestrator.vocab_size", str(vocab_size)]
        if num_ranks is not None and "num_ranks" in fields:
            argv += ["--orchestrator.num_ranks", str(num_ranks)]
        if "teacher" in fields and urls:  # the distillation teacher is checked against it
            argv += ["--orchestrator.teacher.student_url", urls[0]]
        if "teacher" in fields and (teacher := ports.get("teacher")) is not None:
            url, served_model_name = teacher  # the teacher this launch started
            argv += ["--orchestrator.teacher.urls", _toml_list([url]),
                     "--orchestrator.teacher.model", served_model_name]  # fmt: skip
    return argv


def _toml_list(items: list[str]) -> str:
    """A flag value the config reads back as a list of strings."""
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def _env_name(dotted: str) -> str:
    """``object_store.secret_key`` -> ``TREADLE_OBJECT_STORE__SECRET_KEY`` (config.py reads it)."""
    return ENV_PREFIX + ENV_LEVEL_SEP.join(part.upper() for part in dotted.split("."))


def child_sources(sources: ConfigSources) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that hand a launch's config to a child: files and plain flags on the
    command line, secret flags (a secret key name, a URL with a password) as environment
    variables, where neither ``ps`` nor a log line shows them."""
    argv = ["@", *map(str, sources.files)] if sources.files else []
    env: dict[str, str] = {}
    for key, raw, _ in sources.overrides:
        if is_secret_key(key) or url_password(raw):
            env[_env_name(key)] = raw
        else:
            argv += [f"--{key}", raw]
    return argv, env


def has_gpu() -> bool:
    """Whether this machine shows an NVIDIA/AMD GPU device node (no CUDA import needed)."""
    dev = Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()


def _schedule(
    job: str, services: list[str], cpus: list[int], environ: Mapping[str, str], enabled: bool,
    gpu: bool,
) -> tuple[bool, str] | None:  # fmt: skip
    """(split the CPUs?, why) for an ``rl`` job with inference and trainer; else None."""
    if job != "rl" or not {"inference", "trainer"} <= set(services):
        return None
    if gpu:
        return False, "CPU schedule: not split (a GPU generates and trains; CPU threads as set)"
    for var in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        if var in environ:
            return False, (f"CPU schedule: shared, as you set it ({var}={environ[var]}): the "
                           "launcher leaves thread settings alone")  # fmt: skip
    if len(cpus) < 2:
        return False, (f"CPU schedule: shared (one CPU, {cpus[0] if cpus else '?'}): generation "
                       "and training take turns on it")  # fmt: skip
    if not enabled:
        return False, ("CPU schedule: shared ([launcher] split_cpus = false): vLLM and the "
                       "trainer both use every CPU")  # fmt: skip
    return True, (f"CPU schedule: split, {len(cpus) // 2} CPU(s) generating and "
                  f"{len(cpus) - len(cpus) // 2} training at once -- the fastest of split, shared "
                  "and turn-taking on a 2-core machine (benchmarks/cpu_schedule.py), the "
                  "orchestrator and env runners where [launcher] helper_cpus says; "
                  "[launcher] split_cpus = false shares them")  # fmt: skip


def cpu_schedule(
    job: str,
    services: list[str],
    cpus: list[int],
    environ: Mapping[str, str],
    *,
    enabled: bool = True,
    gpu: bool = False,
) -> str | None:
    """One line saying how ``cpu_split_env`` shares the CPUs between generation and
    training, and why; None when there is no choice to explain (not an ``rl`` job with
    both inference and trainer)."""
    got = _schedule(job, services, cpus, environ, enabled, gpu)
    return None if got is None else got[1]


def cpu_split_env(
    job: str,
    services: list[str],
    cpus: list[int],
    environ: Mapping[str, str],
    *,
    enabled: bool = True,
    gpu: bool = False,
    helpers: str = "all",
) -> dict[str, dict[str, str]]:
    """Per-service environment overrides for ``rl`` on a machine without a GPU: the
    trainer's OpenMP threads get the second half of ``cpus`` (``TREADLE_CPUS``); vLLM's
    threads are bound to the first half, where the inference service runs too; the
    orchestrator and the env runners run where ``helpers`` says (default: any of
    ``cpus``). Empty when it does not apply or the user already chose thread settings
    (``cpu_schedule`` says which)."""
    got = _schedule(job, services, cpus, environ, enabled, gpu)
    if got is None or not got[0]:
        return {}
    half = len(cpus) // 2
    engine = ",".join(map(str, cpus[:half]))
    trainer = ",".join(map(str, cpus[half:]))
    where = {"generation": engine, "training": trainer, "all": ",".join(map(str, cpus))}[helpers]
    out = {name: {CPUS_ENV: where} for name in services if name not in ("inference", "trainer")}
    out["inference"] = {
        CPUS_ENV: engine,
        "OMP_NUM_THREADS": str(half),
        "VLLM_CPU_OMP_THREADS_BIND": engine,
    }
    out["trainer"] = {CPUS_ENV: trainer, "OMP_NUM_THREADS": str(len(cpus) - half)}
    return out


def teacher_cpu_env(
    split: Mapping[str, Mapping[str, str]], where: str = "generation"
) -> dict[str, str]:
    """Where the distillation teacher's vLLM runs when ``cpu_split_env`` split the CPUs:
    ``where`` ([launcher] teacher_cpus) is "generation" (the student's vLLM's CPUs and
    thread settings) or "training" (the trainer's, its OpenMP threads bound there).
    Empty when the CPUs are not split."""
    if where not in ("generation", "training"):
        raise ValueError(f"teacher CPUs {where!r}: 'generation' or 'training'")
    side = split.get("inference" if where == "generation" else "trainer", {})
    if CPUS_ENV not in side:
        return {}
    return {**side, "VLLM_CPU_OMP_THREADS_BIND": side[CPUS_ENV]}


async def run_stack(sources: ConfigSources, *, check_only: bool) -> int:
    """Start the local stack; with ``check_only`` stop it again once every part is healthy."""
    return await run_job(sources, "stack", check_only=check_only)


async def run_job(sources: ConfigSources, job: str, *, check_only: bool = False) -> int:
    """Start the job's services and supervise them until done, Ctrl-C, or a failure."""
    cfg, specs = resolve(sources, job)
    num_ranks = orchestrator_num_ranks(specs)  # a mismatch stops the launch before it starts
    runner_envs = env_runner_envs(specs)  # likewise an env the env runner would not serve
    for c in [cfg, *(spec_cfg for _, spec_cfg in specs)]:
        register_config_secrets(c)  # masked in the launcher's own log lines
    run_dir = cfg.run.run_dir
    logs_dir = _make_run_dir(cfg)
    write_secret(run_dir / "config.toml", resolved_toml(cfg, specs))
    # TensorBoard / W&B copies of the metrics: opened before anything starts, so that a
    # missing package or a W&B login error stops the run at once
    sinks = open_run_sinks(cfg.telemetry, cfg.run.name, run_dir) if job in JOB_SERVICES else []
    supervisor = Supervisor(logs_dir)
    nats: EmbeddedNats | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    launched: list[Launched] = []
    follower: asyncio.Task[None] | None = None
    t0 = time.monotonic()
    try:
        creds = None
        if cfg.launcher.secure:
            hosts = [spec.grpc_section(spec_cfg).host for spec, spec_cfg in specs]
            creds = await asyncio.to_thread(
                generate, run_dir / "credentials", cfg.run.name, hosts=hosts
            )
            configure_clients(ControlSecurity.load(_control_section(cfg, creds)))
        nats_url = cfg.nats.url
        bus_cfg = cfg.nats  # how the launcher itself connects (metrics, streams)
        if nats_url is None:
            store_dir = cfg.nats.embedded_store_dir or run_dir / "nats"
            nats = EmbeddedNats(
                store_dir,
                logs_dir / "nats-server.log",
                config_file=creds.nats_conf if creds else None,
            )
            nats_url = await asyncio.to_thread(nats.start)
            log.info(
                "[startup] embedded nats-server at %s (pid %s, %s)",
                nats_url,
                nats.process and nats.process.pid,
                "TLS, one nkey user per service" if creds else "OPEN: no authentication",
            )
            bus_cfg = cfg.nats.model_copy(update={"url": nats_url})
            if creds is not None:
                bus_cfg = bus_cfg.model_copy(
                    update={"credentials": creds.seed("admin"), "tls_ca": creds.ca}
                )
            await _create_streams(
                bus_cfg, cfg.run.name, (runner_envs or _env_runner_envs(specs)) if creds else []
            )
        child_argv, secret_env = child_sources(sources)
        secret_env[_env_name("nats.url")] = nats_url
        cpu_args: dict[str, Any] = {"enabled": cfg.launcher.split_cpus, "gpu": has_gpu()}
        names = [spec.name for spec, _ in specs]
        cpus = sorted(os.sched_getaffinity(0))
        env_overrides = cpu_split_env(
            job, names, cpus, os.environ, helpers=cfg.launcher.helper_cpus, **cpu_args
        )
        if (why := cpu_schedule(job, names, cpus, os.environ, **cpu_args)) is not None:
            log.info("[startup] %s", why)
        for name, extra in env_overrides.items():
            log.info(
                "[startup] %s on CPUs: %s", name, " ".join(f"{k}={v}" for k, v in extra.items())
            )
        ports: dict[str, Any] = {}
        vocab_size = orchestrator_vocab_size(specs)
        replicas = cfg.launcher.inference_replicas
        teacher = teacher_deployment(job, specs)
        # the teacher where [launcher] teacher_cpus says
        teacher_env = teacher_cpu_env(env_overrides, cfg.launcher.teacher_cpus) if teacher else {}
        if teacher is not None:
            log.info("[startup] the distillation teacher: %s, served as %r by an inference "
                     "service of its own (fixed: it loads no policy weights)%s",
                     teacher.checkpoint, teacher.served_model_name,
                     f"; on the {cfg.launcher.teacher_cpus} CPUs ([launcher] teacher_cpus): "
                     + " ".join(f"{k}={v}" for k, v in teacher_env.items())
                     if env_overrides else "")  # fmt: skip
        # vLLM engines started side by side share the machine
        engines = replicas + (teacher is not None)
        inference_timeout_s = cfg.launcher.health_timeout_s * engines
        later = inference_started_later(job, names, replicas=replicas, teacher=teacher is not None)
        if replicas > 1 and "inference" in (spec.name for spec, _ in specs):
            log.warning(
                "[startup] %d inference replicas on %d CPUs%s: they share the machine (a test "
                "of replica routing and failover, not a speed-up)", replicas,
                len(os.sched_getaffinity(0)), "" if not has_gpu() else " and its GPUs",
            )  # fmt: skip

        def launch(
            spec: ServiceSpec, spec_cfg: Any, copy: int, copies: int, *, as_teacher: bool = False
        ) -> tuple[str, str, ServiceSpec, asyncio.Future[Any]]:
            """Start one service (or one of ``copies`` inference replicas, or with
            ``as_teacher`` the teacher's inference) on free ports: (name, gRPC target, spec,
            the start that ends once it is healthy)."""
            name = spec.name if copies == 1 else f"{spec.name}-{copy + 1}"
            name = "teacher" if as_teacher else name
            host = spec.grpc_section(spec_cfg).host
            try:
                port = free_port(host)
                http_port = free_port("127.0.0.1") if spec.name == "inference" else None
            except OSError as e:
                raise ConfigError(
                    f"{spec.name}.grpc.host = {host!r} cannot be bound on this machine ({e.strerror}); "
                    "use 127.0.0.1 or an address of one of its interfaces"
                ) from None
            target = f"{host}:{port}"
            if as_teacher:  # the student's replicas' wiring is not the teacher's
                assert teacher is not None
                assert http_port is not None
                ports["teacher"] = (f"http://127.0.0.1:{http_port}", teacher.served_model_name)
                wiring = teacher.flags(http_port)
            else:
                if spec.name == "inference":
                    ports["inference_http"] = http_port
                    ports.setdefault("inference_urls", []).append(f"http://127.0.0.1:{http_port}")
                    ports.setdefault("inference_grpcs", []).append(target)
                    ports["inference_max_model_len"] = getattr(
                        getattr(spec_cfg, "inference", None), "max_model_len", None
                    )
                wiring = _wiring(spec, job, ports, vocab_size=vocab_size, num_ranks=num_ranks,
                                 runner_envs=runner_envs)  # fmt: skip
                if spec.name == "inference":
                    wiring += inference_lora_flags(specs)
                if spec.name == "orchestrator" and later:
                    wiring += ["--orchestrator.inference_wait_s", str(inference_timeout_s)]
            argv = [sys.executable, "-m", spec.module, *child_argv,
                    f"--{spec.name}.grpc.port", str(port), *wiring]  # fmt: skip
            cpu_env = teacher_env if as_teacher else env_overrides.get(spec.name, {})
            env = {**os.environ, **cpu_env, **secret_env}
            if creds is not None:
                env |= _child_credentials(creds, spec.name, cfg, embedded=nats is not None)

            async def healthy(target: str = target, name: str = spec.control.full_name) -> bool:
                return await check_health(target, name)

            print(f"treadle: starting {name} ...", flush=True)
            start = supervisor.start(
                name,
                argv,
                health=healthy,
                # copies started side by side share the machine: each gets the time
                # one would have alone, once per copy
                health_timeout_s=inference_timeout_s
                if spec.name == "inference"
                else cfg.launcher.health_timeout_s * copies,
                stop_grace_s=cfg.launcher.stop_grace_s,
                env=env,
                # a job's end is theirs: they may be done at once (see _supervise)
                may_finish=job in JOB_SERVICES and spec.name in ("orchestrator", "trainer"),
            )
            return name, target, spec, asyncio.ensure_future(start)

        stages = start_stages(names)
        # starts not waited for before the next stage (inference's, when started later)
        carried: list[tuple[str, str, ServiceSpec, asyncio.Future[Any]]] = []
        for n, stage in enumerate([*stages, []]):
            if stop.is_set():  # Ctrl-C while the services before it started
                for *_, task in carried:
                    task.cancel()
                await asyncio.gather(*(s[3] for s in carried), return_exceptions=True)
                return _interrupted_in_startup(job)
            starts: list[tuple[str, str, ServiceSpec, asyncio.Future[Any]]] = []
            procs = None
            try:  # side by side; Ctrl-C ends the wait (vLLM takes half a minute)
                for spec, spec_cfg in specs:
                    copies = replicas if spec.name == "inference" else 1
                    if spec.name in stage:
                        starts += [launch(spec, spec_cfg, i, copies) for i in range(copies)]
                    if spec.name in stage and spec.name == "inference" and teacher is not None:
                        starts.append(launch(spec, spec_cfg, 0, 1, as_teacher=True))
                if len(starts) > 1:
                    log.info("[startup] starting %s side by side", ", ".join(s[0] for s in starts))
                if later and n == 0:
                    log.info("[startup] the next services start once the trainer is healthy; "
                             "the orchestrator waits for inference before it dispatches")  # fmt: skip
                waited = carried + [
                    s for s in starts if not (later and n == 0 and s[2].name == "inference")
                ]
                procs = await _unless_stopped(asyncio.gather(*(s[3] for s in waited)), stop)
            finally:
                if procs is None:  # refused, failed or stopped: what started stops with the rest
                    for *_, task in carried + starts:
                        task.cancel()
                    await asyncio.gather(*(s[3] for s in carried + starts), return_exceptions=True)
            if procs is None:
                return _interrupted_in_startup(job)
            for (name, target, spec, _), proc in zip(waited, procs, strict=True):
                assert proc.pid is not None
                launched.append(Launched(spec, proc.pid, target, name))
            carried = [s for s in starts if s not in waited]
        launched.sort(key=lambda item: names.index(item.spec.name))  # the job's order
        shown_url = redact_urls(nats_url)
        _write_stack(run_dir / "stack.json", shown_url, nats, launched)
        print(
            f"treadle: {job} of run {cfg.run.name!r} is up in {time.monotonic() - t0:.1f}s (logs: {logs_dir})"
        )
        print(
            f"  {'nats':<13} {shown_url}  {'embedded, pid ' + str(nats.process.pid) if nats and nats.process else 'external'}"
            f"{'' if creds or nats is None else '  OPEN BUS (launcher.secure = false)'}"
        )
        exited = {c.process.name: c.process.poll() for c in supervisor.children}
        for item in launched:
            code = exited.get(item.name)
            try:
                state = await _status_line(item) if code is None else f"FINISHED (exit {code})"
            except Exception as e:  # exited since, or busy: _supervise judges it next
                state = f"no status ({type(e).__name__})"
            print(f"  {item.name:<13} grpc {item.target}  pid {item.pid}  {state}")
        if check_only:
            return 0
        if job in JOB_SERVICES:
            from treadle.services.progress import follow_metrics

            max_steps = _max_steps(specs)
            follower = asyncio.create_task(
                follow_metrics(cfg, bus_cfg, run_dir / "metrics.jsonl", job, max_steps, sinks)
            )
        else:
            print("press Ctrl-C to stop")
        return await _supervise(supervisor, stop, job, waits_for_eval=_final_eval(specs))
    finally:
        if follower is not None:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
        codes = supervisor.stop_all()
        if nats is not None:
            nats.stop(cfg.launcher.stop_grace_s)
        if codes:
            print(
                "treadle: stack stopped ("
                + ", ".join(f"{n}: exit {c}" for n, c in codes.items())
                + ")"
            )
        close_sinks(sinks)


def _control_section(cfg: ServiceConfig, creds: RunCredentials) -> ControlSection:
    """The run's control-plane files, unless the run file chose its own."""
    mine = cfg.control
    if mine.tls_cert is not None or mine.token_file is not None or mine.tls_ca is not None:
        return mine
    return ControlSection(
        tls_cert=creds.cert, tls_key=creds.key, tls_ca=creds.ca, token_file=creds.token,
        require_client_cert=mine.require_client_cert,
    )  # fmt: skip


def _child_credentials(
    creds: RunCredentials, role: str, cfg: ServiceConfig, *, embedded: bool
) -> dict[str, str]:
    """Environment entries with the child's credential files: its NATS user (embedded
    server only: an external server has its own users) and the control plane's files."""
    env = creds.child_env(role)
    if not embedded:
        env = {k: v for k, v in env.items() if not k.startswith("TREADLE_NATS__")}
    if _control_section(cfg, creds) is cfg.control:  # the run file set [control] itself
        env = {k: v for k, v in env.items() if not k.startswith("TREADLE_CONTROL__")}
    return env


async def _create_streams(bus_cfg: NatsSection, run: str, envs: list[str]) -> None:
    """Create the run's streams, and the env runners' work-queue consumers of ``envs``,
    before any service starts (services may not create streams, env runners no consumers)."""
    bus = await Bus.connect(bus_cfg, run, name="treadle-launcher", role="admin")
    try:
        await bus.ensure_streams()
        await make_work_queue_consumers(bus, envs)
    finally:
        await bus.close()


def _env_runner_envs(specs: list[tuple[ServiceSpec, ServiceConfig]]) -> list[str]:
    for spec, spec_cfg in specs:
        if spec.name == "env_runner":
            section: Any = getattr(spec_cfg, spec.name)
            return list(getattr(section, "envs", None) or [])
    return []


def _max_steps(specs: list[tuple[ServiceSpec, ServiceConfig]]) -> int | None:
    for spec, spec_cfg in specs:
        if spec.name == "orchestrator":
            section: Any = spec_cfg
            return int(section.orchestrator.max_steps)
    return None


def _final_eval(specs: list[tuple[ServiceSpec, ServiceConfig]]) -> bool:
    """The orchestrator evaluates the final policy (orchestrator.eval) after the last step."""
    for spec, spec_cfg in specs:
        if spec.name == "orchestrator":
            section: Any = spec_cfg
            return bool(section.orchestrator.eval.enabled)
    return False


async def _unless_stopped(
    work: asyncio.Future[list[ManagedProcess]], stop: asyncio.Event
) -> list[ManagedProcess] | None:
    """``work``'s result, or None (``work`` cancelled) once ``stop`` is set first."""
    stopped: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    either: set[asyncio.Future[Any]] = {work, stopped}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    return None


def _interrupted_in_startup(job: str) -> int:
    """Ctrl-C (SIGINT/SIGTERM) before every service was up: the stack stops without
    starting the rest (a job: 130, as cut short; a stack: 0, its normal end)."""
    print(f"treadle: {job} interrupted during startup; stopping what had started")
    return 130 if job in JOB_SERVICES else 0


async def _supervise(
    supervisor: Supervisor, stop: asyncio.Event, job: str, *, waits_for_eval: bool = False
) -> int:
    """Until Ctrl-C (stack: 0; a job cut short: 130), the job's end (0: the trainer finished,
    and with ``waits_for_eval`` the orchestrator too: it evaluates the final policy after the
    trainer's last step), or a child's failure (raise)."""
    finished: set[str] = set()
    while not stop.is_set():
        for child in supervisor.children:
            name = child.process.name
            code = child.process.poll()
            if code is None or name in finished:
                continue
            if code == 0 and job in JOB_SERVICES and name == "orchestrator":
                finished.add(name)
                log.info("orchestrator finished publishing batches")
                if "trainer" in finished:  # its final evaluation is done too
                    print(f"treadle: {job} finished: the trainer completed its last step, "
                          "the orchestrator its last evaluation")  # fmt: skip
                    return 0
            elif code == 0 and job in JOB_SERVICES and name == "trainer":
                if waits_for_eval and "orchestrator" not in finished:
                    finished.add(name)
                    print("treadle: the trainer completed its last step; waiting for the "
                          "orchestrator's evaluation of the final policy")  # fmt: skip
                    continue
                print(f"treadle: {job} finished: the trainer completed its last step")
                return 0
            else:
                raise child.process.failure("died")
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.5)
        except TimeoutError:
            pass
    if job not in JOB_SERVICES:  # `treadle stack` runs until Ctrl-C: its normal end
        print("treadle: stopping the stack")
        return 0
    print(f"treadle: {job} interrupted before the trainer's last step; stopping the stack")
    return 130


def _write_stack(
    path: Any, nats_url: str, nats: EmbeddedNats | None, launched: list[Launched]
) -> None:
    doc = {
        "started_at": time.time(),
        "nats": {"url": nats_url, "pid": nats.process.pid if nats and nats.process else None},
        "services": {i.name: {"pid": i.pid, "grpc": i.target} for i in launched},
    }
    write_secret(path, json.dumps(doc, indent=2))


__all__ = [
    "LAUNCHER_SECTION",
    "ChildFailedError",
    "LauncherConfig",
    "LauncherSection",
    "resolve",
    "run_stack",
]
