"""The model as one rollout sees it: every chat turn recorded, token-exact.

A harness (in process, or a program behind the interception server) calls
``ModelSession.chat(messages, tools)``. With the token backend the session

    first call      renders ``messages`` with treadle_native (one node per message)
    later calls     checks that ``messages`` extend the conversation it returned last
                    and appends only the new messages with ``Renderer.bridge`` — the
                    sampled ids stay exactly as inference returned them
    every call      generates from token ids (inference's token route), parses content,
                    reasoning and tool calls, and appends an assistant node holding the
                    generation prompt + sampled ids, mask, logprobs and policy versions

A conversation that does not extend the last one (the harness rewrote history), or one
the template cannot extend append-only, starts a new branch (a new root): each
root->leaf branch is one training sample. With ``privileged`` context (self-distillation)
each new branch's prompt is rendered a second time with it (``with_privileged``) and
recorded as the branch's ``PrivilegedPrompt``: a teacher scores those ids followed by the
branch's own tokens, so the sampled tokens are never re-tokenized. With the OpenAI
backend (``treadle eval`` against any OpenAI-compatible endpoint) the same nodes are
recorded without token ids.

Limits (turns, total tokens, the model's context length, wall time) raise ``Truncated``;
a call samples at most the rollout's per-call ``max_tokens`` whatever the harness asks
for. Inference or template failures raise ``TurnError`` with the rollout's error kind.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

import treadle_native
from treadle.env_runner.rubric import RolloutState
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_token_array
from treadle.services.errors import TreadleError
from treadle.services.inference_client import InferenceRequestError
from treadle.services.telemetry import absorbing_calls, tracer

log = logging.getLogger(__name__)

Status = rollout_pb2.RolloutStatus
Role = rollout_pb2.Role
ROLES = {
    "system": Role.ROLE_SYSTEM,
    "developer": Role.ROLE_SYSTEM,
    "user": Role.ROLE_USER,
    "assistant": Role.ROLE_ASSISTANT,
    "tool": Role.ROLE_TOOL,
}
CALL_STATUS = {
    "ok": rollout_pb2.ToolCall.Status.STATUS_OK,
    "malformed": rollout_pb2.ToolCall.Status.STATUS_MALFORMED,
    "unknown_tool": rollout_pb2.ToolCall.Status.STATUS_UNKNOWN_TOOL,
    "invalid_arguments": rollout_pb2.ToolCall.Status.STATUS_INVALID_ARGUMENTS,
}


class Truncated(Exception):
    """A limit ended the rollout; it is still scored and trainable."""

    def __init__(self, truncation: int, message: str):
        super().__init__(message)
        self.truncation = truncation


class TurnError(Exception):
    """A model call failed; ``error_kind`` is the rollout's RolloutStatus.ErrorKind."""

    def __init__(self, error_kind: int, message: str):
        super().__init__(message)
        self.error_kind = error_kind


def with_privileged(messages: Sequence[dict[str, Any]], context: str) -> list[dict[str, Any]]:
    """``messages`` with ``context`` added as a last paragraph of the first user message
    (content given as a list of parts gets a text part); ValueError without a user message."""
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = [*content, {"type": "text", "text": context}]
        else:
            text = "" if content is None else str(content)
            m["content"] = f"{text}\n\n{context}" if text else context
        return out
    raise ValueError("the conversation has no user message to add the privileged context to")


# how vLLM words a prompt longer than the model's context (HTTP 400)
CONTEXT_EXCEEDED = re.compile(r"maximum (?:model|context) length", re.I)


@dataclass
class Limits:
    max_turns: int = 0
    """Model calls per rollout (0 = no limit)."""
    max_total_tokens: int = 0
    """Tokens of a branch, prompt + every turn (0 = no limit)."""
    deadline: float = 0.0
    """time.monotonic() after which no new model call starts (0 = none)."""
    max_tokens: int = 256
    """Sampled tokens per call when the rollout's sampling settings set none."""
    max_model_len: int = 0
    """The served model's context length, prompt + completion, in tokens (0 = unknown)."""


