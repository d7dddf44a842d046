"""tool_search: answer questions with a search tool over a small local corpus and a
calculator (multi-turn OpenAI-style function calling).

The corpus is a handful of short passages about fictional towns (so the answer must
come from the tools, not from memory). A question needs one or two facts and often a
calculation: ``{"question": "How many years after Brindle was founded was Corvath
founded?", "answer": 37}``. Reward ``correct``: the last number in the final answer
equals the answer. Metrics: searches, calculations (how the tools were used).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from treadle.env_runner.environments import Environment
from treadle.env_runner.envs.countdown import ExpressionError, evaluate
from treadle.env_runner.rubric import RolloutState, Rubric
from treadle.env_runner.tasksets import TaskSet

CORPUS = {
    "brindle": "Brindle is a river town founded in 1712. It has 4200 inhabitants and is known for its rope works.",
    "corvath": "Corvath was founded in 1749 on a granite hill. Its population is 12800 and it hosts a yearly kite fair.",
    "dunmere": "Dunmere, a fishing port, was founded in 1688. About 3100 people live there; its lighthouse is 41 meters tall.",
    "elstow": "Elstow is a market town founded in 1801, with 9600 inhabitants and a clock tower 27 meters tall.",
    "farrow": "Farrow was founded in 1655 by salt traders. It has 1500 inhabitants and three bridges.",
    "galloway_ridge": "Galloway Ridge is a mining village founded in 1873. Its 800 inhabitants run two copper mines.",
    "harlow_cross": "Harlow Cross, founded in 1730, is a crossroads town of 5400 people with seven inns.",
    "istead": "Istead was founded in 1822 beside a lake 14 kilometers long. It has 2300 inhabitants.",
}

QUESTIONS = [
    ("In what year was Brindle founded?", 1712),
    ("How many people live in Corvath?", 12800),
    ("How many years after Brindle was Corvath founded?", 37),
    ("How tall, in meters, is the lighthouse of Dunmere?", 41),
    ("What is the combined population of Elstow and Farrow?", 11100),
    ("How many years before Elstow was Farrow founded?", 146),
    ("How many inhabitants does Galloway Ridge have per copper mine?", 400),
    ("How many inns does Harlow Cross have?", 7),
    ("How many more people live in Harlow Cross than in Brindle?", 1200),
    ("How long, in kilometers, is the lake beside Istead?", 14),
    ("How many years passed between the founding of Dunmere and of Istead?", 134),
    ("What is the population of Corvath minus the population of Elstow?", 3200),
]


def search(query: str, k: int = 2) -> str:
    """Search the encyclopedia of towns.

    Args:
        query: words to look for, e.g. a town name.
        k: how many passages to return (1 to 5).
    """
    words = {w for w in re.findall(r"[a-z]+", query.lower()) if len(w) > 2}
    if not words:
        return "no results: the query has no words"
    scored = []
    for key, text in CORPUS.items():
        tokens = set(re.findall(r"[a-z]+", text.lower())) | set(key.split("_"))
        scored.append((len(words & tokens), key, text))
    scored.sort(key=lambda s: (-s[0], s[1]))
    hits = [f"[{key}] {text}" for score, key, text in scored[: max(1, min(int(k), 5))] if score > 0]
    return "\n".join(hits) or "no results"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: e.g. "(1749 - 1712) * 2".
    """
    try:
        value, _ = evaluate(expression)
    except ExpressionError as e:
        raise ValueError(f"cannot evaluate {expression!r}: {e}") from None
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def correct(task: dict[str, Any], completion: str) -> float:
    nums = re.findall(r"-?\d+(?:\.\d+)?", completion.replace(",", ""))
    return float(bool(nums) and Fraction(nums[-1]) == Fraction(task["answer"]))


def searches(state: RolloutState) -> float:
    return float(
        sum(1 for m in state.messages if m.get("role") == "tool" and m.get("name") == "search")
    )


def calculations(state: RolloutState) -> float:
    return float(
        sum(1 for m in state.messages if m.get("role") == "tool" and m.get("name") == "calculator")
    )


SYSTEM = (
    "You answer questions about towns. Use the search tool to find facts and the "
    "calculator for arithmetic. End with the final number."
)

ENVIRONMENT = Environment(
    "tool_search",
    prompt=lambda task: task["question"],
    system_prompt=SYSTEM,
    tools=[search, calculator],
    rubric=Rubric(rewards=[correct], metrics=[searches, calculations]),
    tasks=lambda: TaskSet.from_rows(
        "tool_search",
        [{"id": f"q{i}", "question": q, "answer": a} for i, (q, a) in enumerate(QUESTIONS)],
    ),
    required=("question", "answer"),
    description="multi-turn tool use: search a local corpus and calculate",
)
