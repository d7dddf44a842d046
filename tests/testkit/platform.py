"""A hosted deployment on this machine, for tests and benchmarks: one nats-server holding
every run's users, one hosted inference (vLLM serving each run's LoRA adapter by its key),
one hosted trainer (each run's adapter on one base), and per run its own orchestrator and
env runner, each as that run's own NATS user on that run's own store prefix.

    Deployment(root, model, [RunPlan("alpha", "reverse_text"), ...]).start()
        ─▶ nats-server (generate_shared: users + a key per run) ─▶ inference + trainer
        ─▶ per run: orchestrator, env runner ─▶ wait_trained(): every run's last step
           is announced and served ─▶ stop()

Each process is ``python -m treadle.<service>`` with its own log under root/logs.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit.hosted import host_argv, last_policy, run_nats_section, start_shared_nats, write_config
from testkit.procs import wait_healthy
from treadle.proto.v1 import common_pb2
from treadle.services.credentials import RunCredentials
from treadle.services.nats_server import EmbeddedNats
from treadle.services.ports import free_port
from treadle.services.rpc import open_channel
from treadle.services.supervisor import ManagedProcess

PLATFORM = "platform"  # the deployment's own namespace on the bus


@dataclass
class RunPlan:
    """One tenant's run: its environment, seed and length."""

    name: str
    env: str  # a built-in environment (reverse_text, countdown, arithmetic), or package's
    seed: int = 0
    package: Path | None = None  # an environment package the tenant pushes (env push)
    steps: int = 3
    lr: float = 1e-3
    tasks: Path | None = None  # a task file (default: the environment's first 64 tasks)


@dataclass
class Settings:
    rank: int = 8
    group_size: int = 4
    groups_per_step: int = 2
    max_tokens: int = 24
    seq_len: int = 512
    max_model_len: int = 512
    algorithm_args: dict[str, Any] = field(default_factory=dict)  # orchestrator's (grpo's)
    max_concurrency: int = 4  # each env runner's rollouts at once


def write_env_tasks(env: str, path: Path, n: int = 64) -> Path:
    """``n`` tasks of a built-in environment as a JSONL file (orchestrator.tasks)."""
    import importlib

    from treadle.env_runner.environments import BUILTIN

    module, attr = BUILTIN[env].split(":")
    environment = getattr(importlib.import_module(module), attr)
    tasks = environment.task_set()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(tasks[i]) + "\n" for i in range(min(n, len(tasks)))))
    return path


