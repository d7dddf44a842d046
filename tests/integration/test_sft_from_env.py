"""`treadle sft` from an environment, end to end: rejection sampling against an
OpenAI-compatible endpoint (scripted, testkit.chat_endpoint), the dataset it writes, and
the real trainer and orchestrator (SFT feed) training on it as separate processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.chat_endpoint import ReverserEndpoint
from treadle.services.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_sft_samples_an_environment_then_trains_on_what_it_kept(tmp_path: Path) -> None:
    model = tmp_path / "model"
    spec = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1,
                         intermediate_size=128)  # fmt: skip
    build_tiny_model(
        model, tokenizer="bpe", spec=spec, seed=0, bpe_vocab_size=320, vocab_multiple=1
    )
    with ReverserEndpoint() as url:
        cfg = tmp_path / "run.toml"
        cfg.write_text(f"""
[run]
name = "sft-env"
output_dir = "{tmp_path / "out"}"

[sft_data]
env = "reverse_text"
base_url = "{url}"
num_tasks = 12
samples_per_task = 3
min_reward = 1.0
[sft_data.sampling]
seed = 0

[trainer]
model = "{model}"
max_steps = 3

[trainer.loss]
kind = "sft"

[orchestrator]
tokenizer = "{model}"
max_steps = 3
sft_samples_per_step = 4
seq_len = 256
""")
        argv = [sys.executable, "-m", "treadle.services.cli", "sft", "@", str(cfg)]
        # the feed may publish all 3 steps before its health check passes: not a failure
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
        calls = len(ReverserEndpoint.calls)
        # the same command again: sampling resumes (no new calls), nothing trains twice
        again = subprocess.run(argv, capture_output=True, text=True, timeout=240)
        calls_again = len(ReverserEndpoint.calls) - calls
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert calls == 12 * 3
    assert "kept: 12 samples with reward >= 1, from 12/12 tasks" in out
    run_dir = tmp_path / "out" / "sft-env"
    dataset = run_dir / "sft_data" / "dataset.jsonl"
    rows = [json.loads(x) for x in dataset.read_text().splitlines()]
    assert {r["index"] for r in rows} == {0}  # the exact reversals only
    assert f"[sft] {dataset}: 12 conversations" in out
    assert "treadle: sft finished" in out
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {m["step"] for m in steps if m["service"] == "trainer" and "loss" in m} == {1, 2, 3}
    fed = [m for m in steps if m["service"] == "orchestrator"]
    assert [m["num_samples"] for m in fed] == [4.0, 4.0, 4.0]
    assert (run_dir / "final_model" / "model.safetensors").exists()
    out_again = again.stdout + again.stderr
    assert again.returncode == 0, out_again[-4000:]
    assert calls_again == 0
    assert "treadle: sft finished" in out_again
    steps_again = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m["step"] for m in steps_again if m["service"] == "trainer" and "loss" in m]
    assert sorted(trained) == [1, 2, 3]
