"""`treadle stack`/`rl` tell env runners the context inference serves: a rollout's model
calls then fit in `inference.max_model_len` when it is below the model's own context,
instead of being refused by vLLM (a 400 that ended the rollout as an inference error)."""

from __future__ import annotations

import json
from pathlib import Path

from treadle.env_runner.service import context_bound
from treadle.env_runner.spec import SPEC as ENV_RUNNER
from treadle.env_runner.spec import EnvRunnerConfig
from treadle.services.config import split_argv
from treadle.services.host import load_service_config
from treadle.services.launcher import _wiring, child_sources


def model_folder(tmp_path: Path, context: int) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
    return folder


def env_runner_config(argv: list[str], ports: dict[str, object]) -> EnvRunnerConfig:
    """The env runner's config as the child the launcher starts reads it."""
    child_argv, _ = child_sources(split_argv(argv))
    cfg, _ = load_service_config(ENV_RUNNER, [*child_argv, *_wiring(ENV_RUNNER, "stack", ports)])
    assert isinstance(cfg, EnvRunnerConfig)
    return cfg


def test_env_runner_calls_fit_the_context_inference_serves(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, 4096)
    ports = {"inference_http": 8123, "inference_max_model_len": 512}
    cfg = env_runner_config(["--env_runner.tokenizer", str(folder)], ports)
    assert cfg.env_runner.max_model_len == 512
    assert context_bound(cfg.env_runner) == (512, "env_runner.max_model_len")


def test_the_model_s_own_context_wins_when_smaller_or_nothing_is_served(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, 256)
    served = env_runner_config(
        ["--env_runner.tokenizer", str(folder)], {"inference_max_model_len": 512}
    )
    assert context_bound(served.env_runner) == (256, "config.json")
    unset = env_runner_config(
        ["--env_runner.tokenizer", str(folder)], {"inference_max_model_len": None}
    )
    assert unset.env_runner.max_model_len is None
    assert context_bound(unset.env_runner) == (256, "config.json")
    assert context_bound(env_runner_config([], {}).env_runner) == (0, "")
