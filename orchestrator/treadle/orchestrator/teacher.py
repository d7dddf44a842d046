"""On-policy distillation's teacher: another inference deployment that scores the tokens
the student sampled, as the ``teacher_logprobs`` signal of a group.

    Group (each sample's token ids as sampled: prompt, completion, every turn) ──▶ Teacher
      calls: the group's samples cut into calls of at most ``max_sequences_per_call``
             sequences / ``max_tokens_per_call`` tokens; up to ``max_calls_in_flight`` at once
      call:  span ``teacher_call`` (in the batch's trace) ──▶ one prompt-logprobs request
             per sequence, sent together (vLLM batches them in its engine):
             POST <url>/inference/v1/generate {token_ids, prompt_logprobs: 0, max_tokens: 1}
             ◀── log p_teacher(token_i | tokens_<i) for every position i >= 1
    ─▶ teacher_logprobs: one [num_tokens] float32 array per sample, 0 off the loss mask

The teacher sees exactly the student's token ids (nothing is decoded or re-tokenized), so
teacher and student must share one tokenizer and vocabulary. ``check_tokenizer`` proves
it before the run starts, against the student's own inference server: the same token ids
for probe texts (``/tokenize``), the same text for token ids spread over the student's
vocabulary (``/detokenize``), and a teacher vocabulary that holds every id the student
can sample (the id ``orchestrator.vocab_size - 1`` taken; a larger teacher vocabulary is
fine: models of one family often pad their embeddings differently). A mismatch is a
``ConfigError`` naming both sides.
A teacher with another tokenizer is not supported (it would need the student's text
re-tokenized and the logprobs re-aligned, which is not token-exact); with
``check_tokenizer = false`` the run trusts the setting and says so at startup.

Self-distillation (``self_distill``): the teacher is the policy itself, served by the
student's inference unless ``urls`` are given, with privileged context (a hint, the
answer) it sees in its prompt. The env runner renders each branch's prompt a second time
with the context (``Rollout.privileged_prompts``, ``Sample.privileged_ids``) and the
teacher scores those ids followed by the branch's own ids after the prompt they replace:
the student's sampled ids, tool results and later turns exactly as they were, so each
teacher logprob is of the very token the student sampled (``view_of``, ``aligned``). A
group none of whose samples has a privileged prompt (an environment without
``privileged``) stops the run (``NoPrivilegedContext``), naming the environment; a
sample without one beside others refuses its group.

Failures: each call has a deadline (``timeout_s``); a call that fails because the server
was unreachable, slow or answered against the contract is retried (up to
``max_retries`` times, on the next endpoint when there are several); a request the
server refuses (HTTP 4xx: e.g. a sequence longer than the teacher's context) is not.
A group whose teacher logprobs cannot be had raises ``AlgorithmError``: the group is
refused (logged, counted: ``num_teacher_errors``, ``num_groups_refused_by_algorithm``),
none of it trained -- it is never trained without the signal.

Metrics per step (``take_metrics``): ``teacher_kl_mean``, the mean over the loss tokens of
the step's groups of ``student_logprob - teacher_logprob`` (the per-token reverse-KL
estimate, KL(student || teacher)); ``teacher_num_tokens``; and of the calls made since the
last step (groups are scored ahead of their batch, ``Algorithms.prefetch``):
``teacher_call_s_mean``, ``num_teacher_calls``, ``num_teacher_errors``.

Top-k (``topk``, the ``teacher_topk`` signal): the same calls ask for ``prompt_logprobs =
top_k``; the teacher's ``top_k`` most likely tokens and their logprobs at each position
come back with the sampled token's, aligned the same way (``TopK``: [num_tokens, k] each,
rows 0 off the loss mask). Before the run starts ``check_top_k`` asks each endpoint once:
a server whose ``--max-logprobs`` is below ``top_k`` stops the run with an error naming
the setting.

Not here: the advantage (``algorithms.py``: ``distill``, ``grpo+distill``,
``distill-topk``) and the top-k term (``trainer/losses.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from opentelemetry import trace

from treadle.orchestrator.algorithms import AlgorithmError, Group, TopK
from treadle.orchestrator.samples import Sample
from treadle.services import telemetry
from treadle.services.errors import ConfigError, DecodeError, TreadleError
from treadle.services.inference_client import (
    InferenceClient,
    InferenceRequestError,
    InferenceUnavailableError,
    PromptTopK,
)

if TYPE_CHECKING:
    from treadle.orchestrator.spec import TeacherSection

log = logging.getLogger(__name__)

# texts both tokenizers must turn into the same ids: words, digits, whitespace, accents,
# other scripts, emoji, markup a chat template uses
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog. 0123456789 3.14159 -42",
    "  leading spaces,\ttabs\tand\nnew lines\n\n",
    "Ünïcödé: café, naïve, Ωμέγα, Привет, 漢字かなカナ, 한국어, العربية 🙂🚀",
    '<|im_start|>user\n{"tool": "search", "args": [1, 2]}<|im_end|>\n<think></think>',
)
NUM_ID_PROBES = 64  # token ids spread over the vocabulary, detokenized by both


class TokenServer(Protocol):
    """What the teacher needs of an inference server (``InferenceClient`` is one)."""

    base_url: str

    async def prompt_topk_many(
        self,
        sequences: Sequence[Sequence[int] | np.ndarray],
        top_k: int,
        *,
        timeout_s: float | None = None,
    ) -> list[PromptTopK]: ...

    async def tokenize(self, text: str, timeout_s: float = 30.0) -> list[int]: ...

    async def detokenize(self, token_ids: Sequence[int], timeout_s: float = 30.0) -> str: ...

    async def accepts_token_id(self, token_id: int, timeout_s: float = 30.0) -> bool: ...

    async def aclose(self) -> None: ...


def calls_of(lengths: Sequence[int], max_sequences: int, max_tokens: int) -> list[list[int]]:
    """Sample indexes cut into calls of at most ``max_sequences`` sequences and
    ``max_tokens`` tokens (a sequence longer than ``max_tokens`` is a call of its own)."""
    calls: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if current and (len(current) >= max_sequences or tokens + n > max_tokens):
            calls.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        calls.append(current)
    return calls


@dataclass(frozen=True)
class View:
    """A sample as the teacher scores it: ``token_ids``; the teacher's logprob of the
    sample's token j (for j >= ``start``) is at position ``j + offset`` of them."""

    token_ids: np.ndarray
    start: int = 1
    offset: int = 0


