"""The admission gate as plain ASGI: held requests, the service's bypass, drain, guarded routes."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from treadle.inference.gate import CONTROL_PATH, TOKEN_HEADER, AdmissionGate

TOKEN = "s3cret"


class InnerApp:
    """Stands in for vLLM: records paths, and finishes a request when released."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.paths.append(scope["path"])
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def call(
    app: Callable[..., Awaitable[None]],
    path: str,
    *,
    method: str = "POST",
    token: str | None = None,
    body: dict[str, Any] | None = None,
    key: str | None = None,
) -> tuple[int, dict[str, Any]]:
    headers = [(TOKEN_HEADER.encode(), token.encode())] if token else []
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    data = json.dumps(body or {}).encode()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = sent[0]["status"]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return status, json.loads(payload or b"{}")


def test_gate_starts_closed_and_holds_generation_until_opened() -> None:
    async def main() -> None:
        inner = InnerApp()
        gate = AdmissionGate(inner, token=TOKEN)
        held = asyncio.create_task(call(gate, "/inference/v1/generate"))
        await asyncio.sleep(0.05)
        assert not held.done()
        assert inner.paths == []
        assert gate.held == 1
        assert await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True}) == (
            200,
            {
                "open": True,
                "in_flight": 0,
                "held": 1,
                "adapter": None,
                "routes": {},
                "adapter_in_flight": {},
            },  # woken, not run yet
        )
        assert (await asyncio.wait_for(held, 1))[0] == 200
        assert gate.held == 0
        assert inner.paths == ["/inference/v1/generate"]

    asyncio.run(main())


def test_gate_lets_the_services_probe_and_reads_through_while_closed() -> None:
    async def main() -> None:
        inner = InnerApp()
        gate = AdmissionGate(inner, token=TOKEN)
        assert (await asyncio.wait_for(call(gate, "/inference/v1/generate", token=TOKEN), 1))[
            0
        ] == 200
        assert (await asyncio.wait_for(call(gate, "/metrics", method="GET"), 1))[0] == 200
        assert (await asyncio.wait_for(call(gate, "/tokenize"), 1))[0] == 200
        assert inner.paths == ["/inference/v1/generate", "/metrics", "/tokenize"]

    asyncio.run(main())


def test_gate_guards_admin_routes_with_the_token() -> None:
    async def main() -> None:
        inner = InnerApp()
        gate = AdmissionGate(inner, token=TOKEN)
        status, body = await call(gate, "/collective_rpc", body={"method": "reload_weights"})
        assert status == 403
        assert "reserved for the Treadle inference service" in body["error"]["message"]
        assert (await call(gate, "/collective_rpc", token="wrong"))[0] == 403
        assert (await call(gate, CONTROL_PATH, body={"open": True}))[0] == 403
        assert inner.paths == []
        assert (await call(gate, "/pause", token=TOKEN))[0] == 200
        assert inner.paths == ["/pause"]

    asyncio.run(main())


def test_gate_drain_waits_for_admitted_requests() -> None:
    async def main() -> None:
        inner = InnerApp()
        gate = AdmissionGate(inner, token=TOKEN)
        gate.set_open(True)
        inner.release.clear()
        running = asyncio.create_task(call(gate, "/v1/completions"))
        await asyncio.sleep(0.05)
        assert gate.in_flight == 1
        # closing with a short drain: still one in flight
        assert await call(
            gate, CONTROL_PATH, token=TOKEN, body={"open": False, "drain_timeout_s": 0.1}
        ) == (
            200,
            {
                "open": False,
                "in_flight": 1,
                "held": 0,
                "adapter": None,
                "routes": {},
                "adapter_in_flight": {},
            },
        )
        late = asyncio.create_task(call(gate, "/v1/completions"))  # arrives after closing
        drain = asyncio.create_task(
            call(gate, CONTROL_PATH, token=TOKEN, body={"open": False, "drain_timeout_s": 5})
        )
        await asyncio.sleep(0.05)
        assert not drain.done()
        inner.release.set()
        assert await asyncio.wait_for(drain, 1) == (
            200,
            {
                "open": False,
                "in_flight": 0,
                "held": 1,
                "adapter": None,
                "routes": {},
                "adapter_in_flight": {},
            },
        )
        assert (await running)[0] == 200
        assert not late.done()  # held at the gate, not admitted by the drain
        gate.set_open(True)
        assert (await asyncio.wait_for(late, 1))[0] == 200

    asyncio.run(main())


