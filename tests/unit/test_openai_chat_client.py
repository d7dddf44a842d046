"""OpenAIChat, the client of external OpenAI-compatible endpoints (treadle eval, sft-data,
the model-played user): a think block a server without a reasoning parser leaves in the
content is split off, so that rewards score the answer (a Qwen3-style model answered
"<think>\\n\\n</think>\\n\\ngbq" and the reverse-text reward scored that whole text)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

from treadle.env_runner.session import OpenAIChat, split_think


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("<think>\n\n</think>\n\ngbq", ("", "gbq")),
        ("<think>\nadd them\n</think>\n\n4", ("add them", "4")),
        ("  <think>x</think>y", ("x", "y")),
        ("add them\n</think>\n\n4", ("add them", "4")),  # the template opened the block
        ("4", None),
        ("say <think>hi</think> to me", None),  # not a block opening the answer
        ("", None),
    ],
)
def test_split_think(content: str, expected: tuple[str, str] | None) -> None:
    assert split_think(content) == expected


def client_answering(message: dict[str, Any]) -> OpenAIChat:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        doc = {"choices": [{"message": message, "finish_reason": "stop"}], "usage": {}}
        return httpx.Response(200, content=json.dumps(doc))

    chat = OpenAIChat("http://model.test/v1", "m")
    chat._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return chat


def ask(chat: OpenAIChat) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        try:
            return await chat.chat([{"role": "user", "content": "qbg"}], tools=None,
                                   max_tokens=8, temperature=1.0, top_p=1.0, seed=None)  # fmt: skip
        finally:
            await chat.aclose()

    return asyncio.run(main())


def test_a_think_block_in_the_content_is_split_off_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    chat = client_answering({"role": "assistant", "content": "<think>\n\n</think>\n\ngbq"})
    with caplog.at_level(logging.WARNING):
        out = ask(chat)
    assert (out["content"], out["reasoning_content"]) == ("gbq", "")
    assert "reasoning parser" in caplog.text
    assert "http://model.test/v1" in caplog.text


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_the_server_s_own_split_is_kept(key: str) -> None:
    """A server with a parser (either field name vLLM has used) is taken as it is, even
    where the answer itself mentions </think>."""
    out = ask(client_answering({"role": "assistant", "content": "a </think> b", key: "r"}))
    assert (out["content"], out["reasoning_content"]) == ("a </think> b", "r")
