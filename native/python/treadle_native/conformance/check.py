"""``treadle check-template MODEL_DIR``: the proof a user runs on their own model folder.

It says which renderer the folder gets and why, then renders the project's conformance
corpus with that renderer and with transformers (``AutoTokenizer.from_pretrained(MODEL_DIR)``
+ ``apply_chat_template``, as a user's training code would) and compares, case by case:

- render: same text and token ids, or both reject the case (never one renders alone);
- masks: with ``{% generation %}`` blocks, the loss mask equals transformers'
  ``assistant_masks``; otherwise every trained token belongs to an assistant turn;
- bridge: where the full re-render keeps the previous ids as a prefix, the bridge must
  return exactly the re-render's ids (``bridging.py``); it must never return other ids.

It prints a summary and the first difference, and returns a non-zero exit code when
anything is off. transformers is imported here only (it is not a dependency of the
renderer itself).
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .bridging import bridge_outcomes
from .corpus import Case, cases

# corpus dialect per renderer family (the generic renderer gets the widest input)
DIALECT_OF = {
    "qwen3": "qwen3",
    "qwen2.5": "qwen2.5",
    "llama3": "llama3",
    "deepseek-r1": "deepseek-r1",
}


def _hf_tokenizer(model_dir: Path) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SystemExit(
            "treadle check-template: transformers is needed to compare against (pip install transformers)"
        ) from None
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    finally:
        logger.setLevel(level)


def check_template(
    model_dir: Path,
    *,
    renderer: str = "auto",
    num_cases: int = 120,
    print_: Callable[[str], None] = print,
) -> int:
    """Run the check; returns the process exit code (0: everything agrees)."""
    import treadle_native

    try:
        r = treadle_native.Renderer(renderer, str(model_dir))
    except treadle_native.TreadleNativeError as e:
        print_(f"renderer: cannot build {renderer!r} for {model_dir}: {e}")
        return 1
    print_(f"renderer: {r.family}")
    print_(f"  why: {r.selection}")
    if r.template_sha256:
        print_(f"  template sha256: {r.template_sha256}")
    if r.loss_mask_convention:
        print_(f"  loss mask: {r.loss_mask_convention}")
    tok = _hf_tokenizer(model_dir)
    dialect = DIALECT_OF.get(r.family, "generic")
    corpus = cases(dialect, num_cases)
    print_(f"corpus: {len(corpus)} cases ({dialect} dialect)")
    use_generation = r.loss_mask_convention == "generation"

    def hf_ids(msgs: list[dict[str, Any]], case: Case, agp: bool) -> list[int]:
        text = tok.apply_chat_template(
            copy.deepcopy(msgs), tools=copy.deepcopy(case.tools), add_generation_prompt=agp,
            tokenize=False, **case.template_kwargs,
        )  # fmt: skip
        return list(tok(text, add_special_tokens=False)["input_ids"])

    counts: Counter[str] = Counter()
    bridges: Counter[str] = Counter()
    first: list[str] = []
    t0 = time.monotonic()
    step = max(1, len(corpus) // 10)
    for i, case in enumerate(corpus):
        problem = _check_case(r, tok, case, use_generation, counts)
        if problem and not first:
            first.append(f"{case.id}: {problem}")
        bridges += bridge_outcomes(r, functools.partial(_ids_of, hf_ids, case), case)
        if (i + 1) % step == 0 or i + 1 == len(corpus):
            print_(f"  {i + 1}/{len(corpus)} cases, {time.monotonic() - t0:.1f}s")
    eligible = bridges["ok"] + bridges["missed"]
    print_("render:")
    print_(f"  identical to transformers     {counts['same']}")
    print_(f"  rejected by both              {counts['both_raise']}")
    print_(f"  different                     {counts['different']}")
    print_(f"  rendered, transformers raises {counts['native_only']}")
    print_(f"  rejected, transformers renders {counts['hf_only']}")
    print_(f"masks: agree {counts['mask_ok']}, disagree {counts['mask_bad']}")
    cover = f"{bridges['ok']}/{eligible}" if eligible else "0/0"
    print_(
        f"bridge: exact {cover} of the points where the re-render keeps the previous ids; "
        f"wrong {bridges['wrong']}; correctly refused {bridges['refused']}"
    )
    bad = counts["different"] + counts["native_only"] + counts["hf_only"] + counts["mask_bad"]
    bad += bridges["wrong"]
    if bad:
        print_(
            f"FAIL: {bad} problem(s); first: {first[0] if first else 'a bridge returned other ids'}"
        )
        return 1
    print_("OK: token-exact on every case")
    return 0


def _ids_of(
    hf_ids: Callable[..., list[int]], case: Case, msgs: list[dict[str, Any]], agp: bool
) -> list[int]:
    return hf_ids(msgs, case, agp)


def _check_case(r: Any, tok: Any, case: Case, use_generation: bool, counts: Counter[str]) -> str:
    """Compare one case; counts the outcome and returns a description of a problem ("" if none)."""
    import treadle_native

    kwargs: dict[str, Any] = dict(
        tools=copy.deepcopy(case.tools), add_generation_prompt=case.add_generation_prompt,
        **case.template_kwargs,
    )  # fmt: skip
    try:
        text = tok.apply_chat_template(copy.deepcopy(case.messages), tokenize=False, **kwargs)
        want = list(tok(text, add_special_tokens=False)["input_ids"])
    except Exception as e:  # the template rejects the case
        try:
            r.render(copy.deepcopy(case.messages), **kwargs)
        except treadle_native.TreadleNativeError:
            counts["both_raise"] += 1
            return ""
        counts["native_only"] += 1
        return f"transformers raises ({type(e).__name__}: {e}) but the renderer renders"
    try:
        out = r.render(copy.deepcopy(case.messages), **kwargs)
    except treadle_native.TreadleNativeError as e:
        counts["hf_only"] += 1
        return f"the renderer raises ({e}) but transformers renders"
    if out.text != text or out.token_ids.tolist() != want:
        counts["different"] += 1
        at = next((i for i, (a, b) in enumerate(zip(out.text, text, strict=False)) if a != b), None)
        at = min(len(out.text), len(text)) if at is None else at
        return f"text differs at char {at}: renderer {out.text[at : at + 30]!r}, transformers {text[at : at + 30]!r}"
    counts["same"] += 1
    mask = out.loss_mask.tolist()
    if use_generation:
        hf = tok.apply_chat_template(
            copy.deepcopy(case.messages), tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, **kwargs,
        )  # fmt: skip
        ok = list(hf["assistant_masks"]) == mask
    else:
        roles = [case.messages[i]["role"] if i >= 0 else None for i in out.message_index.tolist()]
        ok = all(role == "assistant" for role, m in zip(roles, mask, strict=True) if m)
    counts["mask_ok" if ok else "mask_bad"] += 1
    return "" if ok else "loss mask differs"
