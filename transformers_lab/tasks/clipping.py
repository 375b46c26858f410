"""Gradient clipping with the norm taken once: ``run.callbacks.safety.NonFiniteGuard`` takes the
2-norm of the gradients to check them, and hands it to the task (``take_checked_norm``),
whose clipping uses it instead of taking it again."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch


class CheckedNorm(NamedTuple):
    """The 2-norm of ``optimizer``'s gradients that ``NonFiniteGuard`` took at ``step``."""

    optimizer: Any
    step: int
    norm: torch.Tensor


@runtime_checkable
class TakesCheckedNorm(Protocol):
    """A LightningModule that clips its gradients with the norm ``NonFiniteGuard`` took of
    them (``tasks.base.Task``): the guard hands it over, the clipping takes it back."""

    def take_checked_norm(self, checked: CheckedNorm) -> None: ...


def clip_with_checked_norm(
    checked: CheckedNorm | None,
    optimizer: Any,
    step: int,
    clip_val: float | None,
    algorithm: Any,
) -> bool:
    """Clip ``optimizer``'s gradients to norm ``clip_val`` with the norm ``NonFiniteGuard``
    took of them at this ``step``, instead of taking it again; False (nothing done) when
    there is no such norm or the clipping is not by norm."""
    if checked is None or not clip_val or (algorithm is not None and algorithm != "norm"):
        return False
    if checked.optimizer is not optimizer or checked.step != step:
        return False
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, clip_val, checked.norm)
    return True
