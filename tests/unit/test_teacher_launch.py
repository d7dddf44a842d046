"""`[orchestrator.teacher] checkpoint`: the launcher serves the distillation teacher
itself, as an inference service of its own that never follows the policy. Here: the
settings that start it or refuse to, the flags that make it the teacher, the wiring that
points the orchestrator at it. (A real `treadle rl` distilling from one:
tests/integration/test_teacher_launch.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from treadle.inference.spec import SPEC as INFERENCE
from treadle.orchestrator.spec import SPEC as ORCHESTRATOR
from treadle.orchestrator.spec import OrchestratorSection, TeacherSection
from treadle.orchestrator.teacher import Teacher
from treadle.services.config import ConfigSources
from treadle.services.errors import ConfigError
from treadle.services.host import load_service_config
from treadle.services.launcher import TeacherDeployment, _wiring, resolve, teacher_deployment


def model_dir(path: Path) -> Path:
    """Enough of a Hugging Face model folder for the config checks (nothing loads it)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 320}))
    (path / "model.safetensors").write_bytes(b"")
    return path


def run_file(tmp_path: Path, algorithm: str = "distill", teacher: str = "") -> Path:
    student = model_dir(tmp_path / "student")
    (tmp_path / "tasks.jsonl").write_text('{"id": "t0", "text": "abc"}\n')
    run = tmp_path / "run.toml"
    run.write_text(
        f'[run]\nname = "d"\noutput_dir = "{tmp_path / "out"}"\n'
        f'[inference]\nmodel = "{student}"\nmax_model_len = 256\n'
        f'[trainer]\nmodel = "{student}"\n'
        f'[orchestrator]\ntasks = "{tmp_path / "tasks.jsonl"}"\nalgorithm = "{algorithm}"\n'
        f'[env_runner]\ntokenizer = "{student}"\n'
        f"[orchestrator.teacher]\n{teacher}"
    )
    return run


def test_a_checkpoint_teacher_is_started_by_an_rl_launch_that_distills(tmp_path: Path) -> None:
    teacher = model_dir(tmp_path / "teacher")
    run = run_file(tmp_path, teacher=f'checkpoint = "{teacher}"\n')
    _, configs = resolve(ConfigSources(files=[run]), "rl")
    got = teacher_deployment("rl", configs)
    assert got == TeacherDeployment(teacher.resolve(), "teacher")
    # the teacher's service: the launch's [inference] with its own model, fixed
    assert got is not None
    cfg, _ = load_service_config(INFERENCE, ["@", str(run), *got.flags(8199)])
    section = cfg.inference  # type: ignore[attr-defined]
    assert section.model == teacher.resolve()
    assert section.served_model_name == "teacher"
    assert section.http_port == 8199
    assert section.follow_policy is False
    assert section.max_model_len == 256  # the student's engine settings
    # a served name the user chose is the one it is served and asked as
    run.write_text(run.read_text() + 'model = "rl-teacher"\n')
    got = teacher_deployment("rl", resolve(ConfigSources(files=[run]), "rl")[1])
    assert got is not None
    assert got.served_model_name == "rl-teacher"


def test_the_orchestrator_is_pointed_at_the_teacher_the_launch_started(tmp_path: Path) -> None:
    teacher = model_dir(tmp_path / "teacher")
    ports = {
        "inference_urls": ["http://127.0.0.1:8101"],
        "inference_grpcs": ["127.0.0.1:50101"],
        "teacher": ("http://127.0.0.1:8199", "teacher"),
    }
    cfg, _ = load_service_config(
        ORCHESTRATOR,
        ["--orchestrator.algorithm", "distill", "--orchestrator.teacher.checkpoint", str(teacher),
         *_wiring(ORCHESTRATOR, "rl", ports)],
    )  # fmt: skip
    section = cfg.orchestrator.teacher  # type: ignore[attr-defined]
    assert section.servers == ["http://127.0.0.1:8199"]
    assert section.model == "teacher"
    assert section.student_url == "http://127.0.0.1:8101"  # the tokenizer check's other side


