"""A fake model for env runner tests: scripted answers as real qwen3 token ids.

    gen = ScriptedGenerator(["<think>\\n\\n</think>\\n\\nolleh<|im_end|>"])
    RolloutContext(renderer, gen, "runner-1")  # gen.generate(prompt_ids) -> Gen
    gen.calls[0]  # the first prompt's token ids
    gen.sampling[0]  # the first call's keyword arguments (max_tokens, temperature, ...)

It stands in for the inference client (``generate(prompt_ids, **kw)``) where the model is
incidental; it does not tokenize prompts, sample, or honour sampling parameters. Tests
that need a real model server use ``testkit.inference``; the env runner service tests use
``testkit.env_runner.FakeInference`` (the same idea over HTTP).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from testkit.paths import shared_tokenizer
from treadle.services.errors import TreadleError


@dataclass
class Gen:
    """One generation, shaped as the inference client returns it."""

    token_ids: np.ndarray  # [num_tokens] int32, the sampled ids
    logprobs: np.ndarray  # [num_tokens] float32
    policy_versions: np.ndarray  # [num_tokens] int32, the policy version of each id
    finish_reason: str


@functools.cache
def qwen3_tokenizer() -> Any:
    """The real qwen3 tokenizer (``tokenizers.Tokenizer``) from ../shared, loaded once."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(shared_tokenizer("qwen3") / "tokenizer.json"))


@functools.cache
def _encode(text: str) -> tuple[int, ...]:
    return tuple(qwen3_tokenizer().encode(text, add_special_tokens=False).ids)


def encode_qwen3(text: str) -> list[int]:
    """``text`` as qwen3 token ids, special tokens (``<|im_end|>``) included as written."""
    return list(_encode(text))


def decode_qwen3(ids: Sequence[int]) -> str:
    """qwen3 token ids as text, special tokens kept."""
    return str(qwen3_tokenizer().decode(list(ids), skip_special_tokens=False))


class ScriptedGenerator:
    """Answers the n-th ``generate`` call with the n-th scripted answer (the last one
    repeats), every answer finishing with "stop"; records each call's prompt ids.

    An answer is text (encoded with :func:`encode_qwen3`) or token ids. The first
    ``fail_times`` calls are recorded and then raise ``TreadleError`` (inference
    unreachable). Every sampled id has logprob -0.5 and policy version ``version``.
    """

    def __init__(
        self,
        answers: Sequence[str | Sequence[int]],
        *,
        fail_times: int = 0,
        version: int = 0,
    ):
        assert answers, "a scripted generator needs at least one answer"
        self.answers = [encode_qwen3(a) if isinstance(a, str) else list(a) for a in answers]
        self.fail_times = fail_times
        self.version = version
        self.calls: list[list[int]] = []  # prompt ids of each generate call, in order
        self.sampling: list[dict[str, Any]] = []  # keyword arguments of each call, in order

    async def generate(self, prompt_ids: Any, **kw: Any) -> Gen:
        self.calls.append(np.asarray(prompt_ids).tolist())
        self.sampling.append(dict(kw))
        if len(self.calls) <= self.fail_times:
            raise TreadleError("inference unreachable")
        ids = self.answers[min(len(self.calls), len(self.answers)) - 1]
        n = len(ids)
        return Gen(
            np.array(ids, np.int32),
            np.full(n, -0.5, np.float32),
            np.full(n, self.version, np.int32),
            "stop",
        )
