"""python-code: write a Python function; graded by running the task's tests against it.

Task: ``{"id", "prompt": problem statement, "entry_point": function name, "tests": Python
code with top-level ``assert`` statements, "timeout_s" (optional, default 10, at most
60)}``. The model answers with one fenced ```python block; the last python (or untagged)
block counts, and an answer without one scores 0 with metric ``no_code``.

Grading. The solution and the tests never share a process, a sandbox or a writable
channel. Two programs run side by side in two workspaces of the environment's runtime
(``RolloutState.runtime``; by default the bubblewrap sandbox: an unprivileged uid in its
own namespaces, no network, read-only system, private ``/tmp``; the local runtime runs
them unconfined, for development only; containers cannot be linked by pipes and are
refused)::

    candidate sandbox                      judge sandbox
    (the solution; the task's limits)      (the tests; no solution code ever runs here)
    CANDIDATE: exec solution.py,  <-calls--  JUDGE: each test in its own namespace, where
    answer each call of the entry   --answers->  the entry point is a proxy that sends the
    point with plain data                     call and decodes the answer
                                              report: one line on its own stdout ---> here

Calls and answers are JSON lines over two pipes the runner created (the only link between
the two); an answer is plain data only (None, bool, int, float, complex, str, bytes and
lists, tuples, dicts, sets, frozensets of them), decoded in the judge into fresh built-in
values, and an exception raised by the solution comes back as its type name (re-raised in
the judge as that built-in exception, else ``CandidateError``). The reward function reads
only the judge's stdout (the candidate cannot write it), whose report line also carries a
per-run nonce the candidate never sees. The candidate never sees the tests either.

    reward  passed                 1.0 when every test passed, the judge reported, and the
                                   candidate ended cleanly (no limit hit)
    metric  tests_passed_fraction  passed tests / tests (each top-level assert is one test)
    metric  no_code                no fenced code block in the answer
    metric  code_error             the code raised on import, lacks the entry point, or its
                                   process ended before it was ready
    metric  no_report              the judge ended without its report
    metric  sandbox_<status>       one-hot SandboxStatus of the candidate (ok, timeout,
                                   cpu_limit, memory_limit, process_limit, output_limit, ...)
    metric  sandbox_wall_s         wall time of the candidate's run (seconds)

The grade (outcome, per-test results, sandbox status, output tails) is kept in
``state.info["python_code"]``. Tests with no top-level assert (e.g. HumanEval's
``def check(candidate)`` plus a call) count as one test that passes when they run without
raising.

What the separation costs: a call's arguments and result cross a process boundary, so a
test cannot observe in-place mutation of its arguments, pass callables or custom objects
to the solution, or receive iterators and custom objects back (such a call fails the
test). Reward hacks it closes by construction: exiting early, printing a fake report,
writing a results file, shadowing builtins or patching modules (the candidate's own
process only), objects equal to everything (only plain data comes back), and walking the
grader's frames (there are none in the candidate's process).
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treadle.env_runner.environments import Environment
from treadle.env_runner.rubric import RolloutState, Rubric
from treadle.env_runner.runtimes.base import Runtime, SandboxLimits, SandboxStatus, Workspace
from treadle.env_runner.runtimes.sandbox import SandboxRuntime
from treadle.env_runner.tasksets import TaskSet
from treadle.services.errors import ConfigError

DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 60.0
JUDGE_GRACE_S = 5.0  # the judge's wall time beyond the candidate's
INFO_KEY = "python_code"
TAIL_CHARS = 4000

SYSTEM = (
    "You are an expert Python programmer. Answer with exactly one fenced ```python code "
    "block holding the complete solution: the requested function and any imports or "
    "helpers it needs. No tests, no example usage, nothing that reads input."
)


def sandbox_limits(timeout_s: float) -> SandboxLimits:
    """The limits one test run gets: ``timeout_s`` of wall time and as much CPU time."""
    return SandboxLimits(
        wall_s=timeout_s,
        cpu_s=max(1, math.ceil(timeout_s)),
        memory_bytes=512 << 20,  # the whole sandbox, /tmp included (and each process)
        processes=32,
        open_files=64,
        file_bytes=16 << 20,
        output_bytes=256 << 10,  # stdout and stderr each
        tmp_bytes=64 << 20,
        shm_bytes=16 << 20,
        work_bytes=64 << 20,
    )


def judge_limits(timeout_s: float) -> SandboxLimits:
    """The judge's limits: it outlives the candidate's wall time, to report after it."""
    return SandboxLimits(
        wall_s=timeout_s + JUDGE_GRACE_S,
        cpu_s=max(1, math.ceil(timeout_s)) + 5,
        memory_bytes=512 << 20,
        processes=8,
        open_files=64,
        file_bytes=1 << 20,
        output_bytes=256 << 10,
        tmp_bytes=16 << 20,
        shm_bytes=1 << 20,
        work_bytes=1 << 20,
    )


# Plain data as JSON, both ways: None/bool/int/float/str as themselves, everything else
# tagged ({"l": [...]} list, "t" tuple, "s" set, "f" frozenset, "d" [[k, v], ...] dict,
# "b" hex bytes, "c" [re, im] complex). Exact built-in types only.
CODEC = r"""
import json as _json

