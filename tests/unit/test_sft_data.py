"""`treadle sft-data` / `treadle sft` with [sft_data]: rejection sampling an environment
through `treadle eval`'s engine against an OpenAI-compatible endpoint (a scripted HTTP
server, testkit.chat_endpoint), the filter's edges, resume, and the CLI."""

from __future__ import annotations

import asyncio
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.chat_endpoint import ReverserEndpoint
from testkit.paths import shared_tokenizer
from treadle.env_runner.sft_data import (
    NothingKeptError,
    SFTDataConfig,
    build,
    dataset_path,
    select,
)
from treadle.orchestrator.chat_data import check_rendering, load_chat_dataset
from treadle.services.cli import main
from treadle.services.rendering import open_renderer


@pytest.fixture
def model_url() -> Iterator[str]:
    with ReverserEndpoint() as url:
        yield url


def config(tmp_path: Path, url: str, **sft_data: Any) -> SFTDataConfig:
    return SFTDataConfig.model_validate({
        "run": {"name": "sd", "output_dir": str(tmp_path)},
        "sft_data": {"env": "reverse_text", "base_url": url, "model": "teacher", "num_tasks": 3,
                     "samples_per_task": 3, "sampling": {"seed": 0}} | sft_data,
    })  # fmt: skip


def run(cfg: SFTDataConfig, stream: Any = None) -> dict[str, Any]:
    return asyncio.run(build(cfg, stream=stream or io.StringIO()))


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sft_data_keeps_samples_at_or_above_the_threshold(tmp_path: Path, model_url: str) -> None:
    # per task: sample 0 reward 1.0 (exact), sample 1 partial, sample 2 the echo (lower)
    summary = run(config(tmp_path, model_url, min_reward=1.0))
    assert summary["num_samples"] == 9
    assert summary["num_kept"] == 3
    assert summary["kept_per_task"] == {"1": 3}
    rows = rows_of(dataset_path(config(tmp_path, model_url)))
    assert [r["index"] for r in rows] == [0, 0, 0]
    assert all(r["reward"] == 1.0 for r in rows)
    for r in rows:
        system, user, assistant = r["messages"]
        assert system["role"] == "system"
        assert system["content"] == "Reverse the text."  # the environment's prompt
        assert assistant == {"role": "assistant", "content": user["content"][::-1]}
        assert "tools" not in r


def test_sft_data_threshold_edges_and_max_per_task(tmp_path: Path, model_url: str) -> None:
    summary = run(config(tmp_path, model_url, min_reward=0.0, max_per_task=2))
    assert summary["num_kept"] == 6  # reward >= 0 keeps every sample; two per task remain
    rows = rows_of(dataset_path(config(tmp_path, model_url)))
    by_task: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r)
    for group in by_task.values():
        assert [r["index"] for r in group] == [0, 1]  # the two best rewards of the three
    edge = min(rows, key=lambda r: r["reward"])
    assert 0 < edge["reward"] < 1
    # a threshold exactly at a sample's reward keeps it
    run(config(tmp_path, model_url, min_reward=edge["reward"]))
    kept = rows_of(dataset_path(config(tmp_path, model_url)))
    assert edge["id"] in {r["id"] for r in kept}
    assert all(r["reward"] >= edge["reward"] for r in kept)
    assert len(ReverserEndpoint.calls) == 9  # both reruns only filtered again


def test_sft_data_threshold_keeping_nothing_is_an_error(tmp_path: Path, model_url: str) -> None:
    cfg = config(tmp_path, model_url, min_reward=1.0)
    run(cfg)
    assert dataset_path(cfg).exists()
    with pytest.raises(NothingKeptError, match=r"no sample reached sft_data.min_reward = 1.5 "
                       r"\(best reward 1.000 over 9 ok samples of 3 tasks\)"):  # fmt: skip
        run(config(tmp_path, model_url, min_reward=1.5))
    assert not dataset_path(cfg).exists()  # no older dataset left to train on
    summary = json.loads((dataset_path(cfg).parent / "sft_data.json").read_text())
    assert summary["num_kept"] == 0


def test_sft_data_resumes_and_samples_only_what_is_new(tmp_path: Path, model_url: str) -> None:
    run(config(tmp_path, model_url, num_tasks=2))
    assert len(ReverserEndpoint.calls) == 6
    results = tmp_path / "sd" / "sft_data" / "results.jsonl"
    lines = results.read_text().splitlines()
    results.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:30])  # a crash cut a line
    out = io.StringIO()
    summary = run(config(tmp_path, model_url, num_tasks=3, samples_per_task=4), out)
    # the cut sample, 2 more samples of the 2 old tasks, 4 of the new one
    assert len(ReverserEndpoint.calls) == 6 + 1 + 2 + 4
    assert summary["num_samples"] == 12
    assert "[sft_data] resuming: 5 rollouts already in" in out.getvalue()
    assert "[sft_data] |" in out.getvalue()  # the progress line
    from treadle.services.errors import ConfigError

    with pytest.raises(ConfigError, match=r"different sft_data config .* --sft_data.resume false"):
        run(config(tmp_path, model_url, model="other"))


def test_sft_data_from_an_unreachable_model_says_why_and_a_rerun_samples_again(
    tmp_path: Path, free_port: int
) -> None:
    cfg = config(tmp_path, f"http://127.0.0.1:{free_port}/v1", num_tasks=2, samples_per_task=1)
    with pytest.raises(NothingKeptError, match=r"no sample of 2 finished ok \(error:inference 2\)"):
        run(cfg)
    with ReverserEndpoint(port=free_port):  # the endpoint is up now
        assert run(cfg)["num_kept"] == 2  # the endpoint's failures were not kept as done
        assert len(ReverserEndpoint.calls) == 2