class NoPrivilegedContext(TreadleError):
    """Self-distillation on an environment that gives no privileged context: no group of
    it can ever be scored, so the run stops at the first one (not after a stall)."""


def view_of(sample: Sample, group: Group, self_distill: bool) -> View:
    """What the teacher scores for ``sample``: its own ids, or (self-distillation) its
    branch's privileged prompt followed by its ids after the prompt they replace -- the
    sampled ids exactly as sampled. AlgorithmError when the sample cannot be scored."""
    if not self_distill:
        if sample.loss_mask.size and sample.loss_mask[0] == 1:  # nothing precedes it
            raise AlgorithmError(
                f"sample of rollout {sample.rollout_id} begins with a sampled token; "
                "the teacher cannot score it"
            )
        return View(sample.token_ids)
    if sample.privileged_ids is None:
        raise AlgorithmError(
            f"self-distillation: rollout {sample.rollout_id} of environment {group.env!r} has "
            "no privileged prompt for its branch; the environment needs privileged context "
            "(Environment(privileged=...)) and a user message to add it to"
        )
    k = sample.num_replaced
    ids = np.concatenate([sample.privileged_ids, sample.token_ids[k:]]).astype(np.int32)
    return View(ids, start=k, offset=sample.privileged_ids.size - k)


def aligned(sample: Sample, view: View, scored: np.ndarray) -> np.ndarray:
    """The teacher's ``[len(view.token_ids) - 1, ...]`` prompt logprobs (or top-k rows) of
    ``view`` as a ``[num_tokens, ...]`` array aligned with the sample's tokens, 0 off the
    loss mask."""
    assert scored.shape[0] == view.token_ids.size - 1, (scored.shape, view.token_ids.size)
    out = np.zeros((sample.num_tokens, *scored.shape[1:]), dtype=scored.dtype)
    a, b = view.start + view.offset - 1, sample.num_tokens + view.offset - 1
    out[view.start :] = scored[a:b]
    out[sample.loss_mask != 1] = 0
    return out


