"""What every task shares: the optimizer with weight-decay groups, the schedule, and the
parameter count in the hyperparameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from transformers_lab.nn import weight_decay_groups

OptimizerFactory = Callable[..., Optimizer]
SchedulerFactory = Callable[[Optimizer], LRScheduler]


class Task(L.LightningModule):
    """A LightningModule around a plain ``nn.Module`` model.

    Args:
        model: the network (``GPT``, ``Transformer``, ``ViT``, ...).
        optimizer: a partial optimizer (Hydra ``_partial_: true``), completed with the
            parameter groups of ``weight_decay_groups``; its ``weight_decay`` applies to
            the decayed group.
        scheduler: a partial schedule completed with the optimizer, stepped every
            training step; None for a constant learning rate.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: Callable[..., LRScheduler] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.save_hyperparameters(ignore=["model", "optimizer", "scheduler"])
        self.num_params = sum(p.numel() for p in model.parameters())

    def configure_optimizers(self) -> Any:
        # the partial's weight_decay goes to the decayed group only
        weight_decay = getattr(self.optimizer_factory, "keywords", {}).get("weight_decay", 0.0)
        optimizer = self.optimizer_factory(params=weight_decay_groups(self.model, weight_decay))
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_fit_start(self) -> None:
        for logger in self.loggers:
            logger.log_hyperparams({"model/params": self.num_params})
