"""CommandHarness: any program is the harness, talking to the model over its usual API.

The program (a CLI coding agent, an SDK script, ...) gets the rollout's interception
endpoint as ``OPENAI_BASE_URL`` and ``ANTHROPIC_BASE_URL`` and the task, and does
whatever it does; every model call it makes, in any dialect the server speaks (OpenAI
Chat Completions or Responses, Anthropic Messages), goes through the rollout's
ModelSession and is recorded token-exactly.

    ENVIRONMENT = Environment("fix_bug", prompt=..., rubric=Rubric(rewards=[tests_pass]),
        harness=CommandHarness(["my-agent", "--task", "{task_file}"], timeout_s=600),
        runtime=SandboxRuntime(SandboxLimits(wall_s=600), ro_paths=["/opt/my-agent"]))

The program runs in the environment's runtime (``Environment(runtime=...)``, or the
run's ``[env_runner.runtimes.<env>]``), or in the harness's own ``runtime`` when set.

Per rollout:

    work dir    a fresh directory (``workdir_root``/<rollout_id>-xxxx); ``setup(task, workdir)``
                may fill it first. ``.treadle/task.json`` holds the task,
                ``.treadle/messages.json`` the environment's opening conversation and
                ``.treadle/prompt.txt`` the text of its last user message (what a CLI
                agent takes as its prompt: ``agents.py``).
    argv        ``{task_file}`` and ``{workdir}`` are replaced by their paths as the program
                sees them (``/work/...`` in the sandbox and in containers)
    env         OPENAI_BASE_URL, ANTHROPIC_BASE_URL, OPENAI_API_KEY and ANTHROPIC_API_KEY
                (the rollout's own secret: the interception server refuses requests
                without it; it serves Chat Completions, Responses and Anthropic
                Messages), TREADLE_TASK (the task JSON),
                TREADLE_TASK_FILE, TREADLE_MESSAGES_FILE, TREADLE_ROLLOUT_ID, TREADLE_MODEL,
                TREADLE_WORKDIR, plus ``env``. Nothing of the runner's own environment
                (its credentials, TREADLE_* settings, cloud keys) reaches the program: in
                the local runtime it gets only the basics of ``runtimes.local.PASSED_ENV``
                besides these
    afterwards  ``state.messages`` = the conversation the session recorded last,
                ``state.info["workdir" | "stdout" | "stderr" | "returncode"]`` for rewards

Outcomes: a limit hit during a model call (turns, tokens, time: the interception server
recorded it) is re-raised as that ``Truncated``, a failed model call as its
``TurnError`` (a program still running then, e.g. retrying the refused call, is stopped
``STOP_GRACE_S`` later); running past the wall time kills the program's whole process
group and is ``Truncated(TRUNCATION_TIMEOUT)``; a non-zero exit (or a signal), and a
program that ends without calling the model (nothing to score or train), are
``HarnessError`` with the tail of stderr (ERROR_KIND_HARNESS); any other limit of the
runtime (output flood, memory, CPU time, processes, work-dir size), and a runtime that
cannot run it at all (no bubblewrap, a failing container engine), are ``RuntimeFailure``
(ERROR_KIND_SANDBOX).

In the local runtime the program reaches the server's TCP port directly. In any other
(the bubblewrap sandbox, a container) it has no network, and the model stays reachable
through the work dir: the interception server also listens on a unix socket there
(``/work/.treadle/api.sock`` inside), which serves this rollout only, and the program's
first process is a small relay (:data:`RELAY`, run by the runtime's Python:
``runtime.python()``) that listens on 127.0.0.1 in the program's own network namespace,
forwards each connection to the socket, starts the program with
``OPENAI_BASE_URL=http://127.0.0.1:<port>/rollouts/<id>/v1`` (and ``ANTHROPIC_BASE_URL``
without the ``/v1``) and exits with its code. The program may be any executable visible
in the runtime (system dirs, ``ro_paths``, the image's, or the work dir via ``setup``).

The work dir outlives the harness (rewards read it) and is removed when the rollout's
RolloutState is garbage-collected, unless ``keep_workdir``. This module does not serve
HTTP (the interception package does) nor build sandboxes (runtimes/ does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from treadle.env_runner.harnesses.base import EnvView, HarnessError, RunSync, RuntimeFailure
from treadle.env_runner.interception import Endpoint, InterceptionServer
from treadle.env_runner.rubric import RolloutState
from treadle.env_runner.runtimes import make_runtime
from treadle.env_runner.runtimes.base import Runtime, SandboxStatus, Workspace
from treadle.env_runner.runtimes.container import ContainerEngineError
from treadle.env_runner.runtimes.sandbox import SandboxUnavailableError
from treadle.env_runner.session import ModelSession, Truncated
from treadle.proto.v1 import rollout_pb2

Status = rollout_pb2.RolloutStatus
STDERR_TAIL = 2000  # characters of stderr in a HarnessError

# The program's first process where it cannot reach the runner's loopback (sandbox,
# container): TCP on its own loopback -> the rollout's unix socket in its work dir.
# argv: <unix socket> <base path> <program argv...>; exits with the program's code.
RELAY = r"""
import asyncio, os, sys

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass

