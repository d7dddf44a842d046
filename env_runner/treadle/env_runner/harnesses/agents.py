"""Harness presets: third-party CLI coding agents, unmodified, as the harness of a rollout
(each a ``CommandHarness``: its model calls go through the rollout's interception server
and are recorded token-exactly; see command.py).

    from treadle.env_runner.harnesses.agents import claude_code, codex
    ENVIRONMENT = Environment("fix_bug", prompt=..., rubric=Rubric(rewards=[tests_pass]),
        harness=claude_code("/opt/agents/node_modules/.bin/claude"),
        runtime=SandboxRuntime(SandboxLimits(wall_s=600, memory_bytes=4 << 30)))

Claude Code (npm ``@anthropic-ai/claude-code``; run here with 2.1.197): ``claude -p PROMPT``,
the prompt being the text of the environment's last user message
(``.treadle/prompt.txt``), with

- the Anthropic dialect: ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY`` are the
  rollout's endpoint and key (the harness sets them); ``--model`` is the served name;
- ``HOME`` a fresh folder in the work dir, so its settings and session files stay with the
  rollout and no rollout sees another's; no telemetry, error reporting or update checks
  (``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``, ``DISABLE_AUTOUPDATER``): in the sandbox
  it has no network but the model;
- ``--allowedTools``: the tools it may use without asking (default: files and shell in
  the work dir); ``--output-format json``: stdout is one JSON object whose ``result`` is
  its final answer (rewards read ``state.info["stdout"]``, or the work dir).

Codex CLI (npm ``@openai/codex``; run here with 0.171.0): ``codex exec PROMPT`` with

- the OpenAI Responses dialect through a provider of its own (``-c model_providers...``:
  ``base_url`` the rollout's ``OPENAI_BASE_URL``, ``env_key`` ``OPENAI_API_KEY``,
  ``wire_api = "responses"``); ``-m`` is the served name;
- ``CODEX_HOME`` a fresh folder in the work dir; no git repository needed;
- its own sandbox and approvals off (``--dangerously-bypass-approvals-and-sandbox``: the
  rollout's runtime is the sandbox); the tools a runner cannot serve off: hosted web
  search (``web_search = "disabled"``) and the sub-agent and goal tools, which it sends as
  tool namespaces (``--disable multi_agent --disable goals``), so that every tool it
  offers the model is a function it runs itself (``exec_command``, ``write_stdin``, ...).

The agent runs in the environment's runtime (or the harness's ``runtime=``). Its install
must be readable there: its ``node_modules`` is added to ``ro_paths`` (in the sandbox it
must not be under /tmp or /work, which the sandbox replaces).

Not here: the interception server (interception/), the runtimes (runtimes/).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from treadle.env_runner.harnesses.command import CommandHarness

CLAUDE_CODE_TOOLS = ("Read", "Write", "Edit", "Glob", "Grep", "Bash")

# run in the work dir; the agent's state inside it; the prompt from the file the harness writes
_CLAUDE_SCRIPT = (
    'export HOME="$PWD/.treadle/home"; mkdir -p "$HOME"; '
    'exec "$0" -p "$(cat .treadle/prompt.txt)" --output-format json '
    '--model "$TREADLE_MODEL" "$@"'
)
_CODEX_SCRIPT = (
    'export CODEX_HOME="$PWD/.treadle/codex"; mkdir -p "$CODEX_HOME"; '
    'exec "$0" exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox '
    "-c model_provider=treadle -c model_providers.treadle.name=treadle "
    '-c "model_providers.treadle.base_url=\\"$OPENAI_BASE_URL\\"" '
    "-c model_providers.treadle.env_key=OPENAI_API_KEY "
    "-c model_providers.treadle.wire_api=responses "
    "-c web_search=disabled --disable multi_agent --disable goals "
    '-m "$TREADLE_MODEL" "$@" "$(cat .treadle/prompt.txt)"'
)


def _install_dir(exe: Path) -> Path:
    """The npm install holding ``exe``: its node_modules when the resolved binary is in a
    (scoped) package there (the platform binaries sit beside it), else its folder."""
    binary = exe.resolve()
    for parent in binary.parents:
        if parent.name == "node_modules":
            return parent
    return binary.parent


def claude_code(
    executable: str | Path,
    *,
    allowed_tools: Sequence[str] = CLAUDE_CODE_TOOLS,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    **harness: Any,
) -> CommandHarness:
    """A CommandHarness running Claude Code at ``executable`` (see the module doc);
    ``harness``: CommandHarness settings (timeout_s, runtime, setup, max_turns, ...)."""
    args = ["--allowedTools", ",".join(allowed_tools)] if allowed_tools else []
    quiet = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
             "DISABLE_ERROR_REPORTING": "1", "DISABLE_TELEMETRY": "1"}  # fmt: skip
    return _agent("claude_code", "@anthropic-ai/claude-code", _CLAUDE_SCRIPT, executable,
                  [*args, *extra_args], {**quiet, **(env or {})}, harness)  # fmt: skip


def codex(
    executable: str | Path,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    **harness: Any,
) -> CommandHarness:
    """A CommandHarness running Codex CLI at ``executable`` (see the module doc);
    ``harness``: CommandHarness settings (timeout_s, runtime, setup, max_turns, ...)."""
    return _agent("codex", "@openai/codex", _CODEX_SCRIPT, executable, list(extra_args),
                  dict(env or {}), harness)  # fmt: skip


def _agent(
    preset: str,
    package: str,
    script: str,
    executable: str | Path,
    args: list[str],
    env: dict[str, str],
    harness: dict[str, Any],
) -> CommandHarness:
    exe = Path(executable)
    if not exe.exists():
        raise ValueError(f"{preset}: no such executable {exe} (npm install {package})")
    # readable wherever it runs (the local runtime sees it anyway)
    ro_paths = [*harness.pop("ro_paths", ()), str(_install_dir(exe))]
    return CommandHarness(
        ["sh", "-c", script, str(exe), *args], env=env, ro_paths=ro_paths, **harness
    )
