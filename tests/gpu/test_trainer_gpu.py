"""The trainer on CUDA: TorchTitan's fast attention kernels (flex, varlen) respect packed
documents exactly as the CPU block-causal SDPA does, in the forward and the backward,
and full trainer steps (float32 and bfloat16, fused AdamW) train, publish and probe.

Skipped without CUDA (conftest). Shapes: L = tokens in the packed micro-batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from testkit.trainer import make_batch, store_batch, tiny_qwen3, vocab_size_of
from treadle.services.objectstore import LocalObjectStore
from treadle.trainer.models.hf import load_safetensors
from treadle.trainer.policy import Policy, build_policy
from treadle.trainer.spec import TrainerSection
from treadle.trainer.trainer import Trainer

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("model") / "qwen3")


def packed_docs(vocab: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Three documents and 4 padding tokens packed into one row of L = 128 tokens (the
    flex block size, so the mask crosses no partial block)."""
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, vocab, (n,), generator=gen) for n in (37, 61, 26)]
    pad = 128 - sum(len(d) for d in docs)
    ids_L = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])
    pos_L = torch.cat([*(torch.arange(len(d)) for d in docs), torch.zeros(pad, dtype=torch.long)])
    return docs, ids_L[None].to(CUDA), pos_L[None].to(CUDA)


def build(model_dir: Path, attention: str, dtype: torch.dtype = torch.float32) -> Policy:
    try:
        return build_policy(model_dir, attention=attention, device=CUDA, dtype=dtype)
    except ModuleNotFoundError as e:  # varlen needs FlashAttention 3 where torch lacks it
        pytest.skip(f"{attention} attention is not available here: {e}")


@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_gpu_packed_logprobs_equal_per_document_logprobs(model_dir: Path, backend: str) -> None:
    policy = build(model_dir, backend)
    assert policy.attention == backend
    docs, ids_BL, pos_BL = packed_docs(policy.hf.vocab_size)
    with torch.no_grad():
        packed_BL, _ = policy.token_logprobs(ids_BL, pos_BL, with_entropy=False)
    start = 0
    for doc in docs:
        d = doc.to(CUDA)[None]
        with torch.no_grad():
            alone, _ = policy.token_logprobs(
                d, torch.arange(d.shape[1], device=CUDA)[None], with_entropy=False
            )
        # position 0 of a document reads the previous document: not compared
        torch.testing.assert_close(
            packed_BL[:, start + 1 : start + len(doc)], alone[:, 1:], rtol=1e-4, atol=1e-4
        )
        start += len(doc)


@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_gpu_kernel_gradients_equal_block_causal_sdpa(model_dir: Path, backend: str) -> None:
    """Same weights, same packed row: the loss and every parameter gradient through the
    fast kernel equal those through the explicit-mask SDPA (the CPU path)."""
    results = {}
    for name in (backend, "sdpa"):
        policy = build(model_dir, name)
        _, ids_BL, pos_BL = packed_docs(policy.hf.vocab_size)
        mask_BL = (pos_BL > 0).float()  # every token but a document's first
        logprobs_BL, entropy_BL = policy.token_logprobs(ids_BL, pos_BL, with_entropy=True)
        loss = -(logprobs_BL * mask_BL).sum() / mask_BL.sum()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in policy.model.named_parameters()}
        assert entropy_BL is not None
        results[name] = (loss.detach(), grads, entropy_BL)
    loss_k, grads_k, ent_k = results[backend]
    loss_s, grads_s, ent_s = results["sdpa"]
    torch.testing.assert_close(loss_k, loss_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_k, ent_s, rtol=1e-4, atol=1e-4)
    assert grads_k.keys() == grads_s.keys()
    for n in grads_k:
        torch.testing.assert_close(grads_k[n], grads_s[n], rtol=1e-3, atol=1e-5, msg=n)


def make_trainer(model_dir: Path, root: Path, name: str, device: str, **kw: object) -> Trainer:
    section = TrainerSection(
        model=model_dir,
        optim={"lr": 1e-3, "warmup_steps": 0},  # type: ignore[arg-type]
        device=device,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    return Trainer(section, LocalObjectStore(root / "store"), checkpoint_dir=root / name / "ckpt")


def test_gpu_trainer_step_equals_the_cpu_step(model_dir: Path, tmp_path: Path) -> None:
    """One float32 step on CUDA (flex, fused AdamW) and on CPU (sdpa, foreach AdamW) on
    the same batch: same loss, grad norm and published weights."""
    vocab = vocab_size_of(model_dir)
    metrics, weights = {}, {}
    for where, trainer in (
        ("cuda", make_trainer(model_dir, tmp_path, "gpu", "cuda")),
        ("cpu", make_trainer(model_dir, tmp_path, "cpu", "cpu")),
    ):
        ready = store_batch(trainer.store, make_batch(1, vocab_size=vocab, seq_len=128))
        result = trainer.train_step(ready)
        assert result.skipped_reason == ""
        assert result.update_skipped_reason == ""
        assert result.weights is not None
        metrics[where] = result.metrics
        trainer.store.fetch_dir(result.weights, tmp_path / where)
        weights[where] = load_safetensors(tmp_path / where)
    for key in ("loss", "grad_norm", "entropy", "mismatch_kl"):
        assert metrics["cuda"][key] == pytest.approx(metrics["cpu"][key], rel=1e-3, abs=1e-6), key
    for k in weights["cpu"]:
        torch.testing.assert_close(
            weights["cuda"][k], weights["cpu"][k], rtol=1e-3, atol=1e-5, msg=k
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_trainer_steps_train_and_probe(model_dir: Path, tmp_path: Path, dtype: str) -> None:
    """Several SFT steps on one batch on CUDA: loss falls, metrics stay finite, and the
    published probe equals transformers' logprobs of the published weights."""
    trainer = make_trainer(model_dir, tmp_path, dtype, "cuda", dtype=dtype, loss={"kind": "sft"})
    assert trainer.policy.attention == "flex"
    vocab = vocab_size_of(model_dir)
    batch = make_batch(1, vocab_size=vocab, seq_len=128)
    losses = []
    result = None
    for step in range(1, 9):
        batch.step = step
        ready = store_batch(trainer.store, batch)
        result = trainer.train_step(ready)
        assert result.skipped_reason == ""
        assert result.update_skipped_reason == ""
        m = result.metrics
        assert all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "entropy")), m
        losses.append(m["loss"])
    assert losses[-1] < losses[0] * 0.9, losses
    assert result is not None
    assert result.weights is not None
    manifest = trainer.store.read_manifest(result.weights)
    probe = manifest.metadata["probe"]
    folder = tmp_path / "published"
    trainer.store.fetch_dir(result.weights, folder)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([probe["token_ids"]])
    with torch.no_grad():
        logits = hf(ids).logits[0, :-1].float()
    expect = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(torch.tensor(probe["logprobs"]), expect, rtol=tol, atol=tol)
