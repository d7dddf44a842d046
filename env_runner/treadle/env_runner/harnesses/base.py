"""What every harness shares: the Harness protocol, what it may ask of its environment,
and the harness's own failure.

A harness runs one rollout: it builds the conversation, calls the model through the
rollout's ModelSession (which records every turn token-exactly), runs tools or a program
in the environment's runtime, and leaves the final conversation in ``state.messages`` for
the rubric. It knows its environment only through :class:`EnvView` (no import of
``environments``: an Environment is built from harnesses, never the reverse).

Not here: the harnesses themselves (chat.py: SingleTurn, ToolUse, UserSimulator;
command.py: CommandHarness; agents.py: presets of third-party CLI agents).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from treadle.env_runner.tools import RunSync
from treadle.proto.v1 import rollout_pb2

if TYPE_CHECKING:
    from treadle.env_runner.rubric import RolloutState
    from treadle.env_runner.runtimes.base import Runtime
    from treadle.env_runner.session import ModelSession
    from treadle.env_runner.tools import ToolSet


class HarnessError(Exception):
    """The harness itself failed (e.g. its program exited non-zero): ERROR_KIND_HARNESS."""

    error_kind: ClassVar[int] = rollout_pb2.RolloutStatus.ErrorKind.ERROR_KIND_HARNESS


class RuntimeFailure(HarnessError):
    """The harness's program passed a limit of its runtime (memory, CPU time, processes,
    output, work-dir size), or the runtime could not run it at all (no bubblewrap, a
    container engine that failed): ERROR_KIND_SANDBOX."""

    error_kind: ClassVar[int] = rollout_pb2.RolloutStatus.ErrorKind.ERROR_KIND_SANDBOX


class EnvView(Protocol):
    """What a harness reads of its environment."""

    name: str
    runtime: Runtime
    """Where the environment's programs run."""

    async def messages(self, task: dict[str, Any], run_sync: RunSync) -> list[dict[str, Any]]:
        """The opening conversation of ``task``."""
        ...

    def toolset(self, task: dict[str, Any]) -> ToolSet:
        """The tools the model may call on ``task``."""
        ...


class Harness(Protocol):
    async def run(self, env: EnvView, task: dict[str, Any], session: ModelSession,
                  state: RolloutState, run_sync: RunSync) -> None: ...  # fmt: skip
