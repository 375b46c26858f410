"""The one way back from a checkpoint (``restore``), for ``tlab-eval``, ``tlab-sample``,
``tlab-translate``, every evaluation length and notebooks (``load_task``, from a path):
the saved run's data module (the tokenizer it was trained with), model and task built,
the weights checked and loaded from the checkpoint already read."""

from __future__ import annotations

from typing import Any, NamedTuple

import lightning as L

from transformers_lab.run.checkpoints.compare import Resume
from transformers_lab.run.checkpoints.saved import SavedCheckpoint, read_checkpoint
from transformers_lab.run.components import build_components


class Restored(NamedTuple):
    """A checkpoint brought back: the checkpoint, its data module (the tokenizer it was
    trained with) and its task, weights loaded (``task.model`` is the network)."""

    checkpoint: SavedCheckpoint
    datamodule: L.LightningDataModule
    task: Any


def restore(checkpoint: SavedCheckpoint, data: Any = None, model: Any = None) -> Restored:
    """The saved run's data module (``data`` overrides entries of its config), model and
    task built, the weights checked and loaded. ``model`` overrides entries of the model
    config that hold no weights (``block_size``, for another length)."""
    run = checkpoint.run_config(data, model)
    parts = build_components(run, Resume({}, checkpoint, against=run))
    parts.task.load_state_dict(checkpoint.state_dict)
    return Restored(checkpoint, parts.datamodule, parts.task.eval())


def load_task(
    ckpt_path: str | Any, data: dict[str, Any] | None = None
) -> tuple[Any, L.LightningDataModule]:
    """A checkpoint's task in eval mode, weights loaded (``task.model`` is the network),
    and its data module set up with the tokenizer it was trained with; for notebooks and
    scripts. ``data`` overrides entries of the saved data config (e.g. ``batch_size``)."""
    restored = restore(read_checkpoint(ckpt_path), data)
    return restored.task, restored.datamodule