def test_sft_data_with_tools_keeps_the_schemas_and_renders(tmp_path: Path, model_url: str) -> None:
    cfg = config(tmp_path, model_url, env="tool_search", num_tasks=1, samples_per_task=1)
    assert run(cfg)["num_kept"] == 1
    (row,) = rows_of(dataset_path(cfg))
    assert [m["role"] for m in row["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert row["messages"][2]["tool_calls"][0]["function"]["name"] == "search"
    assert [t["function"]["name"] for t in row["tools"]] == ["search", "calculator"]
    # the SFT feed's reader takes it, and the qwen3 template renders it with the tools
    ds = load_chat_dataset(dataset_path(cfg))
    renderer = open_renderer("auto", shared_tokenizer("qwen3"), what="orchestrator.renderer")
    stats = check_rendering(ds, renderer, seq_len=4096)
    assert stats["num_rows"] == 1
    assert 0 < stats["num_loss_tokens"] < stats["num_tokens"]
    assert len(renderer.render(row["messages"], tools=row["tools"])) > len(
        renderer.render(row["messages"])
    )  # the schemas are in the prompt


def row(task: str, index: int, reward: float, status: str = "ok") -> dict[str, Any]:
    return {"task_id": task, "index": index, "reward": reward, "status": status,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}  # fmt: skip


def test_select_drops_errors_truncations_and_nan_and_breaks_ties_by_index() -> None:
    rows = [row("a", 0, 0.5), row("a", 1, 0.9), row("a", 2, 0.9), row("a", 3, 1.0, "truncated"),
            row("b", 0, math.nan), row("b", 1, 1.0, "error"), row("c", 0, 0.7)]  # fmt: skip
    kept = select(rows, 0.5, 2)
    assert [(r["task_id"], r["index"]) for r in kept] == [("a", 1), ("a", 2), ("c", 0)]
    assert [(r["task_id"], r["index"]) for r in select(rows, 0.5, None)] == [
        ("a", 1), ("a", 2), ("a", 0), ("c", 0)
    ]  # fmt: skip
    no_answer = row("d", 0, 1.0) | {"messages": [{"role": "user", "content": "q"}]}
    assert select([no_answer], 0.0, None) == []


def test_cli_sft_data_prints_the_summary(
    tmp_path: Path, model_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["sft-data", "--sft_data.env", "reverse_text", "--sft_data.base_url", model_url,
                 "--sft_data.num_tasks", "2", "--sft_data.samples_per_task", "2",
                 "--sft_data.sampling.seed", "0", "--run.output_dir", str(tmp_path), "--run.name", "c"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 tasks x 2 samples = 4" in out
    assert "kept: 2 samples with reward >= 1, from 2/2 tasks" in out
    assert "tasks by samples kept: 1: 2" in out
    assert f"dataset: {tmp_path / 'c' / 'sft_data' / 'dataset.jsonl'} (2 conversations)" in out
    code = main(["sft-data", "--sft_data.env", "reverse_text", "--sft_data.base_url", model_url,
                 "--sft_data.num_tasks", "2", "--sft_data.samples_per_task", "2", "--sft_data.min_reward", "2",
                 "--sft_data.sampling.seed", "0", "--run.output_dir", str(tmp_path), "--run.name", "c"])  # fmt: skip
    assert code == 1
    assert "treadle: error: no sample reached sft_data.min_reward = 2" in capsys.readouterr().err


def model_folder(tmp_path: Path) -> str:
    """A folder of a model's shape: dry runs check it, never load it."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    return str(tmp_path / "model")


@pytest.mark.parametrize(("job", "setting"), [("sft", "tasks"), ("rl", "demos.data")])
def test_cli_dry_run_with_sft_data_points_the_jobs_setting_at_the_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], job: str, setting: str
) -> None:
    """With [sft_data] env the dataset sampled first is `treadle sft`'s orchestrator.tasks
    and `treadle rl`'s orchestrator.demos.data (every batch's demonstrations); setting it
    too is an error."""
    model = model_folder(tmp_path)
    base = ["--trainer.model", model, "--orchestrator.tokenizer", model,
            "--run.output_dir", str(tmp_path), "--run.name", "s"]  # fmt: skip
    if job == "rl":
        tasks = tmp_path / "t.jsonl"
        tasks.write_text(json.dumps({"id": "t", "text": "abc"}) + "\n")
        base += ["--inference.model", model, "--orchestrator.tasks", str(tasks),
                 "--env_runner.tokenizer", model]  # fmt: skip
    src = ["--sft_data.env", "reverse_text", "--sft_data.base_url", "http://127.0.0.1:9/v1"]
    assert main([job, "--dry-run", *base, *src]) == 0
    out = capsys.readouterr().out
    key = setting.rpartition(".")[2]
    assert f'{key} = "{tmp_path / "s" / "sft_data" / "dataset.jsonl"}"' in out
    assert not (tmp_path / "s").exists()  # a dry run samples nothing
    assert main([job, "--dry-run", *base, *src, f"--orchestrator.{setting}", "x.jsonl"]) == 2
    assert f"set either orchestrator.{setting}" in capsys.readouterr().err
    assert main([job, "--dry-run", *base, "--sft_data.env", "reverse_text"]) == 2
    assert 'backend "openai" needs sft_data.base_url' in capsys.readouterr().err
    if job == "rl":  # no [sft_data]: no demonstrations
        assert main(["rl", "--dry-run", *base]) == 0
        assert "dataset.jsonl" not in capsys.readouterr().out
