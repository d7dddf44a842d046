"""One inference request for a group's identical first calls (vLLM's parallel sampling).

The ``group_size`` rollouts of one task usually open with the same prompt: same task,
same rendering. Sent one by one, each is a request of its own -- parsed, scheduled,
answered and decoded apart -- which on a small model costs more than sampling its few
tokens. ``SiblingCalls`` gathers the first model call of each rollout of a group that
this runner holds, and sends the calls with equal prompts and sampling settings as one
request with ``n`` = their number::

    rollout g-000 ─ first call ─┐
    rollout g-001 ─ first call ─┼─▶ one generate, n = 3 ─▶ choice k to the k-th caller
    rollout g-002 ─ first call ─┘

A batch is sent when every rollout of the group has made its first call here, or
``window_s`` after its first caller arrived (siblings on other runners, or still
queued behind this runner's concurrency, are not waited for longer). Each completion is
still one rollout's own: its own tokens, logprobs and per-token policy versions, from
the same prompt and settings it asked for, so nothing a rollout records changes except
its share of the cost. Later calls (the turns after the first, whose prompts hold each
rollout's own samples) and calls with a fixed seed (n samples under one seed are not
the samples of n requests with that seed) go out alone at once. A batch that fails
fails each caller's call; each then retries on its own. The model-call span of every
caller records the request's ``gen_ai.request.choice.count``; that of a rollout that
shared another's request also ``treadle.generate.request_of`` (that rollout's id) and a
link to that rollout's model-call span, whose trace holds vLLM's span of the request.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from opentelemetry import trace

from treadle.proto.v1 import rollout_pb2
from treadle.services import telemetry


@dataclass
class _Batch:
    key: tuple[Any, ...]
    prompt_ids: Any
    kwargs: dict[str, Any]
    context: contextvars.Context
    members: list[_Sibling] = field(default_factory=list)
    future: asyncio.Future[list[Any]] | None = None
    timer: asyncio.TimerHandle | None = None


@dataclass
class _Group:
    group_id: str
    size: int
    bound: int = 0  # rollouts of the group running here now
    sent: int = 0  # first calls already sent (alone or in a batch)
    batches: dict[tuple[Any, ...], _Batch] = field(default_factory=dict)

    @property
    def waiting(self) -> int:
        return sum(len(b.members) for b in self.batches.values())


class SiblingCalls:
    """Gathers the first calls of each group's rollouts (module doc)."""

    def __init__(self, window_s: float):
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.window_s = window_s
        self._groups: dict[str, _Group] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def bind(self, req: rollout_pb2.RolloutRequested, generator: Any) -> Any:
        """The generator of rollout ``req``: ``generator`` itself when nothing can be shared
        (a group of one, a fixed seed, a generator without ``generate_n``, window 0)."""
        if (self.window_s <= 0 or req.group_size < 2 or req.sampling.HasField("seed")
                or not hasattr(generator, "generate_n")):  # fmt: skip
            return generator
        group = self._groups.setdefault(req.group_id, _Group(req.group_id, req.group_size))
        group.bound += 1
        return _Sibling(self, group, req.rollout_id, generator)

    def release(self, sibling: Any) -> None:
        """Rollout done: forget its group once none of the group's rollouts runs here."""
        if not isinstance(sibling, _Sibling) or sibling.released:
            return
        sibling.released = True
        group = sibling.group
        group.bound -= 1
        if sibling.first:  # it ended before its first call: nobody waits for it
            sibling.first = False
            group.sent += 1
            self._send_if_complete(group)
        self._forget_if_done(group)

    def _forget_if_done(self, group: _Group) -> None:
        if group.bound <= 0 and not group.batches and self._groups.get(group.group_id) is group:
            del self._groups[group.group_id]

    def _join(self, sibling: _Sibling, prompt_ids: Any, kwargs: dict[str, Any]) -> _Batch:
        group = sibling.group
        key = (np.asarray(prompt_ids, dtype=np.int64).tobytes(),
               tuple(sorted((k, _frozen(v)) for k, v in kwargs.items())))  # fmt: skip
        batch = group.batches.get(key)
        if batch is None:
            batch = _Batch(key, prompt_ids, dict(kwargs), contextvars.copy_context())
            batch.future = asyncio.get_running_loop().create_future()
            # read by its callers; one that no caller waits for any more is not an error
            batch.future.add_done_callback(lambda f: f.cancelled() or f.exception())
            group.batches[key] = batch
            if self.window_s > 0:
                batch.timer = asyncio.get_running_loop().call_later(
                    self.window_s, self._send, group, batch
                )
        batch.members.append(sibling)
        self._send_if_complete(group)
        return batch

    def _send_if_complete(self, group: _Group) -> None:
        if group.sent + group.waiting >= group.size:  # every sibling is here: no more wait
            for b in list(group.batches.values()):
                self._send(group, b)

    def _send(self, group: _Group, batch: _Batch) -> None:
        if group.batches.get(batch.key) is not batch:
            return  # sent already
        del group.batches[batch.key]
        if batch.timer is not None:
            batch.timer.cancel()
        group.sent += len(batch.members)
        self._forget_if_done(group)  # its callers all gave up (cancelled) before it was sent
        task = asyncio.get_running_loop().create_task(self._run(batch), context=batch.context)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: _Batch) -> None:
        assert batch.future is not None
        leader = batch.members[0]
        n = len(batch.members)
        try:
            if n == 1:
                results = [await leader.inner.generate(batch.prompt_ids, **batch.kwargs)]
            else:
                results = await leader.inner.generate_n(batch.prompt_ids, n, **batch.kwargs)
        except asyncio.CancelledError:  # the runner stops
            batch.future.cancel()
            raise
        except Exception as e:  # each caller's own retry loop decides
            if not batch.future.done():
                batch.future.set_exception(e)
            return
        for member in batch.members[1:]:
            if (pin_like := getattr(member.inner, "pin_like", None)) is not None:
                pin_like(leader.inner)  # its later turns go where its prompt is cached
        if not batch.future.done():
            batch.future.set_result(results)


class _Sibling:
    """One rollout's generator: its first call may share a request (module doc)."""

    def __init__(self, calls: SiblingCalls, group: _Group, rollout_id: str, inner: Any):
        self.calls, self.group = calls, group
        self.rollout_id = rollout_id
        self.inner = inner
        self.first = True
        self.released = False

    async def generate(self, prompt_ids: Any, **kwargs: Any) -> Any:
        if not self.first:
            return await self.inner.generate(prompt_ids, **kwargs)
        self.first = False
        batch = self.calls._join(self, prompt_ids, kwargs)
        index = len(batch.members) - 1
        assert batch.future is not None
        results = await asyncio.shield(batch.future)
        if len(results) > 1 and (span := telemetry.absorbing_span()) is not None:
            span.set_attributes({
                "gen_ai.request.choice.count": len(results),
                "gen_ai.usage.prompt_tokens": len(batch.prompt_ids),
                "gen_ai.usage.completion_tokens": results[index].num_tokens,
            })  # fmt: skip
            if index:  # the request's vLLM span is in the first caller's trace: link it
                span.set_attribute("treadle.generate.request_of", batch.members[0].rollout_id)
                leader = batch.context.run(trace.get_current_span).get_span_context()
                if leader.is_valid:
                    span.add_link(leader, {"treadle.link": "shared generate request"})
        return results[index]


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.tobytes())
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value
