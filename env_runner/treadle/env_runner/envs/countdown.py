"""countdown and arithmetic: answers verified exactly, no partial credit from a model.

countdown — ``{"numbers": [3, 7, 25, 50], "target": 82}``: write an arithmetic expression
that uses each given number at most once (+ - * / and parentheses) and equals the
target. The answer's last line (or a ``<answer>...</answer>`` span) is parsed into an
AST and evaluated with exact fractions; anything but numbers and + - * / is rejected.

arithmetic — ``{"question": "12 + 7 * 3", "answer": 33}``: the last integer in the reply
must equal the answer.
"""

from __future__ import annotations

import ast
import itertools
import random
import re
from fractions import Fraction
from typing import Any

from treadle.env_runner.environments import Environment
from treadle.env_runner.rubric import Rubric
from treadle.env_runner.tasksets import TaskSet

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}  # fmt: skip


class ExpressionError(ValueError):
    pass


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Value of ``expr`` (exact) and the integer literals it uses; ExpressionError when it
    is not a plain arithmetic expression."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ExpressionError(f"not an expression: {e.msg}") from None
    used: list[int] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ExpressionError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int)
            and not isinstance(node.value, bool)
        ):
            used.append(node.value)
            return Fraction(node.value)
        raise ExpressionError(f"{type(node).__name__} is not allowed")

    return ev(tree.body), used


def extract_expression(completion: str) -> str:
    m = re.search(r"<answer>(.*?)</answer>", completion, re.S)
    text = m.group(1) if m else completion.strip().splitlines()[-1] if completion.strip() else ""
    text = text.split("=")[0] if "=" in text else text
    return text.strip().strip("`$ ")


def countdown_correct(task: dict[str, Any], completion: str) -> float:
    """1.0 if the answer uses only the given numbers (each at most once) and hits the target."""
    try:
        value, used = evaluate(extract_expression(completion))
    except ExpressionError:
        return 0.0
    pool = list(task["numbers"])
    for n in used:
        if n not in pool:
            return 0.0
        pool.remove(n)
    return float(value == Fraction(task["target"]))


def valid_expression(completion: str) -> float:
    try:
        evaluate(extract_expression(completion))
        return 1.0
    except ExpressionError:
        return 0.0


def make_countdown(rng: random.Random, index: int) -> dict[str, Any]:
    """Numbers and a target reachable by construction (so every task has a solution)."""
    numbers = [rng.randint(1, 12) for _ in range(3)] + [rng.choice([10, 25, 50])]
    a, b, c = rng.sample(numbers, 3)
    for ops in itertools.product("+-*", repeat=2):
        target = eval(f"({a} {ops[0]} {b}) {ops[1]} {c}")
        if 1 <= target <= 200 and rng.random() < 0.6:
            break
    else:
        target = a + b + c
    return {"numbers": numbers, "target": int(target)}


def countdown_prompt(task: dict[str, Any]) -> str:
    nums = ", ".join(map(str, task["numbers"]))
    return (f"Using the numbers {nums} (each at most once) and + - * / with parentheses, "
            f"write an expression equal to {task['target']}. Put only the expression "
            f"between <answer> and </answer>.")  # fmt: skip


def arithmetic_correct(task: dict[str, Any], completion: str) -> float:
    ints = re.findall(r"-?\d+", completion.replace(",", ""))
    return float(bool(ints) and int(ints[-1]) == int(task["answer"]))


def make_arithmetic(rng: random.Random, index: int) -> dict[str, Any]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    op1, op2 = rng.choice("+-"), rng.choice("+-*")
    q = f"{a} {op1} {b} {op2} {c}"
    return {"question": q, "answer": int(eval(q))}


ENVIRONMENT = Environment(
    "countdown",
    prompt=countdown_prompt,
    rubric=Rubric(rewards=[countdown_correct], metrics=[valid_expression]),
    tasks=lambda: TaskSet.from_generator(make_countdown, n=500, seed=0, name="countdown"),
    required=("numbers", "target"),
    description="reach a target number with the given numbers; exact verification",
)

ARITHMETIC = Environment(
    "arithmetic",
    prompt=lambda task: f"Compute {task['question']}. Answer with the number only.",
    rubric=Rubric(rewards=[arithmetic_correct]),
    tasks=lambda: TaskSet.from_generator(make_arithmetic, n=500, seed=0, name="arithmetic"),
    required=("question", "answer"),
    description="integer arithmetic; the last number of the reply must be exact",
    privileged=lambda task: f"(The answer is {task['answer']}.)",
)