@dataclass
class CallRecord:
    id: str
    name: str
    arguments: str
    status: str  # ok | malformed | unknown_tool
    raw_text: str = ""


@dataclass
class Turn:
    """One model call's result."""

    content: str
    reasoning: str
    tool_calls: list[CallRecord]
    finish_reason: str  # stop | length
    node_id: int
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    stop_sequence: str = ""
    """The caller's stop sequence that ended the turn, when one did (``finish_reason``
    "stop"; the content ends before it, the recorded ids end with the token completing it)."""

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message as a harness appends it to its conversation (well-formed
        tool calls only; malformed ones are in ``tool_calls`` with their raw text)."""
        content = self.content
        for c in self.tool_calls:  # keep what the model wrote visible when it is re-rendered
            if c.status == "malformed" and c.raw_text and c.raw_text not in content:
                content = f"{content}\n{c.raw_text}" if content else c.raw_text
        m: dict[str, Any] = {"role": "assistant", "content": content}
        calls = [c for c in self.tool_calls if c.status != "malformed"]
        if calls:
            m["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        return m


class Generator(Protocol):
    async def generate(self, prompt_ids: Any, *, max_tokens: int, temperature: float,
                       top_p: float, top_k: int, seed: int | None) -> Any: ...  # fmt: skip


def _norm(messages: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What must match for a conversation to extend another (content, calls, ids)."""
    out = []
    for m in messages:
        calls = []
        for c in m.get("tool_calls") or []:
            f = c.get("function", c)
            args = f.get("arguments", "")
            try:
                args = json.dumps(
                    json.loads(args) if isinstance(args, str) else args, sort_keys=True
                )
            except (json.JSONDecodeError, TypeError):
                pass
            calls.append((f.get("name"), args))
        out.append(
            (m.get("role"), str(m.get("content") or ""), tuple(calls), m.get("tool_call_id") or "")
        )
    return out


def _arr(a: np.ndarray) -> Any:
    return to_token_array(np.ascontiguousarray(a))


