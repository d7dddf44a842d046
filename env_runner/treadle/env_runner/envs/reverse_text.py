"""reverse-text: reverse a string character by character; partial credit by similarity.

Task: ``{"id": ..., "text": "abc def"}``. Reward: the longest-common-subsequence ratio
between the answer (stripped of surrounding whitespace) and the reversed text, in
[0, 1]; an exact reversal scores 1. Metric ``exact``: 1 for an exact reversal.
Privileged context (self-distillation): the reversed text itself.
"""

from __future__ import annotations

import random
import string
from typing import Any

from treadle.env_runner.environments import Environment
from treadle.env_runner.rubric import Rubric
from treadle.env_runner.tasksets import TaskSet

SYSTEM = "Reverse the text."


def lcs_ratio(a: str, b: str) -> float:
    """2 * LCS(a, b) / (len(a) + len(b)); 1.0 for two empty strings."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return 2.0 * prev[-1] / (len(a) + len(b))


def prompt(task: dict[str, Any]) -> list[dict[str, Any]]:
    text = task.get("text")
    if not isinstance(text, str):
        raise ValueError("reverse_text task needs a string field 'text'")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def reward(task: dict[str, Any], completion: str) -> float:
    return lcs_ratio(completion.strip(), str(task["text"])[::-1])


def exact(task: dict[str, Any], completion: str) -> float:
    return float(completion.strip() == str(task["text"])[::-1])


def answer_hint(task: dict[str, Any]) -> str:
    """What a self-distillation teacher is told: the answer."""
    return f"(The reversed text is: {str(task['text'])[::-1]})"


def make_task(rng: random.Random, index: int) -> dict[str, Any]:
    alphabet = string.ascii_lowercase + "  "
    return {
        "text": "".join(rng.choice(alphabet) for _ in range(rng.randint(4, 12))).strip() or "ab"
    }


ENVIRONMENT = Environment(
    "reverse_text",
    prompt=prompt,
    rubric=Rubric(rewards=[reward], metrics=[exact]),
    tasks=lambda: TaskSet.from_generator(make_task, n=200, seed=1, name="reverse_text"),
    required=("text",),
    description="reverse a string; partial credit by longest common subsequence",
    privileged=answer_hint,
)
