"""Trainer test kit: tiny HF checkpoints (Qwen3 from the chassis, Llama 3 written here)
and realistic training batches packed by ``treadle_native.pack``, stored in an object
store and announced by a BatchReady — exactly what the orchestrator produces.

Shapes: S samples, T tokens over all samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import treadle_native
from treadle.proto.v1 import batch_pb2
from treadle.services.codecs import to_token_array
from treadle.services.objectstore import ObjectStore
from treadle.services.tiny_model import TinyModelSpec, build_tiny_model

TINY = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                     intermediate_size=128, max_position_embeddings=512)  # fmt: skip


def tiny_qwen3(out_dir: Path, *, seed: int = 0, tie: bool = False) -> Path:
    """A random-init Qwen3 checkpoint small enough for CPU tests (float32)."""
    spec = TinyModelSpec(**{**TINY.__dict__, "tie_word_embeddings": tie})
    return build_tiny_model(out_dir, tokenizer="bpe", spec=spec, seed=seed)


def tiny_llama3(out_dir: Path, *, seed: int = 0, vocab_size: int = 320, tie: bool = False) -> Path:
    """A random-init LlamaForCausalLM checkpoint with Llama 3.1's rope scaling (no tokenizer)."""
    from safetensors.numpy import save_file

    h, n_heads, n_kv, hd, inter, layers = 64, 4, 2, 16, 128, 2
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(n_heads * hd, h),
            p + "self_attn.k_proj.weight": normal(n_kv * hd, h),
            p + "self_attn.v_proj.weight": normal(n_kv * hd, h),
            p + "self_attn.o_proj.weight": normal(h, n_heads * hd),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
            p + "input_layernorm.weight": 1 + normal(h),
            p + "post_attention_layernorm.weight": 1 + normal(h),
        }
    tensors["model.norm.weight"] = 1 + normal(h)
    if not tie:
        tensors["lm_head.weight"] = normal(vocab_size, h)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv, "head_dim": hd,
        "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "tie_word_embeddings": tie, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def vocab_size_of(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def make_batch(
    step: int,
    *,
    vocab_size: int,
    lengths: tuple[int, ...] = (23, 17, 30, 9, 12),
    seq_len: int = 48,
    num_ranks: int = 1,
    seed: int = 0,
    policy_version: int | None = None,
    logprob_scale: float = 1.0,
    group_size: int = 1,
    prompts: tuple[int, ...] | None = None,
) -> batch_pb2.Batch:
    """A Batch of samples (prompt half, sampled half) packed by treadle_native.pack.
    ``prompts``: each sample's prompt length instead (the rest sampled). ``group_size``
    > 1: consecutive samples in groups of that many open with the same prompt (the
    group's first sample's, as far as each one's own prompt goes)."""
    rng = np.random.default_rng(seed + 1000 * step)
    lengths_S = np.asarray(lengths, dtype=np.int64)
    num_tokens = int(lengths_S.sum())
    token_ids = rng.integers(3, vocab_size, num_tokens).astype(np.int32)
    starts_S = np.concatenate([[0], np.cumsum(lengths_S)[:-1]])
    prompt_S = np.asarray(prompts if prompts is not None else lengths_S // 2, dtype=np.int64)
    if len(prompt_S) != len(lengths_S) or (prompt_S < 1).any() or (prompt_S >= lengths_S).any():
        raise ValueError("each sample needs a prompt of 1 token or more and a sampled rest")
    for s in range(len(lengths_S)):
        first = s - s % group_size
        n = int(min(prompt_S[s], prompt_S[first]))
        token_ids[starts_S[s] : starts_S[s] + n] = token_ids[starts_S[first] : starts_S[first] + n]
    loss_mask = np.zeros(num_tokens, dtype=np.uint8)
    for start, n, p in zip(starts_S, lengths_S, prompt_S, strict=True):
        loss_mask[start + p : start + n] = 1  # after the prompt: sampled
    version = step - 1 if policy_version is None else policy_version
    advantages_S = rng.standard_normal(len(lengths_S)).astype(np.float32)
    # near the log-probability a random-init model gives any token: ratios stay near 1
    noise = rng.normal(0.0, 0.05 * logprob_scale, num_tokens)
    behaviour = np.where(loss_mask == 1, -np.log(vocab_size) + noise, 0.0)
    versions = np.where(loss_mask == 1, version, -1).astype(np.int32)
    packed = treadle_native.pack(
        lengths_S,
        token_ids,
        loss_mask,
        advantages_S,
        behaviour.astype(np.float32),
        versions,
        seq_len=seq_len,
        num_ranks=num_ranks,
    )
    batch = batch_pb2.Batch(step=step)
    for m in range(packed.num_micro_batches):
        batch.micro_batches.append(
            batch_pb2.MicroBatch(
                rank=int(packed.rank[m]),
                index=int(packed.index[m]),
                num_tokens=packed.seq_len,
                input_ids=to_token_array(packed.input_ids[m]),
                position_ids=to_token_array(packed.position_ids[m]),
                cu_seqlens=to_token_array(packed.micro_batch_cu_seqlens(m)),
                loss_mask=to_token_array(packed.loss_mask[m]),
                advantages=to_token_array(packed.advantages[m]),
                behaviour_logprobs=to_token_array(packed.behaviour_logprobs[m]),
                policy_versions=to_token_array(packed.policy_versions[m]),
                sample_index=to_token_array(packed.micro_batch_sample_index(m)),
            )
        )
    for s in range(packed.num_samples):
        batch.samples.append(
            batch_pb2.SampleRef(
                rollout_id=f"r{step}-{s}", num_tokens=int(packed.sample_num_tokens[s])
            )
        )
    return batch


def store_batch(
    store: ObjectStore, batch: batch_pb2.Batch, *, num_ranks: int = 1
) -> batch_pb2.BatchReady:
    """Put ``batch`` in the store and return its BatchReady."""
    data = batch.SerializeToString()
    ref = store.put_bytes(
        f"batches/step{batch.step:06d}.pb",
        data,
        "application/x-protobuf; type=treadle.proto.v1.Batch",
    )
    from treadle.services.codecs import to_array

    num_loss = sum(int(to_array(mb.loss_mask).sum()) for mb in batch.micro_batches)
    used = sum(int(to_array(mb.cu_seqlens)[-1]) for mb in batch.micro_batches)
    return batch_pb2.BatchReady(
        step=batch.step,
        rollout_ids=sorted({s.rollout_id for s in batch.samples}),
        num_ranks=num_ranks,
        seq_len=batch.micro_batches[0].num_tokens,
        data=ref,
        num_samples=len(batch.samples),
        num_tokens=used,
        num_loss_tokens=num_loss,
    )