@dataclass
class ModelSession:
    """One rollout's model (see the module doc)."""

    rollout: rollout_pb2.Rollout
    sampling: rollout_pb2.SamplingParams
    limits: Limits
    state: RolloutState
    renderer: treadle_native.Renderer | None = None
    generator: Generator | None = None
    openai: Any = None
    """An OpenAIChat (eval against any endpoint) instead of renderer + generator."""
    attempts: int = 3
    enable_thinking: bool | None = None
    privileged: str | None = None
    """Self-distillation context (module doc); None: no privileged prompts recorded."""
    num_turns: int = 0
    _branch_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    _branch_messages: list[tuple[Any, ...]] = field(default_factory=list)
    _branch_tools: str = ""
    _leaf: int = -1
    _last_key: str = ""
    _last_turn: Turn | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    # -- public ---------------------------------------------------------------------------
    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        stop: Sequence[str] | None = None,
    ) -> Turn:
        """Generate the next assistant turn after ``messages`` and record it. ``stop``:
        strings that end the turn where its content first holds one (token backend: the
        sample is cut after the token completing it; OpenAI backend: sent along)."""
        messages = [dict(m) for m in messages]
        stop = [s for s in stop or () if s]
        request: list[Any] = [messages, tools or [], max_tokens, temperature]
        if stop:
            request.append(stop)
        key = hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()
        async with self._lock:
            if key == self._last_key and self._last_turn is not None:
                return self._last_turn  # a client retry: same request, same answer, no new call
            self._check_limits()
            with (
                tracer(__name__).start_as_current_span(
                    "model_call", attributes={"treadle.turn": self.num_turns}
                ) as span,
                absorbing_calls(span),  # the inference call records itself on model_call
            ):
                if self.openai is not None:
                    turn = await self._chat_openai(messages, tools, max_tokens, temperature, stop)
                else:
                    turn = await self._chat_tokens(messages, tools, max_tokens, temperature, stop)
            self.num_turns += 1
            self.state.num_turns = self.num_turns
            self.state.messages = [*messages, turn.message]
            self.state.tools = list(tools or [])
            self._last_key, self._last_turn = key, turn
            return turn

    def record_messages(self, messages: Sequence[dict[str, Any]]) -> None:
        """Record messages that follow the last turn but were never sent to the model (e.g.
        the last tool results), as content-only nodes, so the graph shows the whole episode."""
        for m in messages:
            self._node(m, np.zeros(0, np.int32), parent=self._leaf)

    # -- limits -----------------------------------------------------------------------------
    def _check_limits(self) -> None:
        lim = self.limits
        if lim.max_turns and self.num_turns >= lim.max_turns:
            raise Truncated(
                Status.Truncation.TRUNCATION_MAX_TURNS, f"turn limit {lim.max_turns} reached"
            )
        if lim.deadline and time.monotonic() >= lim.deadline:
            raise Truncated(
                Status.Truncation.TRUNCATION_TIMEOUT, "the rollout's time budget ran out"
            )

    def _max_tokens(self, requested: int | None) -> int:
        """Tokens one call may sample: what the harness asked for (a program behind the
        interception server may ask for any number), never more than the rollout's
        per-call budget (sampling.max_tokens, else ``limits.max_tokens``)."""
        budget = self.sampling.max_tokens or self.limits.max_tokens
        return min(requested, budget) if requested else budget

    # -- nodes ------------------------------------------------------------------------------
    def _node(
        self, message: dict[str, Any], ids: np.ndarray, parent: int
    ) -> rollout_pb2.MessageNode:
        node = self.rollout.nodes.add(
            node_id=len(self.rollout.nodes),
            parent_id=parent,
            role=ROLES.get(str(message.get("role")), Role.ROLE_UNSPECIFIED),
            content=str(message.get("content") or ""),
            tool_call_id=str(message.get("tool_call_id") or ""),
            name=str(message.get("name") or ""),
        )
        n = len(ids)
        node.token_ids.CopyFrom(_arr(np.asarray(ids, np.int32)))
        node.sampled_mask.CopyFrom(_arr(np.zeros(n, np.uint8)))
        node.logprobs.CopyFrom(_arr(np.zeros(n, np.float32)))
        node.policy_versions.CopyFrom(_arr(np.full(n, -1, np.int32)))
        for c in message.get("tool_calls") or []:
            f = c.get("function", c)
            args = f.get("arguments", "")
            node.tool_calls.add(
                id=str(c.get("id") or ""), name=str(f.get("name") or ""),
                arguments_json=args if isinstance(args, str) else json.dumps(args),
                status=rollout_pb2.ToolCall.Status.STATUS_OK,
            )  # fmt: skip
        self._leaf = node.node_id
        return node

    def _message_nodes(
        self, messages: Sequence[dict[str, Any]], ids: np.ndarray, index: np.ndarray, parent: int
    ) -> np.ndarray:
        """One node per message (template scaffold outside messages joins the node before
        it; scaffold before the first joins the first); returns the ids after the last
        message (the generation prompt)."""
        owned = np.nonzero(index >= 0)[0]
        if not len(owned):
            return np.asarray(ids, np.int32)
        last = int(owned[-1])
        seg_msg: list[int] = []
        seg_start: list[int] = []
        for i in range(last + 1):
            m = int(index[i])
            if m >= 0 and (not seg_msg or seg_msg[-1] != m):
                seg_msg.append(m)
                seg_start.append(i if seg_start else 0)
        seg_end = [*seg_start[1:], last + 1]
        self._leaf = parent
        for m, s, e in zip(seg_msg, seg_start, seg_end, strict=True):
            self._node(messages[m], ids[s:e], parent=self._leaf)
        return np.ascontiguousarray(ids[last + 1 :], dtype=np.int32)

    # -- token backend ------------------------------------------------------------------------
    async def _chat_tokens(
        self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        max_tokens: int | None, temperature: float | None, stop: Sequence[str] = (),
    ) -> Turn:  # fmt: skip
        assert self.renderer is not None
        assert self.generator is not None
        tools_key = json.dumps(tools or [], sort_keys=True)
        norm = _norm(messages)
        n_prev = len(self._branch_messages)
        extends = (
            n_prev > 0
            and tools_key == self._branch_tools
            and len(norm) > n_prev
            and norm[:n_prev] == self._branch_messages
        )
        gen_prompt: np.ndarray | None = None
        if extends:
            new = messages[n_prev:]
            try:
                # prev_messages/tools: the generic renderer proves the bridge by rendering
                # the harness's conversation (family ports read the ids alone)
                b = self.renderer.bridge(
                    self._branch_ids, new, True, prev_messages=messages[:n_prev],
                    tools=list(tools) if tools else None, enable_thinking=self.enable_thinking,
                )  # fmt: skip
            except treadle_native.TreadleNativeError as e:
                raise TurnError(
                    Status.ErrorKind.ERROR_KIND_TEMPLATE, f"cannot render the new messages: {e}"
                ) from None
            if b.ok:
                gen_prompt = self._message_nodes(new, b.appended_ids, b.message_index, self._leaf)
                prompt_ids = np.concatenate([self._branch_ids, b.appended_ids]).astype(np.int32)
            else:
                log.debug("conversation cannot extend append-only (%s): new branch", b.reason)
        if gen_prompt is None:
            try:
                r = self.renderer.render(messages, tools=list(tools) if tools else None,
                                         add_generation_prompt=True, enable_thinking=self.enable_thinking)  # fmt: skip
            except treadle_native.TreadleNativeError as e:
                raise TurnError(
                    Status.ErrorKind.ERROR_KIND_TEMPLATE, f"cannot render the prompt: {e}"
                ) from None
            self.rollout.metrics["num_branches"] = self.rollout.metrics["num_branches"] + 1
            root = len(self.rollout.nodes)
            gen_prompt = self._message_nodes(messages, r.token_ids, r.message_index, -1)
            prompt_ids = np.asarray(r.token_ids, np.int32)
            if self.privileged is not None:
                self._privileged_prompt(root, messages, tools, len(prompt_ids))
        s = self.sampling
        budget = self._max_tokens(max_tokens)
        lim = self.limits
        for cap, what in ((lim.max_total_tokens, "limit"), (lim.max_model_len, "context length")):
            if cap:
                room = cap - len(prompt_ids)
                if room <= 0:
                    raise Truncated(
                        Status.Truncation.TRUNCATION_MAX_TOTAL_TOKENS,
                        f"the conversation reached {len(prompt_ids)} tokens ({what} {cap})",
                    )
                budget = min(budget, room)
        gen = await self._generate(
            prompt_ids, budget, s.temperature if temperature is None else temperature
        )
        sampled = np.ascontiguousarray(gen.token_ids, dtype=np.int32)
        logprobs = np.asarray(gen.logprobs, np.float32)
        versions = np.asarray(gen.policy_versions, np.int32)
        n_kept, stop_sequence = self._stop_at(sampled, stop) if stop else (len(sampled), "")
        sampled, logprobs, versions = sampled[:n_kept], logprobs[:n_kept], versions[:n_kept]
        k = len(gen_prompt)
        node = self._node(
            {"role": "assistant"}, np.concatenate([gen_prompt, sampled]), parent=self._leaf
        )
        node.sampled_mask.CopyFrom(
            _arr(np.concatenate([np.zeros(k, np.uint8), np.ones(len(sampled), np.uint8)]))
        )
        node.logprobs.CopyFrom(_arr(np.concatenate([np.zeros(k, np.float32), logprobs])))
        node.policy_versions.CopyFrom(_arr(np.concatenate([np.full(k, -1, np.int32), versions])))
        if versions.size:
            lo, hi = int(versions.min()), int(versions.max())
            ro = self.rollout
            ro.min_policy_version = (
                lo if ro.min_policy_version < 0 else min(ro.min_policy_version, lo)
            )
            ro.max_policy_version = max(ro.max_policy_version, hi)
        try:
            parsed = self.renderer.parse(sampled)
        except treadle_native.TreadleNativeError as e:
            raise TurnError(
                Status.ErrorKind.ERROR_KIND_MODEL_OUTPUT, f"cannot parse the completion: {e}"
            ) from None
        names = {t.get("function", t).get("name") for t in tools or []}
        calls = []
        for i, c in enumerate(parsed.tool_calls):
            status = (
                c.status if c.status != "ok" or not tools or c.name in names else "unknown_tool"
            )
            calls.append(
                CallRecord(f"call_{node.node_id}_{i}", c.name, c.arguments, status, c.raw_text)
            )
        content = parsed.content
        if stop_sequence:
            content = content[: content.find(stop_sequence)]
        turn = Turn(
            content, parsed.reasoning or "", calls,
            "stop" if parsed.stopped or stop_sequence else "length",
            node.node_id, len(prompt_ids), len(sampled), stop_sequence,
        )  # fmt: skip
        self._fill_assistant(node, turn)
        self._branch_ids = np.concatenate([prompt_ids, sampled]).astype(np.int32)
        self._branch_messages = [*norm, _norm([turn.message])[0]]
        self._branch_tools = tools_key
        self.rollout.metrics["completion_tokens"] = self.rollout.metrics["completion_tokens"] + len(
            sampled
        )
        return turn

    def _privileged_prompt(
        self, root: int, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        num_replaced: int,
    ) -> None:  # fmt: skip
        """Record the branch rooted at ``root`` rendered with the privileged context. A
        conversation it cannot be added to records nothing (the teacher then refuses the
        group, naming why)."""
        assert self.renderer is not None
        assert self.privileged is not None
        try:
            r = self.renderer.render(
                with_privileged(messages, self.privileged), tools=list(tools) if tools else None,
                add_generation_prompt=True, enable_thinking=self.enable_thinking,
            )  # fmt: skip
        except (ValueError, treadle_native.TreadleNativeError) as e:
            log.warning("rollout %s: no privileged prompt for the branch at node %d: %s",
                        self.rollout.rollout_id, root, e)  # fmt: skip
            self.rollout.metrics["privileged_prompt_errors"] += 1
            return
        self.rollout.privileged_prompts.add(
            root_node_id=root, num_replaced=num_replaced,
            token_ids=_arr(np.asarray(r.token_ids, np.int32)),
        )  # fmt: skip

    def _stop_at(self, sampled: np.ndarray, stop: Sequence[str]) -> tuple[int, str]:
        """(how many sampled ids to keep, the stop sequence met): the shortest prefix whose
        parsed content holds one of ``stop`` (binary search: a longer prefix's content
        holds what a shorter one's does); (all of them, "") when none is met."""
        assert self.renderer is not None
        renderer = self.renderer

        def met(n: int) -> str:
            try:
                content = renderer.parse(sampled[:n]).content
            except treadle_native.TreadleNativeError:
                return ""
            hits = [(content.find(s), s) for s in stop if s in content]
            return min(hits)[1] if hits else ""

        if not met(len(sampled)):
            return len(sampled), ""
        lo, hi = 1, len(sampled)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if met(mid) else (mid + 1, hi)
        return lo, met(lo)

    async def _generate(self, prompt_ids: np.ndarray, max_tokens: int, temperature: float) -> Any:
        assert self.generator is not None
        s = self.sampling
        last_error = ""
        t0 = time.monotonic()
        try:
            for attempt in range(self.attempts):
                try:
                    result = await self.generator.generate(
                        prompt_ids, max_tokens=max_tokens, temperature=temperature,
                        top_p=s.top_p or 1.0, top_k=s.top_k, seed=s.seed if s.HasField("seed") else None,
                    )  # fmt: skip
                    self.rollout.timing.prompt_tokens += len(prompt_ids)  # the usage ledger's
                    self.rollout.timing.sampled_tokens += len(result.token_ids)
                    return result
                except InferenceRequestError as e:
                    if not 400 <= e.status_code < 500 or e.status_code in (408, 429):
                        last_error = str(e)
                        log.warning("generate for %s failed (attempt %d/%d): %s",
                                    self.rollout.rollout_id, attempt + 1, self.attempts, e)  # fmt: skip
                        if attempt + 1 < self.attempts:
                            await asyncio.sleep(min(2.0**attempt, 10.0))
                        continue
                    # refused: asking again changes nothing
                    if CONTEXT_EXCEEDED.search(str(e)):  # the conversation outgrew the model
                        raise Truncated(
                            Status.Truncation.TRUNCATION_MAX_TOTAL_TOKENS,
                            f"the conversation ({len(prompt_ids)} tokens) no longer fits the "
                            f"model's context: {e}",
                        ) from None
                    raise TurnError(
                        Status.ErrorKind.ERROR_KIND_INFERENCE, f"inference refused the call: {e}"
                    ) from None
                except TreadleError as e:
                    last_error = str(e)
                    log.warning("generate for %s failed (attempt %d/%d): %s",
                                self.rollout.rollout_id, attempt + 1, self.attempts, e)  # fmt: skip
                    if attempt + 1 < self.attempts:
                        await asyncio.sleep(min(2.0**attempt, 10.0))
            raise TurnError(
                Status.ErrorKind.ERROR_KIND_INFERENCE,
                f"inference failed {self.attempts} times: {last_error}",
            )
        finally:
            self.rollout.timing.generation_s += time.monotonic() - t0
            self.rollout.timing.num_model_calls += 1

    def _fill_assistant(self, node: rollout_pb2.MessageNode, turn: Turn) -> None:
        node.content = turn.content
        node.reasoning_content = turn.reasoning
        node.finish_reason = (
            rollout_pb2.FinishReason.FINISH_REASON_STOP
            if turn.finish_reason == "stop"
            else rollout_pb2.FinishReason.FINISH_REASON_LENGTH
        )
        for c in turn.tool_calls:
            node.tool_calls.add(id=c.id, name=c.name, arguments_json=c.arguments,
                                status=CALL_STATUS[c.status], raw_text=c.raw_text)  # fmt: skip

    # -- OpenAI backend ------------------------------------------------------------------------
    async def _chat_openai(
        self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        max_tokens: int | None, temperature: float | None, stop: Sequence[str] = (),
    ) -> Turn:  # fmt: skip
        norm = _norm(messages)
        n_prev = len(self._branch_messages)
        if n_prev and len(norm) > n_prev and norm[:n_prev] == self._branch_messages:
            for m in messages[n_prev:]:
                self._node(m, np.zeros(0, np.int32), parent=self._leaf)
        else:
            self._leaf = -1
            for m in messages:
                self._node(m, np.zeros(0, np.int32), parent=self._leaf)
        s = self.sampling
        t0 = time.monotonic()
        try:
            reply = await self.openai.chat(
                messages, tools=list(tools) if tools else None,
                max_tokens=self._max_tokens(max_tokens),
                temperature=s.temperature if temperature is None else temperature,
                top_p=s.top_p or 1.0, seed=s.seed if s.HasField("seed") else None,
                **({"stop": list(stop)} if stop else {}),
            )  # fmt: skip
        except TreadleError as e:
            raise TurnError(Status.ErrorKind.ERROR_KIND_INFERENCE, str(e)) from None
        finally:
            self.rollout.timing.generation_s += time.monotonic() - t0
            self.rollout.timing.num_model_calls += 1
        names = {t.get("function", t).get("name") for t in tools or []}
        calls = []
        for i, c in enumerate(reply.get("tool_calls") or []):
            f = c.get("function", {})
            args = f.get("arguments") or "{}"
            try:
                ok = isinstance(json.loads(args), dict)
            except json.JSONDecodeError:
                ok = False
            status = (
                "malformed"
                if not ok
                else ("unknown_tool" if tools and f.get("name") not in names else "ok")
            )
            calls.append(
                CallRecord(
                    str(c.get("id") or f"call_{i}"),
                    str(f.get("name") or ""),
                    args,
                    status,
                    args if not ok else "",
                )
            )
        node = self._node({"role": "assistant"}, np.zeros(0, np.int32), parent=self._leaf)
        turn = Turn(str(reply.get("content") or ""), str(reply.get("reasoning_content") or ""), calls,
                    "length" if reply.get("finish_reason") == "length" else "stop", node.node_id,
                    int(reply.get("prompt_tokens") or 0), int(reply.get("completion_tokens") or 0))  # fmt: skip
        self._fill_assistant(node, turn)
        self.rollout.timing.prompt_tokens += turn.num_prompt_tokens  # the usage ledger's
        self.rollout.timing.sampled_tokens += turn.num_completion_tokens
        self._branch_messages = [*norm, _norm([turn.message])[0]]
        self.rollout.metrics["completion_tokens"] = (
            self.rollout.metrics["completion_tokens"] + turn.num_completion_tokens
        )
        return turn


