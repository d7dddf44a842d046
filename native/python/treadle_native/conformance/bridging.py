"""Bridge coverage: where transformers' full re-render keeps the previous ids as a prefix,
`Renderer.bridge` must extend them to exactly the re-render's ids; elsewhere it must refuse.

For a conversation M and each point j where M[j-1] is an assistant turn, the previous ids
are transformers' ids of M[:j] and the re-render those of M[:j'] with the generation
prompt, j' being the next assistant turn (or the end). Each point is one outcome:

- ``ok``: eligible (the re-render starts with the previous ids) and the bridge returned
  exactly the rest of the re-render;
- ``missed``: eligible, but the bridge refused;
- ``wrong``: the bridge returned ids that differ from the re-render (never allowed);
- ``refused``: not eligible and the bridge refused (correct).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

from .corpus import Case

Render = Callable[[list[dict[str, Any]], bool], list[int]]


def bridge_points(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    out = []
    for j in range(1, len(messages)):
        if messages[j - 1]["role"] == "assistant" and messages[j]["role"] != "assistant":
            nxt = next(
                (k for k in range(j, len(messages)) if messages[k]["role"] == "assistant"),
                len(messages),
            )
            out.append((j, nxt))
    return out


def bridge_outcomes(renderer: Any, render: Render, case: Case) -> Counter[str]:
    """Outcomes of every bridge point of a case (`render(messages, add_generation_prompt)`
    is transformers' ids; points where it raises are skipped)."""
    counts: Counter[str] = Counter()
    msgs = case.messages
    kwargs = dict(case.template_kwargs)
    for j, nxt in bridge_points(msgs):
        try:
            prev = render(msgs[:j], False)
            full = render(msgs[:nxt], True)
        except Exception:  # the template rejects this prefix: not a bridge point
            continue
        eligible = full[: len(prev)] == prev
        try:
            b = renderer.bridge(
                prev,
                copy.deepcopy(msgs[j:nxt]),
                True,
                prev_messages=copy.deepcopy(msgs[:j]),
                tools=copy.deepcopy(case.tools),
                **kwargs,
            )
        except ValueError:  # TreadleNativeError: the renderer rejects the new messages
            counts["refused" if not eligible else "missed"] += 1
            continue
        if b.ok:
            counts["ok" if eligible and b.token_ids.tolist() == full else "wrong"] += 1
        else:
            counts["missed" if eligible else "refused"] += 1
    return counts