@dataclass
class Deployment:
    root: Path
    model: Path
    runs: list[RunPlan]
    settings: Settings = field(default_factory=Settings)
    server: EmbeddedNats | None = None
    creds: dict[str, RunCredentials] = field(default_factory=dict)
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    grpc: dict[str, int] = field(default_factory=dict)
    http_port: int = 0

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def store_root(self, run: str) -> Path:
        return self.root / "stores" / run

    # --- configs -------------------------------------------------------------------------
    def _lora(self) -> dict[str, Any]:
        r = self.settings.rank
        return {"enabled": True, "rank": r, "alpha": 2.0 * r}

    def _run_sections(self, run: str, role: str) -> dict[str, dict[str, Any]]:
        assert self.server is not None
        return {
            "run": {"name": run, "output_dir": self.root / "out"},
            "nats": run_nats_section(self.server, self.creds[run], role),
            "object_store": {"root": self.store_root(run)},
        }

    def _files(self) -> tuple[list[Path], list[Path]]:
        """(inference run files, trainer run files)."""
        inference, trainer = [], []
        for plan in self.runs:
            folder = self.root / "runs" / plan.name
            inference.append(write_config(folder / "inference.toml", {
                **self._run_sections(plan.name, "inference"),
                "inference.hosted": {"key_file": self.creds[plan.name].inference_key},
            }))  # fmt: skip
            trainer.append(write_config(folder / "trainer.toml", {
                **self._run_sections(plan.name, "trainer"),
                "trainer": {"model": self.model, "device": "cpu", "max_steps": plan.steps,
                            "seed": plan.seed,
                            "checkpoint_every": plan.steps},
                "trainer.lora": self._lora(),
                "trainer.optim": {"lr": plan.lr},
            }))  # fmt: skip
        return inference, trainer

    def _run_config(self, plan: RunPlan) -> Path:
        """The run's own file for its orchestrator and env runner (credentials by flag);
        a pushed package is stored in the run's store first and pinned."""
        s = self.settings
        folder = self.root / "runs" / plan.name
        key = self.creds[plan.name].inference_key
        runner: dict[str, Any] = {"envs": [plan.env]}
        if plan.package is not None:
            from treadle.env_runner.pushed import push
            from treadle.services.objectstore import LocalObjectStore

            pushed = push(LocalObjectStore(self.store_root(plan.name)), plan.package)
            assert pushed.name == plan.env, pushed
            runner = {"envs": [plan.env], "pushed_envs": [pushed.pin]}
            tasks = folder / "tasks.jsonl"
            tasks.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(plan.package / plan.env / "tasks.jsonl", tasks)
        elif plan.tasks is not None:
            tasks = plan.tasks
        else:
            tasks = write_env_tasks(plan.env, folder / "tasks.jsonl")
        return write_config(folder / "run.toml", {
            **self._run_sections(plan.name, "orchestrator"),
            "orchestrator": {
                "env": plan.env, "tasks": tasks,
                "max_steps": plan.steps, "group_size": s.group_size,
                "groups_per_step": s.groups_per_step, "max_groups_in_flight": 2 * s.groups_per_step,
                "max_async_level": 1, "seq_len": s.seq_len, "seed": plan.seed,
                "status_poll_s": 0.2, "algorithm_args": s.algorithm_args,
                "inference_grpc": [f"127.0.0.1:{self.grpc['inference']}"],
            },
            "orchestrator.sampling": {"max_tokens": s.max_tokens},
            "env_runner": {
                **runner, "tokenizer": self.model, "max_concurrency": s.max_concurrency,
                "inference_url": f"http://127.0.0.1:{self.http_port}",
                "inference_model": plan.name, "inference_key_file": key,
                "max_model_len": s.max_model_len,
            },
        })  # fmt: skip

    # --- processes -----------------------------------------------------------------------
    async def _start(self, name: str, argv: list[str], timeout_s: float = 600) -> None:
        proc = ManagedProcess(name, argv, self.log(name)).start()
        self.procs[name] = proc
        await wait_healthy(proc, f"127.0.0.1:{self.grpc[name]}", timeout_s=timeout_s)

    def start(self) -> Deployment:
        names = [p.name for p in self.runs]
        self.server, self.creds = start_shared_nats(
            self.root, [PLATFORM, *names], {p.name: [p.env] for p in self.runs}
        )
        for name in ["inference", "trainer"] + [f"{r}-{s}" for r in names
                                                for s in ("orchestrator", "env_runner")]:  # fmt: skip
            self.grpc[name] = free_port()
        self.http_port = free_port()
        inference_files, trainer_files = self._files()
        s, platform = self.settings, self.creds[PLATFORM]
        inference = [
            *host_argv("inference", self.root, self.server, platform, inference_files),
            "--inference.model", str(self.model), "--inference.dtype", "float32",
            "--inference.max_model_len", str(s.max_model_len),
            "--inference.http_port", str(self.http_port),
            "--inference.grpc.port", str(self.grpc["inference"]),
            "--inference.lora.enabled", "true", "--inference.lora.max_lora_rank", str(s.rank),
            "--inference.lora.max_loras", str(max(2, len(self.runs))),
        ]  # fmt: skip
        lora = self._lora()
        trainer = [
            *host_argv("trainer", self.root, self.server, platform, trainer_files),
            "--trainer.model", str(self.model), "--trainer.device", "cpu",
            "--trainer.grpc.port", str(self.grpc["trainer"]),
            "--trainer.lora.enabled", "true", "--trainer.lora.rank", str(lora["rank"]),
            "--trainer.lora.alpha", str(lora["alpha"]),
        ]  # fmt: skip

        async def main() -> None:
            await asyncio.gather(self._start("inference", inference),
                                 self._start("trainer", trainer))  # fmt: skip
            for plan in self.runs:
                cfg = self._run_config(plan)
                for service in ("orchestrator", "env_runner"):
                    name = f"{plan.name}-{service}"
                    argv = [sys.executable, "-m", f"treadle.{service}", "@", str(cfg),
                            "--nats.credentials", str(self.creds[plan.name].seed(service)),
                            f"--{service}.grpc.port", str(self.grpc[name])]  # fmt: skip
                    await self._start(name, argv)

        try:
            asyncio.run(main())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop(30)
        if self.server is not None:
            self.server.stop()

    # --- progress ------------------------------------------------------------------------
    async def announced(self, run: str) -> int:
        """The run's newest policy version on its POLICY stream (0: none)."""
        assert self.server is not None
        last = await last_policy(self.server, self.creds[run])
        return last.policy_version if last is not None else 0

    async def served(self, run: str) -> tuple[int, str]:
        """(policy version, adapter) the hosted inference serves for ``run``."""
        from treadle.inference.spec import SPEC

        async with open_channel(f"127.0.0.1:{self.grpc['inference']}", [SPEC.control]) as ch:
            got = await SPEC.stub(ch).GetStatus(common_pb2.GetStatusRequest(run=run), timeout=30)
        return got.policy_version, got.adapter

    def wait_trained(self, timeout_s: float = 1200) -> dict[str, float]:
        """Wait until every run's last step is announced and served; returns the seconds
        from this call until each run got there."""
        started = time.monotonic()
        done: dict[str, float] = {}

        async def main() -> None:
            while len(done) < len(self.runs):
                for proc in self.procs.values():
                    if proc.poll() not in (None, 0):
                        raise proc.failure("died")
                for plan in self.runs:
                    if plan.name in done:
                        continue
                    if (await self.served(plan.name))[0] >= plan.steps:
                        done[plan.name] = time.monotonic() - started
                assert time.monotonic() - started < timeout_s, f"not trained: {done}"
                await asyncio.sleep(1.0)

        asyncio.run(main())
        return done
