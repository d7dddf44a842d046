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

opencode (npm ``opencode-ai``; run here with 1.18.33, a Bun executable): ``opencode run
PROMPT`` with

- the OpenAI Chat Completions dialect through a provider of its own in a config file the
  harness writes (``@ai-sdk/openai-compatible``, bundled: nothing is installed at run
  time; ``baseURL`` the rollout's ``OPENAI_BASE_URL``, the key from ``OPENAI_API_KEY``),
  ``-m treadle/<served name>``;
- ``HOME`` and the XDG folders fresh in the work dir; no title generation (a second model
  call per rollout), no sharing, no autoupdate; its fetch of the public model list fails
  offline and it goes on without it;
- in the sandbox, Bun reserves far more address space than it uses: give the runtime's
  limits ``address_space_bytes`` of 16 GiB or more (at 4 GiB it crashes with SIGILL when
  it starts a tool's shell); memory stays capped by ``memory_bytes``.

mini-swe-agent (PyPI ``mini-swe-agent``; run here with 2.4.6, in a virtualenv of its own:
it brings litellm): ``mini --yolo --exit-immediately --task PROMPT`` with

- the OpenAI Chat Completions dialect through litellm (``--model openai/<served name>``,
  ``model.model_kwargs.api_base`` the rollout's ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``
  from the harness), its ``bash`` tool run in the work dir by its own local environment;
- no first-run setup, no cost tracking (``MSWEA_CONFIGURED``, ``MSWEA_COST_TRACKING``),
  litellm's bundled model map (``LITELLM_LOCAL_MODEL_COST_MAP``: no download), its global
  config folder in the work dir, its trajectory in ``.treadle/mini.traj.json``;
- ``step_limit``: the model calls it may make (it stops cleanly beyond, unattended).

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

# the config is written by the shell, so that it holds this rollout's URL and model name
_OPENCODE_SCRIPT = """export HOME="$PWD/.treadle/home"; export XDG_CONFIG_HOME="$HOME/.config"
export XDG_DATA_HOME="$HOME/.local/share" XDG_CACHE_HOME="$HOME/.cache" XDG_STATE_HOME="$HOME/.local/state"
mkdir -p "$XDG_CONFIG_HOME/opencode"
cat > "$XDG_CONFIG_HOME/opencode/opencode.json" <<EOF
{"provider": {"treadle": {"npm": "@ai-sdk/openai-compatible", "name": "treadle",
  "options": {"baseURL": "$OPENAI_BASE_URL", "apiKey": "{env:OPENAI_API_KEY}"},
  "models": {"$TREADLE_MODEL": {}}}},
 "model": "treadle/$TREADLE_MODEL", "small_model": "treadle/$TREADLE_MODEL",
 "autoupdate": false, "share": "disabled", "agent": {"title": {"disable": true}}}
EOF
exec "$0" run -m "treadle/$TREADLE_MODEL" "$@" "$(cat .treadle/prompt.txt)"
"""

_MINI_SCRIPT = (
    'export MSWEA_GLOBAL_CONFIG_DIR="$PWD/.treadle/mini"; mkdir -p "$MSWEA_GLOBAL_CONFIG_DIR"; '
    'exec "$0" --yolo --exit-immediately --cost-limit 0 --model "openai/$TREADLE_MODEL" '
    '-c mini.yaml -c "model.model_kwargs.api_base=$OPENAI_BASE_URL" '
    '-o .treadle/mini.traj.json "$@" --task "$(cat .treadle/prompt.txt)"'
)


def _install_dir(exe: Path) -> Path:
    """The install holding ``exe``: its node_modules when the resolved binary is in a
    (scoped) npm package there (the platform binaries sit beside it), the virtualenv when
    it is a script of one (``<venv>/bin/<exe>``), else its folder."""
    binary = exe.resolve()
    for parent in binary.parents:
        if parent.name == "node_modules":
            return parent
    if (exe.parent.parent / "pyvenv.cfg").is_file():
        return exe.parent.parent
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


def opencode(
    executable: str | Path,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    **harness: Any,
) -> CommandHarness:
    """A CommandHarness running opencode at ``executable`` (see the module doc);
    ``harness``: CommandHarness settings (timeout_s, runtime, setup, max_turns, ...)."""
    quiet = {"OPENCODE_DISABLE_AUTOUPDATE": "true", "NO_COLOR": "1"}
    return _agent("opencode", "opencode-ai", _OPENCODE_SCRIPT, executable, list(extra_args),
                  {**quiet, **(env or {})}, harness)  # fmt: skip


def mini_swe_agent(
    executable: str | Path,
    *,
    step_limit: int = 20,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    **harness: Any,
) -> CommandHarness:
    """A CommandHarness running mini-swe-agent's ``mini`` at ``executable`` (the script in
    its virtualenv; see the module doc); ``harness``: CommandHarness settings."""
    if step_limit < 1:
        raise ValueError(f"mini_swe_agent: step_limit must be >= 1, got {step_limit}")
    quiet = {"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
             "MSWEA_SILENT_STARTUP": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
             "LITELLM_TELEMETRY": "False", "NO_COLOR": "1"}  # fmt: skip
    args = ["-c", f"agent.step_limit={step_limit}", *extra_args]
    return _agent("mini_swe_agent", "mini-swe-agent", _MINI_SCRIPT, executable, args,
                  {**quiet, **(env or {})}, harness, installer="pip install")  # fmt: skip


def _agent(
    preset: str,
    package: str,
    script: str,
    executable: str | Path,
    args: list[str],
    env: dict[str, str],
    harness: dict[str, Any],
    installer: str = "npm install",
) -> CommandHarness:
    exe = Path(executable)
    if not exe.exists():
        raise ValueError(f"{preset}: no such executable {exe} ({installer} {package})")
    # readable wherever it runs (the local runtime sees it anyway)
    ro_paths = [*harness.pop("ro_paths", ()), str(_install_dir(exe))]
    return CommandHarness(
        ["sh", "-c", script, str(exe), *args], env=env, ro_paths=ro_paths, **harness
    )
