"""Image (or sequence) classification."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from transformers_lab.analysis.attention import Example, patch_labels, token_labels
from transformers_lab.tasks.base import Task


class ClassificationTask(Task):
    """Cross-entropy on class labels; logs ``train/loss``, ``{val,test}/loss`` and
    ``{val,test}/acc``, and ``val/acc_best``."""

    best_acc = 0.0

    def step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log(f"{stage}/loss", loss, prog_bar=stage != "test", batch_size=len(y))
        if stage != "train":
            self.log(f"{stage}/acc", acc, prog_bar=True, batch_size=len(y))
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.step(batch, "train")

    def example(self, batch: tuple[Tensor, Tensor], index: int = 0) -> Example:
        x, y = batch
        caption = f"example {index}, label {int(y[index])}"
        if x.dim() == 4:  # an image (C, H, W): the model sees [cls] + patches
            patches = getattr(getattr(self.model, "embedding", None), "num_patches", None)
            extra = int(getattr(self.model, "cls_token", None) is not None)
            tokens = patch_labels(patches, patches + extra) if patches else None
            return Example((x[index : index + 1],), tokens=tokens, image=x[index], caption=caption)
        decode = getattr(self, "decode", None)
        return Example(
            (x[index : index + 1],), tokens=token_labels(x[index].tolist(), decode), caption=caption
        )

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        acc = self.trainer.callback_metrics.get("val/acc")
        if acc is not None and not self.trainer.sanity_checking:
            self.best_acc = max(self.best_acc, float(acc))
            self.log("val/acc_best", self.best_acc)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.step(batch, "test")