class Teacher:
    """The teacher deployment of a run: fills ``teacher_logprobs`` (a ``SignalProvider``)."""

    def __init__(self, cfg: TeacherSection, servers: Sequence[TokenServer] | None = None):
        self.cfg = cfg
        self.servers: list[TokenServer] = list(servers) if servers is not None else [
            InferenceClient(url, timeout_s=cfg.timeout_s, model=cfg.model, max_retries=3)
            for url in cfg.servers
        ]  # fmt: skip
        if not self.servers and cfg.checkpoint is not None:
            raise ConfigError(
                f"orchestrator.teacher.checkpoint = {str(cfg.checkpoint)!r} is served by the "
                "launcher (`treadle rl` starts the teacher's inference and sets "
                "orchestrator.teacher.urls); an orchestrator started alone cannot serve it: "
                "serve the model (`treadle serve inference`, inference.follow_policy = false) "
                "and set orchestrator.teacher.urls"
            )
        if not self.servers:
            raise ConfigError(
                "orchestrator.teacher: no teacher to ask: set orchestrator.teacher.urls"
                + (" or orchestrator.teacher.student_url (`treadle rl` sets it)"
                   if cfg.self_distill else "")
            )  # fmt: skip
        self._next = 0  # round robin over the endpoints
        self._slots = asyncio.Semaphore(cfg.max_calls_in_flight)
        # group id -> (sum of student - teacher logprobs over its loss tokens, their number),
        # until the step that trains the group reports it
        self._kl_of: dict[str, tuple[float, int]] = {}
        self._reset()
        self.errors_total = 0
        self.vocab_size: int | None = None  # the student's: top-k ids must fall inside it

    def _reset(self) -> None:
        self._calls = 0
        self._call_s = 0.0
        self._errors = 0

    @property
    def name(self) -> str:
        model = f" (model {self.cfg.model!r})" if self.cfg.model else ""
        return f"teacher {', '.join(s.base_url for s in self.servers)}{model}"

    async def aclose(self) -> None:
        for server in self.servers:
            await server.aclose()

    # --- the signal ------------------------------------------------------------------------
    async def __call__(self, group: Group) -> list[np.ndarray]:
        """``teacher_logprobs`` of ``group``: one [num_tokens] array per sample (a sample
        without sampled tokens is not sent: all 0)."""
        return [lp for lp, _ in await self._score(group, 0)]

    async def topk(self, group: Group) -> list[TopK]:
        """``teacher_topk`` of ``group``: the teacher's ``top_k`` most likely tokens and
        their logprobs at each token of each sample (rows 0 off the loss mask)."""
        out = [top for _, top in await self._score(group, self.cfg.top_k)]
        if self.vocab_size is not None:
            for smp, top in zip(group.samples, out, strict=True):
                if top.ids.size and int(top.ids.max()) >= self.vocab_size:
                    self._errors += 1
                    self.errors_total += 1
                    raise AlgorithmError(
                        f"{self.name}: its top {self.cfg.top_k} for rollout {smp.rollout_id} "
                        f"hold token id {int(top.ids.max())}, outside the student's vocabulary "
                        f"(orchestrator.vocab_size = {self.vocab_size}); the student cannot "
                        "be taught a token it does not have"
                    )
        return out

    async def _score(self, group: Group, top_k: int) -> list[tuple[np.ndarray, TopK]]:
        """Per sample: the teacher's logprob of each token and (``top_k`` > 0) its top
        ``top_k`` there, aligned with the sample; the group's KL kept for the metrics."""
        samples = group.samples
        scored = [i for i, s in enumerate(samples) if s.loss_mask.any()]
        if (
            self.cfg.self_distill
            and scored
            and all(samples[i].privileged_ids is None for i in scored)
        ):
            raise NoPrivilegedContext(
                f"orchestrator.teacher.self_distill: no rollout of group {group.group_id} of "
                f"environment {group.env!r} carries a privileged prompt, so the teacher has "
                "nothing to score; the environment needs privileged context "
                "(Environment(privileged=...)) and a user message to add it to, or turn "
                "self_distill off for it"
            )
        try:
            views = {i: view_of(samples[i], group, self.cfg.self_distill) for i in scored}
        except AlgorithmError as e:
            self._errors += 1
            self.errors_total += 1
            raise AlgorithmError(f"{self.name}: {e}") from None
        calls = [
            [scored[j] for j in c]
            for c in calls_of(
                [views[i].token_ids.size for i in scored],
                self.cfg.max_sequences_per_call,
                self.cfg.max_tokens_per_call,
            )
        ]
        parts = await asyncio.gather(
            *(self._call(group, [(samples[i], views[i]) for i in c], top_k) for c in calls),
            return_exceptions=True,
        )  # every call ends before a failure is raised: none is left running
        for part in parts:
            if isinstance(part, BaseException):
                if isinstance(part, AlgorithmError):
                    self._errors += 1
                    self.errors_total += 1
                raise part
        out = [
            (np.zeros(s.num_tokens, dtype=np.float32),
             TopK(np.zeros((s.num_tokens, top_k), np.int32),
                  np.zeros((s.num_tokens, top_k), np.float32)))
            for s in samples
        ]  # fmt: skip
        for idx, got in zip(calls, parts, strict=True):
            assert not isinstance(got, BaseException)
            for i, answer in zip(idx, got, strict=True):
                out[i] = answer
        kl_sum, kl_tokens = 0.0, 0
        for smp, (lp, _) in zip(samples, out, strict=True):
            on = smp.loss_mask == 1
            kl_sum += float(np.sum(smp.logprobs[on].astype(np.float64) - lp[on]))
            kl_tokens += int(on.sum())
        self._kl_of[group.group_id] = (kl_sum, kl_tokens)
        return out

    async def _call(
        self, group: Group, samples: list[tuple[Sample, View]], top_k: int
    ) -> list[tuple[np.ndarray, TopK]]:
        """One teacher call: the prompt logprobs (and top ``top_k``) of ``samples``,
        retried as a whole."""
        num_tokens = sum(v.token_ids.size for _, v in samples)
        async with self._slots:
            attempt = 0
            while True:
                server = self.servers[self._next % len(self.servers)]
                self._next += 1
                started = time.monotonic()
                with telemetry.tracer(__name__).start_as_current_span(
                    "teacher_call", kind=trace.SpanKind.CLIENT,
                    attributes={"server.address": server.base_url,
                                "treadle.group_id": group.group_id,
                                "treadle.num_sequences": len(samples),
                                "treadle.num_tokens": num_tokens, "treadle.attempt": attempt},
                ) as span:  # fmt: skip
                    try:
                        got = await server.prompt_topk_many(
                            [v.token_ids for _, v in samples], top_k,
                            timeout_s=self.cfg.timeout_s,
                        )  # fmt: skip
                    except InferenceRequestError as e:  # refused: asking again changes nothing
                        span.set_status(trace.StatusCode.ERROR, str(e)[:200])
                        raise AlgorithmError(
                            f"{self.name} refused the group {group.group_id} ({num_tokens} tokens "
                            f"in {len(samples)} sequences): {e}"
                        ) from None
                    except (InferenceUnavailableError, DecodeError, TreadleError) as e:
                        span.set_status(trace.StatusCode.ERROR, str(e)[:200])
                        attempt += 1
                        if attempt > self.cfg.max_retries:
                            raise AlgorithmError(
                                f"{self.name}: no usable answer for group {group.group_id} "
                                f"after {attempt} attempts: {e}"
                            ) from None
                        log.warning("%s: call for group %s failed (%s); retrying (%d of %d)",
                                    self.name, group.group_id, e, attempt,
                                    self.cfg.max_retries)  # fmt: skip
                        continue
                    finally:
                        self._calls += 1
                        self._call_s += time.monotonic() - started
                if len(got) != len(samples):
                    raise AlgorithmError(
                        f"{self.name} gave {len(got)} answers for {len(samples)} sequences "
                        f"(group {group.group_id})"
                    )
                out = []
                for (s, v), ans in zip(samples, got, strict=True):
                    n = v.token_ids.size - 1
                    if (
                        ans.logprobs.shape != (n,)
                        or ans.top_ids.shape != (n, top_k)
                        or (ans.top_logprobs.shape != (n, top_k))
                    ):
                        raise AlgorithmError(
                            f"{self.name} gave {ans.logprobs.shape[0]} logprobs"
                            + (f" and top-{top_k} rows {ans.top_ids.shape}" if top_k else "")
                            + f" for a sequence of {v.token_ids.size} tokens "
                            f"(rollout {s.rollout_id})"
                        )
                    top = TopK(aligned(s, v, ans.top_ids), aligned(s, v, ans.top_logprobs))
                    out.append((aligned(s, v, ans.logprobs), top))
                return out

    def forget(self, group_id: str) -> None:
        """A group scored ahead that will not be trained: out of the KL metrics."""
        self._kl_of.pop(group_id, None)

    def take_metrics(self, group_ids: Iterable[str] | None = None) -> dict[str, float]:
        """The step's teacher metrics (module doc): the KL of ``group_ids`` (None: of every
        group scored since the last call), the calls since the last call; reset."""
        if group_ids is None:
            took = list(self._kl_of.values())
            self._kl_of.clear()
        else:
            took = [kl for gid in group_ids if (kl := self._kl_of.pop(gid, None)) is not None]
        kl_sum = sum(x for x, _ in took)
        kl_tokens = sum(n for _, n in took)
        out = {
            "teacher_kl_mean": kl_sum / kl_tokens if kl_tokens else 0.0,
            "teacher_num_tokens": float(kl_tokens),
            "teacher_call_s_mean": self._call_s / self._calls if self._calls else 0.0,
            "num_teacher_calls": float(self._calls),
            "num_teacher_errors": float(self._errors),
        }
        self._reset()  # the KL of groups scored ahead of a later step stays
        return out

    # --- the startup check -----------------------------------------------------------------
    async def check_tokenizer(
        self, student: TokenServer | None, vocab_size: int | None, student_name: str
    ) -> None:
        """ConfigError naming both sides unless every teacher endpoint and ``student``
        tokenize, detokenize and bound the vocabulary alike (module doc)."""
        if self.cfg.self_distill and not self.cfg.urls:
            log.info("[startup] self-distillation: the teacher is the policy, served by %s",
                     self.name)  # fmt: skip
            return
        if not self.cfg.check_tokenizer:
            log.warning("[startup] orchestrator.teacher.check_tokenizer = false: the run trusts "
                        "that %s and the student share one tokenizer and vocabulary; if they do "
                        "not, every teacher logprob is of the wrong tokens", self.name)  # fmt: skip
            return
        if student is None:
            raise ConfigError(
                "orchestrator.teacher: the tokenizer check needs the student's inference server: "
                "set orchestrator.teacher.student_url (`treadle rl` sets it), or "
                "orchestrator.teacher.check_tokenizer = false to trust that they match"
            )
        for server in self.servers:
            teacher = f"teacher {server.base_url}" + (
                f" (model {self.cfg.model!r})" if self.cfg.model else ""
            )
            try:
                await _compare(server, student, vocab_size, teacher, student_name)
            except (InferenceUnavailableError, InferenceRequestError, DecodeError) as e:
                raise ConfigError(
                    f"orchestrator.teacher: cannot check the tokenizer of {teacher} against "
                    f"{student_name}: {e}"
                ) from None
        log.info("[startup] %s: same tokenizer and vocabulary as %s (%s)", self.name,
                 student_name, f"vocab_size {vocab_size}" if vocab_size else
                 "vocabulary size unknown: orchestrator.vocab_size is unset")  # fmt: skip


