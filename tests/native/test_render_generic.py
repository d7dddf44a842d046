"""The generic renderer and renderer selection: templates found as transformers finds them,
"auto" never silently wrong, `{% generation %}` masks, the sampled mask convention and
bridges proved against a full render. transformers is the oracle wherever it has an answer."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treadle_native as tn
from testkit.paths import shared_tokenizer

QWEN3 = shared_tokenizer("qwen3")


def hf(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def model_dir(tmp_path: Path, template: Any = None, files: dict[str, str] | None = None) -> Path:
    """A model folder with Qwen3's tokenizer and the given template arrangement."""
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(QWEN3 / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((QWEN3 / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, text in (files or {}).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    return d


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]
SIMPLE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --- selection --------------------------------------------------------------------------------


def test_auto_uses_the_port_only_for_its_proven_template() -> None:
    r = tn.Renderer("auto", QWEN3)
    assert r.family == "qwen3"
    assert "proven equal" in r.selection
    assert r.template_sha256 is not None
    assert len(r.template_sha256) == 64


def test_auto_takes_the_generic_renderer_for_a_changed_template(tmp_path: Path) -> None:
    original = json.loads((QWEN3 / "tokenizer_config.json").read_text())["chat_template"]
    d = model_dir(tmp_path, original.replace("<|im_start|>system", "<|im_start|>system "))
    r = tn.Renderer("auto", d)
    assert r.family == "jinja"
    assert "not one a family port is proven equal to" in r.selection
    out = r.render(CHAT, add_generation_prompt=True)
    assert out.text == hf(d).apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    with pytest.raises(tn.TemplateError, match="does not match the model's chat template"):
        tn.Renderer("qwen3", d)
    forced = tn.Renderer("qwen3", d, force=True)
    assert forced.selection.startswith("FORCED")


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    d = model_dir(tmp_path, "{{ 'from config' }}", {"chat_template.jinja": SIMPLE})
    r = tn.Renderer("auto", d)
    assert "chat_template.jinja" in r.selection
    assert r.render(CHAT).text == hf(d).apply_chat_template(CHAT, tokenize=False)


def test_named_templates_pick_default_and_tool_use_as_transformers(tmp_path: Path) -> None:
    tool_use = SIMPLE.replace("{% for m", "TOOLS:{{ tools | length }}\n{% for m")
    d = model_dir(
        tmp_path,
        [{"name": "default", "template": SIMPLE}, {"name": "tool_use", "template": tool_use}],
    )
    r = tn.Renderer("jinja", d)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    h = hf(d)
    assert r.render(CHAT).text == h.apply_chat_template(CHAT, tokenize=False)
    assert r.render(CHAT, tools=tools).text == h.apply_chat_template(
        CHAT, tools=tools, tokenize=False
    )
    assert r.render(CHAT, tools=tools).text.startswith("TOOLS:1")
    named = tn.Renderer("jinja", d, chat_template="tool_use")
    assert named.render(CHAT, tools=[]).text.startswith("TOOLS:0")


def test_named_templates_without_default_are_a_clear_error(tmp_path: Path) -> None:
    d = model_dir(tmp_path, [{"name": "rag", "template": SIMPLE}])
    with pytest.raises(
        tn.TemplateError, match=r"several chat templates and none named \"default\" \(rag\)"
    ):
        tn.Renderer("auto", d)


def test_no_template_is_a_clear_error(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    with pytest.raises(tn.TemplateError, match="no chat template"):
        tn.Renderer("auto", d)
    with pytest.raises(tn.TemplateError, match="needs a chat template"):
        tn.Renderer("jinja", d)


def test_unknown_loss_mask_convention_is_an_error() -> None:
    with pytest.raises(tn.TreadleNativeError, match="loss_mask must be"):
        tn.Renderer("jinja", QWEN3, loss_mask="everything")


# --- what the template sees ----------------------------------------------------------------------


def test_developer_role_list_content_and_template_kwargs_reach_the_template(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}[{{ m.role }}]"
        "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}|{% endfor %}{% endif %}"
        "{% endfor %}effort={{ reasoning_effort }}"
    )
    d = model_dir(tmp_path, template)
    msgs = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    r = tn.Renderer("jinja", d)
    out = r.render(msgs, reasoning_effort="high")
    assert out.text == hf(d).apply_chat_template(msgs, tokenize=False, reasoning_effort="high")
    assert out.text == "[developer]rules[user]a|b|effort=high"


# --- masks ------------------------------------------------------------------------------------------

GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_generation_blocks_give_transformers_assistant_masks(tmp_path: Path) -> None:
    d = model_dir(tmp_path, GENERATION)
    r = tn.Renderer("auto", d)
    assert r.loss_mask_convention == "generation"
    msgs = [*CHAT, {"role": "assistant", "content": "See you"}]
    out = r.render(msgs)
    want = hf(d).apply_chat_template(
        msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert out.token_ids.tolist() == want["input_ids"]
    assert out.loss_mask.tolist() == want["assistant_masks"]
    assert sum(want["assistant_masks"]) > 0


def test_sampled_mask_includes_the_stop_token_and_survives_a_think_prefill(tmp_path: Path) -> None:
    # the generation prompt pre-fills "<think>\n"; history turns are rendered without it
    template = SIMPLE.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"
    )
    d = model_dir(
        tmp_path, template, {"generation_config.json": json.dumps({"eos_token_id": 151645})}
    )
    r = tn.Renderer("jinja", d)
    assert r.loss_mask_convention == "sampled"
    msgs = [*CHAT, {"role": "assistant", "content": "See you"}]
    out = r.render(msgs)
    tok = hf(d)
    trained = [t for t, m in zip(out.token_ids.tolist(), out.loss_mask.tolist(), strict=True) if m]
    text = tok.decode(trained)
    assert text == "Hello!<|im_end|>See you<|im_end|>"


def test_sampled_mask_keeps_the_stop_token_when_the_template_rewrites_history() -> None:
    # Qwen3 drops the reasoning of earlier turns: not prefix-stable, content located instead
    r = tn.Renderer("jinja", QWEN3)
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    ]
    out = r.render(msgs)
    assert out.prefix_stable is False
    im_end = int(r.stop_ids[0])
    ids, mask = out.token_ids.tolist(), out.loss_mask.tolist()
    ends = [i for i, t in enumerate(ids) if t == im_end]
    assert mask[ends[1]] == 1  # the first assistant turn's <|im_end|>
    assert mask[ends[3]] == 1
    assert mask[ends[0]] == 0  # user turns
    assert mask[ends[2]] == 0


# pieces of the template's own scaffold and of the other fields: a content search finds them
# in the wrong place (it trained "assistant\n<think>..." when the content was "t")
SCAFFOLD_BITS = st.sampled_from(
    ["t", "e", "assistant", "user", "im", "think", "4", "6", "\n", "the answer"]
)


@functools.cache
def _qwen3_jinja_and_hf() -> tuple[tn.Renderer, Any]:
    return tn.Renderer("jinja", QWEN3), hf(QWEN3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # (an answer starting with "\n" shares a token with its prompt's "\n" in the render)
    answers=st.lists(
        st.lists(SCAFFOLD_BITS, min_size=1, max_size=3)
        .map("".join)
        .filter(lambda a: not a[0].isspace()),
        min_size=2,
        max_size=3,
    ),
    reasonings=st.lists(
        st.lists(SCAFFOLD_BITS, min_size=1, max_size=4).map(" ".join), min_size=3, max_size=3
    ),
)
def test_sampled_mask_of_a_rewritten_conversation_is_what_each_turn_sampled(
    answers: list[str], reasonings: list[str]
) -> None:
    """Qwen3's template drops earlier turns' reasoning: not prefix-stable. The last turn is
    trained from the end of its generation prompt (its reasoning included) through
    <|im_end|>, earlier ones as rendered (content and <|im_end|>), nothing else, whatever
    the contents repeat of the scaffold or of one another."""
    r, tok = _qwen3_jinja_and_hf()
    msgs: list[dict[str, Any]] = []
    for i, (answer, reasoning) in enumerate(zip(answers, reasonings, strict=False)):
        msgs.append({"role": "user", "content": f"question {i}"})
        msgs.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
    out = r.render(msgs)
    ids, mask = out.token_ids.tolist(), out.loss_mask.tolist()
    runs: list[str] = []
    for i, (t, m) in enumerate(zip(ids, mask, strict=True)):
        if m and (i == 0 or not mask[i - 1]):
            runs.append("")
        if m:
            runs[-1] += tok.decode([t])
    prompt = r.render(msgs[:-1], add_generation_prompt=True).text
    full = out.text
    assert full.startswith(prompt)
    expected = [f"{a}<|im_end|>" for a in answers[:-1]] + [full[len(prompt) :].rstrip("\n")]
    assert runs == expected


# --- bridge ---------------------------------------------------------------------------------------


def test_generic_bridge_equals_the_full_render_and_refuses_rewrites(tmp_path: Path) -> None:
    d = model_dir(tmp_path, SIMPLE)
    r = tn.Renderer("jinja", d)
    history = CHAT[:3]
    prev = r.render(history).token_ids
    new = [{"role": "user", "content": "More?"}]
    b = r.bridge(prev, new, prev_messages=history)
    assert b.ok, b.reason
    full = r.render(history + new, add_generation_prompt=True)
    assert b.token_ids.tolist() == full.token_ids.tolist()
    assert set(b.message_index.tolist()) <= {-1, 0}
    assert 0 in b.message_index.tolist()
    # a sampled turn that stopped at <|im_end|> (no trailing newline) bridges too
    b = r.bridge(prev[:-1], new, prev_messages=history)
    assert b.ok
    assert b.token_ids.tolist() == full.token_ids.tolist()
    # history the template would write differently: refused, with the place
    b = r.bridge(prev, new, prev_messages=[*CHAT[:2], {"role": "assistant", "content": "Other"}])
    assert not b.ok
    assert "differently from prev_ids at character" in b.reason
    # the generic renderer cannot bridge without knowing what prev_ids render
    assert "prev_messages" in r.bridge(prev, new).reason


def test_generic_bridge_remembers_proved_ids_but_proves_the_text_again(tmp_path: Path) -> None:
    """A rollout's bridges extend ids an earlier bridge proved: the renderer remembers them,
    and answers exactly as one that proved nothing yet; the text is still compared."""
    d = model_dir(tmp_path, SIMPLE)
    r = tn.Renderer("jinja", d)
    history = CHAT[:3]
    prev = r.render(history).token_ids
    new = [{"role": "user", "content": "More?"}]
    turns = [(prev, history)]
    b = r.bridge(prev, new, prev_messages=history)
    assert b.ok, b.reason
    sampled = hf(d)("Sure.<|im_end|>", add_special_tokens=False)["input_ids"]
    turns.append(
        (
            np.concatenate([b.token_ids, sampled]),
            [*history, *new, {"role": "assistant", "content": "Sure."}],
        )
    )
    turns.append(turns[0])  # the same ids again
    for ids, messages in turns:
        ours = r.bridge(ids, new, prev_messages=messages)
        fresh = tn.Renderer("jinja", d).bridge(ids, new, prev_messages=messages)
        assert ours.ok, ours.reason
        assert fresh.ok, fresh.reason
        for field in ("token_ids", "message_index", "loss_mask", "is_content"):
            assert getattr(ours, field).tolist() == getattr(fresh, field).tolist(), field
    # the proved ids, with a history the template writes differently: refused all the same
    other = [*CHAT[:2], {"role": "assistant", "content": "Other"}]
    refused = r.bridge(prev, new, prev_messages=other)
    assert not refused.ok
    assert "differently from prev_ids at character" in refused.reason


def test_generic_bridge_closes_a_truncated_turn(tmp_path: Path) -> None:
    d = model_dir(tmp_path, SIMPLE)
    r = tn.Renderer("jinja", d)
    prompt = r.render(CHAT[:2], add_generation_prompt=True).token_ids.tolist()
    sampled = hf(d)("Hel", add_special_tokens=False)["input_ids"]  # cut off by max_tokens
    history = [*CHAT[:2], {"role": "assistant", "content": "Hel"}]
    b = r.bridge(prompt + sampled, [{"role": "user", "content": "go on"}], prev_messages=history)
    assert b.ok, b.reason
    assert b.closed_turn
    assert b.text.startswith("<|im_end|>\n<|im_start|>user")
