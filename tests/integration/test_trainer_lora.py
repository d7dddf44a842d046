"""LoRA through the real trainer service and the real vLLM LoRA loader:

- `python -m treadle.trainer --nproc-per-node 2` (what `treadle serve trainer` runs:
  torchrun, gloo, FSDP2) with trainer.lora on a real nats-server trains 2 steps, announces
  each as PolicyPublished(format "peft-lora"), checkpoints the adapter at max_steps and
  exports <run>/final_adapter; each published adapter equals the one trained by 1 rank in
  this process, and 1 rank resumes the 2-rank checkpoint (tolerance: see
  test_trainer_ranks.py — the same sums in another order, float32; a lost or doubled
  gradient moves an adapter weight by ~lr = 1e-3, 100x it).
- vLLM's own loader (PEFTHelper + LoRAModel.from_local_checkpoint, CPU, no engine) reads
  the published adapter: the modules, shapes, scaling and tensors it gets are ours.
- `treadle rl` with LoRA is refused before anything starts (inference cannot serve it).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from testkit.trainer import make_batch, store_batch, tiny_qwen3, vocab_size_of
from treadle.proto.v1 import policy_pb2
from treadle.services.bus import Bus
from treadle.services.config import ConfigSources
from treadle.services.errors import ConfigError
from treadle.services.objectstore import LocalObjectStore
from treadle.services.sections import NatsSection
from treadle.services.supervisor import ManagedProcess
from treadle.trainer.lora import peft_state_dict
from treadle.trainer.models.hf import load_safetensors
from treadle.trainer.spec import TrainerSection
from treadle.trainer.trainer import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LR, EPS, ATOL = 1e-3, 1e-5, 1e-5
LORA = {"enabled": True, "rank": 8, "alpha": 16.0}
HF_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_trainer_lora_two_ranks_publish_adapters_equal_to_one_rank_and_export_them(
    tmp_path: Path, nats_url: str, free_port: int
) -> None:
    model = tiny_qwen3(tmp_path / "model")
    vocab = vocab_size_of(model)
    scratch = LocalObjectStore(tmp_path / "scratch")
    section = TrainerSection(model=model, device="cpu", optim={"lr": LR, "eps": EPS}, lora=LORA)
    one = Trainer(section, scratch, checkpoint_dir=tmp_path / "ref")
    ref: dict[int, dict[str, torch.Tensor]] = {}
    for step in (1, 2):
        result = one.train_step(store_batch(scratch, make_batch(step, vocab_size=vocab)))
        assert result.weights is not None
        scratch.fetch_dir(result.weights, tmp_path / f"ref-v{step}")
        ref[step] = load_safetensors(tmp_path / f"ref-v{step}")
    del one

    run = "lora2"
    store = LocalObjectStore(tmp_path / "store")
    argv = [
        sys.executable, "-m", "treadle.trainer", "--nproc-per-node", "2",
        "--nats.url", nats_url, "--run.name", run, "--run.output_dir", str(tmp_path / "out"),
        "--object_store.root", str(tmp_path / "store"), "--trainer.grpc.port", str(free_port),
        "--trainer.model", str(model), "--trainer.device", "cpu", "--trainer.max_steps", "2",
        "--trainer.optim.lr", str(LR), "--trainer.optim.eps", str(EPS),
        "--trainer.lora.enabled", "true", "--trainer.lora.rank", "8",
        "--trainer.lora.alpha", "16", "--trainer.distributed.shutdown_timeout_s", "20",
    ]  # fmt: skip

    async def main() -> list[policy_pb2.PolicyPublished]:
        bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
        await bus.ensure_streams()
        announced: list[policy_pb2.PolicyPublished] = []

        async def on_policy(msg: Any) -> None:
            announced.append(policy_pb2.PolicyPublished.FromString(msg.data))

        await bus.nc.subscribe(bus.subjects.policy_published, cb=on_policy)
        for step in (1, 2):
            ready = store_batch(store, make_batch(step, vocab_size=vocab, num_ranks=2), num_ranks=2)
            await bus.publish(bus.subjects.batches(step), ready, msg_id=f"batch-{step}")
        proc = ManagedProcess("trainer", argv, tmp_path / "trainer.log").start()
        try:
            code = await asyncio.to_thread(proc.proc.wait, 240)  # type: ignore[union-attr]
        finally:
            proc.stop()
        assert code == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        await asyncio.sleep(0.2)
        await bus.close()
        return announced

    announced = asyncio.run(main())
    assert [m.policy_version for m in announced] == [1, 2]
    assert {m.format for m in announced} == {"peft-lora"}
    assert announced[-1].base_model == str(model)
    for step, msg in zip((1, 2), announced, strict=True):
        got = tmp_path / f"got-v{step}"
        manifest = store.fetch_dir(msg.weights, got)
        assert {f.path for f in manifest.files} == {
            "adapter_config.json",
            "adapter_model.safetensors",
        }
        mine = load_safetensors(got)
        assert mine.keys() == ref[step].keys()
        worst = max(float((mine[k] - ref[step][k]).abs().max()) for k in mine)
        assert worst <= ATOL, f"v{step}: 2-rank adapter differs from 1-rank by {worst:.3g}"
    meta = store.read_manifest("checkpoints/trainer/step000002").metadata
    assert (meta["world_size"], meta["lora"]["rank"]) == (2, 8)
    # 1 rank resumes the 2-rank adapter checkpoint (DCP reshards 2 -> 1)
    resumed = Trainer(section, store, checkpoint_dir=tmp_path / "resumed")
    assert resumed.resume() == 2
    assert resumed.policy.lora is not None
    again = peft_state_dict(resumed.policy.lora, resumed.policy.model)
    assert max(float((again[k] - ref[2][k]).abs().max()) for k in again) <= ATOL
    final = tmp_path / "out" / run / "final_adapter"
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 8
    assert (final / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    assert not (tmp_path / "out" / run / "final_model").exists()
    log = (tmp_path / "trainer.log").read_text()
    assert "trainable parameters" in log
    assert "the base is frozen" in log


def test_trainer_lora_adapter_loads_in_vllms_lora_loader(tmp_path: Path) -> None:
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    model = tiny_qwen3(tmp_path / "model")
    store = LocalObjectStore(tmp_path / "store")
    section = TrainerSection(model=model, optim={"lr": 1e-2}, lora={**LORA, "dropout": 0.05})
    trainer = Trainer(section, store, checkpoint_dir=tmp_path / "ckpt")
    result = trainer.train_step(store_batch(store, make_batch(1, vocab_size=vocab_size_of(model))))
    assert result.weights is not None
    folder = tmp_path / "adapter"
    store.fetch_dir(result.weights, folder)
    ours = load_safetensors(folder)

    helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=512)
    helper.validate_legal(LoRAConfig(max_lora_rank=8))
    with pytest.raises(ValueError, match="greater than max_lora_rank"):
        helper.validate_legal(LoRAConfig(max_lora_rank=1))  # a rank above a server's maximum
    lora = LoRAModel.from_local_checkpoint(
        str(folder), HF_TARGETS, helper, lora_model_id=1, device="cpu", dtype=torch.float32
    )
    expected = {f"model.layers.{i}.{m}" for i in (0, 1) for m in
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # fmt: skip
    assert set(lora.loras) == expected
    for name, weights in lora.loras.items():
        assert weights.rank == 8
        assert weights.scaling == pytest.approx(16.0 / 8)
        a = ours[f"base_model.model.{name}.lora_A.weight"]
        b = ours[f"base_model.model.{name}.lora_B.weight"]
        assert torch.equal(weights.lora_a, a), name
        assert torch.equal(weights.lora_b, b), name
    assert any(float(w.lora_b.abs().max()) > 0 for w in lora.loras.values())  # it trained
    # an adapter naming a module vLLM does not expect is refused by the same loader
    with pytest.raises(ValueError, match="expected target modules"):
        LoRAModel.from_local_checkpoint(
            str(folder), HF_TARGETS - {"down_proj"}, helper, device="cpu", dtype=torch.float32
        )


def test_trainer_lora_rl_job_starts_inference_serving_adapters(tmp_path: Path) -> None:
    from treadle.services.launcher import inference_lora_flags, resolve

    model = tiny_qwen3(tmp_path / "model")
    run = tmp_path / "run.toml"
    run.write_text(
        f'[run]\nname = "lora-rl"\noutput_dir = "{tmp_path / "out"}"\n'
        f'[trainer]\nmodel = "{model}"\n[trainer.lora]\nenabled = true\nrank = 4\n'
        f'[inference]\nmodel = "{model}"\n'
        f'[orchestrator]\ntasks = "{tmp_path / "tasks.jsonl"}"\ntokenizer = "{model}"\n'
        f'[env_runner]\ntokenizer = "{model}"\n'
    )
    _, configs = resolve(ConfigSources(files=[run]), "rl")
    flags = ["--inference.lora.enabled", "true", "--inference.lora.max_lora_rank", "4"]
    assert inference_lora_flags(configs) == flags
    # inference told to refuse adapters, or to hold smaller ones than the trainer's: refused
    for extra, words in [
        ("[inference.lora]\nenabled = false\n", "would refuse every one"),
        ("[inference.lora]\nmax_lora_rank = 1\n", "trainer.lora.rank = 4 is above"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(run.read_text() + extra)
        with pytest.raises(ConfigError, match=words):
            resolve(ConfigSources(files=[bad]), "rl")
    # full fine-tuning (the default): inference as before
    run.write_text(run.read_text().replace("enabled = true", "enabled = false"))
    assert inference_lora_flags(resolve(ConfigSources(files=[run]), "rl")[1]) == []
    # full fine-tuning (the default) resolves as before
    run.write_text(run.read_text().replace("enabled = true", "enabled = false"))
    resolve(ConfigSources(files=[run]), "rl")
