"""Next-token prediction: language modelling and the synthetic recall, copy and sort tasks."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.data.base import IGNORE
from transformers_lab.errors import at_least
from transformers_lab.tasks.base import Task, log_text
from transformers_lab.tasks.examples import (
    Detokenizer,
    Example,
    Generating,
    TokenScorer,
    token_labels,
)


class LanguageModelTask(Task):
    """Cross-entropy on next tokens; labels of -100 are not supervised.

    Logs ``train/loss`` (on the steps it is read: ``log_train_loss``); at the end of each
    validation (test), ``val/loss``, ``val/ppl``, ``val/bpt`` (bits per token, bits per
    character for a character model) and ``val/acc`` (accuracy on the supervised positions,
    the recall metric of MQAR), all over the supervised tokens of the whole split (summed
    across processes under DDP). With ``detokenize`` (ids -> text), a sample from the
    model's prompt is logged as text every ``sample_every`` validations (the last ten are
    kept in ``samples``); the sanity check samples nothing.

    Args:
        sample_tokens: tokens to generate for the logged sample (0: none).
        sample_every: validations between samples (generating one token at a time at
            batch size 1 is slow next to a validation pass of a small model on a CPU).
    """

    trains = ("GPT",)  # the models it trains (and their subclasses)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[..., Any],
        scheduler: Callable[..., Any] | None = None,
        sample_tokens: int = 200,
        sample_every: int = 1,
        detokenize: Detokenizer | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(model, optimizer, scheduler, detokenize, run_config)
        at_least(1, sample_every=sample_every)  # validations between samples
        at_least(0, sample_tokens=sample_tokens)
        self.sample_tokens = sample_tokens
        self.sample_every = sample_every
        self.samples: list[str] = []
        self.validations = 0  # finished validations, sanity check excluded

    def loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """The mean loss over the supervised positions, their logits (S, V) and labels (S,).

        Where most positions are not supervised (MQAR: a few answers in a sequence), only
        the supervised ones go through the output layer, a large saving with a large
        vocabulary; where all are (language modelling), all do, as one tensor."""
        x, y = batch
        supervised = y != IGNORE
        if not bool(supervised.all()) and isinstance(self.model, TokenScorer):  # Protocol: slow
            logits = self.model.logits(self.model.features(x)[supervised])  # (S, V)
            targets = y[supervised]
        else:
            logits, targets = self.model(x).flatten(0, 1), y.flatten()  # (B T, V)
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORE)
        return loss, logits, targets

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, _, _ = self.loss(batch)  # the loss alone: accuracy is an evaluation metric
        self.log_train_loss(loss)  # under DDP, all processes' mean
        return loss

    def example(self, batch: tuple[Tensor, Tensor], index: int = 0) -> Example:
        x, y = batch
        supervised = int((y[index] != IGNORE).sum())
        return Example(
            inputs=(x[index : index + 1],),
            tokens=token_labels(x[index].tolist(), self.detokenize),
            caption=f"example {index}: {x.shape[1]} tokens, {supervised} supervised",
        )

    def accumulate(self, batch: tuple[Tensor, Tensor]) -> None:
        loss, logits, targets = self.loss(batch)
        supervised = targets != IGNORE
        correct = ((logits.argmax(-1) == targets) & supervised).sum()
        self.totals.update(loss, correct, supervised.sum())

    def log_totals(self, stage: str) -> None:
        """Log the split's metrics from its summed loss, correct and supervised tokens."""
        loss, acc = self.totals.means()
        # the same on every process (summed over all of them): sync_dist averages equals
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val", sync_dist=True)
        self.log(f"{stage}/acc", acc, sync_dist=True)
        self.log(f"{stage}/ppl", loss.exp(), sync_dist=True)
        self.log(f"{stage}/bpt", loss / math.log(2), sync_dist=True)

    def on_validation_epoch_start(self) -> None:
        self.totals.start(self.device)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.accumulate(batch)

    def on_validation_epoch_end(self) -> None:
        self.log_totals("val")
        if self.trainer.sanity_checking:
            return
        self.validations += 1
        if (
            self.detokenize is not None
            and self.sample_tokens > 0
            and isinstance(self.model, Generating)
            and self.validations % self.sample_every == 0
        ):
            # a generator of its own: sampling must not move the training's random stream
            generator = torch.Generator(self.device).manual_seed(self.global_step)
            prompt = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            ids = self.model.generate(
                prompt, self.sample_tokens, temperature=1.0, top_k=40, generator=generator
            )
            self.samples = [*self.samples[-9:], self.detokenize(ids[0].tolist())]
            log_text(self, "val/sample", self.samples[-1])

    def on_test_epoch_start(self) -> None:
        self.totals.start(self.device)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.accumulate(batch)

    def on_test_epoch_end(self) -> None:
        self.log_totals("test")
