"""The python_code environment end to end (run_rollout -> sandboxed tests -> reward):
hostile answers are contained, end with a clear metric, and the runner keeps scoring
other rollouts correctly, one after another and side by side."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import treadle_native
from testkit.fake_model import ScriptedGenerator
from testkit.paths import REPO_ROOT, shared_tokenizer
from treadle.env_runner.envs import python_code
from treadle.env_runner.envs.python_code import (
    ENVIRONMENT,
    TASKS,
    Grade,
    extract_code,
    run_tests,
    split_tests,
)
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import RolloutState
from treadle.env_runner.runtimes.sandbox import python_runtime
from treadle.proto.v1 import rollout_pb2

pytestmark = pytest.mark.integration

Kind = rollout_pb2.RolloutStatus.Kind
ErrorKind = rollout_pb2.RolloutStatus.ErrorKind

ADD_TASK = {
    "id": "add",
    "prompt": "Write add(a, b) returning a + b.",
    "entry_point": "add",
    "tests": "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 4",
    "timeout_s": 3,
}
GOOD = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def renderer() -> treadle_native.Renderer:
    return treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))


def answer(code: str) -> str:
    return f"Here is my solution.\n\n```python\n{code.strip()}\n```\n"


def request(task: dict[str, Any], rollout_id: str = "r1") -> rollout_pb2.RolloutRequested:
    return rollout_pb2.RolloutRequested(
        rollout_id=rollout_id, group_id="g", env="python_code", task_id=task["id"],
        task_json=json.dumps(task), sampling=rollout_pb2.SamplingParams(max_tokens=4096, temperature=1.0),
    )  # fmt: skip


async def rollout_async(
    renderer: treadle_native.Renderer,
    text: str,
    task: dict[str, Any] = ADD_TASK,
    executor: ThreadPoolExecutor | None = None,
    rollout_id: str = "r1",
) -> tuple[rollout_pb2.Rollout, RolloutState]:
    gen = ScriptedGenerator([f"<think>\n\n</think>\n\n{text}<|im_end|>"])
    rc = RolloutContext(renderer, gen, "runner-1", executor=executor)
    states: list[RolloutState] = []
    r = await run_rollout(request(task, rollout_id), ENVIRONMENT, rc, state_out=states)
    return r, states[0]


def rollout(
    renderer: treadle_native.Renderer, text: str, task: dict[str, Any] = ADD_TASK
) -> tuple[rollout_pb2.Rollout, RolloutState]:
    return asyncio.run(rollout_async(renderer, text, task))


def graded(state: RolloutState) -> Grade:
    g = state.info["python_code"]
    assert isinstance(g, Grade)
    return g


def assert_still_serving(renderer: treadle_native.Renderer) -> None:
    r, _ = rollout(renderer, answer(GOOD))
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert r.metrics["sandbox_ok"] == 1.0


def test_python_code_scores_a_correct_solution_one_and_a_wrong_one_zero(
    renderer: treadle_native.Renderer,
) -> None:
    r, state = rollout(renderer, answer(GOOD))
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert [(x.name, x.value) for x in r.rewards] == [("passed", 1.0)]
    assert r.metrics["tests_passed_fraction"] == 1.0
    assert r.metrics["sandbox_ok"] == 1.0
    assert r.metrics["no_code"] == 0.0
    assert r.metrics["code_error"] == 0.0
    assert 0 < r.metrics["sandbox_wall_s"] < 3
    assert graded(state).results == [True, True, True]

    wrong = "def add(a, b):\n    return a + b if a > 0 else 0\n"  # add(-1, 1) is still 0
    r, state = rollout(renderer, answer(wrong.replace("else 0", "else 1")))
    assert r.status.kind == Kind.KIND_OK
    assert r.reward == 0.0
    assert r.metrics["tests_passed_fraction"] == pytest.approx(2 / 3)
    assert graded(state).results == [True, False, True]
    assert "failed: assert add(-1, 1) == 0" in graded(state).stderr_tail


def test_python_code_answer_without_a_code_block_is_no_code(
    renderer: treadle_native.Renderer,
) -> None:
    r, state = rollout(renderer, "def add(a, b): return a + b")
    assert r.status.kind == Kind.KIND_OK
    assert r.reward == 0.0
    assert r.metrics["no_code"] == 1.0
    assert r.metrics["sandbox_ok"] == 0.0  # nothing ran
    assert graded(state).outcome == "no_code"


def test_python_code_code_that_raises_or_lacks_the_entry_point_is_a_code_error(
    renderer: treadle_native.Renderer,
) -> None:
    r, state = rollout(renderer, answer("def add(a, b)\n    return a + b"))  # SyntaxError
    assert (r.reward, r.metrics["code_error"]) == (0.0, 1.0)
    assert "SyntaxError" in graded(state).stderr_tail
    r, state = rollout(renderer, answer("def plus(a, b):\n    return a + b"))
    assert (r.reward, r.metrics["code_error"]) == (0.0, 1.0)
    assert graded(state).outcome == "no_entry_point"


def test_python_code_bad_task_is_an_error_status(renderer: treadle_native.Renderer) -> None:
    r, _ = rollout(renderer, answer(GOOD), {**ADD_TASK, "tests": "assert add(1, 2) ==="})
    assert r.status.kind == Kind.KIND_ERROR
    assert r.status.error_kind == ErrorKind.ERROR_KIND_ENV
    assert "not valid Python" in r.status.message
    r, _ = rollout(renderer, answer(GOOD), {**ADD_TASK, "timeout_s": 3600})
    assert r.status.error_kind == ErrorKind.ERROR_KIND_ENV
    assert "timeout_s" in r.status.message


def test_python_code_extracts_the_last_python_block() -> None:
    text = "```text\nnot code\n```\n```python\nx = 1\n```\nbetter:\n```py\nx = 2\n```\n"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"  # untagged, when no python block
    assert extract_code("```python\nunclosed = True\n") is None
    assert extract_code("no code at all") is None


def test_python_code_splits_tests_per_assert() -> None:
    steps = split_tests("import math\nassert f(1) == 2\nassert f(2) > 1\nx = f(3)\nassert x != 0")
    assert [s["kind"] for s in steps] == ["setup", "compare", "assert", "setup", "compare"]
    assert (steps[1]["left"], steps[1]["op"], steps[1]["right"]) == ("f(1)", "==", "2")
    assert [s["kind"] for s in split_tests("def check(c):\n    assert c(1)\ncheck(f)")] == ["block"]


def test_python_code_builtin_tasks_pass_with_reference_solutions() -> None:
    """Each built-in task is solvable as stated (and its tests are not vacuous: the same
    tests against a wrong solution fail)."""
    solutions = {
        "fizzbuzz": "def fizzbuzz(n):\n    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 "
                    "else 'Buzz' if i % 5 == 0 else str(i) for i in range(1, n + 1)]",
        "reverse_words": "def reverse_words(s):\n    return ' '.join(reversed(s.split()))",
        "is_prime": "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
        "is_palindrome": "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]",
        "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)",
        "fibonacci": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        "gcd": "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
        "flatten": "def flatten(items):\n    out = []\n    for x in items:\n"
                   "        out.extend(flatten(x) if isinstance(x, list) else [x])\n    return out",
        "two_sum": "def two_sum(nums, target):\n    seen = {}\n    for j, x in enumerate(nums):\n"
                   "        if target - x in seen:\n            return (seen[target - x], j)\n        seen[x] = j",
        "run_length_encode": "import itertools\ndef run_length_encode(s):\n"
                             "    return ''.join(f'{k}{len(list(g))}' for k, g in itertools.groupby(s))",
        "roman_to_int": "def roman_to_int(s):\n    v = dict(I=1, V=5, X=10, L=50, C=100, D=500, M=1000)\n"
                        "    return sum(-v[a] if v[a] < v[b] else v[a] for a, b in zip(s, s[1:] + 'I'))",
        "max_subarray_sum": "def max_subarray_sum(nums):\n    best = cur = nums[0]\n    for x in nums[1:]:\n"
                            "        cur = max(x, cur + x)\n        best = max(best, cur)\n    return best",
    }  # fmt: skip
    tasks = ENVIRONMENT.task_set()
    assert [t["id"] for t in tasks] == list(solutions)

    async def grade_all() -> tuple[list[Grade], list[Grade]]:
        good = [run_tests(t, solutions[t["id"]]) for t in tasks]
        wrong = [run_tests(t, f"def {t['entry_point']}(*args):\n    return None") for t in tasks]
        return list(await asyncio.gather(*good)), list(await asyncio.gather(*wrong))

    good, wrong = asyncio.run(grade_all())
    assert [(t["id"], g.outcome) for t, g in zip(tasks, good, strict=True)] == [
        (t["id"], "passed") for t in tasks
    ], [g.stderr_tail for g in good if not g.passed]
    assert all(g.outcome == "failed" and not any(g.results) for g in wrong)


def test_python_code_network_is_unreachable(renderer: treadle_native.Renderer) -> None:
    with socket.socket() as server:  # a server on the host's loopback: must see nothing
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        attack = f"""
        import socket
        for host, port in [("1.1.1.1", 53), ("127.0.0.1", {port})]:
            try:
                socket.create_connection((host, port), timeout=2).close()
                print("CONNECTED", host, port)
            except OSError as e:
                print("refused", host, port, type(e).__name__)
        """
        r, state = rollout(renderer, answer(textwrap.dedent(attack) + GOOD))
        with pytest.raises(BlockingIOError):  # no connection ever reached the host
            server.accept()
    out = graded(state).stdout_tail
    assert out.count("refused") == 2, out
    assert "CONNECTED" not in out
    assert r.reward == 1.0  # contained; the function itself is right
    assert_still_serving(renderer)


def test_python_code_cannot_write_outside_its_dir(
    renderer: treadle_native.Renderer, tmp_path: Path
) -> None:
    name = f"pwned-{secrets.token_hex(4)}"
    targets = [Path("/etc") / name, REPO_ROOT / name, Path.home() / name, tmp_path / name]
    attack = f"""
    import os
    for path in {[str(p) for p in targets]!r}:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").write("x")
            print("wrote", path)
        except OSError as e:
            print("refused", path, e.errno)
    """
    r, state = rollout(renderer, answer(textwrap.dedent(attack) + GOOD))
    assert r.reward == 1.0, graded(state).stderr_tail
    assert [p for p in targets if p.exists()] == []
    out = graded(state).stdout_tail
    # /etc and $HOME are read-only in there; the repo's and the test's folders can be
    # created, but only inside the sandbox's own /work and private /tmp
    assert f"refused /etc/{name}" in out, out
    assert f"refused {Path.home() / name}" in out, out
    assert_still_serving(renderer)


def test_python_code_cannot_read_host_secrets(
    renderer: treadle_native.Renderer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = secrets.token_hex(16)
    monkeypatch.setenv("TREADLE_TEST_SECRET", secret)
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret)
    paths = [str(secret_file), str(Path.home() / ".ssh" / "id_rsa"), "/root/.ssh/id_ed25519",
             "/proc/1/environ", "/proc/self/environ", "/etc/shadow"]  # fmt: skip
    attack = f"""
    import os
    print("ENV", dict(os.environ))
    for path in {paths!r}:
        try:
            print("READ", path, open(path, "rb").read()[:4000])
        except OSError as e:
            print("refused", path, e.errno)
    for d in ("/root", "/home", os.path.expanduser("~")):
        try:
            print("LIST", d, os.listdir(d))
        except OSError as e:
            print("refused", d, e.errno)
    """
    r, state = rollout(renderer, answer(textwrap.dedent(attack) + GOOD))
    g = graded(state)
    assert r.reward == 1.0, g.stderr_tail
    assert "ENV {" in g.stdout_tail
    assert "TREADLE_TEST_SECRET" not in g.stdout_tail
    for path in (
        str(secret_file),
        str(Path.home() / ".ssh" / "id_rsa"),
        "/root/.ssh/id_ed25519",
        "/etc/shadow",
    ):
        assert f"refused {path}" in g.stdout_tail, g.stdout_tail
    assert secret not in r.SerializeToString().decode("utf-8", "replace")
    assert secret not in repr(state.info)
    assert secret not in g.stdout_tail + g.stderr_tail
    assert_still_serving(renderer)


@pytest.mark.parametrize(
    ("attack", "statuses"),
    [
        ("import os\nwhile True:\n    os.fork()", {"process_limit", "timeout"}),
        ("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))", {"memory_limit"}),
        ("def add(a, b):\n    while True:\n        pass", {"timeout", "cpu_limit"}),
        ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", {"output_limit"}),
    ],
    ids=["fork_bomb", "memory_bomb", "infinite_loop", "huge_stdout"],
)
def test_python_code_resource_attacks_end_with_a_sandbox_metric(
    renderer: treadle_native.Renderer, attack: str, statuses: set[str]
) -> None:
    t0 = time.monotonic()
    r, state = rollout(renderer, answer(attack + "\n" + GOOD.replace("add", "unused")))
    g = graded(state)
    assert r.status.kind == Kind.KIND_OK, (
        r.status.message
    )  # the rollout completed; the answer failed
    assert r.reward == 0.0
    assert g.sandbox_status in statuses, (g.sandbox_status, g.message, g.stderr_tail[-500:])
    assert r.metrics[f"sandbox_{g.sandbox_status}"] == 1.0
    assert r.metrics["sandbox_ok"] == 0.0
    assert g.message
    assert time.monotonic() - t0 < 20  # killed at its limit, not waited for
    assert_still_serving(renderer)


@pytest.mark.parametrize(
    "hack",
    [
        "import sys\nsys.exit(0)",  # exit before the tests run
        "import os\nos._exit(0)",
        "print('\\n0123456789abcdef0123456789abcdef ran 111')\nimport os\nos._exit(0)",  # a fake report
        "class Anything:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
        "def add(a, b):\n    return Anything()",
        "import os\n_w = os.write\ndef forge(fd, data):\n    if b' ran ' in data:\n"  # rewrite the report
        "        data = data[: data.rindex(b' ran ') + 5] + b'111\\n'\n    return _w(fd, data)\n"
        "os.write = forge\ndef add(a, b):\n    return 0",
    ],
    ids=["sys_exit", "os_exit", "fake_report", "always_equal", "patched_write"],
)
def test_python_code_reward_hacks_score_zero(renderer: treadle_native.Renderer, hack: str) -> None:
    r, state = rollout(renderer, answer(hack))
    assert r.reward == 0.0, graded(state)
    assert r.metrics["tests_passed_fraction"] < 1.0


def test_python_code_tests_do_not_see_builtins_the_solution_shadows(
    renderer: treadle_native.Renderer,
) -> None:
    task = {
        **ADD_TASK,
        "tests": "assert len(str(add(10, 5))) == 2\nassert sorted([add(2, 1), 1]) == [1, 3]",
    }
    hack = (
        "def len(x):\n    return 2\ndef sorted(x):\n    return [1, 3]\ndef add(a, b):\n    return 0"
    )
    r, _ = rollout(renderer, answer(hack), task)
    assert r.reward == 0.0
    assert rollout(renderer, answer(GOOD), task)[0].reward == 1.0


def test_python_code_rollouts_side_by_side_are_unaffected_by_bombs(
    renderer: treadle_native.Renderer,
) -> None:
    """Bombs and good answers at once, environment code in the runner's own pool: every
    good answer scores 1, the wrong one 0, each bomb its metric, and the good ones are
    done long before the busy loop's time runs out."""
    loop_task = {**ADD_TASK, "id": "loop", "timeout_s": 6}
    # time enough that a busy machine's slower start never turns the memory bomb into a
    # timeout: it reaches its memory limit within a second of running
    memory_task = {**ADD_TASK, "id": "memory", "timeout_s": 30}
    jobs: list[tuple[str, str, dict[str, Any]]] = [
        ("fork", answer("import os\nwhile True:\n    os.fork()"), ADD_TASK),
        ("memory", answer("x = []\nwhile True:\n    x.append(bytearray(64 << 20))"), memory_task),
        ("loop", answer("while True:\n    pass"), loop_task),
        *((f"good{i}", answer(GOOD), ADD_TASK) for i in range(4)),
        ("wrong", answer("def add(a, b):\n    return a - b"), ADD_TASK),
    ]

    async def all_rollouts() -> list[tuple[rollout_pb2.Rollout, RolloutState]]:
        with ThreadPoolExecutor(len(jobs), thread_name_prefix="env") as pool:
            return list(
                await asyncio.gather(
                    *(rollout_async(renderer, text, task, pool, name) for name, text, task in jobs)
                )
            )

    results = {r.rollout_id: (r, s) for r, s in asyncio.run(all_rollouts())}
    for name in ("good0", "good1", "good2", "good3"):
        r, s = results[name]
        assert (r.status.kind, r.reward) == (Kind.KIND_OK, 1.0), (name, graded(s))
    assert results["wrong"][0].reward == 0.0
    assert results["wrong"][0].metrics["sandbox_ok"] == 1.0
    fork, memory, loop = (results[n][0] for n in ("fork", "memory", "loop"))
    assert fork.reward == memory.reward == loop.reward == 0.0
    assert fork.metrics["sandbox_process_limit"] + fork.metrics["sandbox_timeout"] == 1.0
    assert memory.metrics["sandbox_memory_limit"] == 1.0
    assert loop.metrics["sandbox_timeout"] + loop.metrics["sandbox_cpu_limit"] == 1.0
    loop_end = loop.timing.finished_at.ToNanoseconds()
    assert all(
        results[f"good{i}"][0].timing.finished_at.ToNanoseconds() < loop_end for i in range(4)
    )