def test_gate_answers_held_requests_503_before_a_restart() -> None:
    async def main() -> None:
        inner = InnerApp()
        gate = AdmissionGate(inner, token=TOKEN)
        held = asyncio.create_task(call(gate, "/inference/v1/generate"))
        await asyncio.sleep(0.05)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": False, "reject_held": True})
        status, body = await asyncio.wait_for(held, 1)
        assert status == 503
        assert "restarting with new weights" in body["error"]["message"]
        assert inner.paths == []

    asyncio.run(main())


def test_gate_without_a_token_is_transparent() -> None:
    async def main() -> None:
        inner = InnerApp()
        gate = AdmissionGate(inner, token="")
        assert (await asyncio.wait_for(call(gate, "/inference/v1/generate"), 1))[0] == 200
        assert (await asyncio.wait_for(call(gate, "/collective_rpc"), 1))[0] == 200

    asyncio.run(main())


class BodyApp:
    """Stands in for vLLM: records the JSON body and content-length of each request."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], int]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        length = dict(scope["headers"]).get(b"content-length", b"-1")
        self.seen.append((json.loads(message["body"]), int(length)))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def test_gate_sends_requests_for_the_policy_to_the_served_adapter(monkeypatch: Any) -> None:
    monkeypatch.setenv("TREADLE_SERVED_MODEL_NAME", "policy")

    async def main() -> None:
        inner = BodyApp()
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        await call(gate, "/inference/v1/generate", body={"token_ids": [1]})
        assert inner.seen[-1][0] == {"token_ids": [1]}  # no adapter: the base, untouched
        status, state = await call(
            gate, CONTROL_PATH, token=TOKEN, body={"open": True, "adapter": "run-v3"}
        )
        assert (status, state["adapter"]) == (200, "run-v3")
        for body in ({"token_ids": [1]}, {"token_ids": [1], "model": "policy"}):
            await call(gate, "/inference/v1/generate", body=body)
            doc, length = inner.seen[-1]
            assert doc == {"token_ids": [1], "model": "run-v3"}
            assert length == len(json.dumps(doc).encode())
        await call(gate, "/v1/completions", body={"model": "run-v2", "prompt": "x"})
        assert inner.seen[-1][0] == {"model": "run-v2", "prompt": "x"}  # named: kept
        # back to the base weights
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True, "adapter": None})
        await call(gate, "/inference/v1/generate", body={"model": "policy"})
        assert inner.seen[-1][0] == {"model": "policy"}
        bad = await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True, "adapter": 3})
        assert bad[0] == 400

    asyncio.run(main())


def test_gate_keeps_lora_routes_to_the_service() -> None:
    async def main() -> None:
        inner = BodyApp()
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert (await call(gate, path, body={"lora_name": "x"}))[0] == 403
            assert (await call(gate, path, token=TOKEN, body={"lora_name": "x"}))[0] == 200
        assert len(inner.seen) == 2

    asyncio.run(main())


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_gate_serves_each_hosted_run_its_own_adapter_by_its_key(monkeypatch: Any) -> None:
    monkeypatch.setenv("TREADLE_SERVED_MODEL_NAME", "policy")

    async def main() -> None:
        inner = BodyApp()
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        for run in ("alpha", "beta"):
            route = {"model": run, "adapter": None, "key_sha256": _sha(f"{run}-key")}
            assert (await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route}))[0] == 200
        # a run's first requests run on the base
        assert (await call(gate, "/inference/v1/generate", key="alpha-key", body={}))[0] == 200
        assert inner.seen[-1][0] == {"model": "policy"}
        route = {"model": "beta", "adapter": "beta-v2"}  # a new version: the key stays
        status, state = await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route})
        assert (status, state["routes"], state["open"]) == (
            200,
            {"alpha": None, "beta": "beta-v2"},
            True,
        )
        for body in ({"token_ids": [1]}, {"token_ids": [1], "model": "beta"}):
            assert (await call(gate, "/inference/v1/generate", key="beta-key", body=body))[0] == 200
            doc, length = inner.seen[-1]
            assert (doc, length) == ({"token_ids": [1], "model": "beta-v2"},
                                     len(json.dumps(doc).encode()))  # fmt: skip
        seen = len(inner.seen)
        # another run's model or adapter, the base, no key, a wrong key: refused, not run
        for key, body, code in (
            ("alpha-key", {"model": "beta"}, 403),
            ("alpha-key", {"model": "beta-v2"}, 403),
            ("alpha-key", {"model": "policy"}, 403),
            (None, {"model": "alpha"}, 401),
            ("gamma-key", {}, 401),
        ):
            got = await call(gate, "/v1/completions", key=key, body=body)
            assert got[0] == code, (key, body, got)
        assert len(inner.seen) == seen
        # aborting requests by id: a run could abort another run's
        assert (await call(gate, "/inference/v1/abort_requests", key="alpha-key"))[0] == 403
        assert (await call(gate, "/inference/v1/abort_requests", token=TOKEN))[0] == 200
        # the service itself still probes any adapter
        await call(gate, "/inference/v1/generate", token=TOKEN, body={"model": "beta-v2"})
        assert inner.seen[-1][0] == {"model": "beta-v2"}
        # a key belongs to one run; a route without a key is for a registered run only
        for route in ({"model": "gamma", "key_sha256": _sha("alpha-key")},
                      {"model": "gamma", "adapter": "gamma-v1"},
                      {"model": "beta", "key_sha256": "ab"}):  # fmt: skip
            assert (await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route}))[0] == 400
        # a new key replaces a run's old one
        route = {"model": "alpha", "adapter": None, "key_sha256": _sha("alpha-key-2")}
        await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route})
        assert (await call(gate, "/v1/completions", key="alpha-key", body={}))[0] == 401
        assert (await call(gate, "/v1/completions", key="alpha-key-2", body={}))[0] == 200

    asyncio.run(main())


def test_gate_counts_hosted_requests_per_adapter() -> None:
    async def main() -> None:
        inner = InnerApp()
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        route = {"model": "alpha", "adapter": "alpha-v1", "key_sha256": _sha("k")}
        await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route})
        inner.release.clear()
        running = asyncio.create_task(call(gate, "/inference/v1/generate", key="k", body={}))
        await asyncio.sleep(0.05)
        route = {"model": "alpha", "adapter": "alpha-v2"}
        _, state = await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route})
        assert state["adapter_in_flight"] == {"alpha-v1": 1}  # still runs on v1
        inner.release.set()
        assert (await asyncio.wait_for(running, 1))[0] == 200
        _, state = await call(gate, CONTROL_PATH, method="GET", token=TOKEN)
        assert state["adapter_in_flight"] == {}

    asyncio.run(main())


def test_gate_unroute_refuses_a_removed_runs_key_and_lets_its_admitted_requests_finish() -> None:
    async def main() -> None:
        inner = InnerApp()
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        for run in ("alpha", "beta"):
            route = {"model": run, "adapter": f"{run}-v1", "key_sha256": _sha(f"{run}-key"),
                     "max_sampled_tokens": 100}  # fmt: skip
            await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route})
        inner.release.clear()
        running = asyncio.create_task(call(gate, "/inference/v1/generate", key="alpha-key",
                                           body={}))  # fmt: skip
        await asyncio.sleep(0.05)
        status, state = await call(gate, CONTROL_PATH, token=TOKEN, body={"unroute": "alpha"})
        assert (status, state["open"], state["routes"]) == (200, True, {"beta": "beta-v1"})
        assert state["adapter_in_flight"] == {"alpha-v1": 1}  # admitted before: still runs
        assert gate.quota == {"beta": 100}
        got = await call(gate, "/v1/completions", key="alpha-key", body={"model": "alpha"})
        assert got[0] == 401  # like an unknown key
        assert "send your run's key" in got[1]["error"]["message"]
        inner.release.set()
        assert (await asyncio.wait_for(running, 1))[0] == 200
        assert (await call(gate, "/v1/completions", key="beta-key", body={}))[0] == 200
        # again, or a run never hosted: nothing to do, no error
        for model in ("alpha", "gamma"):
            assert (await call(gate, CONTROL_PATH, token=TOKEN, body={"unroute": model}))[0] == 200
        assert (await call(gate, CONTROL_PATH, token=TOKEN, body={"unroute": ""}))[0] == 400
        assert (await call(gate, CONTROL_PATH, body={"unroute": "beta"}))[0] == 403
        # its key is free again: the run added back (or another run) may register it
        back = {"model": "alpha", "adapter": None, "key_sha256": _sha("alpha-key")}
        assert (await call(gate, CONTROL_PATH, token=TOKEN, body={"route": back}))[0] == 200
        assert (await call(gate, "/v1/completions", key="alpha-key", body={}))[0] == 200

    asyncio.run(main())


def test_gate_hosting_no_run_refuses_every_generation_without_a_key() -> None:
    async def main() -> None:
        inner = InnerApp()
        gate = AdmissionGate(inner, token=TOKEN)
        status, state = await call(gate, CONTROL_PATH, token=TOKEN,
                                   body={"hosted": True, "open": True})  # fmt: skip
        assert (status, state["open"], state["routes"]) == (200, True, {})
        for key, body in ((None, {}), ("any-key-0123456789", {"model": "policy"})):
            assert (await call(gate, "/v1/completions", key=key, body=body))[0] == 401
        assert (await call(gate, "/inference/v1/abort_requests"))[0] == 403
        # the last run removed: still a hosting gate, not an open base
        route = {"model": "alpha", "adapter": None, "key_sha256": _sha("alpha-key")}
        await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route})
        assert (await call(gate, "/v1/completions", key="alpha-key", body={}))[0] == 200
        await call(gate, CONTROL_PATH, token=TOKEN, body={"unroute": "alpha"})
        assert (await call(gate, "/v1/completions", body={}))[0] == 401
        assert inner.paths == ["/v1/completions"]  # only alpha's, while it was hosted
        assert (await call(gate, CONTROL_PATH, token=TOKEN, body={"hosted": False}))[0] == 400

    asyncio.run(main())


class SamplingApp:
    """Stands in for vLLM: answers each request with ``n`` sampled token ids (token route)
    or ``n`` completion tokens (OpenAI route)."""

    def __init__(self, n: int):
        self.n = n
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += 1
        if scope["path"].startswith("/inference/"):
            body = {"choices": [{"token_ids": list(range(self.n))}]}
        else:
            body = {"choices": [{"text": "x"}], "usage": {"completion_tokens": self.n}}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": data[:5], "more_body": True})
        await send({"type": "http.response.body", "body": data[5:]})


def test_gate_stops_a_hosted_run_at_its_sampled_token_quota_alone() -> None:
    async def main() -> None:
        inner = SamplingApp(4)
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        # alpha may sample 10 tokens and had used 3 before (its ledger); beta has no quota
        route = {"model": "alpha", "adapter": "alpha-v1", "key_sha256": _sha("a"),
                 "max_sampled_tokens": 10, "sampled_tokens": 3}  # fmt: skip
        assert (await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route}))[0] == 200
        route = {"model": "beta", "adapter": None, "key_sha256": _sha("b")}
        await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route})
        assert (await call(gate, "/inference/v1/generate", key="a", body={}))[0] == 200  # 7
        assert (await call(gate, "/v1/completions", key="a", body={}))[0] == 200  # 11
        assert gate.sampled == {"alpha": 11}
        status, body = await call(gate, "/inference/v1/generate", key="a", body={})
        assert status == 429
        assert body["error"]["message"].startswith(
            "run 'alpha' has used 11 sampled tokens of its quota of 10"
        )
        assert inner.calls == 2  # refused before the engine
        # a stream could not be counted: refused for a run with a quota, not for others
        streamed = await call(gate, "/v1/completions", key="a", body={"stream": True})
        assert streamed[0] == 400
        for _ in range(5):  # beta is untouched
            assert (await call(gate, "/inference/v1/generate", key="b", body={}))[0] == 200
        _, state = await call(gate, CONTROL_PATH, method="GET", token=TOKEN)
        assert state["sampled"] == {"alpha": 11}
        bad = {"model": "beta", "max_sampled_tokens": 0}
        assert (await call(gate, CONTROL_PATH, token=TOKEN, body={"route": bad}))[0] == 400

    asyncio.run(main())


class HonestApp:
    """Stands in for vLLM: samples ``max_tokens`` tokens per sample, ``n`` samples (the
    token route's sampling_params, else the OpenAI fields), each request held until
    ``release`` is set; records the bodies it was given; ``fail`` ends a request without
    an answer (a client that went away, an engine error)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.fail = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        doc = json.loads((await receive())["body"])
        self.bodies.append(doc)
        await self.release.wait()
        if self.fail:
            raise ConnectionError("the client went away")
        params = doc.get("sampling_params", doc)
        n, k = params.get("n", 1), params.get("max_completion_tokens", params.get("max_tokens"))
        if scope["path"].startswith("/inference/"):
            body: dict[str, Any] = {"choices": [{"token_ids": list(range(k))}] * n}
        else:
            body = {"choices": [{"text": "x"}] * n, "usage": {"completion_tokens": n * k}}
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def test_a_quota_is_hard_even_for_requests_in_flight() -> None:
    """What a run's requests running may still sample counts against its quota: the
    sum of answers never passes it, however many requests it sends at once."""

    async def main() -> None:
        inner = HonestApp()
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        route = {"model": "alpha", "adapter": None, "key_sha256": _sha("a"),
                 "max_sampled_tokens": 100, "sampled_tokens": 10}  # fmt: skip
        await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route})
        inner.release.clear()
        generate = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 24, "n": 2}}
        running = [asyncio.create_task(call(gate, "/inference/v1/generate", key="a",
                                            body=generate)) for _ in range(3)]  # fmt: skip
        await asyncio.sleep(0.05)
        # 3 x 2 x 24 = 144 asked for, 90 left: the first holds 48, the second's max_tokens
        # is lowered to the 42 left over its 2 samples, the third finds nothing left
        assert [b["sampling_params"]["max_tokens"] for b in inner.bodies] == [24, 21]
        assert gate.reserved == {"alpha": 90}
        status, body = await call(gate, "/v1/completions", key="a", body={"max_tokens": 1})
        assert status == 429
        assert body["error"]["message"] == (
            "run 'alpha' has used 10 sampled tokens of its quota of 100 and its requests "
            "running may sample 90 more (inference.hosted.quotas): no more generation for it"
        )
        inner.release.set()
        assert [s for s, _ in await asyncio.gather(*running)] == [200, 200, 429]
        assert gate.sampled == {"alpha": 100}
        assert gate.reserved == {}
        assert (await call(gate, "/v1/completions", key="a", body={"max_tokens": 1}))[0] == 429

    asyncio.run(main())


