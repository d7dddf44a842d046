"""CommandHarness: any program is the harness, talking to the model over its usual API.

The program (a CLI coding agent, an SDK script, ...) gets the rollout's interception
endpoint as ``OPENAI_BASE_URL`` and ``ANTHROPIC_BASE_URL`` and the task, and does
whatever it does; every model call it makes, in any dialect the server speaks (OpenAI
Chat Completions or Responses, Anthropic Messages), goes through the rollout's
ModelSession and is recorded token-exactly.

    ENVIRONMENT = Environment("fix_bug", prompt=..., rubric=Rubric(rewards=[tests_pass]),
        harness=CommandHarness(["my-agent", "--task", "{task_file}"], timeout_s=600,
                               sandbox=SandboxLimits(wall_s=600)))

Per rollout:

    work dir    a fresh directory (``workdir_root``/<rollout_id>-xxxx); ``setup(task, workdir)``
                may fill it first. ``.treadle/task.json`` holds the task,
                ``.treadle/messages.json`` the environment's opening conversation and
                ``.treadle/prompt.txt`` the text of its last user message (what a CLI
                agent takes as its prompt: ``agents.py``).
    argv        ``{task_file}`` and ``{workdir}`` are replaced by their paths as the program
                sees them (``/work/...`` in the sandbox)
    env         OPENAI_BASE_URL, ANTHROPIC_BASE_URL, OPENAI_API_KEY and ANTHROPIC_API_KEY
                (the rollout's own secret: the interception server refuses requests
                without it; it serves Chat Completions, Responses and Anthropic
                Messages), TREADLE_TASK (the task JSON),
                TREADLE_TASK_FILE, TREADLE_MESSAGES_FILE, TREADLE_ROLLOUT_ID, TREADLE_MODEL,
                plus ``env``. Nothing of the runner's own environment (its credentials,
                TREADLE_* settings, cloud keys) reaches the program: without a sandbox it
                gets only the basics of :data:`PASSED_ENV` besides these
    afterwards  ``state.messages`` = the conversation the session recorded last,
                ``state.info["workdir" | "stdout" | "stderr" | "returncode"]`` for rewards

Outcomes: a limit hit during a model call (turns, tokens, time: the interception server
recorded it) is re-raised as that ``Truncated``, a failed model call as its
``TurnError``; running past the wall time kills the program's whole process group and is
``Truncated(TRUNCATION_TIMEOUT)``; a non-zero exit is ``HarnessError`` with the tail of
stderr (ERROR_KIND_HARNESS).

With ``sandbox=SandboxLimits(...)`` the program runs in the bubblewrap Sandbox, without
network. The model stays reachable: the interception server also listens on a unix
socket in the work dir (``/work/.treadle/api.sock`` inside), which serves this rollout
only, and the sandbox's first process is a small relay (:data:`RELAY`, run by the
sandbox's Python) that listens on 127.0.0.1 in the sandbox's own network namespace
(bubblewrap brings its loopback up), forwards each connection to the socket, starts the
program with ``OPENAI_BASE_URL=http://127.0.0.1:<port>/rollouts/<id>/v1`` (and
``ANTHROPIC_BASE_URL`` without the ``/v1``) and exits with its code. The program may be
any executable visible in the sandbox (system dirs, ``ro_paths``, or the work dir via
``setup``).

The work dir outlives the harness (rewards read it) and is removed when the rollout's
RolloutState is garbage-collected, unless ``keep_workdir``. This module does not serve
HTTP (the interception package does) nor build sandboxes (sandbox.py does).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from treadle.env_runner.harness import HarnessError, RunSync
from treadle.env_runner.interception import Endpoint, InterceptionServer
from treadle.env_runner.rubric import RolloutState
from treadle.env_runner.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxStatus,
    check_ro_paths,
    python_executable,
    python_runtime,
)
from treadle.env_runner.session import ModelSession, Truncated
from treadle.proto.v1 import rollout_pb2

if TYPE_CHECKING:
    from treadle.env_runner.environments import Environment

Status = rollout_pb2.RolloutStatus
# what an unsandboxed program inherits from the runner's environment (and nothing else)
PASSED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL",
              "LC_CTYPE", "TERM", "TZ", "TMPDIR")  # fmt: skip
SANDBOX_WORKDIR = "/work"  # where Sandbox mounts the work dir
STDERR_TAIL = 2000  # characters of stderr in a HarnessError

# The sandbox's first process: TCP on the sandbox's loopback -> the rollout's unix socket.
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


@dataclass
class _Outcome:
    returncode: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    failure: str = ""
    """Why the program failed, when it did (a non-zero exit, a sandbox limit)."""


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
    """Wall time of the program; it is killed beyond (TRUNCATION_TIMEOUT). The rollout's
    own time budget, when shorter, wins."""
    sandbox: SandboxLimits | None = None
    """Run the program in the bubblewrap sandbox (no network) with these limits."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables of the program."""
    setup: Callable[[dict[str, Any], Path], Any] | None = None
    """``setup(task, workdir)`` prepares the work dir before the program starts (blocking
    is fine: it runs in the runner's executor)."""
    ro_paths: Sequence[str] = ()
    """Sandbox only: extra host paths the program may read (e.g. the agent's install).
    Paths under /tmp or /work are refused: the sandbox replaces both (its private /tmp, the
    work dir at /work); copy such files into the work dir with ``setup``."""
    workdir_root: Path | None = None
    """Where work dirs are made (default: <tmp>/treadle-agents). Keep it short: the sandbox's
    unix socket path must fit in 107 bytes."""
    keep_workdir: bool = False
    """Leave work dirs on disk after the rollout (for debugging)."""
    server: InterceptionServer | None = None
    """The interception server (default: InterceptionServer.current())."""
    max_output_bytes: int = 1 << 20
    """Without a sandbox: the tail of stdout/stderr kept (the sandbox has its own limit)."""
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
        if self.sandbox is not None:
            check_ro_paths(self.ro_paths)

    async def run(self, env: Environment, task: dict[str, Any], session: ModelSession,
                  state: RolloutState, run_sync: RunSync) -> None:  # fmt: skip
        server = self.server or InterceptionServer.current()
        if self.max_turns:
            session.limits.max_turns = self.max_turns
        rollout_id = session.rollout.rollout_id
        workdir = self._make_workdir(rollout_id, state)
        meta = workdir / ".treadle"
        meta.mkdir()
        (meta / "task.json").write_text(json.dumps(task))
        messages = await env.messages(task, run_sync)
        (meta / "messages.json").write_text(json.dumps(messages))
        (meta / "prompt.txt").write_text(prompt_text(messages))
        if self.setup is not None:
            setup = self.setup
            await run_sync(lambda: setup(task, workdir))
        wall = self._wall_s(session)
        socket = meta / "api.sock" if self.sandbox is not None else None
        async with server.serving(rollout_id, session, unix_socket=socket) as ep:
            if self.sandbox is not None:
                out = await self._run_sandboxed(ep, task, workdir, wall, server.model_name)
            else:
                out = await self._run_local(ep, task, workdir, wall, server.model_name)
        state.messages = list(session.state.messages)
        state.info["workdir"] = str(workdir)
        state.info["stdout"] = out.stdout.decode(errors="replace")
        state.info["stderr"] = out.stderr.decode(errors="replace")
        state.info["returncode"] = out.returncode
        state.metrics["agent_requests"] = float(ep.num_requests)
        if ep.error is not None:  # the program's model call hit a limit or failed
            raise ep.error
        if out.timed_out:
            raise Truncated(Status.Truncation.TRUNCATION_TIMEOUT,
                            f"{self.argv[0]} still running after {wall:.3g} s of wall time; killed")  # fmt: skip
        if out.failure:
            tail = state.info["stderr"][-STDERR_TAIL:].strip()
            raise HarnessError(
                f"{self.argv[0]} {out.failure}" + (f"; stderr ends:\n{tail}" if tail else "")
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

    def _wall_s(self, session: ModelSession) -> float:
        """The program's wall time: ``timeout_s``, the sandbox's, and what is left of the
        rollout's budget (minus a margin, so that the program is killed here, not
        abandoned by the rollout's own timeout)."""
        wall = self.timeout_s
        if self.sandbox is not None:
            wall = min(wall, self.sandbox.wall_s)
        if session.limits.deadline:
            left = session.limits.deadline - time.monotonic()
            wall = min(wall, max(left - min(2.0, 0.1 * left), 0.1))
        return wall

    def _argv(self, task_file: str, workdir: str) -> list[str]:
        return [
            a.replace("{task_file}", task_file).replace("{workdir}", workdir) for a in self.argv
        ]

    def _env(self, ep: Endpoint, task: dict[str, Any], meta: str, model: str) -> dict[str, str]:
        return {
            **self.env,
            **{k: v for k, v in ep.env().items() if k.endswith("_API_KEY")},
            "TREADLE_TASK": json.dumps(task),
            "TREADLE_TASK_FILE": f"{meta}/task.json",
            "TREADLE_MESSAGES_FILE": f"{meta}/messages.json",
            "TREADLE_ROLLOUT_ID": ep.rollout_id,
            "TREADLE_MODEL": model,
        }

    async def _run_local(self, ep: Endpoint, task: dict[str, Any], workdir: Path, wall: float,
                         model: str) -> _Outcome:  # fmt: skip
        meta = str(workdir / ".treadle")
        no_proxy = ",".join(
            filter(None, [os.environ.get("NO_PROXY", ""), "127.0.0.1", "localhost"])
        )
        basics = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env = {**basics, **self._env(ep, task, meta, model), **ep.env(),
               "TREADLE_WORKDIR": str(workdir), "NO_PROXY": no_proxy, "no_proxy": no_proxy}  # fmt: skip
        argv = self._argv(f"{meta}/task.json", str(workdir))
        # our own pipes (not asyncio's PIPE): a grandchild that escapes the kill may hold
        # them open, and we must be able to stop reading and close them regardless
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=workdir, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=out_w, stderr=err_w, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            for fd in (out_r, err_r):
                os.close(fd)
            raise HarnessError(f"cannot start {argv[0]}: {e}") from None
        finally:
            os.close(out_w)
            os.close(err_w)
        stdout, stderr = bytearray(), bytearray()
        readers = [asyncio.ensure_future(_read_tail(out_r, stdout, self.max_output_bytes)),
                   asyncio.ensure_future(_read_tail(err_r, stderr, self.max_output_bytes))]  # fmt: skip
        timed_out = False
        try:
            try:
                await asyncio.wait_for(proc.wait(), wall)
            except TimeoutError:
                timed_out = True
        finally:  # also on cancellation: no program outlives its rollout
            _kill_group(proc.pid)
            if proc.returncode is None:
                await proc.wait()
            _, pending = await asyncio.wait(readers, timeout=1.0)
            for t in pending:  # a grandchild escaped the kill and holds a pipe: stop reading
                t.cancel()
            if pending:
                await asyncio.wait(pending)
        rc = proc.returncode
        failure = "" if timed_out or rc == 0 else _describe_exit(rc)
        return _Outcome(rc, bytes(stdout), bytes(stderr), timed_out, failure)

    async def _run_sandboxed(self, ep: Endpoint, task: dict[str, Any], workdir: Path, wall: float,
                             model: str) -> _Outcome:  # fmt: skip
        assert self.sandbox is not None
        assert ep.unix_socket is not None
        meta = f"{SANDBOX_WORKDIR}/.treadle"
        env = {**self._env(ep, task, meta, model), "TREADLE_WORKDIR": SANDBOX_WORKDIR}
        inner_socket = f"{meta}/{ep.unix_socket.name}"
        argv = [python_executable(), "-I", "-c", RELAY, inner_socket, ep.path,
                *self._argv(f"{meta}/task.json", SANDBOX_WORKDIR)]  # fmt: skip
        limits = dataclasses.replace(self.sandbox, wall_s=wall)
        sandbox = Sandbox(
            workdir, limits, network=False, env=env, ro_paths=[*python_runtime(), *self.ro_paths]
        )
        r = await sandbox.run(argv)
        timed_out = r.status == SandboxStatus.TIMEOUT
        failure = ""
        if not r.ok and not timed_out:
            failure = (
                _describe_exit(r.returncode)
                if r.status == SandboxStatus.EXIT_NONZERO
                else f"failed in the sandbox ({r.status}): {r.message}"
            )
        return _Outcome(r.returncode, r.stdout, r.stderr, timed_out, failure)


def _remove_in_background(path: str) -> None:
    """rmtree off the calling thread (a finalizer may run on the event loop's)."""
    threading.Thread(
        target=shutil.rmtree, args=(path, True), name="rm-workdir", daemon=True
    ).start()


async def _read_tail(fd: int, buf: bytearray, cap: int) -> None:
    """Read the pipe ``fd`` to its end (or until cancelled), keeping its last ``cap`` bytes
    in ``buf``; the pipe is closed either way."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
    )
    try:
        while chunk := await reader.read(65536):
            buf += chunk
            del buf[: max(len(buf) - cap, 0)]
    finally:
        transport.close()


def _describe_exit(rc: int | None) -> str:
    if rc is not None and rc < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


def _kill_group(pid: int) -> None:
    """SIGKILL the program's process group (it is its own session leader)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