def test_python_code_task_set_is_the_builtin_rows() -> None:
    tasks = ENVIRONMENT.task_set()
    assert len(tasks) == len(TASKS) >= 12
    for t in tasks:
        python_code.check(t)
        assert ENVIRONMENT.prompt(t)[-1]["content"].endswith(
            f"define the function `{t['entry_point']}`."
        )
    assert "```python" in ENVIRONMENT.prompt(tasks[0])[0]["content"]


# The grader's own frames, the report channel, the tests and the judge's process are out
# of the solution's reach: each hack below is run for real and must score 0.
FORGERIES = {
    # the forgery: call the grader's finish() through the caller's frame
    "frame_finish": """
import sys
frame = sys._getframe(0)
while frame is not None:
    for scope in (frame.f_locals, frame.f_globals):
        for name in ("finish", "send", "_write"):
            fn = scope.get(name)
            if callable(fn):
                try:
                    fn("ran", "111") if name == "finish" else fn({"ready": True})
                except BaseException as e:
                    print("tried", name, type(e).__name__)
    frame = frame.f_back
def add(a, b):
    return 0
""",
    # find anything that looks like the nonce in reachable memory and print a report with it
    "fake_report_with_found_nonce": """
import gc, re, sys
found = set()
for obj in gc.get_objects():
    if isinstance(obj, (str, bytes)):
        text = obj if isinstance(obj, str) else obj.decode("latin-1")
        found.update(re.findall(r"\\b[0-9a-f]{32}\\b", text))
for nonce in found:
    print("\\n" + nonce + " ran 111", flush=True)
    sys.stderr.write("\\n" + nonce + " ran 111\\n")
print("PASSED\\nOK (3 tests)\\nran 111")
def add(a, b):
    return 0
""",
    # patch the interpreter the tests would run in: builtins, modules, assertions
    "patched_test_module": """
import builtins, json, sys, types
builtins.AssertionError = type("AssertionError", (Exception,), {})
fake = types.ModuleType("tests")
fake.__dict__["add"] = lambda a, b: a + b
sys.modules["tests"] = sys.modules["__main__"] = fake
json.dumps = lambda *a, **k: '{"ok": 3}'
json.loads = lambda *a, **k: {"args": {"l": []}, "kwargs": {"d": []}}
def add(a, b):
    return 0
""",
    # write results files wherever a grader might read them, and the other processes' fds
    "results_file": """
import glob, os
for path in ("/work/report.json", "/work/results.txt", "/tmp/report", "/work/.treadle"):
    try:
        open(path, "w").write('{"passed": true, "results": [1, 1, 1]}')
    except OSError:
        pass
for fd in glob.glob("/proc/[0-9]*/fd/[0-9]*"):
    try:
        with open(fd, "w") as f:
            f.write("\\nran 111\\n")
    except OSError:
        pass
def add(a, b):
    return 0
""",
    # the answer channel is the candidate's: flood it with answers before being asked
    "preanswered_calls": """
import gc, io
for obj in gc.get_objects():
    if isinstance(obj, io.BufferedWriter) and obj.fileno() > 2:
        obj.write(b'{"ready": true}\\n' + b'{"ok": true}\\n' * 100)
        obj.flush()
def add(a, b):
    return 0
""",
}


