"""Lightning callbacks of the framework's own: a progress bar that ends its line on an
error, a validation of the final weights, and pictures of what the model does."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities import move_data_to_device

from transformers_lab.analysis.attention import attention_maps, evaluating, plot_attention_maps
from transformers_lab.analysis.plots import figure_to_array, plot_predictions

log = logging.getLogger(__name__)


class ProgressBar(TQDMProgressBar):
    """Lightning's progress bar, ended on its own line when the run stops with an error:
    Lightning's left its last state on the terminal's line, so the entry point's ``error:``
    line was printed after it (``grep ^error:`` missed it)."""

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        for name in ("val", "test", "predict", "train"):  # the inner bars (lower) first
            bar = getattr(self, f"_{name}_progress_bar", None)
            if bar is not None and not getattr(bar, "disable", True):
                bar.close()  # tqdm ends the bar's line


class ValidateAtMaxSteps(L.Callback):
    """When ``trainer.max_steps`` ends a run between two validations, validate the final
    weights before it stops, so the run's final metrics, ``best.ckpt`` and ``last.ckpt``
    describe the weights it ends with. (Lightning validates only at the epoch's end or
    every ``val_check_interval`` batches: a run of 300 steps validating every 250 would
    end with the metrics of step 250, and one shorter than an epoch with none at all.)
    """

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if 0 < trainer.max_steps <= trainer.global_step and not trainer.should_stop:
            # a stop request is what makes Lightning validate mid-epoch; the run ends at
            # max_steps anyway, so min_epochs has nothing left to hold it for
            trainer.fit_loop.min_epochs = 0
            trainer.should_stop = True


class ValidationImages(L.Callback):
    """After a validation, draw the attention maps of one validation example (every layer,
    the first ``max_heads`` heads) and, for image classifiers, a grid of predictions;
    save them as PNG files and send them to the loggers that take images.

    The example is the same at every validation (``index`` in the first validation batch),
    so the pictures of successive epochs compare. Only rank 0 draws.

    Args:
        every_n_epochs: draw after the validations of every N-th epoch (1: every epoch).
            With ``trainer.val_check_interval`` validating several times an epoch, the
            first validation of such an epoch is drawn.
        every_n_validations: count validations instead of epochs (overrides the above).
        index: which example of the first validation batch.
        layers: regular expressions selecting the attention layers (None: all).
        max_heads: heads drawn per layer.
        predictions: how many images of the first batch go into the prediction grid
            (image classification only; 0: no grid).
        dirpath: where the PNG files go (None: no files).
        to_loggers: also log to wandb (``log_image``) and TensorBoard (``add_image``).
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        every_n_validations: int | None = None,
        index: int = 0,
        layers: Sequence[str] | None = None,
        max_heads: int = 4,
        predictions: int = 16,
        dirpath: str | Path | None = None,
        to_loggers: bool = True,
    ) -> None:
        for name, value in (("every_n_epochs", every_n_epochs), ("max_heads", max_heads)):
            if value < 1:
                raise ValueError(f"ValidationImages: {name} must be >= 1, got {value}")
        if every_n_validations is not None and every_n_validations < 1:
            raise ValueError(
                "ValidationImages: every_n_validations must be >= 1 or null, "
                f"got {every_n_validations}"
            )
        if index < 0 or predictions < 0:
            raise ValueError(
                f"ValidationImages: index and predictions must be >= 0, got {index}, {predictions}"
            )
        self.every_n_epochs = every_n_epochs
        self.every_n_validations = every_n_validations
        self.index, self.layers, self.max_heads = index, layers, max_heads
        self.predictions = predictions
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.to_loggers = to_loggers
        self.validations = 0
        self.last_epoch = -1
        self.batch: Any = None
        self.written: list[Path] = []

    def due(self, trainer: L.Trainer) -> bool:
        """Whether this validation is one to draw (sanity checks never are)."""
        if trainer.sanity_checking:
            return False
        self.validations += 1
        if self.every_n_validations is not None:
            return self.validations % self.every_n_validations == 0
        epoch = trainer.current_epoch
        if epoch == self.last_epoch or (epoch + 1) % self.every_n_epochs:
            return False
        self.last_epoch = epoch
        return True

    def first_batch(self, trainer: L.Trainer) -> Any:
        if self.batch is None:
            loaders = trainer.val_dataloaders
            loader = loaders[0] if isinstance(loaders, list | tuple) else loaders
            self.batch = move_data_to_device(next(iter(loader)), "cpu")
        return self.batch

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.due(trainer) or not trainer.is_global_zero:
            return
        batch = move_data_to_device(self.first_batch(trainer), pl_module.device)
        size = len(batch[0])
        if self.index >= size:
            raise ValueError(
                f"ValidationImages: index={self.index} but the first validation batch has "
                f"{size} examples; choose an index below {size}"
            )
        example = pl_module.example(batch, self.index)
        maps = attention_maps(pl_module.model, *example.inputs, layers=self.layers)
        title = f"step {trainer.global_step}: {example.caption}"
        figure = plot_attention_maps(maps, example, max_heads=self.max_heads, title=title)
        self.emit(trainer, "val/attention", figure)
        if self.predictions and example.image is not None:
            images, targets = batch[0][: self.predictions], batch[1][: self.predictions]
            with evaluating(pl_module.model) as model:
                predicted = model(images).argmax(-1)
            self.emit(trainer, "val/predictions", plot_predictions(images, targets, predicted))

    def emit(self, trainer: L.Trainer, key: str, figure: Any) -> None:
        """Write the figure to ``dirpath`` and hand it to the loggers."""
        epoch, step = trainer.current_epoch, trainer.global_step
        if self.dirpath is not None:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            path = self.dirpath / f"{key.replace('/', '_')}_epoch{epoch:03d}_step{step:07d}.png"
            figure.savefig(path, dpi=100)
            self.written.append(path)
            log.info("%s saved to %s", key, path)
        if not self.to_loggers:
            return
        pixels = None
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):  # wandb
                pixels = figure_to_array(figure) if pixels is None else pixels
                logger.log_image(key=key, images=[pixels], step=step)
            elif hasattr(getattr(logger, "experiment", None), "add_image"):  # tensorboard
                pixels = figure_to_array(figure) if pixels is None else pixels
                logger.experiment.add_image(key, pixels, step, dataformats="HWC")
