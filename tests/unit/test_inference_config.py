"""The inference service's config, vLLM launch plan, probe checks and update decisions
(no vLLM here: tests/integration/test_inference_*.py start the real one)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from treadle.inference.engine import parse_metrics, plan_launch
from treadle.inference.errors import ManifestError
from treadle.inference.probe import Probe, compare, read_policy_metadata
from treadle.inference.spec import SPEC, InferenceConfig, InferenceSection
from treadle.inference.updater import choose_reload
from treadle.services.config import load_config
from treadle.services.errors import ConfigError


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def load(*flags: str) -> InferenceConfig:
    cfg = load_config(SPEC.config_cls, list(flags), environ={})
    assert isinstance(cfg, InferenceConfig)
    return cfg


def test_inference_config_nonexistent_model_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError) as e:
        load("--inference.model", str(missing))
    problem = str(e.value).splitlines()[1]
    assert problem == (
        f"  - inference.model: Value error, no such model folder; got {str(missing)!r} "
        "(set in flag --inference.model)"
    )


def test_inference_config_folder_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"not a Hugging Face model folder \(it has no config\.json\)"
    ):
        load("--inference.model", str(tmp_path))


def test_inference_config_folder_without_weights_is_refused(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"it has no \*\.safetensors weights"):
        load("--inference.model", str(model_dir))


def test_inference_config_unknown_key_is_an_error() -> None:
    with pytest.raises(
        ConfigError, match=r"inference.http_prot: unknown key .*did you mean 'inference.http_port'"
    ):
        load("--inference.http_prot", "1")


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("--port=9", "--port is set by the service; use inference.http_port instead"),
        ("--max-model-len", "use inference.max_model_len instead"),
        ("--api-server-count", "not supported: the admission gate"),
    ],
)
def test_inference_config_extra_args_cannot_take_over_managed_flags(arg: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load("--inference.extra_vllm_args", f'["{arg}", "2"]')


def test_inference_config_tolerance_follows_dtype() -> None:
    assert InferenceSection(dtype="float32").tolerance() == 1e-3
    assert InferenceSection(dtype="bfloat16").tolerance() == 0.1
    assert InferenceSection(dtype="bfloat16", verify_tolerance=0.5).tolerance() == 0.5


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_launch_plan_on_cpu_enables_every_route_the_service_uses(model_dir: Path) -> None:
    cfg = InferenceSection(model=model_dir, http_port=9100, kv_cache_space_gib=3, max_model_len=512)
    plan = plan_launch(
        cfg, weights=Path("/w/v000002"), device="cpu", token="t", python="py", base_env={"A": "1"}
    )
    argv = plan.argv
    assert argv[:3] == ["py", "-m", "treadle.inference.vllm_entry"]
    assert flag_value(argv, "--model") == "/w/v000002"
    # tokenizer and generation config (stop tokens) always come from the configured model
    assert flag_value(argv, "--tokenizer") == str(model_dir)
    assert flag_value(argv, "--generation-config") == str(model_dir)
    assert flag_value(argv, "--port") == "9100"
    assert flag_value(argv, "--max-model-len") == "512"
    assert flag_value(argv, "--middleware") == "treadle.inference.gate.AdmissionGate"
    assert flag_value(argv, "--logprobs-mode") == "processed_logprobs"
    assert {"--enable-scale-out", "--enforce-eager"} <= set(argv)
    assert flag_value(argv, "--distributed-executor-backend") == "uni"
    assert "--gpu-memory-utilization" not in argv
    assert plan.env["A"] == "1"
    assert plan.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert plan.env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert plan.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert plan.env["TREADLE_VLLM_ENGINE_FORK"] == "1"  # the engine process is forked
    assert plan.env["HF_HUB_OFFLINE"] == "1"
    assert plan.env["TREADLE_GATE_TOKEN"] == "t"
    assert plan.warnings == []


def test_launch_plan_on_gpu_warns_about_cpu_settings(model_dir: Path) -> None:
    cfg = InferenceSection(
        model=model_dir,
        kv_cache_space_gib=4,
        gpu_memory_utilization=0.5,
        extra_vllm_args=["--max-num-seqs", "8"],
    )
    plan = plan_launch(cfg, weights=model_dir, device="cuda", token="t", base_env={})
    assert flag_value(plan.argv, "--gpu-memory-utilization") == "0.5"
    assert "--enforce-eager" not in plan.argv
    assert "VLLM_CPU_KVCACHE_SPACE" not in plan.env
    assert "TREADLE_VLLM_ENGINE_FORK" not in plan.env  # CUDA must not be forked
    assert plan.argv[-2:] == ["--max-num-seqs", "8"]
    assert plan.warnings == ["inference.kv_cache_space_gib is ignored on GPU"]
    cpu = plan_launch(
        InferenceSection(model=model_dir, gpu_memory_utilization=0.5),
        weights=model_dir,
        device="cpu",
        token="t",
        base_env={},
    )
    assert cpu.warnings == ["inference.gpu_memory_utilization is ignored on CPU"]
    spawned = InferenceSection(model=model_dir, cpu_engine_fork=False)
    plan = plan_launch(spawned, weights=model_dir, device="cpu", token="t", base_env={})
    assert "TREADLE_VLLM_ENGINE_FORK" not in plan.env


def test_launch_plan_sets_a_kv_block_that_a_groups_prompt_fills(model_dir: Path) -> None:
    """Prefix caching shares whole KV blocks: on CPU the block is 32 tokens (vLLM's CPU
    default of 128 is longer than many prompts); on GPU vLLM's own unless set."""
    cfg = InferenceSection(model=model_dir)
    cpu = plan_launch(cfg, weights=model_dir, device="cpu", token="t", base_env={})
    assert flag_value(cpu.argv, "--block-size") == "32"
    gpu = plan_launch(cfg, weights=model_dir, device="cuda", token="t", base_env={})
    assert "--block-size" not in gpu.argv
    for device, size in (("cpu", 64), ("cuda", 16)):
        plan = plan_launch(InferenceSection(model=model_dir, block_size=size), weights=model_dir,
                           device=device, token="t", base_env={})  # fmt: skip
        assert flag_value(plan.argv, "--block-size") == str(size)
    with pytest.raises(ConfigError, match=r"inference\.block_size = 48: vLLM.s CPU attention"):
        plan_launch(InferenceSection(model=model_dir, block_size=48), weights=model_dir,
                    device="cpu", token="t", base_env={})  # fmt: skip
    with pytest.raises(ValidationError, match=r"use inference\.block_size instead"):
        InferenceSection(model=model_dir, extra_vllm_args=["--block-size", "16"])


