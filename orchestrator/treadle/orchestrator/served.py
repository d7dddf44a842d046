"""Whether anything serves the environments the loop requests rollouts of.

Rollout requests wait in JetStream until an env runner serving their environment pulls
them, so a run whose env runners do not serve an environment (a typo in
``env_runner.envs``, a runner that never started) waits without an error: its groups fill
``max_groups_in_flight`` and training stalls. ``ServedWatch`` notices an environment none
of whose requested rollouts has completed within ``after_s`` of its first request and
says so, naming it, once and then every ``again_s`` while it lasts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServedWatch:
    after_s: float
    """Seconds without any completion before an environment is reported (0: never)."""
    again_s: float = 600.0
    _first_request: dict[str, float] = field(default_factory=dict)
    _completed: set[str] = field(default_factory=set)
    _warned_at: dict[str, float] = field(default_factory=dict)

    def requested(self, env: str, now: float) -> None:
        if env not in self._completed:
            self._first_request.setdefault(env, now)

    def completed(self, env: str) -> None:
        self._completed.add(env)
        self._first_request.pop(env, None)
        self._warned_at.pop(env, None)

    def due(self, now: float) -> list[str]:
        """Warnings to log now (each names an environment and how long it waited)."""
        if self.after_s <= 0:
            return []
        out = []
        for env, since in sorted(self._first_request.items()):
            waited = now - since
            last = self._warned_at.get(env)
            if waited >= self.after_s and (last is None or now - last >= self.again_s):
                self._warned_at[env] = now
                out.append(
                    f"no rollout of environment {env!r} has completed in {waited:.0f} s since "
                    "the first was requested: is an env runner serving it (env_runner.envs), "
                    "and running? Its requests wait in the queue until one is"
                )
        return out
