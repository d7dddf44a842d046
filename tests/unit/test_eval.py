"""`treadle eval`: N tasks x k rollouts against an OpenAI-compatible endpoint, pass@k,
results JSONL, resume, group rewards, tool calls, an unreachable model."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from treadle.env_runner.evaluate import EvalConfig, evaluate, summary_table
from treadle.services.cli import main
from treadle.services.errors import ConfigError
from treadle.services.passk import pass_at_k


class FakeModel(BaseHTTPRequestHandler):
    """Arithmetic: right when the request's seed is even. Towns: searches, then answers."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeModel.calls.append(body)
        last = body["messages"][-1]
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if body.get("tools"):
            if last["role"] == "user":
                message["tool_calls"] = [{"id": "c1", "type": "function", "function": {
                    "name": "search", "arguments": json.dumps({"query": "Brindle"})}}]  # fmt: skip
            else:
                year = re.search(r"founded in (\d+)", last["content"])
                message["content"] = f"Founded in {year.group(1) if year else '?'}."
        else:
            q = re.search(r"Compute (.+)\. Answer", last["content"])
            value = eval(q.group(1)) if q else 0
            message["content"] = str(value if body.get("seed", 1) % 2 == 0 else value + 1)
        data = json.dumps({
            "id": "x", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3},
        }).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def model_url() -> Iterator[str]:
    FakeModel.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeModel)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()
    server.server_close()


def config(tmp_path: Path, url: str, **eval_: Any) -> EvalConfig:
    return EvalConfig.model_validate({
        "run": {"name": "ev", "output_dir": str(tmp_path)},
        "eval": {"env": "arithmetic", "base_url": url, "model": "m", "num_tasks": 3,
                 "rollouts_per_task": 4, "sampling": {"seed": 0, "temperature": 1.0}} | eval_,
    })  # fmt: skip


def run(cfg: EvalConfig) -> dict[str, Any]:
    return asyncio.run(evaluate(cfg, stream=open("/dev/null", "w")))


def test_pass_at_k_estimator() -> None:
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError, match=r"pass@3 needs at least 3 samples"):
        pass_at_k(2, 1, 3)