@pytest.mark.parametrize("hack", list(FORGERIES), ids=list(FORGERIES))
def test_python_code_grader_forgeries_score_zero(
    renderer: treadle_native.Renderer, hack: str
) -> None:
    r, state = rollout(renderer, answer(FORGERIES[hack]))
    g = graded(state)
    assert r.reward == 0.0, g
    assert r.metrics["tests_passed_fraction"] < 1.0
    assert g.outcome in ("failed", "load_error"), g
    assert_still_serving(renderer)


def test_python_code_solution_never_sees_the_tests_or_the_judge(
    renderer: treadle_native.Renderer,
) -> None:
    marker = f"expected{secrets.token_hex(8)}"
    task = {**ADD_TASK, "tests": f"{marker} = 3\nassert add(1, 2) == {marker}"}
    spy = f"""
    import glob, os
    seen = []
    for path in glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/environ"):
        try:
            if b"{marker}" in open(path, "rb").read():
                seen.append(path)
        except OSError:
            pass
    for top in ("/work", "/tmp"):
        for root, dirs, files in os.walk(top):
            for name in files:
                try:
                    if b"{marker}" in open(os.path.join(root, name), "rb").read():
                        seen.append(name)
                except OSError:
                    pass
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    print("SEEN", seen, "PIDS", len(pids))
    """
    r, state = rollout(renderer, answer(textwrap.dedent(spy) + GOOD), task)
    out = graded(state).stdout_tail
    assert "SEEN [] " in out, out
    assert int(out.split("PIDS")[1].split()[0]) <= 3  # bwrap's init, setpriv/python: no judge
    assert r.reward == 1.0  # and the honest part of the answer is graded as usual