def test_launch_plan_runs_vllms_compiled_helpers_eagerly_only_on_an_eager_cpu(
    model_dir: Path,
) -> None:
    """On CPU in eager mode torch.compile is turned off (vLLM would still compile a sampler
    helper at the first request); a compiled CPU engine, a GPU and a user's own setting
    keep theirs."""
    cfg = InferenceSection(model=model_dir)
    eager = plan_launch(cfg, weights=model_dir, device="cpu", token="t", base_env={})
    assert eager.env["TORCHDYNAMO_DISABLE"] == "1"
    compiled = InferenceSection(model=model_dir, enforce_eager=False)
    for plan in (
        plan_launch(compiled, weights=model_dir, device="cpu", token="t", base_env={}),
        plan_launch(cfg, weights=model_dir, device="cuda", token="t", base_env={}),
    ):
        assert "TORCHDYNAMO_DISABLE" not in plan.env
    own = plan_launch(cfg, weights=model_dir, device="cpu", token="t",
                      base_env={"TORCHDYNAMO_DISABLE": "0"})  # fmt: skip
    assert own.env["TORCHDYNAMO_DISABLE"] == "0"


def test_launch_plan_exports_vllm_request_spans_only_with_an_otlp_endpoint(model_dir: Path) -> None:
    cfg = InferenceSection(model=model_dir)
    off = plan_launch(cfg, weights=model_dir, device="cpu", token="t", base_env={})
    assert "--otlp-traces-endpoint" not in off.argv
    assert "OTEL_SERVICE_NAME" not in off.env
    on = plan_launch(cfg, weights=model_dir, device="cpu", token="t", base_env={},
                     otlp_endpoint="http://collector:4317")  # fmt: skip
    assert flag_value(on.argv, "--otlp-traces-endpoint") == "http://collector:4317"
    assert on.env["OTEL_SERVICE_NAME"] == "treadle-inference"