async def check_top_k(servers: Sequence[TokenServer], top_k: int, name: str) -> None:
    """ConfigError naming ``orchestrator.teacher.top_k`` unless every teacher endpoint
    answers the top ``top_k`` tokens of a probe (vLLM refuses more than its
    ``--max-logprobs``)."""
    for server in servers:
        try:
            await server.prompt_topk_many([[0, 1, 2]], top_k, timeout_s=60.0)
        except (InferenceUnavailableError, InferenceRequestError, DecodeError) as e:
            raise ConfigError(
                f"orchestrator.teacher.top_k = {top_k}: {name} ({server.base_url}) does not "
                f"answer the top {top_k} tokens of a probe: {e}. Lower top_k, or serve the "
                f"teacher with --max-logprobs >= {top_k}"
            ) from None
    log.info("[startup] %s answers the top %d tokens at each position (top-k distillation)",
             name, top_k)  # fmt: skip


async def _compare(
    teacher: TokenServer,
    student: TokenServer,
    vocab_size: int | None,
    teacher_name: str,
    student_name: str,
) -> None:
    def mismatch(what: str, t: object, s: object) -> ConfigError:
        return ConfigError(
            f"orchestrator.teacher: {teacher_name} and {student_name} do not share a tokenizer: "
            f"{what}: teacher {str(t)[:200]!r}, student {str(s)[:200]!r}. On-policy distillation "
            "scores the student's token ids with the teacher, so both must use one tokenizer "
            "and vocabulary (a teacher of another family is not supported)"
        )

    probes: list[int] = []
    for text in PROBE_TEXTS:
        t_ids, s_ids = await teacher.tokenize(text), await student.tokenize(text)
        if t_ids != s_ids:
            raise mismatch(f"token ids of {text[:40]!r}", t_ids, s_ids)
        probes += s_ids
    top = vocab_size if vocab_size is not None else max(probes, default=0) + 1
    ids = sorted({int(i) for i in np.linspace(0, top - 1, NUM_ID_PROBES)} | set(probes))
    for tid in ids:  # one at a time: a startup check, not a load test
        t_text, s_text = await _text_of(teacher, tid), await _text_of(student, tid)
        if t_text != s_text:
            raise mismatch(f"text of token id {tid}", t_text, s_text)
    if vocab_size is not None and not await teacher.accepts_token_id(vocab_size - 1):
        raise mismatch(
            f"token id {vocab_size - 1} (the student's last, orchestrator.vocab_size = "
            f"{vocab_size}) in the vocabulary",
            "refused",
            "taken",
        )


async def _text_of(server: TokenServer, token_id: int) -> str | None:
    """The text of one token id; None when the server refuses it (an id past its
    tokenizer's vocabulary, e.g. an embedding row added for padding)."""
    try:
        return await server.detokenize([token_id])
    except InferenceRequestError:
        return None