def split_think(content: str) -> tuple[str, str] | None:
    """(reasoning, answer) of a message whose content holds a think block -- a server
    without a reasoning parser returns it as text: ``<think>R</think>A``, or ``R</think>A``
    where the chat template opened the block in the prompt. None when there is none."""
    head, sep, tail = content.partition("</think>")
    if not sep:
        return None
    stripped = head.lstrip()
    if stripped.startswith("<think>"):
        head = stripped[len("<think>") :]
    elif "<think>" in head:
        return None  # a block that does not open the answer: text, not reasoning
    return head.strip("\n"), tail.lstrip("\n")


class OpenAIChat:
    """Client of any OpenAI-compatible /chat/completions endpoint (eval of external models).
    A think block the server left in the content (no reasoning parser) is split off as
    reasoning, with a warning (``split_think``)."""

    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 300.0
    ):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers)
        self._warned_think = False

    async def aclose(self) -> None:
        await self._client.aclose()

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                   max_tokens: int, temperature: float, top_p: float, seed: int | None,
                   stop: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
        import httpx

        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p,
        }  # fmt: skip
        if tools:
            body["tools"] = tools
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = stop
        try:
            resp = await self._client.post(f"{self.base_url}/chat/completions", json=body)
        except httpx.HTTPError as e:
            raise TreadleError(f"{self.base_url} unreachable: {e}") from None
        if resp.status_code != 200:
            raise TreadleError(
                f"{self.base_url} answered HTTP {resp.status_code}: {resp.text[:300]}"
            )
        try:
            doc = resp.json()
            choice = doc["choices"][0]
            msg = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise TreadleError(f"{self.base_url}: not a chat completion ({e})") from None
        usage = doc.get("usage") or {}
        content, reasoning = (
            msg.get("content"),
            msg.get("reasoning_content") or msg.get("reasoning"),
        )
        if reasoning is None and isinstance(content, str):
            split = split_think(content)
            if split is not None:
                reasoning, content = split
                if not self._warned_think:
                    self._warned_think = True
                    log.warning(
                        "%s answered with its reasoning inside the message content "
                        "(<think>...</think>): split off as reasoning, so that rewards see the "
                        "answer; serve the model with a reasoning parser (vLLM: "
                        "--reasoning-parser) to have the server do it", self.base_url,
                    )  # fmt: skip
        return {
            "content": content,
            "reasoning_content": reasoning,
            "tool_calls": msg.get("tool_calls"),
            "finish_reason": choice.get("finish_reason"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
        }