def test_launch_plan_enables_lora_serving_only_when_asked(model_dir: Path) -> None:
    off = plan_launch(InferenceSection(model=model_dir), weights=model_dir, device="cpu",
                      token="t", base_env={})  # fmt: skip
    assert "--enable-lora" not in off.argv
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in off.env
    cfg = InferenceSection.model_validate(
        {"model": model_dir, "lora": {"enabled": True, "max_lora_rank": 4}}
    )
    assert cfg.lora.max_lora_rank == 8  # the next rank vLLM accepts
    on = plan_launch(cfg, weights=model_dir, device="cpu", token="t", base_env={})
    assert "--enable-lora" in on.argv
    assert flag_value(on.argv, "--max-lora-rank") == "8"
    assert flag_value(on.argv, "--max-loras") == "2"
    assert on.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    assert on.env["TREADLE_SERVED_MODEL_NAME"] == "policy"
    with pytest.raises(ValidationError, match="less than or equal to 512"):
        InferenceSection.model_validate({"lora": {"max_lora_rank": 1024}})
    with pytest.raises(ValidationError, match="--max-lora-rank is set by the service"):
        InferenceSection(extra_vllm_args=["--max-lora-rank", "64"])


def test_engine_metrics_are_read_from_prometheus_text() -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            'vllm:num_requests_running{engine="0",model_name="policy"} 3.0',
            'vllm:num_requests_waiting{engine="0",model_name="policy"} 2.0',
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="policy",reason="capacity"} 9.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.25',
        ]
    )
    metrics = parse_metrics(text)
    assert (metrics.num_running_requests, metrics.num_waiting_requests, metrics.kv_cache_usage) == (
        3,
        2,
        0.25,
    )


def metadata(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "policy_version": 4,
        "format": "hf-safetensors",
        "probe": {"token_ids": [1, 2, 3], "logprobs": [-1.0, -2.0]},
    }
    return doc | overrides


def test_policy_metadata_is_read() -> None:
    policy = read_policy_metadata(metadata(), "m", expected_version=4)
    assert policy.policy_version == 4
    assert policy.probe == Probe((1, 2, 3), (-1.0, -2.0))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"policy_version": 5},
            "the manifest is policy version 5, but it was announced as version 4",
        ),
        ({"policy_version": "4"}, "policy_version must be an integer"),
        ({"format": "pt"}, "supported: hf-safetensors, peft-lora"),
        ({"probe": None}, "metadata.probe is missing"),
        ({"probe": {"token_ids": [1], "logprobs": []}}, "list of >= 2 token ids"),
        (
            {"probe": {"token_ids": [1, 2, 3], "logprobs": [-1.0]}},
            "must hold len.token_ids. - 1 = 2 numbers, got 1",
        ),
        ({"probe": {"token_ids": [1, 2], "logprobs": [float("nan")]}}, "finite numbers <= 0"),
    ],
)
def test_policy_metadata_problems_are_clear(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        read_policy_metadata(
            metadata(**overrides), "s3://b/policies/v000004/MANIFEST.json", expected_version=4
        )


def test_probe_check_uses_the_mean_difference() -> None:
    probe = Probe((1, 2, 3, 4), (-1.0, -2.0, -3.0))
    check = compare([-1.0, -2.0, -3.3], probe, tolerance=0.1)
    assert check.ok
    assert math.isclose(check.mean_abs_diff, 0.1)
    assert math.isclose(check.max_abs_diff, 0.3)
    assert not compare([-1.5, -2.5, -3.5], probe, tolerance=0.1).ok
    assert not compare([-1.0, float("nan"), -3.0], probe, tolerance=0.1).ok


def test_reload_in_place_unless_tied_or_changed() -> None:
    untied = {
        "model_type": "qwen3",
        "hidden_size": 128,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    assert choose_reload("auto", untied, untied | {"torch_dtype": "bfloat16"}) is None
    assert "config.json changed (hidden_size)" in str(
        choose_reload("auto", untied, untied | {"hidden_size": 64})
    )
    tied = untied | {"tie_word_embeddings": True}
    assert "ties its input and output embeddings" in str(choose_reload("auto", tied, tied))
    assert choose_reload("always", tied, tied) is None
    assert choose_reload("never", untied, untied) == "inference.inplace_reload is 'never'"


def test_launch_plan_on_cpu_serves_float32_unless_asked(model_dir: Path) -> None:
    auto = plan_launch(
        InferenceSection(model=model_dir), weights=model_dir, device="cpu", token="t", base_env={}
    )
    assert auto.argv[auto.argv.index("--dtype") + 1] == "float32"
    asked = plan_launch(
        InferenceSection(model=model_dir, dtype="bfloat16"),
        weights=model_dir, device="cpu", token="t", base_env={},
    )  # fmt: skip
    assert asked.argv[asked.argv.index("--dtype") + 1] == "bfloat16"
    gpu = plan_launch(
        InferenceSection(model=model_dir), weights=model_dir, device="cuda", token="t", base_env={}
    )
    assert gpu.argv[gpu.argv.index("--dtype") + 1] == "auto"
