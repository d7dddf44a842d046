"""The trainer's config section: light to import, strict, cross-field checks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from treadle.trainer.spec import TrainerConfig, TrainerSection


def test_spec_import_does_not_import_torch() -> None:
    code = "import sys, treadle.trainer.spec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_spec_defaults_are_the_documented_ones() -> None:
    s = TrainerSection()
    assert s.loss.kind == "pg"
    assert s.optim.name == "AdamW"
    assert s.checkpoint_every == 10
    assert s.device == "auto"
    assert s.dtype == "float32"
    assert s.max_steps == 0


def test_spec_unknown_keys_are_errors() -> None:
    with pytest.raises(ValidationError, match="seq_len"):
        TrainerConfig.model_validate({"trainer": {"seq_len": 128}})
    with pytest.raises(ValidationError, match="clip"):
        TrainerConfig.model_validate({"trainer": {"loss": {"clip": 0.1}}})


def test_spec_flex_attention_on_cpu_is_refused() -> None:
    with pytest.raises(ValidationError, match="needs CUDA"):
        TrainerSection(device="cpu", attention="flex")


def test_spec_decay_needs_max_steps() -> None:
    with pytest.raises(ValidationError, match="max_steps"):
        TrainerSection(optim={"decay": "cosine"})  # type: ignore[arg-type]
    assert TrainerSection(optim={"decay": "cosine"}, max_steps=10).max_steps == 10  # type: ignore[arg-type]


def test_spec_loss_kinds_are_a_closed_set() -> None:
    with pytest.raises(ValidationError):
        TrainerSection(loss={"kind": "grpo"})  # type: ignore[arg-type]