def test_a_quota_lowers_max_tokens_to_what_is_left_on_every_route() -> None:
    async def main() -> None:
        inner = HonestApp()
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        route = {"model": "alpha", "adapter": None, "key_sha256": _sha("a"),
                 "max_sampled_tokens": 30}  # fmt: skip
        await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route})
        # max_tokens unset (vLLM would sample up to the context): what is left, n ways
        assert (await call(gate, "/v1/completions", key="a", body={"n": 4}))[0] == 200
        assert inner.bodies[-1]["max_tokens"] == 7  # 30 // 4
        # chat's max_completion_tokens; within what is left: unchanged
        chat = {"max_completion_tokens": 1, "max_tokens": None}
        assert (await call(gate, "/v1/chat/completions", key="a", body=chat))[0] == 200
        assert inner.bodies[-1]["max_completion_tokens"] == 1
        assert gate.sampled == {"alpha": 29}
        # 1 left, 2 samples asked for: refused, saying so
        status, body = await call(gate, "/v1/completions", key="a", body={"n": 2})
        assert status == 429
        assert body["error"]["message"].endswith("1 left, fewer than the 2 samples asked for")
        for bad in ({"n": 0}, {"n": "2"}, {"max_tokens": 0}, {"max_tokens": 2.5}):
            status, body = await call(gate, "/v1/completions", key="a", body=bad)
            assert status == 400, bad
        both = {"max_tokens": 1, "max_completion_tokens": 9}  # the larger is held and lowered
        assert (await call(gate, "/v1/chat/completions", key="a", body=both))[0] == 200
        got = inner.bodies[-1]
        assert (got["max_tokens"], got["max_completion_tokens"]) == (1, 1)
        assert gate.sampled == {"alpha": 30}
        assert len(inner.bodies) == 3  # the refused never reached the engine

    asyncio.run(main())


