"""Subjects and stream layout of DESIGN.md section 4."""

from __future__ import annotations

import pytest

from treadle.services.sections import NatsSection
from treadle.services.subjects import Retention, Subjects


def test_subjects_layout() -> None:
    s = Subjects("run-1")
    assert s.rollouts_requested("reverse_text") == "treadle.run-1.rollouts.requested.reverse_text"
    assert s.rollouts_requested_any == "treadle.run-1.rollouts.requested.>"
    assert s.rollouts_completed == "treadle.run-1.rollouts.completed"
    assert s.batches(12) == "treadle.run-1.batches.12"
    assert s.batches_any == "treadle.run-1.batches.*"
    assert s.policy_published == "treadle.run-1.policy.published"
    assert s.metrics("trainer") == "treadle.run-1.metrics.trainer"


def test_subjects_streams_match_design_retention() -> None:
    streams = {spec.name: spec for spec in Subjects("r").streams(NatsSection())}
    assert set(streams) == {
        "ROLLOUT_REQUESTS_r",
        "ROLLOUTS_r",
        "BATCHES_r",
        "POLICY_r",
        "METRICS_r",
        "USAGE_r",
        "DEAD_LETTERS_r",
    }
    assert streams["ROLLOUT_REQUESTS_r"].retention is Retention.WORK_QUEUE
    # the usage ledger is kept as long as the run's data: no age limit
    assert streams["USAGE_r"].retention is Retention.LIMITS
    assert streams["USAGE_r"].max_age_s in (None, 0)
    assert streams["ROLLOUTS_r"].retention is Retention.LIMITS
    assert streams["BATCHES_r"].retention is Retention.LIMITS
    assert streams["POLICY_r"].retention is Retention.LAST_VALUE


@pytest.mark.parametrize("bad", ["a.b", "a b", "a*", "a>", ""])
def test_subjects_reject_tokens_that_break_subjects(bad: str) -> None:
    with pytest.raises(ValueError, match="NATS subject token"):
        Subjects(bad)
    with pytest.raises(ValueError, match="environment name"):
        Subjects("ok").rollouts_requested(bad)


def test_subjects_dead_letter_per_stream_under_one_wildcard() -> None:
    subjects = Subjects("r")
    assert subjects.dead_letter("ROLLOUTS") == "treadle.r.deadletter.rollouts"
    assert subjects.dead_letter_any == "treadle.r.deadletter.*"
    spec = {s.name: s for s in subjects.streams(NatsSection())}["DEAD_LETTERS_r"]
    assert spec.subjects == (subjects.dead_letter_any,)
    # a flood of poison cannot fill the disk
    assert spec.max_msgs > 0
    assert spec.max_bytes > 0
