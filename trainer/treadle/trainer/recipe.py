"""Trainer recipes: named functions returning the TorchTitan components' configs a run
trains with (the model comes from the model folder; see ``models/``).

``RECIPES`` registers them by name; the service uses ``rl`` today.
Not here: building the components (``trainer.py`` calls ``.build()`` on these configs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
)

from treadle.trainer.spec import TrainerSection

# LR schedules without an end still need a horizon for TorchTitan's scheduler
UNBOUNDED_STEPS = 1 << 40


@dataclass(frozen=True)
class Recipe:
    """TorchTitan component configs of one run."""

    name: str
    optimizer: OptimizersContainer.Config
    lr_scheduler: LRSchedulersContainer.Config
    training_steps: int  # horizon of the LR schedule


def rl_recipe(section: TrainerSection, device_type: str) -> Recipe:
    """One optimizer over every parameter (AdamW by default) and a warmup + constant
    (or linear/cosine decay to ``max_steps``) schedule; one LR step per trainer step."""
    opt = section.optim
    optimizer = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=".*",
                optimizer_name=opt.name,
                optimizer_kwargs={
                    "lr": opt.lr,
                    "betas": tuple(opt.betas),
                    "eps": opt.eps,
                    "weight_decay": opt.weight_decay,
                },
            )
        ],
        implementation="fused" if device_type == "cuda" else "foreach",
    )
    if opt.decay == "constant":
        steps = UNBOUNDED_STEPS
        lr_scheduler = LRSchedulersContainer.Config(warmup_steps=opt.warmup_steps, decay_ratio=0.0)
    else:
        steps = section.max_steps
        lr_scheduler = LRSchedulersContainer.Config(
            warmup_steps=opt.warmup_steps,
            decay_type=opt.decay,
            min_lr_factor=opt.min_lr_factor,
        )
    return Recipe("rl", optimizer, lr_scheduler, steps)


RECIPES: dict[str, Callable[[TrainerSection, str], Recipe]] = {"rl": rl_recipe}