def _enc(v, depth=0):
    t = type(v)
    if depth > 100:
        raise TypeError("nested too deeply to transfer")
    if v is None or t in (bool, int, float, str):
        return v
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[t]
        return {tag: [_enc(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[_enc(k, depth + 1), _enc(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"b": v.hex()}
    if t is complex:
        return {"c": [v.real, v.imag]}
    raise TypeError("a " + t.__name__ + " is not plain data (only built-in values cross)")

def _dec(v, depth=0):
    t = type(v)
    if depth > 100:
        raise ValueError("nested too deeply")
    if v is None or t in (bool, int, float, str):
        return v
    if t is not dict or len(v) != 1:
        raise ValueError("not an encoded value")
    (tag, x), = v.items()
    if tag in ("l", "t", "s", "f") and type(x) is list:
        items = [_dec(y, depth + 1) for y in x]
        return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag == "d" and type(x) is list:
        return {_dec(k, depth + 1): _dec(y, depth + 1) for k, y in x}
    if tag == "b" and type(x) is str:
        return bytes.fromhex(x)
    if tag == "c" and type(x) is list and len(x) == 2:
        return complex(float(x[0]), float(x[1]))
    raise ValueError("not an encoded value")
"""

# The candidate, `python -I -B -c CANDIDATE <calls fd> <answers fd> <entry point>`: reads
# the solution from stdin, runs it, says whether it is ready, then answers each call.
# Everything here is the candidate's to change: it only ever yields answers.
CANDIDATE = (
    CODEC
    + r"""
import builtins, os, sys, traceback

def _main():
    code = sys.stdin.read()
    calls = os.fdopen(int(sys.argv[1]), "rb")
    answers = os.fdopen(int(sys.argv[2]), "wb")
    entry = sys.argv[3]

    def send(msg):
        answers.write(_json.dumps(msg).encode() + b"\n")
        answers.flush()

    ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(code, "solution.py", "exec"), ns)
    except BaseException:
        traceback.print_exc()
        send({"error": "load_error"})
        return
    fn = ns.get(entry)
    if not callable(fn):
        print("solution.py does not define a function " + entry + "()", file=sys.stderr)
        send({"error": "no_entry_point"})
        return
    send({"ready": True})
    for line in calls:
        try:
            call = _json.loads(line)
            value = fn(*_dec(call["args"]), **_dec(call["kwargs"]))
            answer = {"ok": _enc(value)}
        except BaseException as e:
            answer = {"raise": type(e).__name__, "msg": str(e)[:1000]}
        send(answer)

_main()
sys.stdout.flush()
sys.stderr.flush()
"""
)

# The judge, `python -I -B -c JUDGE <calls fd> <answers fd>`: reads its job (nonce, entry
# point, tests) from stdin, runs each test with the entry point as a proxy to the
# candidate, and ends with one report line on its stdout: "<nonce> <outcome> <bits>".
JUDGE = (
    CODEC
    + r"""
import builtins, os, sys, traceback

MAX_ANSWER = 64 << 20

class CandidateError(Exception):
    "The solution raised an exception that is not a built-in one, or answered nonsense."

def _main():
    job = _json.loads(sys.stdin.buffer.read())
    nonce, entry, tests = job["nonce"], job["entry_point"], job["tests"]
    report = os.dup(1)
    calls = os.fdopen(int(sys.argv[1]), "wb")
    answers = os.fdopen(int(sys.argv[2]), "rb")
    num_tests = sum(1 for t in tests if t["kind"] != "setup")
    gone = []

    def finish(outcome, bits):
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(report, ("\n" + nonce + " " + outcome + " " + bits + "\n").encode())
        os._exit(0)

    def receive():
        line = answers.readline(MAX_ANSWER)
        if not line.endswith(b"\n"):
            gone.append(True)
            return None
        try:
            msg = _json.loads(line)
        except ValueError:
            msg = None
        return msg if type(msg) is dict else {}

    hello = receive()
    if hello is None:
        print("the solution's process ended before it was ready", file=sys.stderr)
        finish("load_error", "0" * num_tests)
    if hello.get("ready") is not True:
        error = hello.get("error")
        finish(error if error in ("load_error", "no_entry_point") else "load_error", "0" * num_tests)

    def call(*args, **kwargs):
        if gone:
            raise CandidateError("the solution's process has ended")
        try:
            calls.write(_json.dumps({"args": _enc(list(args)), "kwargs": _enc(kwargs)}).encode() + b"\n")
            calls.flush()
        except (BrokenPipeError, OSError):
            gone.append(True)
            raise CandidateError("the solution's process has ended") from None
        answer = receive()
        if answer is None:
            raise CandidateError("the solution's process ended during the call")
        if "ok" in answer:
            try:
                return _dec(answer["ok"])
            except (ValueError, TypeError, RecursionError) as e:
                raise CandidateError("the solution's answer did not decode: " + str(e)) from None
        name, msg = answer.get("raise"), answer.get("msg")
        cls = getattr(builtins, name, None) if type(name) is str else None
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = CandidateError
        raise cls(msg if type(msg) is str else "")

    call.__name__ = entry
    ns = {"__name__": "tests", "__builtins__": builtins, entry: call}
    bits = ""
    for t in tests:
        ok = False
        try:
            exec(compile(t["src"], "tests.py", "exec"), ns)
            ok = True
        except BaseException:
            print("failed: " + t["src"], file=sys.stderr)
            traceback.print_exc(limit=-1)
        if t["kind"] != "setup":
            bits += "1" if ok else "0"
    calls.close()
    finish("ran", bits)

_main()
"""
)

FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
PYTHON_TAGS = ("python", "py", "python3")


def extract_code(completion: str) -> str | None:
    """The last fenced python block of ``completion`` (else the last untagged block), or
    None when there is no closed block with code in it."""
    tagged: list[str] = []
    untagged: list[str] = []
    for m in FENCE.finditer(completion):
        lang = m.group(1).lower()
        if lang in PYTHON_TAGS:
            tagged.append(m.group(2))
        elif not lang:
            untagged.append(m.group(2))
    blocks = [b for b in (tagged or untagged) if b.strip()]
    return blocks[-1] if blocks else None


def split_tests(tests: str) -> list[dict[str, str]]:
    """The tests as steps for the grader: each top-level ``assert`` is one test
    (``a == b`` / ``a != b`` asserts as ``compare`` steps), other statements are setup;
    code without a top-level assert is one ``block`` test. ValueError if it does not parse."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as e:
        raise ValueError(f"python_code task 'tests' is not valid Python: {e}") from None
    if not any(isinstance(s, ast.Assert) for s in tree.body):
        return [{"kind": "block", "src": tests}]
    steps: list[dict[str, str]] = []
    for stmt in tree.body:
        src = ast.unparse(stmt)
        test = stmt.test if isinstance(stmt, ast.Assert) else None
        if (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], (ast.Eq, ast.NotEq))
        ):
            op = "==" if isinstance(test.ops[0], ast.Eq) else "!="
            steps.append({"kind": "compare", "src": src, "op": op,
                          "left": ast.unparse(test.left), "right": ast.unparse(test.comparators[0])})  # fmt: skip
        else:
            steps.append({"kind": "assert" if test is not None else "setup", "src": src})
    return steps


def task_timeout(task: dict[str, Any]) -> float:
    """The task's ``timeout_s`` (default 10 s); ValueError unless in (0, 60]."""
    value = task.get("timeout_s", DEFAULT_TIMEOUT_S)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= MAX_TIMEOUT_S
    ):
        raise ValueError(
            f"python_code task 'timeout_s' must be a number in (0, {MAX_TIMEOUT_S:g}], got {value!r}"
        )
    return float(value)


