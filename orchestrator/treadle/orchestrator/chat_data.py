"""SFT datasets: chat conversations from a messages JSONL file or a local Hugging Face dataset.

A row is ``{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]?}`` (the
OpenAI chat format; assistant messages may carry ``tool_calls``, tool results are
``role = "tool"``). ``orchestrator.tasks`` names:

- a JSONL file, one row per line (what ``treadle sft-data`` and most chat corpora write);
- a folder written by ``datasets``' ``save_to_disk`` (a Dataset, or a DatasetDict: its
  ``train`` split, or its only split), or a folder of data files ``load_dataset`` reads;
- a ``.parquet`` or ``.arrow`` file.

Hugging Face datasets need the ``datasets`` package (``treadle-orchestrator[datasets]``);
nothing is downloaded: paths are local. Arrow fills keys a row lacks with null, so null
message fields are dropped, and ``tools`` may also be a JSON string.

Every row is checked when the dataset is opened, before the first batch: a row without
``messages``, with a message that is not an object, an unknown role, content that is
not text, or no assistant message (it would train nothing) is a ConfigError naming the
row (``file.jsonl:LINE`` or ``folder row INDEX``) and the field. ``check_rendering``
also renders every row with the model's template (``treadle sft`` does this before it
starts anything) and counts rows longer than ``seq_len``.

Not here: building batches (sft.py) and writing datasets from environments (the env
runner's ``sft_data``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.orchestrator.tasks import Task, load_tasks
from treadle.services.errors import ConfigError

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
"""Chat roles a row may use (developer = system, ipython = tool, as the renderer reads them)."""
HF_SUFFIXES = (".parquet", ".arrow")


@dataclass(frozen=True)
class ChatDataset:
    path: Path
    rows: list[Task]
    """One Task per conversation (``data`` holds messages and tools; ``line`` says where)."""
    hf: bool = False
    """Read with ``datasets`` (``Task.line`` is then the 0-based row index)."""

    def where(self, task: Task) -> str:
        """The row's place, for errors: ``file.jsonl:LINE`` or ``folder row INDEX``."""
        return f"{self.path} row {task.line}" if self.hf else f"{self.path}:{task.line}"


def load_chat_dataset(path: Path) -> ChatDataset:
    """Open and check the SFT dataset at ``path`` (see the module doc)."""
    if path.is_dir() or path.suffix in HF_SUFFIXES:
        ds = ChatDataset(path, _hf_rows(path), hf=True)
    else:
        ds = ChatDataset(path, load_tasks(path))
    for task in ds.rows:
        check_conversation(task.data, ds.where(task))
    return ds


