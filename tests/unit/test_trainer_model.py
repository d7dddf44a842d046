"""Trainer models: TorchTitan logits equal transformers' for the same HF weights, packed
documents never attend across boundaries, weights round-trip through the state-dict
adapters, and bad model folders fail at startup with one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from testkit.trainer import tiny_llama3, tiny_qwen3
from treadle.trainer.errors import ModelFolderError
from treadle.trainer.models.attention import (
    BlockCausalSDPA,
    attention_masks,
    block_causal_mask,
    document_layout,
)
from treadle.trainer.models.hf import load_safetensors
from treadle.trainer.policy import Policy, build_policy

CPU = torch.device("cpu")


def build(folder: Path, **kw: object) -> Policy:
    return build_policy(folder, device=CPU, dtype=torch.float32, **kw)  # type: ignore[arg-type]


def titan_logits(policy: Policy, ids_BL: torch.Tensor, pos_BL: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = policy.model(
            ids_BL, pos_BL, attention_masks(policy.model, "sdpa", pos_BL)
        )
        return out


def hf_logits(folder: Path, ids_BL: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out: torch.Tensor = model(ids_BL).logits
        return out


@pytest.mark.parametrize("tie", [False, True])
def test_model_qwen3_logits_equal_transformers(tmp_path: Path, tie: bool) -> None:
    folder = tiny_qwen3(tmp_path / "m", tie=tie)
    policy = build(folder)
    assert policy.family.name == "qwen3"
    ids = torch.randint(
        0, policy.hf.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)
    )
    ours = titan_logits(policy, ids, torch.arange(40)[None])
    torch.testing.assert_close(ours, hf_logits(folder, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_model_llama3_logits_equal_transformers(tmp_path: Path, tie: bool) -> None:
    folder = tiny_llama3(tmp_path / "m", tie=tie)
    policy = build(folder)
    assert policy.family.name == "llama3"
    # longer than original_max_position_embeddings (64): the llama3 rope scaling matters
    ids = torch.randint(0, 320, (1, 150), generator=torch.Generator().manual_seed(1))
    ours = titan_logits(policy, ids, torch.arange(150)[None])
    torch.testing.assert_close(ours, hf_logits(folder, ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_model_packed_logits_equal_per_document_logits(tmp_path: Path, family: str) -> None:
    folder = tiny_qwen3(tmp_path / "m") if family == "qwen3" else tiny_llama3(tmp_path / "m")
    policy = build(folder)
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 300, (n,), generator=gen) for n in (7, 13, 5)]
    pad = 4
    ids = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])[None]
    pos = torch.cat([*(torch.arange(len(d)) for d in docs), torch.zeros(pad, dtype=torch.long)])[
        None
    ]
    packed = titan_logits(policy, ids, pos)
    start = 0
    for doc in docs:
        alone = titan_logits(policy, doc[None], torch.arange(len(doc))[None])
        torch.testing.assert_close(packed[:, start : start + len(doc)], alone, rtol=1e-5, atol=1e-5)
        start += len(doc)


def test_model_block_causal_mask_keeps_documents_apart() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = block_causal_mask(pos)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize(
    "lengths",
    [
        [[7, 13, 5, 1, 1, 1, 1, 1], [30]],  # trailing padding = documents of one token
        [[1] * 9 + [21], [2, 3, 4, 5, 6, 10]],  # many tiny documents, several buckets
        [[30], [30]],
    ],
)
def test_model_per_document_sdpa_equals_the_block_causal_mask(lengths: list[list[int]]) -> None:
    """The bucketed per-document SDPA gives the outputs and input gradients of SDPA under
    the full block-causal mask, GQA included (8 query heads over 2 key/value heads)."""
    gen = torch.Generator().manual_seed(5)
    pos_BL = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    B, L, N, K, H = *pos_BL.shape, 8, 2, 16
    q, k, v = (torch.randn(B, L, n, H, generator=gen, requires_grad=True) for n in (N, K, K))
    ours = BlockCausalSDPA(BlockCausalSDPA.Config())(
        q, k, v, attention_masks=document_layout(pos_BL), enable_gqa=True
    )
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=block_causal_mask(pos_BL), enable_gqa=True,
    ).transpose(1, 2)  # fmt: skip
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    weight = torch.randn(ours.shape, generator=gen)
    grads_ours = torch.autograd.grad((ours * weight).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for a, b in zip(grads_ours, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("autocast", [False, True])
def test_model_per_document_sdpa_of_bfloat16_runs_in_float32_on_cpu(autocast: bool) -> None:
    """bfloat16 inputs (pure bfloat16 weights, or matmuls under autocast): the attention
    is computed in float32 (CPU SDPA's bfloat16 backward is several times slower), even
    where autocast would cast it down; the output comes back in the input's dtype."""
    gen = torch.Generator().manual_seed(7)
    pos_BL = torch.cat([torch.arange(n) for n in (9, 14, 5, 1, 1)])[None]
    shape = (1, pos_BL.shape[1])
    q32, k32, v32 = (torch.randn(*shape, n, 16, generator=gen) for n in (4, 2, 2))
    q, k, v = (x.to(torch.bfloat16).requires_grad_() for x in (q32, k32, v32))
    attention = BlockCausalSDPA(BlockCausalSDPA.Config())
    seen: list[torch.dtype] = []
    real = F.scaled_dot_product_attention

    def spy(*a: torch.Tensor, **kw: object) -> torch.Tensor:
        seen.append(a[0].dtype)
        return real(*a, **kw)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", spy)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = attention(q, k, v, attention_masks=document_layout(pos_BL), enable_gqa=True)
    assert seen
    assert set(seen) == {torch.float32}
    assert out.dtype == torch.bfloat16
    ref = attention(
        *(x.to(torch.bfloat16).float() for x in (q32, k32, v32)),
        attention_masks=document_layout(pos_BL), enable_gqa=True,
    )  # fmt: skip
    assert torch.equal(out, ref.to(torch.bfloat16))
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


def test_model_document_layout_covers_every_token_once() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0, 1, 2, 3, 0, 0, 0, 1, 0]])  # 9 documents
    layout = document_layout(pos)
    assert len(layout.gather) > 1  # bucketed
    slots = torch.cat([g.flatten() for g in layout.gather])
    assert torch.equal(slots[layout.take], torch.arange(pos.numel()))
    assert torch.equal(layout.take_inv, slots)
    assert int((slots < pos.numel()).sum()) == pos.numel()  # the rest is padding
    for g, inv in zip(layout.gather, layout.gather_inv, strict=True):
        placed = inv < g.numel()
        assert torch.equal(g.flatten()[inv[placed]], torch.nonzero(placed).flatten())
    x = torch.zeros(1, 16, 2, 4)
    with pytest.raises(TypeError, match="DocumentLayout"):
        BlockCausalSDPA(BlockCausalSDPA.Config())(x, x, x, attention_masks=block_causal_mask(pos))


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_model_weights_round_trip_to_hf_names(tmp_path: Path, family: str) -> None:
    folder = tiny_qwen3(tmp_path / "m") if family == "qwen3" else tiny_llama3(tmp_path / "m")
    policy = build(folder)
    files = policy.save_hf(tmp_path / "out")
    assert set(files) == {"model.safetensors", "config.json"}
    source = load_safetensors(folder)
    saved = load_safetensors(tmp_path / "out")
    assert saved.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(saved[name], tensor), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "float32"


