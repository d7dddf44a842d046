"""SFT datasets (orchestrator chat_data): messages JSONL and local Hugging Face datasets,
and the bad rows that must stop `treadle sft` before anything starts, naming the row."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from testkit.paths import shared_tokenizer
from treadle.orchestrator.chat_data import check_rendering, load_chat_dataset
from treadle.services.cli import main
from treadle.services.errors import ConfigError
from treadle.services.rendering import open_renderer

CHAT = [
    {"role": "system", "content": "Reverse the text."},
    {"role": "user", "content": "abc"},
    {"role": "assistant", "content": "cba"},
]
TOOL_CHAT = {
    "messages": [
        {"role": "user", "content": "When was Brindle founded?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "search", "arguments": '{"query": "Brindle"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Brindle was founded in 1847."},
        {"role": "assistant", "content": "1847"},
    ],
    "tools": [{"type": "function", "function": {"name": "search", "description": "Search.",
               "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}],
}  # fmt: skip


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_data_reads_a_messages_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"id": "t", **TOOL_CHAT}])
    ds = load_chat_dataset(path)
    assert [t.task_id for t in ds.rows] == ["line1", "t"]
    assert ds.rows[1].data["tools"][0]["function"]["name"] == "search"
    assert ds.where(ds.rows[1]) == f"{path}:2"


@pytest.mark.parametrize(
    ("row", "error"),
    [
        ({"prompt": "abc", "completion": "cba"},
         r"d.jsonl:3: no 'messages' field \(the row's fields: completion, prompt\)"),
        ({"messages": []}, r"d.jsonl:3: 'messages' must be a non-empty list of messages, got an empty list"),
        ({"messages": "hi"}, r"d.jsonl:3: 'messages' must be a non-empty list of messages, got str"),
        ({"messages": [CHAT[1], "cba"]}, r"d.jsonl:3: messages\[1\] must be an object"),
        ({"messages": [CHAT[1], {"role": "bot", "content": "cba"}]},
         r"d.jsonl:3: messages\[1\].role is 'bot', not a chat role \(system, developer, user, "),
        ({"messages": [CHAT[1], {"content": "cba"}]}, r"d.jsonl:3: messages\[1\].role is missing"),
        ({"messages": [CHAT[1], {"role": "assistant", "content": 7}]},
         r"d.jsonl:3: messages\[1\].content must be text, a list of parts or null, got int"),
        ({"messages": CHAT[:2]}, r"d.jsonl:3: 'messages' has no assistant message"),
        ({"messages": CHAT, "tools": {"name": "search"}},
         r"d.jsonl:3: 'tools' must be a list of tool schemas \(objects\), got dict"),
    ],
)  # fmt: skip
def test_chat_data_bad_row_names_the_row_and_field(
    tmp_path: Path, row: dict[str, Any], error: str
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": CHAT}, row])
    with pytest.raises(ConfigError, match=error):
        load_chat_dataset(path)


def test_chat_data_reads_hugging_face_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": CHAT}, {"messages": TOOL_CHAT["messages"]}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    loaded = load_chat_dataset(tmp_path / "saved")
    assert [t.task_id for t in loaded.rows] == ["row0", "row1"]
    # Arrow gave the plain messages the tool fields of the others as nulls: dropped again
    assert loaded.rows[0].data["messages"] == CHAT
    assert loaded.rows[1].data["messages"][1]["tool_calls"][0]["function"]["name"] == "search"
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_chat_dataset(tmp_path / "dd").rows) == 2  # the train split
    datasets.DatasetDict({"a": ds, "b": ds}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(ConfigError, match=r"holds the splits a, b and none is 'train'"):
        load_chat_dataset(tmp_path / "ab")
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert len(load_chat_dataset(tmp_path / "d.parquet").rows) == 2
    (tmp_path / "files").mkdir()  # a folder of data files, as a hub snapshot has them
    write_jsonl(tmp_path / "files" / "train.jsonl", [{"messages": CHAT, "tools": json.dumps(TOOL_CHAT["tools"])}])  # fmt: skip
    (row,) = load_chat_dataset(tmp_path / "files").rows
    assert row.data["tools"] == TOOL_CHAT["tools"]  # a JSON string column is parsed


def test_chat_data_bad_hugging_face_row_names_its_index(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": CHAT}, {"messages": CHAT[:2]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ConfigError, match=r"saved row 1: 'messages' has no assistant message"):
        load_chat_dataset(tmp_path / "saved")


def test_chat_data_without_the_datasets_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "saved").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'treadle-orchestrator\[datasets\]'"):
        load_chat_dataset(tmp_path / "saved")


def test_chat_data_rendering_check_counts_tokens_and_names_a_bad_row(tmp_path: Path) -> None:
    renderer = open_renderer("auto", shared_tokenizer("qwen3"), what="orchestrator.renderer")
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, TOOL_CHAT])
    stats = check_rendering(load_chat_dataset(path), renderer, seq_len=40)
    assert stats["num_rows"] == 2
    assert 0 < stats["num_loss_tokens"] < stats["num_tokens"]
    assert stats["num_too_long"] == 1  # the tool conversation (its schemas alone are longer)
    bad_call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": "{not json"}}]}  # fmt: skip
    path = write_jsonl(
        tmp_path / "e.jsonl", [{"messages": CHAT}, {"messages": [CHAT[1], bad_call]}]
    )
    with pytest.raises(
        ConfigError, match=r"e.jsonl:2: the chat template cannot render it: .*not valid JSON"
    ):
        check_rendering(load_chat_dataset(path), renderer, seq_len=4096)


def test_cli_sft_stops_on_a_bad_row_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"prompt": "abc"}])
    model = str(tmp_path / "model")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    code = main(["sft", "--trainer.model", model, "--orchestrator.tokenizer", str(shared_tokenizer("qwen3")),
                 "--orchestrator.tasks", str(path), "--run.output_dir", str(tmp_path), "--run.name", "r"])  # fmt: skip
    assert code == 2
    assert f"treadle: configuration error: {path}:2: no 'messages' field" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # no run folder, no service started