def check(task: dict[str, Any]) -> None:
    """ValueError naming the field when ``task`` is not a valid python_code task."""
    for key in ("prompt", "tests", "entry_point"):
        if not isinstance(task.get(key), str) or not task[key].strip():
            raise ValueError(f"python_code task needs a non-empty string field {key!r}")
    if not task["entry_point"].isidentifier():
        raise ValueError(
            f"python_code task 'entry_point' is not a Python name: {task['entry_point']!r}"
        )
    split_tests(task["tests"])
    task_timeout(task)


def prompt(task: dict[str, Any]) -> list[dict[str, Any]]:
    check(task)
    user = (
        f"{task['prompt'].strip()}\n\nYour code must define the function `{task['entry_point']}`."
    )
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


@dataclass
class Grade:
    """What grading one answer found."""

    outcome: str
    """passed | failed | no_code | load_error | no_entry_point | no_report"""
    num_tests: int
    results: list[bool] = field(default_factory=list)
    """One per test; empty when the grader's report never came."""
    sandbox_status: str = ""
    """A SandboxStatus value; "" when nothing ran."""
    message: str = ""
    """The sandbox's explanation of its status ("" for ok)."""
    wall_s: float = 0.0
    stdout_tail: str = ""
    stderr_tail: str = ""

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    @property
    def fraction(self) -> float:
        return sum(self.results) / self.num_tests if self.results and self.num_tests else 0.0