def test_python_code_builtin_exceptions_cross_to_the_tests(
    renderer: treadle_native.Renderer,
) -> None:
    tests = (
        "try:\n    add('a', 1)\n    raised = None\nexcept TypeError:\n    raised = 'TypeError'\n"
        "assert raised == 'TypeError'\nassert add((1,), (2,)) == (1, 2)\n"
        "assert add({1: [2]}.get(1), [b'x']) == [2, b'x']"
    )
    r, state = rollout(renderer, answer(GOOD), {**ADD_TASK, "tests": tests})
    assert r.reward == 1.0, graded(state).stderr_tail
    r, _ = rollout(renderer, answer("def add(a, b):\n    return iter([a, b])"), ADD_TASK)
    assert r.reward == 0.0  # an iterator is not plain data: the call fails in the tests


def test_python_code_solution_cannot_remount_and_write_host_files(
    renderer: treadle_native.Renderer,
) -> None:
    """The issue's escape, as a model answer: remount the read-only binds writable and
    write under /usr and the runner's Python prefix."""
    name = f"pwned-{secrets.token_hex(4)}"
    prefix = (python_runtime() or ["/usr/lib"])[0]
    attack = f"""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    for target in ("/usr", {prefix!r}, "/"):
        rc = libc.mount(b"none", target.encode(), None, 0x20 | 0x1000, None)  # MS_REMOUNT|MS_BIND
        print("remount", target, "ok" if rc == 0 else os.strerror(ctypes.get_errno()))
    print("uid", os.getuid(), "caps", open("/proc/self/status").read().split("CapEff:")[1].split()[0])
    for path in ("/usr/{name}", {prefix!r} + "/{name}"):
        try:
            open(path, "w").write("x")
            print("wrote", path)
        except OSError as e:
            print("refused", path, e.strerror)
    """
    r, state = rollout(renderer, answer(textwrap.dedent(attack) + GOOD))
    out = graded(state).stdout_tail
    assert out.count("remount") == 3, out
    assert " ok" not in out
    assert "wrote" not in out
    assert "uid 0 " not in out
    assert "caps 0000000000000000" in out
    assert not Path("/usr", name).exists()
    assert not Path(prefix, name).exists()
    assert r.reward == 1.0  # contained; the function itself is right
