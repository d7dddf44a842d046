"""Task sets: where an environment's tasks come from (``base.py``: TaskSet, check_task).
The built-in environments' own task sets live beside them in ``envs/``."""

from treadle.env_runner.tasksets.base import Task, TaskError, TaskSet, check_task

__all__ = ["Task", "TaskError", "TaskSet", "check_task"]
