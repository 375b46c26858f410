"""Image (or sequence) classification."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.tasks.base import Task
from transformers_lab.tasks.examples import Example, PatchLayout, patch_labels, token_labels


class ClassificationTask(Task):
    """Cross-entropy on class labels; logs ``train/loss`` (``log_train_loss``) and, over the whole
    split, ``{val,test}/loss`` and ``{val,test}/acc`` (summed across processes under DDP,
    so every rank logs the metric of the whole split), and ``val/acc_best``."""

    trains = ("EncoderClassifier",)  # and ViT, a subclass: the models it trains

    best_acc = 0.0

    def step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        if stage == "train":
            self.log_train_loss(loss, batch_size=len(y))
        else:
            correct = (logits.argmax(-1) == y).sum()
            self.totals.update(loss, correct, torch.tensor(len(y), device=y.device))
        return loss

    def log_totals(self, stage: str) -> float:
        loss, acc = self.totals.means()
        # the same on every process (summed over all of them): sync_dist averages equals
        self.log(f"{stage}/loss", loss, prog_bar=stage != "test", sync_dist=True)
        self.log(f"{stage}/acc", acc, prog_bar=True, sync_dist=True)
        return float(acc)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.step(batch, "train")

    def example(self, batch: tuple[Tensor, Tensor], index: int = 0) -> Example:
        x, y = batch
        caption = f"example {index}, label {int(y[index])}"
        if x.dim() == 4:  # an image (C, H, W): the model sees [cls] + patches
            tokens = None
            if isinstance(self.model, PatchLayout) and (patches := self.model.num_patches):
                tokens = patch_labels(patches, patches + self.model.num_prefix_tokens)
            return Example((x[index : index + 1],), tokens=tokens, image=x[index], caption=caption)
        tokens = token_labels(x[index].tolist(), self.detokenize)
        return Example((x[index : index + 1],), tokens=tokens, caption=caption)

    def on_validation_epoch_start(self) -> None:
        self.totals.start(self.device)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        acc = self.log_totals("val")
        if not self.trainer.sanity_checking:
            self.best_acc = max(self.best_acc, acc)
            self.log("val/acc_best", self.best_acc, sync_dist=True)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["best_acc"] = self.best_acc  # a resumed run goes on from it

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.best_acc = checkpoint.get("best_acc", self.best_acc)

    def on_test_epoch_start(self) -> None:
        self.totals.start(self.device)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self.log_totals("test")
