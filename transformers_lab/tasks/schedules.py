"""Learning-rate schedules, as factories that Hydra completes with the optimizer."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from transformers_lab.errors import at_least, must_be


def check_schedule(warmup_steps: int, max_steps: int | None, min_lr_ratio: float = 0.1) -> None:
    """The warm-up cosine schedule's one rule (raises ``ValueError``): counts of steps
    that are counts, a floor in [0, 1], and a pinned length (``max_steps``) that outlasts
    the warm-up; a null length follows the run's steps and shortens the warm-up to fit."""
    at_least(0, warmup_steps=warmup_steps)
    if max_steps is not None:
        at_least(1, max_steps=max_steps)
    number = isinstance(min_lr_ratio, int | float) and not isinstance(min_lr_ratio, bool)
    if not number or not 0 <= min_lr_ratio <= 1:
        raise ValueError(must_be("min_lr_ratio", "a number in [0, 1]", min_lr_ratio))
    if max_steps is not None and max_steps <= warmup_steps:
        raise ValueError(
            f"max_steps={max_steps} must exceed warmup_steps={warmup_steps}: give a longer "
            "schedule, a shorter warm-up (scheduler.warmup_steps=...), or "
            "scheduler.max_steps=null to follow the run's steps"
        )


def warmup_cosine(
    optimizer: Optimizer,
    warmup_steps: int,
    max_steps: int,
    min_lr_ratio: float = 0.1,
    warmup_tokens: float | None = None,
) -> LambdaLR:
    """Linear warm-up to the base learning rate over ``warmup_steps``, then a cosine decay
    to ``min_lr_ratio`` times it at ``max_steps`` (constant after), as in nanoGPT.
    ``warmup_tokens`` is the warm-up in tokens, which a run budgeted in tokens makes
    ``warmup_steps`` before the schedule is built (``run.budget``)."""
    if warmup_tokens is not None:
        raise ValueError(
            f"warmup_tokens={warmup_tokens} needs the run's batch in tokens to become steps "
            "(tlab-train with trainer.batch_tokens or trainer.max_tokens); give warmup_steps"
        )
    check_schedule(warmup_steps, max_steps, min_lr_ratio)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def check_noam(d_model: int, warmup_steps: int = 4000) -> None:
    """The Noam schedule's one rule (raises ``ValueError``): a width and a warm-up of at
    least one."""
    at_least(1, d_model=d_model, warmup_steps=warmup_steps)


def noam(optimizer: Optimizer, d_model: int, warmup_steps: int = 4000) -> LambdaLR:
    """The schedule of Vaswani et al.: lr = base * d_model^-0.5 * min(step^-0.5,
    step * warmup^-1.5), so set the optimizer's lr to 1 (or a scale of it)."""
    check_noam(d_model, warmup_steps)

    def factor(step: int) -> float:
        step = step + 1
        return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)

    return LambdaLR(optimizer, factor)


# each schedule's rule, which the preflight calls before the optimizer exists
RULES = {warmup_cosine: check_schedule, noam: check_noam}
