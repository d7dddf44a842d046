"""Chat rendering throughput: treadle_native vs the ways trainers tokenize chats today.

    .venv/bin/python benchmarks/native_bench.py [--family qwen3] [--conversations 300] [--generic]

`--generic` times the generic renderer (`Renderer("jinja")`, minijinja) on the family's
template instead of the hand-written port: the path every other model's template takes.

Everything below runs on the same conversations in the same process:

  (a) HF `apply_chat_template(tokenize=False)` + `tokenizer(text)`            ids only
  (b) HF per-prefix masking: render every prefix, diff the lengths           ids + assistant mask
  (c) raw `tokenizers` encode of the already rendered text                   the floor (BPE alone)
  (d) the `renderers` package, when installed                                ids + mask
  (n) `treadle_native.Renderer.render`                                       ids + mask + message index

Single-thread numbers first (RAYON_NUM_THREADS=1 is set before anything starts), then
batch numbers with every core (`render_batch` vs `encode_batch`), then `bridge`:
appending a ~200-token tool result to a ~32k-token conversation vs re-rendering it
with HF. Outputs are checked to agree before anything is timed. Ratios are what to
read; absolute numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "tokenizers"
FOLDERS = {
    "qwen3": "qwen3",
    "qwen2.5": "qwen2.5-instruct",
    "llama3": "llama-3.2-instruct",
    "deepseek-r1": "deepseek-r1-distill-qwen",
}
WORDS = [
    "the",
    "model",
    "reads",
    "a",
    "question",
    "and",
    "answers",
    "it",
    "with",
    "care",
    "while",
    "the",
    "tool",
    "returns",
    "data",
    "about",
    "weather",
    "cities",
    "numbers",
    "code",
    "tests",
    "files",
    "reverse",
    "strings",
    "count",
    "letters",
    "sum",
    "values",
    "python",
    "function",
    "result",
    "error",
    "retry",
    "plan",
    "step",
    "check",
    "final",
    "because",
    "however",
    "therefore",
    "example",
    "東京",
    "café",
    "naïve",
    "🚀",
]
TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the corpus",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(rng: random.Random, family: str) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": words(rng, 20)}]
    for _ in range(rng.randint(2, 5)):
        msgs.append({"role": "user", "content": words(rng, rng.randint(20, 120))})
        if rng.random() < 0.4 and family != "deepseek-r1":
            call = {
                "type": "function",
                "function": {"name": "search", "arguments": {"query": words(rng, 3)}},
            }
            msgs.append(
                {
                    "role": "assistant",
                    "content": "" if family != "llama3" else None,
                    "tool_calls": [call],
                }
            )
            msgs.append({"role": "tool", "content": words(rng, rng.randint(30, 150))})
        msgs.append({"role": "assistant", "content": words(rng, rng.randint(40, 250))})
    return msgs


def load_renderers(hf: Any, family: str) -> Any:
    """The competitor `renderers` package's renderer for `family`, if it is installed."""
    try:
        import renderers  # type: ignore[import-not-found]
    except ImportError as e:
        print(f"(d) renderers package: not installed ({e})")
        return None
    configs = {
        "qwen3": "Qwen3RendererConfig",
        "llama3": "Llama3RendererConfig",
        "deepseek-r1": "DeepSeekR1RendererConfig",
        "qwen2.5": "DefaultRendererConfig",
    }
    return renderers.create_renderer(hf, getattr(renderers, configs[family])())