@pytest.mark.parametrize(
    ("teacher", "words"),
    [
        ('checkpoint = "{t}"\nurls = "http://127.0.0.1:8300"\n', "are both set: set one"),
        ('checkpoint = "{t}"\nself_distill = true\n', "set one or the other"),
        ('checkpoint = "{t}/nothing"\n', "is not a local model folder"),
    ],
)
def test_a_teacher_the_launch_cannot_serve_is_refused_before_anything_starts(
    tmp_path: Path, teacher: str, words: str
) -> None:
    t = model_dir(tmp_path / "teacher")
    run = run_file(tmp_path, teacher=teacher.format(t=t))
    with pytest.raises(ConfigError, match=words):
        resolve(ConfigSources(files=[run]), "rl")


def test_a_launch_that_does_not_distill_starts_no_teacher(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = model_dir(tmp_path / "teacher")
    run = run_file(tmp_path, algorithm="grpo", teacher=f'checkpoint = "{t}"\n')
    with caplog.at_level(logging.WARNING):
        configs = resolve(ConfigSources(files=[run]), "rl")[1]
        assert "the teacher is not started" not in caplog.text  # said once, by the launch
        assert teacher_deployment("rl", configs) is None
    assert caplog.text.count("the teacher is not started") == 1
    # a stack without inference cannot start it beside one
    (tmp_path / "s").mkdir()
    run = run_file(tmp_path / "s", teacher=f'checkpoint = "{t}"\n')
    _, configs = resolve(ConfigSources(files=[run]), "rl")
    with pytest.raises(ConfigError, match="starts no inference service"):
        teacher_deployment("rl", [(s, c) for s, c in configs if s.name != "inference"])


def test_an_orchestrator_alone_says_who_serves_a_checkpoint_teacher(tmp_path: Path) -> None:
    t = model_dir(tmp_path / "teacher")
    section = TeacherSection(checkpoint=t)
    assert section.enabled
    assert section.servers == []
    with pytest.raises(
        ConfigError, match=r"is served by the launcher .* set orchestrator\.teacher\.urls"
    ):
        Teacher(section)
    # without any teacher the distill algorithm names every way to give it one
    with pytest.raises(ValueError, match=r"set orchestrator\.teacher\.checkpoint"):
        OrchestratorSection.model_validate({"algorithm": "distill"})


@pytest.mark.parametrize(
    ("extra", "what"),
    [
        (["--inference.lora.enabled", "true"], "inference.lora.enabled"),
        (["--inference.announce", "true"], "inference.announce"),
        (["--inference.hosted.accept_runs", "true"], "inference.hosted"),
    ],
)
def test_a_fixed_model_serves_nothing_of_the_policy(
    tmp_path: Path, extra: list[str], what: str
) -> None:
    with pytest.raises(ConfigError, match=f"follow_policy = false serves one fixed model; {what}"):
        load_service_config(INFERENCE, ["--inference.follow_policy", "false", *extra])


def test_a_fixed_model_refuses_update_weights() -> None:
    """UpdateWeights on the teacher's service is refused before it reaches vLLM (nothing
    here may call the updater: it is a stand-in that fails if asked)."""
    import asyncio
    from types import SimpleNamespace

    import grpc

    from treadle.inference.service import FIXED, InferenceAdmin
    from treadle.proto.v1 import inference_service_pb2

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise Aborted(code, details)

    class Updater:
        async def update(self, *_: object) -> None:
            raise AssertionError("a fixed model's updater was asked to load weights")

    cfg, _ = load_service_config(INFERENCE, ["--inference.follow_policy", "false"])
    admin = InferenceAdmin(SimpleNamespace(config=cfg), Updater())  # type: ignore[arg-type]
    request = inference_service_pb2.UpdateWeightsRequest(policy_version=1)
    with pytest.raises(Aborted) as err:
        asyncio.run(admin.UpdateWeights(request, Context()))  # type: ignore[arg-type]
    assert err.value.args == (grpc.StatusCode.FAILED_PRECONDITION, FIXED)