async def main(sock_path, base_path, argv):
    async def relay(r1, w1):
        try:
            r2, w2 = await asyncio.open_unix_connection(sock_path)
        except OSError as e:
            print(f"treadle relay: cannot reach the interception server: {e}", file=sys.stderr)
            w1.close()
            return
        await asyncio.gather(pipe(r1, w2), pipe(r2, w1))
        w1.close()
        w2.close()

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}{base_path}"
    env = dict(os.environ, OPENAI_BASE_URL=base, ANTHROPIC_BASE_URL=base.removesuffix("/v1"))
    try:
        proc = await asyncio.create_subprocess_exec(*argv, env=env)
    except OSError as e:
        print(f"treadle relay: cannot start {argv[0]}: {e}", file=sys.stderr)
        return 127
    rc = await proc.wait()
    return 128 - rc if rc < 0 else rc

sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
"""


def prompt_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last user message of ``messages`` (text parts joined), or ''."""
    for m in reversed(messages):
        if m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(
                    str(p.get("text", "")) for p in content
                    if isinstance(p, dict) and p.get("type") in ("text", "input_text")
                )  # fmt: skip
            return ""
    return ""


@dataclass
class CommandHarness:
    """Run ``argv`` as the harness of each rollout (see the module doc)."""

    uses_interception: ClassVar[bool] = True
    """The env runner starts its interception server for environments using this harness."""

    argv: Sequence[str]
    """The program and its arguments; ``{task_file}`` and ``{workdir}`` are replaced."""
    timeout_s: float = 600.0
    """Wall time of the program; it is killed beyond (TRUNCATION_TIMEOUT). The runtime's
    wall-time limit and the rollout's own time budget, when shorter, win."""
    runtime: Runtime | str | Mapping[str, Any] | None = None
    """Where the program runs: a runtime, a kind ("local", "sandbox", "container") or a
    config table (``treadle.env_runner.runtimes``); None: the environment's runtime."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables of the program."""
    setup: Callable[[dict[str, Any], Path], Any] | None = None
    """``setup(task, workdir)`` prepares the work dir before the program starts (blocking
    is fine: it runs in the runner's executor)."""
    ro_paths: Sequence[str] = ()
    """Extra host paths the program may read (e.g. the agent's install), added to the
    runtime's. In the sandbox, paths under /tmp or /work are refused: it replaces both
    (its private /tmp, the work dir at /work); copy such files into the work dir with
    ``setup``."""
    workdir_root: Path | None = None
    """Where work dirs are made (default: <tmp>/treadle-agents). Keep it short: the sandbox's
    unix socket path must fit in 107 bytes."""
    keep_workdir: bool = False
    """Leave work dirs on disk after the rollout (for debugging)."""
    server: InterceptionServer | None = None
    """The interception server (default: InterceptionServer.current())."""
    max_turns: int = 0
    """Model calls the program may make (0 = no limit); beyond, the interception server
    answers "the rollout ended" and the rollout is truncated (MAX_TURNS). The program
    drives the calls, so the limit lives in the rollout's session."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.argv, str)
            or not self.argv
            or not all(isinstance(a, str) for a in self.argv)
        ):
            raise ValueError(
                f"CommandHarness argv must be a non-empty list of strings, got {self.argv!r}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"CommandHarness timeout_s must be > 0, got {self.timeout_s}")
        if self.runtime is not None:  # checked now: a bad runtime or path is a ConfigError
            self.runtime = make_runtime(self.runtime).with_ro_paths(self.ro_paths)
            self.ro_paths = ()

    def runtime_for(self, env: EnvView) -> Runtime:
        """Where this harness runs its program for ``env``."""
        if isinstance(self.runtime, Runtime):
            return self.runtime
        return env.runtime.with_ro_paths(self.ro_paths)

    async def run(self, env: EnvView, task: dict[str, Any], session: ModelSession,
                  state: RolloutState, run_sync: RunSync) -> None:  # fmt: skip
        server = self.server or InterceptionServer.current()
        runtime = self.runtime_for(env)
        if self.max_turns:
            session.limits.max_turns = self.max_turns
        rollout_id = session.rollout.rollout_id
        ws = Workspace(runtime, self._make_workdir(rollout_id, state), keep=True)
        messages = await env.messages(task, run_sync)
        ws.put(".treadle/task.json", json.dumps(task))
        ws.put(".treadle/messages.json", json.dumps(messages))
        ws.put(".treadle/prompt.txt", prompt_text(messages))
        if self.setup is not None:
            setup = self.setup
            await run_sync(lambda: setup(task, ws.workdir))
        wall = self._wall_s(session, runtime)
        relayed = not runtime.shares_host_loopback
        socket = ws.workdir / ".treadle" / "api.sock" if relayed else None
        async with server.serving(rollout_id, session, unix_socket=socket) as ep:
            argv, env_vars = self._command(ws, ep, task, server.model_name, relayed)
            # a program that goes on after its rollout ended (a limit, a failed model call)
            # is stopped a few seconds later, not at its wall time
            limits = dataclasses.replace(runtime.limits, wall_s=wall)
            try:
                r = await ws.exec(argv, env=env_vars, limits=limits, stop_when=ep.ended)
            except (SandboxUnavailableError, ContainerEngineError) as e:
                raise RuntimeFailure(
                    f"the {runtime.kind} runtime could not run {self.argv[0]}: {e}"
                ) from None
        state.messages = list(session.state.messages)
        state.info["workdir"] = str(ws.workdir)
        state.info["stdout"] = r.stdout.decode(errors="replace")
        state.info["stderr"] = r.stderr.decode(errors="replace")
        state.info["returncode"] = r.returncode
        state.metrics["agent_requests"] = float(ep.num_requests)
        if ep.error is not None:  # the program's model call hit a limit or failed
            raise ep.error
        if r.status == SandboxStatus.TIMEOUT:
            raise Truncated(Status.Truncation.TRUNCATION_TIMEOUT,
                            f"{self.argv[0]} still running after {wall:.3g} s of wall time; killed")  # fmt: skip
        if not r.ok:
            if r.status == SandboxStatus.EXIT_NONZERO:
                failure, error = f"exited with code {r.returncode}", HarnessError
            elif r.status == SandboxStatus.SIGNALED:
                failure, error = r.message or "was killed", HarnessError
            else:  # a limit of its runtime: memory, CPU, processes, output, disk
                failure = f"passed a limit of the {runtime.kind} runtime ({r.status}): {r.message}"
                error = RuntimeFailure
            tail = state.info["stderr"][-STDERR_TAIL:].strip()
            raise error(f"{self.argv[0]} {failure}" + (f"; stderr ends:\n{tail}" if tail else ""))
        if ep.num_requests == 0:
            raise HarnessError(
                f"{self.argv[0]} ended (exit 0) without calling the model: the rollout has "
                "nothing to score or train (is it pointed at OPENAI_BASE_URL / ANTHROPIC_BASE_URL?)"
            )
        if ep.last_finish_reason == "length":
            state.truncated = "max_tokens"

    # -- pieces -----------------------------------------------------------------------------
    def _make_workdir(self, rollout_id: str, state: RolloutState) -> Path:
        root = self.workdir_root or Path(tempfile.gettempdir()) / "treadle-agents"
        root.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", rollout_id)[:40]
        workdir = Path(tempfile.mkdtemp(prefix=f"{safe}-", dir=root))
        if not self.keep_workdir:  # rewards read it after the harness: gone with the state
            weakref.finalize(state, _remove_in_background, str(workdir))
        return workdir

    def _wall_s(self, session: ModelSession, runtime: Runtime) -> float:
        """The program's wall time: ``timeout_s``, the runtime's, and what is left of the
        rollout's budget (minus a margin, so that the program is killed here, not
        abandoned by the rollout's own timeout)."""
        wall = min(self.timeout_s, runtime.limits.wall_s)
        if session.limits.deadline:
            left = session.limits.deadline - time.monotonic()
            wall = min(wall, max(left - min(2.0, 0.1 * left), 0.1))
        return wall

    def _command(self, ws: Workspace, ep: Endpoint, task: dict[str, Any], model: str,
                 relayed: bool) -> tuple[list[str], dict[str, str]]:  # fmt: skip
        """The argv and environment of the program: directly (it reaches the server's
        TCP port) or behind the relay (it reaches the rollout's unix socket)."""
        meta = f"{ws.path}/.treadle"
        env = {
            **self.env,
            **{k: v for k, v in ep.env().items() if k.endswith("_API_KEY")},
            "TREADLE_TASK": json.dumps(task),
            "TREADLE_TASK_FILE": f"{meta}/task.json",
            "TREADLE_MESSAGES_FILE": f"{meta}/messages.json",
            "TREADLE_ROLLOUT_ID": ep.rollout_id,
            "TREADLE_MODEL": model,
            "TREADLE_WORKDIR": ws.path,
        }
        argv = [
            a.replace("{task_file}", f"{meta}/task.json").replace("{workdir}", ws.path)
            for a in self.argv
        ]
        if not relayed:
            no_proxy = ",".join(
                filter(None, [os.environ.get("NO_PROXY", ""), "127.0.0.1", "localhost"])
            )
            return argv, {**env, **ep.env(), "NO_PROXY": no_proxy, "no_proxy": no_proxy}
        assert ep.unix_socket is not None
        inner_socket = f"{meta}/{ep.unix_socket.name}"
        python = ws.runtime.python()
        return [python, "-I", "-c", RELAY, inner_socket, ep.path, *argv], env


def _remove_in_background(path: str) -> None:
    """rmtree off the calling thread (a finalizer may run on the event loop's)."""
    threading.Thread(
        target=shutil.rmtree, args=(path, True), name="rm-workdir", daemon=True
    ).start()
