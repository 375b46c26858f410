"""Next-token prediction: language modelling and the synthetic recall, copy and sort tasks."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.tasks.base import Task, log_text

IGNORE = -100


class LanguageModelTask(Task):
    """Cross-entropy on next tokens; labels of -100 are not supervised.

    Logs ``train/loss``; ``val/loss``, ``val/ppl``, ``val/bpt`` (bits per token, bits per
    character for a character model) and ``val/acc`` (accuracy on the supervised
    positions, the recall metric of MQAR). With a ``decode`` function (ids -> text), a
    sample from the model's prompt is logged as text at the end of each validation (the
    last ten are kept in ``samples``).

    Args:
        sample_tokens: tokens to generate for the logged sample (0: none).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[..., Any],
        scheduler: Callable[..., Any] | None = None,
        sample_tokens: int = 200,
    ) -> None:
        super().__init__(model, optimizer, scheduler)
        self.sample_tokens = sample_tokens
        self.decode: Callable[[list[int]], str] | None = None
        self.samples: list[str] = []

    def step(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        logits = self.model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        supervised = y != IGNORE
        correct = (logits.argmax(-1) == y) & supervised
        return loss, correct.sum(), supervised.sum()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, _, _ = self.step(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, correct, total = self.step(batch)
        n = batch[0].shape[0]
        self.log("val/loss", loss, prog_bar=True, batch_size=n)
        self.log("val/acc", correct.float() / total.clamp_min(1), batch_size=n)

    def on_validation_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/ppl", torch.exp(loss))
            self.log("val/bpt", loss / math.log(2))
        if self.decode is not None and self.sample_tokens > 0 and hasattr(self.model, "generate"):
            prompt = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            ids = self.model.generate(prompt, self.sample_tokens, temperature=1.0, top_k=40)
            self.samples = [*self.samples[-9:], self.decode(ids[0].tolist())]
            log_text(self, "val/sample", self.samples[-1])

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, correct, total = self.step(batch)
        n = batch[0].shape[0]
        self.log("test/loss", loss, batch_size=n)
        self.log("test/acc", correct.float() / total.clamp_min(1), batch_size=n)
