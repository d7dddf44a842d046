"""The inference client against a tiny fake of vLLM's generate route, and span expansion."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
from opentelemetry import trace

from testkit.teacher import FakeTeacherServer
from treadle.services import telemetry
from treadle.services.inference_client import (
    InferenceClient,
    InferenceRequestError,
    InferenceResponseError,
    InferenceUnavailableError,
    expand_weight_versions,
    parse_completions_prompt_logprobs,
    parse_generate_response,
)
from treadle.services.ports import free_port


def generate_body(
    ids: list[int], spans: list[dict[str, Any]] | None, **extra: Any
) -> dict[str, Any]:
    """A /inference/v1/generate response body shaped like vLLM 0.32's."""
    content = [
        {"token_id": t, "logprob": -0.5 - i, "rank": 1, "top_logprobs": []}
        for i, t in enumerate(ids)
    ]
    return {
        "request_id": "generate-tokens-x",
        "prompt_token_ids": [1, 2, 3],
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": ids,
                "logprobs": {"content": content},
                "weight_versions": spans,
                **extra,
            }
        ],
    }


# A reply: (status, JSON body) or "drop" (close the connection without answering) or
# ("sleep", seconds, reply)
Reply = Any


class FakeVllm:
    """A threaded HTTP server that answers POSTs from a script and records the bodies."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.closing = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers["content-length"])
                fake.requests.append(json.loads(self.rfile.read(length)))
                fake.headers.append({k.lower(): v for k, v in self.headers.items()})
                reply = (
                    fake.replies.pop(0)
                    if fake.replies
                    else (500, {"error": {"message": "no reply scripted"}})
                )
                if isinstance(reply, tuple) and reply[0] == "sleep":
                    # the test ends (closing is set) before the reply is due: never write to a
                    # connection the client gave up on (SIGPIPE may be fatal in this process)
                    if fake.closing.wait(reply[1]):
                        return
                    reply = reply[2]
                if reply == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                status, body = reply
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeVllm]:
    server = FakeVllm()
    yield server
    server.close()


def run(fn: Callable[[InferenceClient], Any], url: str, **kwargs: Any) -> Any:
    async def main() -> Any:
        async with InferenceClient(url, **kwargs) as client:
            return await fn(client)

    return asyncio.run(main())


def test_inference_client_generate_returns_numpy_arrays(fake: FakeVllm) -> None:
    fake.replies.append((200, generate_body([7, 8, 9], [{"version": "3", "start": 0, "end": 3}])))
    result = run(
        lambda c: c.generate(
            np.array([1, 2, 3]),
            max_tokens=3,
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            seed=11,
            stop_token_ids=[2],
        ),
        fake.url,
    )
    assert result.token_ids.dtype == np.int32
    assert result.token_ids.tolist() == [7, 8, 9]
    assert result.logprobs.dtype == np.float32
    assert result.logprobs.tolist() == [-0.5, -1.5, -2.5]
    assert result.policy_versions.dtype == np.int32
    assert result.policy_versions.tolist() == [3, 3, 3]
    assert result.finish_reason == "length"
    assert result.prompt_token_ids.tolist() == [1, 2, 3]
    sent = fake.requests[0]
    assert sent["token_ids"] == [1, 2, 3]
    assert sent["sampling_params"] == {
        "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_tokens": 0, "logprobs": 0,
        "detokenize": False, "ignore_eos": False, "seed": 11, "stop_token_ids": [2],
    }  # fmt: skip


def test_inference_client_call_is_a_span_whose_traceparent_vllm_gets(
    fake: FakeVllm, span_exporter: Any
) -> None:
    fake.replies.append((200, generate_body([7, 8], [{"version": "1", "start": 0, "end": 2}])))

    async def call(c: InferenceClient) -> Any:
        with trace.get_tracer("test").start_as_current_span("model_call"):
            return await c.generate([1, 2, 3], max_tokens=2)

    run(call, fake.url)
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    generate, caller = spans["generate"], spans["model_call"]
    assert generate.kind == trace.SpanKind.CLIENT
    assert generate.parent is not None
    assert generate.parent.span_id == caller.context.span_id
    assert generate.attributes["gen_ai.usage.completion_tokens"] == 2
    # W3C traceparent: version-traceid-spanid-flags; vLLM makes its request span a child
    _, trace_id, span_id, flags = fake.headers[0]["traceparent"].split("-")
    assert trace_id == format(generate.context.trace_id, "032x")
    assert span_id == format(generate.context.span_id, "016x")
    assert int(flags, 16) & 1  # sampled: vLLM records it too


def test_inference_client_call_records_itself_on_a_span_that_absorbs_calls(
    fake: FakeVllm, span_exporter: Any
) -> None:
    fake.replies.append((503, {"error": {"message": "busy"}}))  # answered by a retry
    fake.replies.append((200, generate_body([7, 8], [{"version": "1", "start": 0, "end": 2}])))
    fake.replies.append((400, {"error": {"message": "bad request", "code": 400}}))
    fake.replies.append((200, generate_body([9], [{"version": "1", "start": 0, "end": 1}])))

    async def call(c: InferenceClient) -> Any:
        with (
            trace.get_tracer("test").start_as_current_span("model_call") as span,
            telemetry.absorbing_calls(span),
        ):
            await c.generate([1, 2, 3], max_tokens=2)
            with pytest.raises(InferenceRequestError):
                await c.generate([1, 2, 3], max_tokens=2)
            with trace.get_tracer("test").start_as_current_span("inner"):
                return await c.generate([1, 2], max_tokens=2)  # not the span itself

    run(call, fake.url)
    spans = span_exporter.get_finished_spans()
    by_name: dict[str, list[Any]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (caller,) = by_name["model_call"]
    # the two calls made directly in it are no spans; the one under "inner" is
    assert [s.parent.span_id for s in by_name["generate"]] == [by_name["inner"][0].context.span_id]
    assert caller.attributes["gen_ai.usage.completion_tokens"] == 2
    assert caller.attributes["server.address"] == fake.url
    assert caller.attributes["gen_ai.usage.prompt_tokens"] == 3
    # the refused call is an event on it; vLLM's request spans would be its children
    assert [e.name for e in caller.events] == ["generate failed"]
    assert caller.events[0].attributes["error.type"] == "InferenceRequestError"
    span_ids = [h["traceparent"].split("-")[2] for h in fake.headers]
    assert span_ids == [format(caller.context.span_id, "016x")] * 3 + [
        format(by_name["generate"][0].context.span_id, "016x")
    ]


def test_inference_client_error_carries_vllms_message_and_is_not_retried(fake: FakeVllm) -> None:
    message = "This model's maximum context length is 1024 tokens"
    fake.replies.append(
        (400, {"error": {"message": message, "type": "BadRequestError", "code": 400}})
    )
    with pytest.raises(
        InferenceRequestError, match="HTTP 400: This model's maximum context length"
    ) as e:
        run(lambda c: c.generate([1], max_tokens=5000), fake.url)
    assert e.value.status_code == 400
    assert len(fake.requests) == 1


def test_inference_client_retries_503_and_dropped_connections(fake: FakeVllm) -> None:
    fake.replies += [
        (503, {"error": {"message": "restarting"}}),
        "drop",
        (200, generate_body([5], [{"version": "1", "start": 0, "end": 1}])),
    ]
    result = run(lambda c: c.generate([1], max_tokens=1), fake.url)
    assert result.policy_versions.tolist() == [1]
    assert len(fake.requests) == 3


def test_inference_client_retries_are_bounded(fake: FakeVllm) -> None:
    fake.replies += [(503, {"error": {"message": "restarting"}})] * 5
    with pytest.raises(InferenceUnavailableError, match=r"HTTP 503: restarting; 3 attempts"):
        run(lambda c: c.generate([1], max_tokens=1), fake.url, max_retries=2)
    assert len(fake.requests) == 3


def test_inference_client_unreachable_server_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(
        InferenceUnavailableError, match=f"cannot reach the inference server at {url}.*ConnectError"
    ):
        run(lambda c: c.generate([1], max_tokens=1), url, max_retries=2)
    assert time.monotonic() - started < 10


def test_inference_client_deadline_bounds_the_call(fake: FakeVllm) -> None:
    fake.replies.append(
        ("sleep", 3.0, (200, generate_body([5], [{"version": "1", "start": 0, "end": 1}])))
    )
    started = time.monotonic()
    with pytest.raises(InferenceUnavailableError, match=r"no answer within 0\.5s"):
        run(lambda c: c.generate([1], max_tokens=1, timeout_s=0.5), fake.url)
    assert time.monotonic() - started < 2.5
    assert len(fake.requests) == 1  # a timed-out generation is not sent again


def test_inference_client_rejects_empty_prompts() -> None:
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        run(lambda c: c.generate([], max_tokens=1), "http://127.0.0.1:1")


def test_span_expansion_one_version_per_token() -> None:
    spans = [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 5}]
    versions = expand_weight_versions(spans, 5)
    assert versions.dtype == np.int32
    assert versions.tolist() == [4, 4, 5, 5, 5]


def test_span_expansion_of_no_tokens() -> None:
    assert expand_weight_versions(None, 0).tolist() == []
    assert expand_weight_versions([], 0).tolist() == []


@pytest.mark.parametrize(
    ("spans", "num_tokens", "message"),
    [
        (None, 3, "labelled none of 3 tokens"),
        ([{"version": "1", "start": 0, "end": 2}], 3, r"cover tokens \[0, 2\) of 3"),
        ([{"version": "1", "start": 1, "end": 3}], 3, "next start expected at 0"),
        (
            [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 1, "end": 3}],
            3,
            "next start expected at 2",
        ),
        ([{"version": "1", "start": 0, "end": 4}], 3, r"\[0, 4\)"),
        (
            [{"version": "default", "start": 0, "end": 3}],
            3,
            "'default', which is not a policy version",
        ),
        ([{"version": "-1", "start": 0, "end": 3}], 3, "out of range"),
        ([{"start": 0, "end": 3}], 3, "malformed"),
    ],
)
def test_span_expansion_refuses_what_it_cannot_make_exact(
    spans: list[dict[str, Any]] | None, num_tokens: int, message: str
) -> None:
    with pytest.raises(InferenceResponseError, match=message):
        expand_weight_versions(spans, num_tokens)


def test_generate_response_with_mismatched_logprobs_is_refused() -> None:
    body = generate_body([1, 2], [{"version": "0", "start": 0, "end": 2}])
    body["choices"][0]["logprobs"]["content"].pop()
    with pytest.raises(InferenceResponseError, match="2 sampled tokens but 1 logprobs"):
        parse_generate_response(body)


def test_generate_response_of_a_hosted_run_takes_its_version_from_the_adapter() -> None:
    spans = [{"version": "0", "start": 0, "end": 2}]  # a hosted engine labels every token 0
    body = dict(generate_body([4, 5], spans), model="alpha-v7")
    assert parse_generate_response(body, "alpha").policy_versions.tolist() == [7, 7]
    # anything else is read from the spans: the run's base, another name, no run named
    for answered, model in (("policy", "alpha"), ("alpha-v7x", "alpha"), ("beta-v7", "alpha"),
                            ("alpha-v", "alpha"), ("alpha-v7", None)):  # fmt: skip
        got = parse_generate_response(dict(body, model=answered), model)
        assert got.policy_versions.tolist() == [0, 0], (answered, model)
    # with no spans a hosted answer still says exactly which version sampled each token
    assert parse_generate_response(dict(generate_body([4], None), model="alpha-v2"),
                                   "alpha").policy_versions.tolist() == [2]  # fmt: skip


def test_inference_client_of_a_hosted_run_names_it_and_sends_its_key(fake: FakeVllm) -> None:
    body = dict(generate_body([7], [{"version": "0", "start": 0, "end": 1}]), model="alpha-v4")
    fake.replies.append((200, body))
    result = run(lambda c: c.generate([1, 2], max_tokens=1), fake.url, model="alpha",
                 api_key="k-alpha")  # fmt: skip
    assert result.policy_versions.tolist() == [4]
    assert fake.requests[0]["model"] == "alpha"
    assert fake.headers[0]["authorization"] == "Bearer k-alpha"


def n_body(choices: list[tuple[list[int], list[dict[str, Any]] | None]]) -> dict[str, Any]:
    """A generate answer with one choice per (ids, spans), as vLLM answers n > 1."""
    doc = generate_body(*choices[0])
    doc["choices"] = [
        dict(generate_body(ids, spans)["choices"][0], index=k)
        for k, (ids, spans) in enumerate(choices)
    ]
    return doc


def test_generate_n_asks_for_n_samples_in_one_request_and_keeps_each_completion_apart(
    fake: FakeVllm,
) -> None:
    fake.replies.append((200, n_body([
        ([5, 6], [{"version": "2", "start": 0, "end": 2}]),
        ([7], [{"version": "3", "start": 0, "end": 1}]),
        ([8, 9, 10], [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}]),
    ])))  # fmt: skip
    results = run(lambda c: c.generate_n([1, 2, 3], 3, max_tokens=4, temperature=0.7), fake.url)
    assert len(fake.requests) == 1
    assert fake.requests[0]["sampling_params"]["n"] == 3
    assert [r.token_ids.tolist() for r in results] == [[5, 6], [7], [8, 9, 10]]
    assert [r.policy_versions.tolist() for r in results] == [[2, 2], [3], [2, 3, 3]]
    assert [r.logprobs.tolist() for r in results] == [[-0.5, -1.5], [-0.5], [-0.5, -1.5, -2.5]]
    assert all(r.prompt_token_ids.tolist() == [1, 2, 3] for r in results)


def test_generate_sends_no_n_and_generate_n_refuses_an_answer_with_other_than_n_choices(
    fake: FakeVllm,
) -> None:
    fake.replies.append((200, generate_body([4], [{"version": "0", "start": 0, "end": 1}])))
    run(lambda c: c.generate([1], max_tokens=1), fake.url)
    assert "n" not in fake.requests[0]["sampling_params"]  # n = 1: vLLM's default, unsent
    spans = [{"version": "0", "start": 0, "end": 1}]
    for got in (1, 3):
        fake.replies.append((200, n_body([([4], spans)] * got)))
        with pytest.raises(InferenceResponseError, match="2"):
            run(lambda c: c.generate_n([1], 2, max_tokens=1), fake.url)
    with pytest.raises(ValueError, match="n must be >= 1"):
        run(lambda c: c.generate_n([1], 0, max_tokens=1), fake.url)


def test_prompt_logprobs_many_asks_one_completions_request_of_token_id_prompts() -> None:
    teacher = FakeTeacherServer(logprob=-0.75, vocab=64)
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    try:
        got = run(lambda c: c.prompt_logprobs_many(seqs), teacher.url, model="teacher")
    finally:
        teacher.close()
    # the fake answers its choices in reverse order: each is matched by its index
    assert [g.tolist() for g in got] == [[-0.75] * 2, [-0.75], [-0.75] * 3]
    [(path, body)] = teacher.requests
    assert path == "/v1/completions"
    assert body["prompt"] == seqs
    assert (body["prompt_logprobs"], body["max_tokens"], body["model"]) == (0, 1, "teacher")


def test_prompt_logprobs_many_uses_the_token_route_of_a_server_without_completions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    teacher = FakeTeacherServer(logprob=-0.75, vocab=64, completions=False)

    async def twice(c: InferenceClient) -> tuple[list[Any], list[Any]]:
        first = await c.prompt_logprobs_many([[1, 2, 3], [4, 5]])
        assert c.completions is False
        return first, await c.prompt_logprobs_many([[6, 7]])

    try:
        with caplog.at_level("WARNING"):
            first, second = run(twice, teacher.url)
    finally:
        teacher.close()
    assert [g.tolist() for g in first + second] == [[-0.75] * 2, [-0.75], [-0.75]]
    assert [p for p, _ in teacher.requests] == ["/inference/v1/generate"] * 3
    assert sorted(teacher.scored) == [[1, 2, 3], [4, 5], [6, 7]]  # sent together: any order
    said = [r.message for r in caplog.records if "/v1/completions" in r.message]
    assert len(said) == 1  # said once, not per call
    assert "token route" in said[0]


def test_prompt_logprobs_many_does_not_take_an_unknown_model_for_a_missing_route() -> None:
    class NoSuchModel(FakeTeacherServer):
        def answer(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
            if "model" in body and body["model"] != "teacher":
                return 404, {"error": {"message": f"The model `{body['model']}` does not exist.",
                                       "type": "NotFoundError", "code": 404}}  # fmt: skip
            return super().answer(path, body, headers)

    teacher = NoSuchModel(vocab=64)

    async def ask(c: InferenceClient) -> bool:
        with pytest.raises(InferenceRequestError, match="`big` does not exist"):
            await c.prompt_logprobs_many([[1, 2]])
        return c.completions

    try:
        assert run(ask, teacher.url, model="big") is True
    finally:
        teacher.close()
    assert teacher.requests == []


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ({"choices": []}, "2 prompts, got 0 choices"),
        ({}, "2 prompts, got no choices"),
        ({"choices": [{"index": 0}, {"index": 0}]}, "index 0"),
        ({"choices": [{"index": 0}, {"index": 2}]}, "index 2"),
        (
            {"choices": [{"index": 1, "prompt_logprobs": [None, {"2": {"logprob": -1.0}}]},
                         {"index": 0, "prompt_logprobs": [None]}]},
            "prompt logprobs of 2 tokens, got 1",
        ),
    ],
)  # fmt: skip
def test_completions_prompt_logprobs_that_break_the_contract_are_refused(
    doc: dict[str, Any], why: str
) -> None:
    with pytest.raises(InferenceResponseError, match=why):
        parse_completions_prompt_logprobs(doc, [[1, 2], [1, 2]])
