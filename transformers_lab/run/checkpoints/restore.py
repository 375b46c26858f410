"""The one way back from a checkpoint (``restore``), for ``tlab-eval``, ``tlab-sample``,
``tlab-translate``, every evaluation length and notebooks (``load_task``): the saved
run's data module (the tokenizer it was trained with), model and task built, the
weights checked and loaded from the checkpoint already read."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden

from transformers_lab.errors import ConfigError
from transformers_lab.run.checkpoints.compare import check_weights, differences
from transformers_lab.run.checkpoints.saved import (
    SavedCheckpoint,
    read_checkpoint,
    resolved_sections,
)
from transformers_lab.run.components import build_components, target_class


class WrongModel(ConfigError):
    """A checkpoint of another model class than the one asked for (``restore``'s
    ``needs``); ``found`` is its class, for a tool to say which other tool takes it."""

    def __init__(self, message: str, found: type) -> None:
        super().__init__(message)
        self.found = found


class Restored(NamedTuple):
    """A checkpoint brought back: the checkpoint, its data module (the tokenizer it was
    trained with) and its task, weights loaded (``task.model`` is the network)."""

    checkpoint: SavedCheckpoint
    datamodule: L.LightningDataModule
    task: Any


def restore(
    checkpoint: SavedCheckpoint | str | Path,
    data: Any = None,
    needs: type | None = None,
    wanted: str = "",
    model: Any = None,
) -> Restored:
    """The saved run's data module (``data`` overrides entries of its config), model and
    task built, the weights checked and loaded (a path is read first: ``read_checkpoint``).
    With ``needs``, a checkpoint of another model class is refused before anything is
    built, in one line that starts with what is ``wanted``. ``model`` overrides entries of
    the model config that hold no weights (``block_size``, for another length)."""
    if not isinstance(checkpoint, SavedCheckpoint):
        checkpoint = read_checkpoint(checkpoint)
    run = checkpoint.run_config(data, model)
    if needs is not None:
        cls = target_class(run.model)
        if not (isinstance(cls, type) and issubclass(cls, needs)):
            trained_on = str(run.data.get("_target_", "?")).rpartition(".")[2]
            raise WrongModel(
                f"{wanted or f'a {needs.__name__} checkpoint is needed'}; {checkpoint.path} "
                f"holds a {cls.__name__} trained on {trained_on}",
                cls,
            )
    parts = build_components(run, checkpoint)
    changed = differences(checkpoint.config, resolved_sections(run))
    check_weights(checkpoint, parts.task, changed)
    parts.task.load_state_dict(checkpoint.state_dict)
    return Restored(checkpoint, parts.datamodule, parts.task.eval())


def check_split(datamodule: L.LightningDataModule, split: str) -> None:
    """Refuse ``split=test`` on a restored run's data that has no test split."""
    if split == "test" and not is_overridden("test_dataloader", datamodule):
        raise ConfigError(f"{type(datamodule).__name__} has no test split; use split=val")


def load_task(
    ckpt_path: str | Any, data: dict[str, Any] | None = None
) -> tuple[Any, L.LightningDataModule]:
    """A checkpoint's task in eval mode, weights loaded (``task.model`` is the network),
    and its data module set up with the tokenizer it was trained with; for notebooks and
    scripts. ``data`` overrides entries of the saved data config (e.g. ``batch_size``)."""
    restored = restore(ckpt_path, data)
    return restored.task, restored.datamodule