def _parse_report(stdout: bytes, nonce: str, num_tests: int) -> tuple[str, list[bool]] | None:
    at = stdout.rfind(f"\n{nonce} ".encode())
    if at < 0:
        return None
    line = stdout[at + 1 :].split(b"\n", 1)[0].decode("ascii", "replace")
    parts = line.split(" ")
    if len(parts) != 3 or len(parts[2]) != num_tests or set(parts[2]) - {"0", "1"}:
        return None
    return parts[1], [c == "1" for c in parts[2]]


def _tail(data: bytes) -> str:
    return data[-TAIL_CHARS:].decode("utf-8", "replace")


async def run_tests(
    task: dict[str, Any],
    code: str,
    limits: SandboxLimits | None = None,
    runtime: Runtime | None = None,
) -> Grade:
    """Run ``task``'s tests against ``code`` (the candidate and the judge in two fresh
    workspaces of ``runtime``, default the sandbox); every outcome is a Grade. Raises only
    for a bad task (ValueError), a runtime that cannot link the two (ConfigError) or a
    missing sandbox (SandboxUnavailableError)."""
    runtime = runtime or SandboxRuntime()
    if not runtime.passes_fds:
        raise ConfigError(
            f"python_code grades through pipes between two processes, which the "
            f"{runtime.kind} runtime cannot hand its programs: use the sandbox (or local)"
        )
    steps = split_tests(task["tests"])
    num_tests = sum(1 for s in steps if s["kind"] != "setup")
    timeout_s = task_timeout(task)
    limits = limits or sandbox_limits(timeout_s)
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "entry_point": task["entry_point"], "tests": steps}
    root = Path(tempfile.mkdtemp(prefix="treadle-python-code-"))
    calls_r, calls_w = os.pipe()  # judge -> candidate
    answers_r, answers_w = os.pipe()  # candidate -> judge
    fds = [calls_r, calls_w, answers_r, answers_w]  # until the runs own them
    python = [runtime.python(), "-I", "-B", "-c"]
    candidate = Workspace(runtime, root / "candidate")
    judge = Workspace(runtime, root / "judge")
    for ws in (candidate, judge):
        ws.workdir.mkdir(mode=0o700)
    try:
        # each run owns (and closes) the pipe ends it is handed, also when it fails; one
        # failing (no sandbox) cancels the other
        async with asyncio.TaskGroup() as runs:
            cand_run = runs.create_task(candidate.exec(
                [*python, CANDIDATE, str(calls_r), str(answers_w), task["entry_point"]],
                stdin=code.encode(), limits=limits, pass_fds=(calls_r, answers_w),
            ))  # fmt: skip
            judge_run = runs.create_task(judge.exec(
                [*python, JUDGE, str(calls_w), str(answers_r)],
                stdin=json.dumps(job).encode(), limits=judge_limits(limits.wall_s),
                pass_fds=(calls_w, answers_r),
            ))  # fmt: skip
            fds = []
        cand, judged = cand_run.result(), judge_run.result()
    except BaseExceptionGroup as group:  # a run failed (no sandbox): as if awaited alone
        raise group.exceptions[0] from None
    finally:
        for fd in fds:
            os.close(fd)
        await asyncio.to_thread(shutil.rmtree, root, True)
    report = _parse_report(judged.stdout, nonce, num_tests)
    results: list[bool] = []
    if report is None or not judged.ok:
        outcome = "no_report"
    else:
        ran, results = report
        if ran != "ran":
            outcome = ran  # load_error | no_entry_point
        elif all(results) and cand.status == SandboxStatus.OK:
            outcome = "passed"
        else:
            outcome = "failed"
    stderr = cand.stderr + b"\n" + judged.stderr
    return Grade(
        outcome, num_tests, results, cand.status.value, cand.message, cand.wall_s,
        _tail(cand.stdout), _tail(stderr),
    )  # fmt: skip