def best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def timed(renderer: Any, prev: Any, new: list[dict[str, Any]], extra: dict[str, Any]) -> float:
    """Seconds of one bridge."""
    t0 = time.perf_counter()
    renderer.bridge(prev, new, **extra)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--family", default="qwen3", choices=sorted(FOLDERS))
    p.add_argument("--conversations", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--generic", action="store_true", help="the generic renderer on the family's template"
    )
    args = p.parse_args()
    threads = os.cpu_count() or 1
    os.environ["RAYON_NUM_THREADS"] = (
        "1"  # single-thread section first; batch section uses a pool below
    )

    import numpy as np
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    import treadle_native as tn

    folder = SHARED / FOLDERS[args.family]
    kwargs: dict[str, Any] = {"date_string": "26 Jul 2024"} if args.family == "llama3" else {}
    hf = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    r = tn.Renderer("jinja" if args.generic else args.family, folder)
    label = f"{args.family} (generic renderer)" if args.generic else args.family
    rng = random.Random(0)
    convs = [conversation(rng, args.family) for _ in range(args.conversations)]
    texts = [hf.apply_chat_template(c, tools=[TOOL], tokenize=False, **kwargs) for c in convs]

    # correctness first: same ids everywhere
    for c, text in zip(convs[:50], texts[:50], strict=False):
        ours = r.render(c, tools=[TOOL], **kwargs)
        assert ours.text == text
        assert ours.token_ids.tolist() == hf(text, add_special_tokens=False)["input_ids"]
    num_tokens = sum(len(raw.encode(t, add_special_tokens=False).ids) for t in texts)

    def hf_ids() -> None:
        for c in convs:
            hf(
                hf.apply_chat_template(c, tools=[TOOL], tokenize=False, **kwargs),
                add_special_tokens=False,
            )

    def hf_prefix_masks() -> None:
        for c in convs:
            full = hf.apply_chat_template(
                c, tools=[TOOL], tokenize=True, return_dict=False, **kwargs
            )
            mask = np.zeros(len(full), np.uint8)
            for k, m in enumerate(c):
                if m["role"] == "assistant":
                    start = len(
                        hf.apply_chat_template(
                            c[:k],
                            tools=[TOOL],
                            tokenize=True,
                            return_dict=False,
                            add_generation_prompt=True,
                            **kwargs,
                        )
                    )
                    end = len(
                        hf.apply_chat_template(
                            c[: k + 1], tools=[TOOL], tokenize=True, return_dict=False, **kwargs
                        )
                    )
                    mask[start:end] = 1

    def raw_encode() -> None:
        for t in texts:
            raw.encode(t, add_special_tokens=False)

    def native() -> None:
        for c in convs:
            r.render(c, tools=[TOOL], **kwargs)

    rows: list[tuple[str, float]] = [
        ("(n) treadle_native render (ids + masks)", best(native, args.repeats)),
        ("(c) raw tokenizers encode (floor)", best(raw_encode, args.repeats)),
        ("(a) HF apply_chat_template + tokenize", best(hf_ids, args.repeats)),
        ("(b) HF per-prefix masking", best(hf_prefix_masks, 1)),
    ]
    try:
        competitor = load_renderers(hf, args.family)
        if competitor is not None:
            import renderers  # type: ignore[import-not-found]

            sample = renderers.build_training_sample(competitor, convs[0], tools=[TOOL])
    except Exception as e:  # a baseline that cannot take this family is left out, said why
        print(f"(d) renderers package: fails on this family ({type(e).__name__}: {e}); not timed")
        competitor = None
    if competitor is not None:
        if list(sample.token_ids) != r.render(convs[0], tools=[TOOL], **kwargs).token_ids.tolist():
            print("(d) renderers package: ids differ from HF on this corpus; not timed")
        else:
            rows.append(
                (
                    "(d) renderers build_training_sample",
                    best(
                        lambda: [
                            renderers.build_training_sample(competitor, c, tools=[TOOL])
                            for c in convs
                        ],
                        args.repeats,
                    ),
                )
            )
    print(f"\n{label}: {len(convs)} conversations, {num_tokens} tokens, single thread")
    t_native = rows[0][1]
    t_raw = rows[1][1]
    for name, t in rows:
        print(
            f"  {name:<44} {num_tokens / t / 1e3:9.0f} k tok/s   native is {t / t_native:5.2f}x faster"
        )
    print(f"  render+mask time / raw encode time = {t_native / t_raw:.2f} (goal <= 1.3)")

    # the rows above repeat the same conversations over a small word list, so both sides
    # run with warm caches (tokenizers' BPE word cache, the native encoder's piece cache);
    # the first pass of a freshly loaded renderer and tokenizer over conversations of
    # random words (almost every word new) is the other end:
    crng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    global WORDS
    common, WORDS = (
        WORDS,
        ["".join(crng.choice(letters) for _ in range(crng.randint(2, 10))) for _ in range(500_000)],
    )
    cold = [conversation(crng, args.family) for _ in range(args.conversations)]
    WORDS = common
    cold_tokens = sum(
        len(raw.encode(hf.apply_chat_template(c, tools=[TOOL], tokenize=False, **kwargs)).ids)
        for c in cold
    )
    fresh = tn.Renderer("jinja" if args.generic else args.family, folder)
    t0 = time.perf_counter()
    for c in cold:
        fresh.render(c, tools=[TOOL], **kwargs)
    t_cold_native = time.perf_counter() - t0
    fresh_hf = AutoTokenizer.from_pretrained(folder)
    t0 = time.perf_counter()
    for c in cold:
        fresh_hf(
            fresh_hf.apply_chat_template(c, tools=[TOOL], tokenize=False, **kwargs),
            add_special_tokens=False,
        )
    t_cold_hf = time.perf_counter() - t0
    print(
        f"  first pass, fresh renderer/tokenizer, unseen conversations: native "
        f"{cold_tokens / t_cold_native / 1e3:.0f} k tok/s, HF {cold_tokens / t_cold_hf / 1e3:.0f} k tok/s "
        f"(native is {t_cold_hf / t_cold_native:.2f}x faster)"
    )

    # batches over every core
    def native_batch() -> None:
        r.render_batch(convs, tools=[TOOL], **kwargs)

    def raw_batch() -> None:
        raw.encode_batch(texts, add_special_tokens=False)

    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    print(
        f"\nbatches, {threads} threads (RAYON_NUM_THREADS={threads}; pools already built keep their size):"
    )
    for name, fn in [("render_batch", native_batch), ("tokenizers encode_batch", raw_batch)]:
        t = best(fn, args.repeats)
        print(f"  {name:<44} {num_tokens / t / 1e3:9.0f} k tok/s")

    # bridge: a ~200-token tool result appended to a ~32k-token conversation
    brng = random.Random(1)
    long_conv: list[dict[str, Any]] = [{"role": "user", "content": words(brng, 50)}]
    while len(r.render(long_conv, tools=[TOOL], **kwargs)) < 32_000:
        long_conv.append({"role": "assistant", "content": words(brng, 150)})
        long_conv.append({"role": "user", "content": words(brng, 150)})
    # the sampled turn: a tool call (with reasoning for Qwen3), then the tool result arrives
    last: dict[str, Any] = {"role": "assistant", "content": words(brng, 30)}
    if args.family != "deepseek-r1":
        last["tool_calls"] = [
            {
                "type": "function",
                "function": {"name": "search", "arguments": {"query": words(brng, 4)}},
            }
        ]
    if args.family == "qwen3":
        last["reasoning_content"] = words(brng, 40)
    if args.family == "llama3":
        last["content"] = None
    long_conv.append(last)
    prev = r.render(long_conv, tools=[TOOL], **kwargs).token_ids
    if args.family in ("qwen3", "qwen2.5"):
        prev = prev[:-1]  # end at <|im_end|>, as sampling stops there
    tool_result = [{"role": "tool", "content": words(brng, 140)}]
    # the generic renderer proves each bridge by rendering: it needs the conversation
    extra: dict[str, Any] = (
        {"prev_messages": long_conv, "tools": [TOOL], **kwargs} if args.generic else {}
    )
    bridged = r.bridge(prev, tool_result, **extra)
    assert bridged.ok, bridged.reason
    full_ids = hf.apply_chat_template(
        long_conv + tool_result,
        tools=[TOOL],
        tokenize=True,
        return_dict=False,
        add_generation_prompt=True,
        **kwargs,
    )
    assert bridged.token_ids.tolist() == list(full_ids)
    # a rollout's bridges extend ids an earlier bridge proved (the generic renderer
    # remembers them); its first bridge has nothing to go on: a fresh renderer each time
    t_bridge = best(lambda: r.bridge(prev, tool_result, **extra), 20)
    short = {**extra, "prev_messages": long_conv[:3]} if args.generic else {}
    short_prev = r.render(long_conv[:3], tools=[TOOL], **kwargs).token_ids[:-1]

    def first() -> float:
        fresh = tn.Renderer("jinja" if args.generic else args.family, folder)
        fresh.bridge(short_prev, tool_result, **short)  # warm up on a short conversation
        return timed(fresh, prev, tool_result, extra)

    t_first = min(first() for _ in range(5))
    t_rerender = best(
        lambda: hf.apply_chat_template(
            long_conv + tool_result,
            tools=[TOOL],
            tokenize=True,
            return_dict=False,
            add_generation_prompt=True,
            **kwargs,
        ),
        3,
    )
    print(f"\nbridge: {len(prev)}-token conversation + {len(bridged.appended_ids)} appended tokens")
    print(f"  treadle_native bridge      {t_bridge * 1e3:8.3f} ms (goal < 1 ms)")
    print(
        f"    first, fresh renderer    {t_first * 1e3:8.3f} ms (nothing proved before, caches cold)"
    )
    print(f"  HF full re-render          {t_rerender * 1e3:8.3f} ms")
    print(f"  ratio                      {t_rerender / t_bridge:8.0f}x (goal >= 50x)")


if __name__ == "__main__":
    sys.exit(main())