def test_model_token_logprobs_follow_the_sampling_position(tmp_path: Path) -> None:
    policy = build(tiny_qwen3(tmp_path / "m"))
    ids = torch.tensor([[5, 9, 11, 3]])
    logprobs, entropy = policy.token_logprobs(ids, torch.arange(4)[None], with_entropy=True)
    logits = titan_logits(policy, ids, torch.arange(4)[None])
    ref = torch.log_softmax(logits[0, 2], -1)[3]  # token 3 at position 3, predicted at 2
    assert logprobs[0, 0].item() == 0.0
    assert logprobs[0, 3].item() == pytest.approx(ref.item(), abs=1e-6)
    assert entropy is not None
    assert entropy.shape == (1, 4)
    assert policy.probe([5, 9, 11, 3])[2] == pytest.approx(ref.item(), abs=1e-6)


def test_model_missing_folder_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match="is not a folder") as info:
        build(tmp_path / "nope")
    assert "\n" not in str(info.value)


def test_model_folder_without_weights_is_refused(tmp_path: Path) -> None:
    folder = tiny_qwen3(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFolderError, match=r"holds no \*\.safetensors"):
        build(folder)


def test_model_unknown_architecture_is_refused(tmp_path: Path) -> None:
    folder = tiny_qwen3(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg |= {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFolderError, match="match no trainer family"):
        build(folder)


def test_model_family_override_must_match_the_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match="does not match"):
        build(tiny_qwen3(tmp_path / "m"), family="llama3")
    with pytest.raises(ModelFolderError, match="is unknown"):
        build(tiny_qwen3(tmp_path / "m2"), family="gpt9")


def test_model_weights_that_do_not_fit_the_config_are_refused(tmp_path: Path) -> None:
    folder = tiny_qwen3(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 64  # the safetensors hold 128
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFolderError, match="do not fit qwen3") as info:
        build(folder)
    assert "\n" not in str(info.value)
