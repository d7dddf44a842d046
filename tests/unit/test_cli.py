"""The `treadle` command: help everywhere, clear messages on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.services.cli import main


@pytest.mark.parametrize(
    "argv",
    [[], ["rl"], ["sft"], ["eval"], ["stack"], ["serve"], ["report"], ["env"], ["env", "init"]],
)
def test_cli_help_on_every_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    assert "usage: treadle" in capsys.readouterr().out


def test_cli_eval_without_an_environment_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["eval"]) == 2
    err = capsys.readouterr().err
    assert "eval.env is required" in err
    assert "Traceback" not in err


def test_cli_unknown_service_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "trainr"]) == 2
    assert (
        "unknown service 'trainr'; services are: inference, trainer, orchestrator, env_runner"
        in capsys.readouterr().err
    )


def test_cli_config_errors_exit_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "run.toml"
    bad.write_text("[launcher]\nhealth_timeout = 3\n")
    assert main(["stack", "@", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("treadle: configuration error: invalid configuration")
    assert "launcher.health_timeout: unknown key" in err
    assert "Traceback" not in err


def test_cli_stack_dry_run_prints_every_service_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stack", "--dry-run", "--run.name", "dry"]) == 0
    out = capsys.readouterr().out
    assert 'name = "dry"' in out
    for section in (
        "[launcher]",
        "[inference.grpc]",
        "[trainer.grpc]",
        "[orchestrator.grpc]",
        "[env_runner.grpc]",
    ):
        assert section in out


def test_cli_report_summarizes_a_run_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "myrun"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "trainer.log").write_text(
        "12:00:00 INFO trainer up\n12:00:01 ERROR   trainer boom\n"
    )
    rows = [
        {"time": 1.0, "service": "orchestrator", "step": 1, "reward_mean": 0.1},
        {"time": 2.0, "service": "orchestrator", "step": 2, "reward_mean": 0.4},
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    assert main(["report", str(run), "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "metrics: 2 records from orchestrator (1 unreadable lines)" in out
    assert "reward_mean" in out
    assert "first 1: 0.1 -> last 1: 0.4" in out
    assert "1 error lines" in out
    assert not (run / "report.html").exists()  # --no-write


def test_cli_report_refuses_a_non_run_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "does not look like a Treadle run folder" in capsys.readouterr().err


def test_cli_rl_dry_run_validates_every_service_of_the_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "model").mkdir()  # dry runs check the folder's shape, never load it
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    (tmp_path / "tasks.jsonl").write_text('{"text": "abc"}\n')
    model = str(tmp_path / "model")
    tasks = str(tmp_path / "tasks.jsonl")
    rl = ["--inference.model", model, "--trainer.model", model, "--orchestrator.tasks", tasks]
    rl += ["--env_runner.tokenizer", model, "--orchestrator.max_steps", "7"]
    assert main(["rl", "--dry-run", *rl]) == 0
    out = capsys.readouterr().out
    for section in ("[inference.grpc]", "[trainer.grpc]", "[orchestrator]", "[env_runner]"):
        assert section in out
    assert "max_steps = 7" in out
    sft = ["--trainer.model", model, "--orchestrator.tasks", tasks]
    assert main(["sft", "--dry-run", *sft, "--orchestrator.tokenizer", model]) == 0
    assert "[inference" not in capsys.readouterr().out


def test_cli_jobs_name_every_missing_required_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rl", "--dry-run", "--trainer.model", "m"]) == 2
    err = capsys.readouterr().err
    assert "the rl job needs inference.model, orchestrator.tasks, env_runner.tokenizer" in err
    assert main(["sft", "--dry-run"]) == 2
    assert "trainer.model, orchestrator.tasks, orchestrator.tokenizer" in capsys.readouterr().err


def test_cli_rl_config_error_names_the_service_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rl", "--dry-run", "--orchestrator.group_size", "1"]) == 2
    err = capsys.readouterr().err
    assert "- orchestrator: " in err
    assert "needs groups of at least 2 rollouts; orchestrator.group_size is 1" in err
