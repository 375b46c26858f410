"""Sequence-to-sequence translation with the encoder-decoder Transformer."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.text import BLEUScore

from transformers_lab.errors import at_least, check_beam, must_be
from transformers_lab.tasks.base import Task, log_text
from transformers_lab.tasks.examples import Detokenizer, Example, token_labels


class TranslationTask(Task):
    """Teacher-forced cross-entropy with label smoothing, the PAD target ignored.

    At validation, the first ``bleu_batches`` batches are also translated greedily and
    scored with corpus BLEU (``val/bleu``, 0-100) when ``detokenize`` (ids -> text) is
    given; the first translations are kept in ``samples``.

    Args:
        label_smoothing: epsilon of the smoothed targets (0.1 in Vaswani et al.).
        bleu_batches: validation batches decoded for BLEU at each validation (0: none).
        test_bleu_batches: test batches decoded for BLEU (None: all of them, so
            ``test/bleu`` is the BLEU of the whole test set; 0: none).
        max_decode_len: longest translation produced for BLEU.
        beam_size: 1 for greedy, more for beam search.
    """

    trains = ("Transformer",)  # the models it trains (and their subclasses)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[..., Any],
        scheduler: Callable[..., Any] | None = None,
        label_smoothing: float = 0.1,
        bleu_batches: int = 4,
        max_decode_len: int = 64,
        beam_size: int = 1,
        test_bleu_batches: int | None = None,
        detokenize: Detokenizer | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(model, optimizer, scheduler, detokenize, run_config)
        check_beam(beam_size)
        at_least(1, max_decode_len=max_decode_len)
        if isinstance(label_smoothing, bool) or not 0 <= label_smoothing < 1:
            raise ValueError(must_be("label_smoothing", "a number in [0, 1)", label_smoothing))
        self.label_smoothing, self.bleu_batches = label_smoothing, bleu_batches
        self.test_bleu_batches = test_bleu_batches
        self.max_decode_len, self.beam_size = max_decode_len, beam_size
        self.bleu = {"val": BLEUScore(), "test": BLEUScore()}
        self.samples: list[tuple[str, str, str]] = []  # (source, translation, reference)

    def loss(self, src: Tensor, tgt: Tensor) -> Tensor:
        logits = self.model(src, tgt[:, :-1])  # predict tgt[:, 1:] from BOS ... last-but-one
        return F.cross_entropy(
            logits.flatten(0, 1),
            tgt[:, 1:].flatten(),
            ignore_index=self.model.pad_id,
            label_smoothing=self.label_smoothing,
        )

    def example(self, batch: tuple[Tensor, Tensor], index: int = 0) -> Example:
        """Source and teacher-forced target of one pair, padding cut off."""
        src, tgt = batch
        pad = self.model.pad_id
        src = src[index, : int((src[index] != pad).sum())]
        tgt = tgt[index, : int((tgt[index] != pad).sum())][:-1]  # BOS ... last-but-one
        caption = f"example {index}: {len(src)} source, {len(tgt)} target tokens"
        if self.detokenize is not None:
            caption = f"{self.detokenize(src.tolist())} -> {self.detokenize(tgt.tolist())}"
        return Example(
            inputs=(src[None], tgt[None]),
            source=token_labels(src.tolist(), self.detokenize),
            target=token_labels(tgt.tolist(), self.detokenize),
            caption=caption,
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(*batch)
        self.log_train_loss(loss, batch_size=batch[0].shape[0])
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], batch_idx: int, stage: str) -> None:
        src, tgt = batch
        loss = self.loss(src, tgt)  # averaged over the processes under DDP (BLEU syncs itself)
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=len(src), sync_dist=True)
        if self.detokenize is None or batch_idx >= self.decoded_batches(stage):
            return
        out = self.model.translate(src, self.max_decode_len, beam_size=self.beam_size)
        hyps = [self.detokenize(row.tolist()) for row in out]
        refs = [[self.detokenize(row[1:].tolist())] for row in tgt]
        self.bleu[stage].update(hyps, refs)
        if batch_idx == 0:
            sources = [self.detokenize(row.tolist()) for row in src[:3]]
            self.samples = list(zip(sources, hyps, (r[0] for r in refs), strict=False))

    def decoded_batches(self, stage: str) -> float:
        if stage == "test" and self.test_bleu_batches is None:
            return math.inf
        return self.bleu_batches if stage == "val" else self.test_bleu_batches

    def _log_bleu(self, stage: str) -> None:
        if self.detokenize is not None and self.decoded_batches(stage) > 0:
            self.log(f"{stage}/bleu", 100 * self.bleu[stage].compute())
            self.bleu[stage].reset()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "val")

    def on_validation_epoch_end(self) -> None:
        self._log_bleu("val")
        self._log_samples("val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test")

    def on_test_epoch_end(self) -> None:
        self._log_bleu("test")
        self._log_samples("test")

    def _log_samples(self, stage: str) -> None:
        """The first translations of the stage's first batch, with source and reference."""
        if self.samples:
            text = "\n\n".join(
                f"source:      {src}\ntranslation: {hyp}\nreference:   {ref}"
                for src, hyp, ref in self.samples
            )
            log_text(self, f"{stage}/translations", text)
            self.samples = []
