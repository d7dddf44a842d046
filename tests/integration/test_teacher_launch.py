"""`treadle rl` distilling from a teacher it serves itself (``[orchestrator.teacher]
checkpoint``), end to end on tiny models: two real vLLMs (the student's, following the
policy, and the teacher's, fixed), the real trainer, orchestrator and env runner.

The teacher has other weights than the student (another seed) and the student's
tokenizer: every step's tokens are scored by it (teacher calls, a non-zero KL, no errors),
the student's inference follows the policy to the last step while the teacher's loads
nothing, and the stack shows the teacher as a child of its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from treadle.services.host import CPUS_ENV
from treadle.services.launcher import LauncherSection, cpu_split_env
from treadle.services.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 2


@pytest.mark.timeout(900)
def test_rl_distills_from_the_teacher_it_serves_itself(tmp_path: Path) -> None:
    spec = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1,
                         intermediate_size=128)  # fmt: skip
    student = build_tiny_model(tmp_path / "student", spec=spec, seed=0, bpe_vocab_size=320,
                               vocab_multiple=1)  # fmt: skip
    teacher = build_tiny_model(tmp_path / "teacher", tokenizer=student, spec=spec, seed=1,
                               vocab_multiple=1)  # fmt: skip
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "text": "abcdefgh"[: 3 + i % 5]}) + "\n"
                             for i in range(40)))  # fmt: skip
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
[run]
name = "distill"
output_dir = "{tmp_path / "out"}"

[inference]
model = "{student}"
max_model_len = 256

[trainer]
model = "{student}"
max_steps = {STEPS}

[orchestrator]
tasks = "{tasks}"
max_steps = {STEPS}
group_size = 4
groups_per_step = 2
max_groups_in_flight = 4
seq_len = 256
algorithm = "distill"

[orchestrator.sampling]
max_tokens = 8

[orchestrator.teacher]
checkpoint = "{teacher}"

[env_runner]
tokenizer = "{student}"
max_concurrency = 8
""")
    argv = [sys.executable, "-m", "treadle.services.cli", "rl", "@", str(cfg)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=840)
    out = proc.stdout + proc.stderr
    run_dir = tmp_path / "out" / "distill"
    logs = run_dir / "logs"
    assert proc.returncode == 0, out[-4000:] + "\n" + tail(logs / "teacher.log")
    # the teacher started as a child of its own, fixed, on the teacher's weights
    assert re.search(r"^\s+teacher\s+grpc \S+\s+pid \d+", out, re.M), out[-4000:]
    teacher_log = (logs / "teacher.log").read_text()
    assert f"--inference.model {teacher} " in teacher_log  # its command line, logged
    assert "follow_policy is false: this service serves a fixed model" in teacher_log
    assert "serving policy version 1" not in teacher_log
    assert "catching up" not in teacher_log
    student_log = (logs / "inference.log").read_text()
    assert f"serving policy version {STEPS}" in student_log
    # every step was distilled: teacher calls on its tokens, a KL > 0, no error
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["service"] == "orchestrator" and "num_teacher_calls" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), steps
    # groups are scored as they complete: a call may land in the row of an earlier step
    assert sum(r["num_teacher_calls"] for r in steps) >= STEPS * 2, steps  # 2 groups a step
    for r in steps:
        assert r["teacher_num_tokens"] > 0, r
        assert r["num_teacher_errors"] == 0, r
        assert abs(r["teacher_kl_mean"]) > 1e-3, r  # another model's logprobs, not the student's
    trained = {r["step"] for r in rows if r["service"] == "trainer" and "loss" in r}
    assert trained == set(range(1, STEPS + 1))
    # the CPUs split between generation and training: the teacher's vLLM on the side
    # [launcher] teacher_cpus names (its default here)
    split = cpu_split_env(
        "rl", ["inference", "trainer"], sorted(os.sched_getaffinity(0)), os.environ
    )
    if split:
        where = LauncherSection().teacher_cpus
        cpus = split["inference" if where == "generation" else "trainer"][CPUS_ENV]
        said = f"on the {where} CPUs ([launcher] teacher_cpus): {CPUS_ENV}={cpus} "
        assert said in out, out[-4000:]
        assert f"VLLM_CPU_OMP_THREADS_BIND={cpus}" in out, out[-4000:]  # vLLM's threads too
        assert f"[startup] running on CPUs {cpus}\n" in teacher_log


def tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else f"({path} missing)"
