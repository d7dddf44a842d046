"""LoRA training on CPU: a frozen base with adapters (step 0 = the base exactly), only the
adapters trained and held by the optimizer, bit-exact checkpoint/resume of the adapter and
its optimizer state, every loss, the PEFT export (checked by merging it into a
transformers model, since ``peft`` is not installed here), and bad configurations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch.distributed.checkpoint import FileSystemReader

from testkit.trainer import make_batch, store_batch, tiny_llama3, tiny_qwen3, vocab_size_of
from treadle.services.errors import ConfigError
from treadle.services.objectstore import LocalObjectStore
from treadle.trainer.errors import CheckpointError
from treadle.trainer.lora import PEFT_PREFIX, peft_state_dict
from treadle.trainer.models.hf import load_safetensors
from treadle.trainer.spec import LoraSection, TrainerSection
from treadle.trainer.trainer import Trainer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("model") / "qwen3")


def make_trainer(
    model: Path, root: Path, name: str = "a", *, lora: dict[str, object] | None = None,
    **kw: object,
) -> Trainer:  # fmt: skip
    lora = {"enabled": True, "rank": 4, "alpha": 8.0} if lora is None else lora
    section = TrainerSection(model=model, optim={"lr": 1e-2}, lora=lora, **kw)
    return Trainer(section, LocalObjectStore(root / "store"), checkpoint_dir=root / name / "ckpt")


def run_steps(trainer: Trainer, steps: range) -> list[dict[str, float]]:
    vocab = trainer.policy.hf.vocab_size
    return [
        trainer.train_step(store_batch(trainer.store, make_batch(s, vocab_size=vocab))).metrics
        for s in steps
    ]


def adapters(trainer: Trainer) -> Tensors:
    plan = trainer.policy.lora
    assert plan is not None
    return {k: v.clone() for k, v in peft_state_dict(plan, trainer.policy.model).items()}


def logprobs(trainer: Trainer, ids: list[int]) -> torch.Tensor:
    ids_BL = torch.tensor([ids])
    trainer.policy.model.eval()
    with torch.no_grad():
        out, _ = trainer.policy.token_logprobs(
            ids_BL, torch.arange(len(ids))[None], with_entropy=False
        )
    trainer.policy.model.train()
    return out


def test_lora_step0_is_the_base_and_only_adapters_train(model_dir: Path, tmp_path: Path) -> None:
    full = make_trainer(model_dir, tmp_path, "full", lora={})
    lora = make_trainer(model_dir, tmp_path, "lora")
    ids = [(7 * i + 3) % 200 for i in range(24)]
    # B starts at zero: the adapted model computes exactly what the base does
    assert torch.equal(logprobs(lora, ids), logprobs(full, ids))
    assert all(float(v.abs().max()) == 0.0 for k, v in adapters(lora).items() if "lora_B" in k)
    # trainable = the adapters; the optimizer holds exactly those
    trainable = {n for n, p in lora.policy.model.named_parameters() if p.requires_grad}
    assert all(".lora_a." in n or ".lora_b." in n for n in trainable)
    assert len(trainable) == 2 * len(TARGETS) * 2  # A and B x 7 projections x 2 layers
    held = {id(p) for opt in lora.optimizers for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in lora.policy.model.parameters() if p.requires_grad}

    base = {k: v.clone() for k, v in lora.policy.hf_state_dict().items()}
    start = adapters(lora)
    metrics = run_steps(lora, range(1, 3))
    assert all(math.isfinite(m["loss"]) and m["update_skipped"] == 0.0 for m in metrics)
    after = lora.policy.hf_state_dict()
    assert after.keys() == base.keys()
    for k in base:
        assert torch.equal(after[k], base[k]), f"frozen base weight {k} changed"
    moved = adapters(lora)
    for k in start:
        assert not torch.equal(moved[k], start[k]), f"adapter {k} did not train"
    assert not torch.equal(logprobs(lora, ids), logprobs(full, ids))
    # the optimizer's state is the adapters' only: Adam's moments for each, nothing else
    state = lora.optimizers.state_dict()
    held_names = {
        k.removeprefix("state.").rsplit(".", 1)[0] for k in state if k.startswith("state.")
    }
    assert held_names == trainable


def test_lora_resume_is_bit_identical_and_the_checkpoint_holds_the_adapter_only(
    model_dir: Path, tmp_path: Path
) -> None:
    straight = make_trainer(model_dir, tmp_path / "one")
    run_steps(straight, range(1, 5))

    first = make_trainer(model_dir, tmp_path / "two")
    run_steps(first, range(1, 3))
    ref = first.save_checkpoint()
    assert ref is not None
    meta = first.store.read_manifest(ref).metadata
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "target_modules": TARGETS}
    keys = set(
        FileSystemReader(str(first.checkpoint_dir / "step000002"))
        .read_metadata()
        .state_dict_metadata
    )
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys
    assert all(".lora_" in k for k in model_keys), sorted(model_keys)[:5]
    optim_keys = {k for k in keys if k.startswith("optimizer.state.")}
    assert optim_keys
    assert all(".lora_" in k for k in optim_keys), sorted(optim_keys)[:5]
    run_steps(first, range(3, 4))  # progress lost with the "crash"
    del first
    resumed = make_trainer(model_dir, tmp_path / "two", name="b")
    assert resumed.resume() == 2
    run_steps(resumed, range(3, 5))

    a, b = adapters(straight), adapters(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = straight.optimizers.state_dict(), resumed.optimizers.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize(
    "loss",
    [{"kind": "pg"}, {"kind": "tis"}, {"kind": "ppo"}, {"kind": "sft"},
     {"kind": "pg", "kl_coef": 0.1, "sequence_mask": "geometric"}],
    ids=["pg", "tis", "ppo", "sft", "pg-kl-seqmask"],
)  # fmt: skip
def test_lora_trains_with_every_loss(
    model_dir: Path, tmp_path: Path, loss: dict[str, object]
) -> None:
    trainer = make_trainer(model_dir, tmp_path, loss=loss)
    start = adapters(trainer)
    (m,) = run_steps(trainer, range(1, 2))
    assert math.isfinite(m["loss"])
    assert m["update_skipped"] == 0.0
    assert m["grad_norm"] > 0
    if "kl_coef" in loss:
        assert m["kl_ref"] == 0.0  # step 0 of the adapter = the reference (the base)
    assert any(not torch.equal(v, start[k]) for k, v in adapters(trainer).items())


def test_lora_dropout_applies_while_training_only(model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(model_dir, tmp_path, lora={"enabled": True, "rank": 4, "dropout": 0.5})
    run_steps(trainer, range(1, 2))  # B != 0 now: dropout changes the output
    ids = [(5 * i + 1) % 200 for i in range(16)]
    assert torch.equal(logprobs(trainer, ids), logprobs(trainer, ids))  # eval: deterministic
    pos = torch.arange(16)[None]
    with torch.no_grad():
        a, _ = trainer.policy.token_logprobs(torch.tensor([ids]), pos, with_entropy=False)
        b, _ = trainer.policy.token_logprobs(torch.tensor([ids]), pos, with_entropy=False)
    assert not torch.equal(a, b)  # train mode: two dropout masks


def merged_hf_logprobs(base: Path, adapter: Path, ids: list[int]) -> list[float]:
    """log p(ids[i+1] | ids[..i]) from transformers on ``base`` with the PEFT adapter in
    ``adapter`` merged by PEFT's rule W' = W + lora_alpha / r * B A, applied by name."""
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_safetensors(adapter)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    modules = dict(hf.named_modules())
    merged = 0
    with torch.no_grad():
        for key, a_RI in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            name = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            b_OR = tensors[key.replace(".lora_A.", ".lora_B.")]
            modules[name].weight += scale * b_OR @ a_RI
            merged += 1
        logits = hf(torch.tensor([ids])).logits[0].float()
    assert merged == len(tensors) // 2
    return (
        torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    )


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_lora_publishes_a_peft_adapter_equal_to_the_trained_policy(
    tmp_path: Path, family: str
) -> None:
    # llama3: the HF layout permutes q/k rows for RoPE; B's rows must follow
    model = tiny_qwen3(tmp_path / "m") if family == "qwen3" else tiny_llama3(tmp_path / "m")
    trainer = make_trainer(model, tmp_path, lora={"enabled": True, "rank": 4, "alpha": 8.0,
                                                  "target_modules": ["q_proj", "k_proj", "down_proj"]})  # fmt: skip
    vocab = vocab_size_of(model)
    result = None
    for step in (1, 2):
        result = trainer.train_step(store_batch(trainer.store, make_batch(step, vocab_size=vocab)))
    assert result is not None
    assert result.weights is not None
    assert result.weights.uri.endswith("policies/v000002/MANIFEST.json")
    assert trainer.weights_format == "peft-lora"
    manifest = trainer.store.read_manifest(result.weights)
    assert {f.path for f in manifest.files} == {"adapter_config.json", "adapter_model.safetensors"}
    meta = manifest.metadata
    assert meta["format"] == "peft-lora"
    assert meta["lora"] == {
        "rank": 4,
        "alpha": 8.0,
        "target_modules": ["q_proj", "k_proj", "down_proj"],
    }
    folder = tmp_path / "v2"
    trainer.store.fetch_dir(result.weights, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.0)
    assert config["target_modules"] == ["down_proj", "k_proj", "q_proj"]
    assert config["base_model_name_or_path"] == str(model)
    tensors = load_safetensors(folder)
    hidden = 64
    expected = set()
    for layer in (0, 1):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
            expected |= {
                f"base_model.model.model.layers.{layer}.{module}.lora_{x}.weight" for x in "AB"
            }
    assert set(tensors) == expected
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert a.shape == (4, hidden)  # [r, in]
    b = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert b.shape == (hidden, 4)  # [out, r]
    # the oracle: transformers on the base with the adapter merged reproduces the probe,
    # which the trainer computed with its own LoRA modules
    ids = meta["probe"]["token_ids"]
    ref = merged_hf_logprobs(model, folder, ids)
    assert meta["probe"]["logprobs"] == pytest.approx(ref, abs=2e-5)
    # and the adapter matters: the base alone is far from it (a name the merge missed, or
    # B's rows in the wrong order, would show as a difference of this size)
    (folder / "adapter_model.safetensors").unlink()
    from safetensors.torch import save_file

    save_file(
        {k: torch.zeros_like(v) for k, v in tensors.items()},
        str(folder / "adapter_model.safetensors"),
    )
    base_only = merged_hf_logprobs(model, folder, ids)
    assert max(abs(x - y) for x, y in zip(base_only, ref, strict=True)) > 1e-3


def test_lora_unknown_target_module_lists_the_models_projections(
    model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as err:
        make_trainer(
            model_dir, tmp_path, lora={"enabled": True, "target_modules": ["q_proj", "qkv_proj"]}
        )
    msg = str(err.value)
    assert "qkv_proj is not a projection of this qwen3 model" in msg
    for name in TARGETS:
        assert name in msg
    assert "lm_head" not in msg


def test_lora_section_rejects_bad_values() -> None:
    assert LoraSection().enabled is False
    assert TrainerSection().lora.target_modules == TARGETS
    for bad, match in (
        ({"rank": 0}, "greater than or equal to 1"),
        ({"alpha": 0}, "greater than 0"),
        ({"dropout": 1.0}, "less than 1"),
        ({"target_modules": []}, "is empty"),
        ({"target_modules": ["q_proj", "q_proj"]}, "more than once"),
        ({"rnak": 8}, "rnak"),
    ):
        with pytest.raises(ValidationError, match=match):
            LoraSection.model_validate(bad)


def test_lora_resume_refuses_a_checkpoint_of_another_kind(model_dir: Path, tmp_path: Path) -> None:
    full = make_trainer(model_dir, tmp_path / "full", lora={})
    run_steps(full, range(1, 2))
    full.save_checkpoint()
    with pytest.raises(CheckpointError, match=r"holds full weights but trainer\.lora is enabled"):
        make_trainer(model_dir, tmp_path / "full", "b").resume()

    lora = make_trainer(model_dir, tmp_path / "lora")
    run_steps(lora, range(1, 2))
    lora.save_checkpoint()
    with pytest.raises(CheckpointError, match=r"trainer\.lora is disabled"):
        make_trainer(model_dir, tmp_path / "lora", "b", lora={}).resume()
    with pytest.raises(CheckpointError, match=r"this run trains .*'rank': 8"):
        make_trainer(model_dir, tmp_path / "lora", "c", lora={"enabled": True, "rank": 8}).resume()
    other = tiny_qwen3(tmp_path / "other", seed=1)
    with pytest.raises(CheckpointError, match="an adapter fits only its own base"):
        make_trainer(other, tmp_path / "lora", "d").resume()
