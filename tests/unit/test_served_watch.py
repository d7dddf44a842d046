"""The orchestrator names an environment whose requested rollouts nobody completes."""

from __future__ import annotations

from treadle.orchestrator.served import ServedWatch


def test_an_unserved_environment_is_named_once_then_every_again_s() -> None:
    w = ServedWatch(after_s=60, again_s=300)
    w.requested("countdown", 0.0)
    w.requested("reverse_text", 0.0)
    w.requested("countdown", 30.0)  # more requests do not restart the clock
    w.completed("reverse_text")
    assert w.due(59.0) == []
    (line,) = w.due(61.0)
    assert "'countdown'" in line
    assert "61 s" in line
    assert "env_runner.envs" in line
    assert w.due(100.0) == []  # said once ...
    assert len(w.due(361.0)) == 1  # ... and again while it lasts
    w.completed("countdown")  # a runner came up
    assert w.due(10_000.0) == []


def test_a_served_environment_is_never_named_and_zero_turns_it_off() -> None:
    w = ServedWatch(after_s=60)
    w.requested("e", 0.0)
    w.completed("e")
    w.requested("e", 100.0)  # later requests of a served environment are not watched
    assert w.due(1000.0) == []
    off = ServedWatch(after_s=0)
    off.requested("e", 0.0)
    assert off.due(1e9) == []
