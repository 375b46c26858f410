"""A run's checkpoints, the one place that opens them: read once and safely into a
``SavedCheckpoint`` that resume, test and every evaluation length share (``saved``); held
to the run they are given to, config and weights (``compare``); a task and its data from
a path (``load_task``: ``run.components.restore`` builds them); written atomically, at
every save point and on a signal (``writing``). The config's ``_target_``s name the
writer's classes here."""

import importlib
from typing import Any

from transformers_lab.run.checkpoints.compare import (
    RESUME_MAY_CHANGE,
    Resume,
    check_resume,
    check_weights,
    differences,
    resume_from,
)
from transformers_lab.run.checkpoints.saved import (
    GIVE_CHECKPOINT,
    MODEL_SECTIONS,
    SavedCheckpoint,
    checkpoint_step,
    load_file,
    read_checkpoint,
    resolved_sections,
)
from transformers_lab.run.checkpoints.writing import AtomicCheckpointIO, Checkpoint

__all__ = [
    "GIVE_CHECKPOINT",
    "MODEL_SECTIONS",
    "RESUME_MAY_CHANGE",
    "AtomicCheckpointIO",
    "Checkpoint",
    "Restored",
    "Resume",
    "SavedCheckpoint",
    "check_resume",
    "check_weights",
    "checkpoint_step",
    "differences",
    "load_file",
    "load_task",
    "read_checkpoint",
    "resolved_sections",
    "restore",
    "resume_from",
]


# the way back to a model builds the run's components, which hold their checkpoint to the
# run (``compare``): imported when asked for, so that ``run.components`` can import this
LAZY = {"load_task": "restore", "restore": "components", "Restored": "components"}


def __getattr__(name: str) -> Any:
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = (
        "transformers_lab.run.components" if LAZY[name] == "components" else f"{__name__}.restore"
    )
    return getattr(importlib.import_module(where), name)