def test_a_request_that_ends_unanswered_gives_back_what_it_held() -> None:
    async def main() -> None:
        inner = HonestApp()
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        route = {"model": "alpha", "adapter": None, "key_sha256": _sha("a"),
                 "max_sampled_tokens": 10}  # fmt: skip
        await call(gate, CONTROL_PATH, token=TOKEN, body={"route": route})
        inner.fail = True
        with pytest.raises(ConnectionError):
            await call(gate, "/v1/completions", key="a", body={"max_tokens": 8})
        assert gate.reserved == {}
        assert gate.sampled.get("alpha", 0) == 0
        inner.fail = False
        assert (await call(gate, "/v1/completions", key="a", body={"max_tokens": 8}))[0] == 200
        assert gate.sampled == {"alpha": 8}

    asyncio.run(main())


class ConcurrencyApp:
    """Stands in for vLLM: records which requests run together (by their prompt)."""

    def __init__(self) -> None:
        self.running: set[int] = set()
        self.together: list[tuple[int, frozenset[int]]] = []  # (request, others running)
        self.release = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        doc = json.loads((await receive())["body"])
        me = doc["token_ids"][0]
        self.together.append((me, frozenset(self.running)))
        self.running.add(me)
        try:
            if me < 100:  # sampling requests run until released
                await self.release.wait()
            else:
                await asyncio.sleep(0.01)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
        finally:
            self.running.discard(me)