async def grade(task: dict[str, Any], completion: str, state: RolloutState | None = None) -> Grade:
    """The rollout's grade, computed once and kept in ``state.info["python_code"]``."""
    if state is not None and isinstance(state.info.get(INFO_KEY), Grade):
        return state.info[INFO_KEY]
    code = extract_code(completion)
    if code is None:
        num_tests = sum(1 for s in split_tests(task["tests"]) if s["kind"] != "setup")
        result = Grade("no_code", num_tests)
    else:
        result = await run_tests(task, code, runtime=state.runtime if state else None)
    if state is not None:
        state.info[INFO_KEY] = result
    return result


async def passed(task: dict[str, Any], completion: str, state: RolloutState) -> float:
    return float((await grade(task, completion, state)).passed)


async def tests_passed_fraction(
    task: dict[str, Any], completion: str, state: RolloutState
) -> float:
    return (await grade(task, completion, state)).fraction


async def no_code(task: dict[str, Any], completion: str, state: RolloutState) -> float:
    return float((await grade(task, completion, state)).outcome == "no_code")


async def code_error(task: dict[str, Any], completion: str, state: RolloutState) -> float:
    return float((await grade(task, completion, state)).outcome in ("load_error", "no_entry_point"))


async def no_report(task: dict[str, Any], completion: str, state: RolloutState) -> float:
    return float((await grade(task, completion, state)).outcome == "no_report")


async def sandbox_wall_s(task: dict[str, Any], completion: str, state: RolloutState) -> float:
    return (await grade(task, completion, state)).wall_s


def _status_metric(status: SandboxStatus) -> Any:
    async def metric(task: dict[str, Any], completion: str, state: RolloutState) -> float:
        return float((await grade(task, completion, state)).sandbox_status == status.value)

    metric.__name__ = metric.__qualname__ = f"sandbox_{status.value}"
    return metric


