"""A checkpoint's task and data module from its path alone, for notebooks and scripts
(``load_task``): read once (``saved``) and restored (``run.components.restore``, the one
way back from a checkpoint)."""

from __future__ import annotations

from typing import Any

import lightning as L

from transformers_lab.run.checkpoints.saved import read_checkpoint
from transformers_lab.run.components import restore


def load_task(
    ckpt_path: str | Any, data: dict[str, Any] | None = None
) -> tuple[Any, L.LightningDataModule]:
    """A checkpoint's task in eval mode, weights loaded (``task.model`` is the network),
    and its data module set up with the tokenizer it was trained with; for notebooks and
    scripts. ``data`` overrides entries of the saved data config (e.g. ``batch_size``)."""
    checkpoint = read_checkpoint(ckpt_path)
    restored = restore(checkpoint, checkpoint.run_config(data))
    return restored.task, restored.datamodule