def test_gate_runs_prompt_logprobs_alone_where_lora_needs_it(monkeypatch: Any) -> None:
    # vLLM's CPU LoRA path fails when a prompt-logprobs request shares a batch with others
    monkeypatch.setenv("TREADLE_GATE_SCORE_ALONE", "1")
    score = {"sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}}

    async def main() -> None:
        inner = ConcurrencyApp()
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        sampling = [asyncio.create_task(call(gate, "/inference/v1/generate",
                                             body={"token_ids": [k]})) for k in (1, 2)]  # fmt: skip
        await asyncio.sleep(0.05)
        assert inner.running == {1, 2}
        scoring = asyncio.create_task(
            call(gate, "/inference/v1/generate", body={"token_ids": [101], **score})
        )
        await asyncio.sleep(0.05)
        later = asyncio.create_task(call(gate, "/inference/v1/generate", body={"token_ids": [3]}))
        # the service's own probe (token: it passes a closed gate) also runs alone
        probe = asyncio.create_task(
            call(gate, "/inference/v1/generate", token=TOKEN, body={"token_ids": [102], **score})
        )
        await asyncio.sleep(0.05)
        assert inner.running == {1, 2}  # the score waits for them; request 3 waits behind it
        inner.release.set()
        await asyncio.gather(*sampling, scoring, later, probe)
        seen = dict(inner.together)
        assert seen[101] == frozenset()
        assert seen[102] == frozenset()
        assert 101 not in seen[3]
        assert 102 not in seen[3]

    asyncio.run(main())


def test_gate_batches_prompt_logprobs_with_others_without_lora() -> None:
    async def main() -> None:
        inner = ConcurrencyApp()
        gate = AdmissionGate(inner, token=TOKEN)
        await call(gate, CONTROL_PATH, token=TOKEN, body={"open": True})
        first = asyncio.create_task(call(gate, "/inference/v1/generate", body={"token_ids": [1]}))
        await asyncio.sleep(0.05)
        await call(gate, "/inference/v1/generate",
                   body={"token_ids": [101], "sampling_params": {"prompt_logprobs": 0}})  # fmt: skip
        inner.release.set()
        await first
        assert dict(inner.together)[101] == frozenset({1})  # vLLM batches them as usual

    asyncio.run(main())
