"""reverse-text with a long-tailed environment latency, for benchmarks/async_speedup.py.

The reward takes a log-normal time (median ``SLOW_ENV_MEDIAN_S``, sigma ``SLOW_ENV_SIGMA``
from the environment, defaults 0.3 s and 1.0), like a tool or a judge with a long tail.
Loaded by env runners as ``slow_env:ENVIRONMENT`` (benchmarks/ on PYTHONPATH).
"""

from __future__ import annotations

import math
import os
import random
import time
from typing import Any

from treadle.env_runner.envs import reverse_text


class SlowReverseText:
    name = "slow_reverse_text"

    def __init__(self) -> None:
        self.median_s = float(os.environ.get("SLOW_ENV_MEDIAN_S", "0.3"))
        self.sigma = float(os.environ.get("SLOW_ENV_SIGMA", "1.0"))
        self.rng = random.Random()

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return reverse_text.prompt(task)

    def reward(self, task: dict[str, Any], completion: str) -> float:
        time.sleep(self.rng.lognormvariate(math.log(self.median_s), self.sigma))
        return reverse_text.reward(task, completion)


ENVIRONMENT = SlowReverseText()