# fmt: off
TASKS: list[dict[str, Any]] = [
    {"id": "fizzbuzz", "entry_point": "fizzbuzz",
     "prompt": "Write `fizzbuzz(n)` returning a list of strings for 1..n: 'Fizz' for multiples "
               "of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for multiples of both, otherwise the "
               "number itself as a string.",
     "tests": "assert fizzbuzz(1) == ['1']\nassert fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']\n"
              "assert fizzbuzz(15)[-1] == 'FizzBuzz'\nassert len(fizzbuzz(100)) == 100\n"
              "assert fizzbuzz(0) == []"},
    {"id": "reverse_words", "entry_point": "reverse_words",
     "prompt": "Write `reverse_words(s)` returning the words of `s` in reverse order, joined by "
               "single spaces (words are separated by any whitespace).",
     "tests": "assert reverse_words('hello world') == 'world hello'\n"
              "assert reverse_words('  a  b   c ') == 'c b a'\nassert reverse_words('') == ''\n"
              "assert reverse_words('one') == 'one'"},
    {"id": "is_prime", "entry_point": "is_prime",
     "prompt": "Write `is_prime(n)` returning True when the integer `n` is a prime number, else False.",
     "tests": "assert is_prime(2) is True\nassert is_prime(97) is True\nassert is_prime(1) is False\n"
              "assert is_prime(0) is False\nassert is_prime(-7) is False\nassert is_prime(91) is False\n"
              "assert [n for n in range(30) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]"},
    {"id": "is_palindrome", "entry_point": "is_palindrome",
     "prompt": "Write `is_palindrome(s)` returning True when `s` reads the same forwards and "
               "backwards, ignoring case and every character that is not a letter or a digit.",
     "tests": "assert is_palindrome('A man, a plan, a canal: Panama') is True\n"
              "assert is_palindrome('race a car') is False\nassert is_palindrome('') is True\n"
              "assert is_palindrome('No lemon, no melon') is True"},
    {"id": "count_vowels", "entry_point": "count_vowels",
     "prompt": "Write `count_vowels(s)` returning how many characters of `s` are vowels "
               "(a, e, i, o, u, in either case).",
     "tests": "assert count_vowels('hello') == 2\nassert count_vowels('AEIOU xyz') == 5\n"
              "assert count_vowels('') == 0\nassert count_vowels('rhythm') == 0"},
    {"id": "fibonacci", "entry_point": "fibonacci",
     "prompt": "Write `fibonacci(n)` returning the n-th Fibonacci number, with fibonacci(0) == 0 "
               "and fibonacci(1) == 1. It must be fast for n up to 1000.",
     "tests": "assert fibonacci(0) == 0\nassert fibonacci(1) == 1\nassert fibonacci(10) == 55\n"
              "assert fibonacci(90) == 2880067194370816120\n"
              "assert fibonacci(1000) % 1000000007 == 517691607"},
    {"id": "gcd", "entry_point": "gcd",
     "prompt": "Write `gcd(a, b)` returning the greatest common divisor of two non-negative "
               "integers (gcd(0, 0) == 0), without using the math module.",
     "tests": "assert gcd(12, 18) == 6\nassert gcd(17, 5) == 1\nassert gcd(0, 9) == 9\n"
              "assert gcd(0, 0) == 0\nassert gcd(2**40, 2**35 * 3) == 2**35"},
    {"id": "flatten", "entry_point": "flatten",
     "prompt": "Write `flatten(items)` returning a flat list of the non-list values of an "
               "arbitrarily nested list, in order.",
     "tests": "assert flatten([1, [2, [3, [4]], 5]]) == [1, 2, 3, 4, 5]\nassert flatten([]) == []\n"
              "assert flatten([[], [[]]]) == []\nassert flatten(['a', ['b', ('c',)]]) == ['a', 'b', ('c',)]"},
    {"id": "two_sum", "entry_point": "two_sum",
     "prompt": "Write `two_sum(nums, target)` returning a tuple (i, j) with i < j and "
               "nums[i] + nums[j] == target (exactly one such pair exists).",
     "tests": "assert two_sum([2, 7, 11, 15], 9) == (0, 1)\nassert two_sum([3, 2, 4], 6) == (1, 2)\n"
              "assert two_sum([3, 3], 6) == (0, 1)\nassert two_sum([-1, 5, 8, 0], 8) == (2, 3)"},
    {"id": "run_length_encode", "entry_point": "run_length_encode",
     "prompt": "Write `run_length_encode(s)` returning the run-length encoding of `s`: each run "
               "of a repeated character becomes the character followed by the run's length, "
               "e.g. 'aaabcc' -> 'a3b1c2'.",
     "tests": "assert run_length_encode('aaabcc') == 'a3b1c2'\nassert run_length_encode('') == ''\n"
              "assert run_length_encode('x') == 'x1'\nassert run_length_encode('a' * 12 + 'b') == 'a12b1'"},
    {"id": "roman_to_int", "entry_point": "roman_to_int",
     "prompt": "Write `roman_to_int(s)` converting a valid Roman numeral (I, V, X, L, C, D, M, "
               "with subtractive pairs such as IV and CM) to an integer.",
     "tests": "assert roman_to_int('III') == 3\nassert roman_to_int('IV') == 4\n"
              "assert roman_to_int('LVIII') == 58\nassert roman_to_int('MCMXCIV') == 1994"},
    {"id": "max_subarray_sum", "entry_point": "max_subarray_sum",
     "prompt": "Write `max_subarray_sum(nums)` returning the largest sum of a non-empty "
               "contiguous subarray of the non-empty list `nums`.",
     "tests": "assert max_subarray_sum([-2, 1, -3, 4, -1, 2, 1, -5, 4]) == 6\n"
              "assert max_subarray_sum([1]) == 1\nassert max_subarray_sum([-3, -1, -2]) == -1\n"
              "assert max_subarray_sum([5, 4, -1, 7, 8]) == 23"},
]
# fmt: on

ENVIRONMENT = Environment(
    "python_code",
    prompt=prompt,
    rubric=Rubric(
        rewards=[passed],
        metrics=[
            tests_passed_fraction,
            no_code,
            code_error,
            no_report,
            sandbox_wall_s,
            *(_status_metric(s) for s in SandboxStatus),
        ],
    ),
    tasks=lambda: TaskSet.from_rows(
        "python_code", [dict(t) for t in TASKS], ("prompt", "entry_point", "tests")
    ),
    required=("prompt", "entry_point", "tests"),
    description="write a Python function; reward 1 when its tests pass in the sandbox",
)