def check_conversation(row: dict[str, Any], where: str) -> None:
    """A ConfigError naming ``where`` and the field unless ``row`` is a trainable conversation."""
    if "messages" not in row:
        fields = ", ".join(sorted(map(str, row))) or "none"
        raise ConfigError(
            f"{where}: no 'messages' field (the row's fields: {fields}); an SFT row is "
            '{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}'
        )
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise ConfigError(f"{where}: 'messages' must be a non-empty list of messages, got {what}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConfigError(
                f"{where}: messages[{i}] must be an object with 'role' and 'content', "
                f"got {type(m).__name__}"
            )
        role = m.get("role")
        if role not in ROLES:
            shown = "missing" if role is None else f"{role!r}"
            raise ConfigError(
                f"{where}: messages[{i}].role is {shown}, not a chat role ({', '.join(ROLES)})"
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ConfigError(
                f"{where}: messages[{i}].content must be text, a list of parts or null, "
                f"got {type(content).__name__}"
            )
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ConfigError(
                f"{where}: messages[{i}].tool_calls must be a list, got {type(calls).__name__}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(
            f"{where}: 'messages' has no assistant message: SFT learns what the assistant "
            "says, so this row would train nothing"
        )
    tools = row.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ConfigError(
            f"{where}: 'tools' must be a list of tool schemas (objects), got {_kind(tools)}"
        )


def render_row(ds: ChatDataset, task: Task, renderer: Any) -> Any:
    """Row ``task`` of ``ds`` rendered by ``renderer`` (token ids and the loss mask over
    what the assistant says); a ConfigError naming the row when the template cannot."""
    import treadle_native

    try:
        return renderer.render(task.data["messages"], tools=task.data.get("tools"))
    except treadle_native.TreadleNativeError as e:
        raise ConfigError(f"{ds.where(task)}: the chat template cannot render it: {e}") from None


def check_rendering(ds: ChatDataset, renderer: Any, seq_len: int) -> dict[str, int]:
    """Render every row with ``renderer`` (a ConfigError naming the row when the template
    cannot render it); returns counts: rows, tokens, assistant (loss) tokens, rows longer
    than ``seq_len`` (truncated in training)."""
    stats = {"num_rows": len(ds.rows), "num_tokens": 0, "num_loss_tokens": 0, "num_too_long": 0}
    for task in ds.rows:
        out = render_row(ds, task, renderer)
        n = len(out)
        stats["num_tokens"] += n
        stats["num_loss_tokens"] += int(out.loss_mask.sum())
        stats["num_too_long"] += n > seq_len
    return stats


def check_job_dataset(cfg: Any) -> str:
    """``treadle sft``'s check before anything starts: the dataset of the orchestrator
    section ``cfg`` opens, and every row renders with its tokenizer; a line saying so."""
    from treadle.services.rendering import open_renderer

    assert cfg.tasks is not None  # the launcher requires it
    assert cfg.tokenizer is not None  # ... and this
    ds = load_chat_dataset(cfg.tasks)
    renderer = open_renderer(
        cfg.renderer, cfg.tokenizer, force=cfg.renderer_force, what="orchestrator.renderer"
    )
    stats = check_rendering(ds, renderer, cfg.seq_len)
    line = (
        f"[sft] {ds.path}: {stats['num_rows']} conversations, {stats['num_tokens']} tokens "
        f"({stats['num_loss_tokens']} trained: the assistant's)"
    )
    if stats["num_too_long"]:
        line += (
            f"; {stats['num_too_long']} longer than orchestrator.seq_len = {cfg.seq_len} "
            "are truncated"
        )
    return line


def _kind(value: Any) -> str:
    return type(value).__name__


# --- Hugging Face datasets ---------------------------------------------------------------------
def _hf_rows(path: Path) -> list[Task]:
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(
            f"orchestrator.tasks = {str(path)!r} is a Hugging Face dataset, which needs the "
            "`datasets` package: pip install 'treadle-orchestrator[datasets]' (or point "
            "orchestrator.tasks at a messages JSONL file)"
        ) from None
    if not path.exists():
        raise ConfigError(f"orchestrator.tasks: {path} does not exist")
    try:
        if path.is_file():
            kind = "parquet" if path.suffix == ".parquet" else "arrow"
            loaded: Any = datasets.load_dataset(kind, data_files=str(path))
        elif (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            loaded = datasets.load_from_disk(str(path))
        else:  # a folder of data files (parquet, jsonl, ...)
            loaded = datasets.load_dataset(str(path))
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetGenerationError) as e:
        raise ConfigError(f"orchestrator.tasks: cannot read {path} as a dataset: {e}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(splits) == 1:
            loaded = loaded[splits[0]]
        else:
            raise ConfigError(
                f"orchestrator.tasks: {path} holds the splits {', '.join(splits)} and none is "
                "'train': save the split to train on alone (dataset_dict[name].save_to_disk)"
            )
    rows: list[Task] = []
    seen: set[str] = set()
    for index, raw in enumerate(loaded):
        data = _from_arrow(dict(raw))
        task_id = str(data.get("id", f"row{index}"))
        if task_id in seen:
            raise ConfigError(f"{path} row {index}: duplicate id {task_id!r}")
        seen.add(task_id)
        rows.append(Task(task_id, data, json.dumps(data, ensure_ascii=False, default=str), index))
    if not rows:
        raise ConfigError(f"{path} holds no rows")
    return rows


def _from_arrow(row: dict[str, Any]) -> dict[str, Any]:
    """A row as JSON would have it: null message fields (Arrow's filling of keys other
    rows have) dropped, a ``tools`` JSON string parsed."""
    messages = row.get("messages")
    if isinstance(messages, list):
        row["messages"] = [
            {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
            for m in messages
        ]
    tools = row.get("tools")
    if tools is None:
        row.pop("tools", None)
    elif isinstance(tools, str):
        try:
            row["tools"] = json.loads(tools)
        except json.JSONDecodeError:
            pass  # check_conversation names it
    return row
