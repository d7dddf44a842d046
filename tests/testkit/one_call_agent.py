"""A CLI agent in a few lines of the standard library, for tests and benchmarks of the
harness path: it reads the rollout's opening messages, makes ONE model call in the dialect
named by its first argument (``openai_chat``, ``openai_responses``, ``anthropic``) with the
rollout's endpoint and key, and writes the answer's text to ``answer.txt``.

    CommandHarness([python, "-I", "{workdir}/agent.py", "anthropic"], setup=put_agent)
    Rubric(rewards=[answered])      # 1.0 when answer.txt holds "olleh"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

AGENT = r"""
import json, os, sys, urllib.request
dialect = sys.argv[1]
messages = json.load(open(".treadle/messages.json"))
prompt = messages[-1]["content"]
if dialect == "anthropic":
    url = os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages"
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": prompt}]}
    headers = {"x-api-key": os.environ["ANTHROPIC_API_KEY"], "anthropic-version": "2023-06-01"}
else:
    route = "/chat/completions" if dialect == "openai_chat" else "/responses"
    url = os.environ["OPENAI_BASE_URL"] + route
    body = ({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": prompt}]}
            if dialect == "openai_chat" else {"model": "m", "max_output_tokens": 16, "input": prompt})
    headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
req = urllib.request.Request(url, data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json", **headers})
with urllib.request.urlopen(req, timeout=60) as r:
    out = json.load(r)
if dialect == "anthropic":
    text = out["content"][0]["text"]
elif dialect == "openai_chat":
    text = out["choices"][0]["message"]["content"]
else:
    text = out["output"][-1]["content"][0]["text"]
open("answer.txt", "w").write(text)
"""


def put_agent(task: dict[str, Any], workdir: Path) -> None:
    """CommandHarness setup: the agent travels in the work dir (visible in any runtime)."""
    (workdir / "agent.py").write_text(AGENT)


def answered(state: Any) -> float:
    """1.0 when the agent wrote the reversal of "hello"."""
    return float((Path(state.info["workdir"]) / "answer.txt").read_text() == "olleh")