def test_eval_reports_pass_at_k_and_writes_every_rollout(tmp_path: Path, model_url: str) -> None:
    summary = run(config(tmp_path, model_url))
    assert summary["num_rollouts"] == 12
    assert summary["num_tasks"] == 3
    assert summary["pass"] == pytest.approx({"pass@1": 0.5, "pass@2": 1 - 1 / 6, "pass@4": 1.0})
    assert summary["means"]["reward"] == pytest.approx(0.5)
    assert summary["statuses"] == {"ok": 12}
    rows = [
        json.loads(x) for x in (tmp_path / "ev" / "eval" / "results.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 12
    assert {(r["task_id"], r["index"]) for r in rows} == {
        (f"arithmetic-0-{t}", i) for t in range(3) for i in range(4)
    }
    row = rows[0]
    assert row["messages"][0]["role"] == "user"
    assert row["messages"][-1]["role"] == "assistant"
    assert [n["role"] for n in row["nodes"]] == ["user", "assistant"]
    assert len(row["trace_id"]) == 32
    assert row["passed"] == (row["reward"] == 1.0)
    names = [span["name"] for span in row["trace"]]
    assert names[0] == "rollout"
    assert {"model_call", "reward"} <= set(names)
    assert "harness" not in names  # the turns are the rollout's children
    assert row["trace"][0]["attributes"]["treadle.harness"] == "SingleTurn"
    assert (
        json.loads((tmp_path / "ev" / "eval" / "summary.json").read_text())["pass"]["pass@4"] == 1.0
    )
    assert "pass@2" in summary_table(summary)


def test_eval_resumes_where_it_stopped(tmp_path: Path, model_url: str) -> None:
    run(config(tmp_path, model_url, num_tasks=2))
    assert len(FakeModel.calls) == 8
    results = tmp_path / "ev" / "eval" / "results.jsonl"
    lines = results.read_text().splitlines()
    results.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # a crash cut the last line
    summary = run(config(tmp_path, model_url, num_tasks=3))
    assert len(FakeModel.calls) == 8 + 1 + 4  # the cut rollout and the new task only
    assert summary["num_rollouts"] == 12
    with pytest.raises(ConfigError, match="different eval config"):
        run(config(tmp_path, model_url, model="other"))
    run(config(tmp_path, model_url, model="other", resume=False))
    assert len(FakeModel.calls) == 13 + 12


GROUP_ENV = """
from treadle.env_runner import Environment, Rubric

def first_correct(completions, answer):
    seen = False
    out = []
    for c in completions:
        hit = c.strip() == str(answer) and not seen
        seen |= hit
        out.append(float(hit))
    return out

ENV = Environment("grp", prompt=lambda t: f"Compute {t['question']}. Answer with the number only.",
                  rubric=Rubric(rewards=[lambda completion, answer: float(completion.strip() == str(answer))],
                                group_rewards=[(first_correct, 0.5)]),
                  tasks=lambda: __import__("treadle.env_runner.envs.countdown", fromlist=["x"]).ARITHMETIC.task_set())
"""


def test_eval_group_rewards_see_the_whole_group(
    tmp_path: Path, model_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "grp_env.py").write_text(GROUP_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config(tmp_path, model_url, env="grp_env:ENV", num_tasks=2)
    summary = run(cfg)
    rows = [
        json.loads(x) for x in (tmp_path / "ev" / "eval" / "results.jsonl").read_text().splitlines()
    ]
    for task_id in {r["task_id"] for r in rows}:
        group = [r for r in rows if r["task_id"] == task_id]
        assert (
            sum(r["rewards"]["first_correct"] for r in group) == 1.0
        )  # exactly one bonus per group
    assert summary["means"]["reward"] == pytest.approx(0.5 + 0.5 * 2 / 8)


def test_eval_with_tools_over_the_openai_backend(tmp_path: Path, model_url: str) -> None:
    summary = run(config(tmp_path, model_url, env="tool_search", num_tasks=1, rollouts_per_task=1))
    assert summary["means"]["reward"] == 1.0
    assert summary["means"]["metric/searches"] == 1.0
    row = json.loads((tmp_path / "ev" / "eval" / "results.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in row["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert row["nodes"][2]["tool_calls"][0]["name"] == "search"
    assert FakeModel.calls[0]["tools"][0]["function"]["name"] == "search"


def test_eval_against_an_unreachable_model_reports_errors(tmp_path: Path) -> None:
    summary = run(config(tmp_path, "http://127.0.0.1:9/v1", num_tasks=2, rollouts_per_task=1))
    assert summary["statuses"] == {"error:inference": 2}
    assert summary["pass"]["pass@1"] == 0.0


def test_cli_eval_prints_the_summary(
    tmp_path: Path, model_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["eval", "--eval.env", "arithmetic", "--eval.base_url", model_url, "--eval.num_tasks", "2",
                 "--run.output_dir", str(tmp_path), "--run.name", "cli"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 tasks x 1 rollouts = 2" in out
    assert "pass@1" in out
    assert (tmp_path / "cli" / "eval" / "results.jsonl").exists()
    assert main(["eval", "--eval.env", "nope", "--eval.base_url", model_url]) == 2
    assert "unknown environment 'nope'" in capsys.readouterr().err


def test_env_init_scaffolds_a_package_whose_test_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys

    assert main(["env", "init", "my_env", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "my_env"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests")],
                       cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout
    assert main(["env", "init", "my_env", "--dir", str(tmp_path)]) == 2  # exists
    assert main(["env", "init", "Bad-Name", "--dir", str(tmp_path)]) == 2


AGENT = """
import json, os, urllib.request
messages = json.load(open(os.environ["TREADLE_MESSAGES_FILE"]))
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": "m", "messages": messages}).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
print(json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"])
"""

AGENT_ENV = """
import sys
from treadle.env_runner import Environment, Rubric
from treadle.env_runner.harnesses.command import CommandHarness
from treadle.env_runner.envs.countdown import ARITHMETIC

ENV = Environment("agent", prompt=ARITHMETIC.prompt_fn, harness=CommandHarness([sys.executable, AGENT_PATH]),
                  runtime="local",
                  rubric=Rubric(rewards=[lambda completion, answer: float(completion.strip() == str(answer))]),
                  tasks=ARITHMETIC.task_set)
"""


def test_eval_runs_a_cli_agent_through_the_interception_server(
    tmp_path: Path, model_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A separate program is the harness: it calls OPENAI_BASE_URL (the runner's
    interception server), which forwards to the evaluated model and records the turn."""
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "agent_env.py").write_text(
        f"AGENT_PATH = {str(tmp_path / 'agent.py')!r}\n" + AGENT_ENV
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    summary = run(
        config(tmp_path, model_url, env="agent_env:ENV", num_tasks=2, rollouts_per_task=2)
    )
    assert summary["statuses"] == {"ok": 4}
    assert summary["means"]["reward"] == pytest.approx(0.5)  # seeds 0, 1: right, wrong
    rows = [
        json.loads(x) for x in (tmp_path / "ev" / "eval" / "results.jsonl").read_text().splitlines()
    ]
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    assert len(FakeModel.calls) == 4
