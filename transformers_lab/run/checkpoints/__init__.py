"""A run's checkpoints, the one place that opens them: read once and safely into a
``SavedCheckpoint`` that resume, test and every evaluation length share (``saved``); held
to the run they are given to, config and weights (``compare``); the way back to a
model (``restore``); written atomically, at every save point and on a signal
(``writing``). The config's ``_target_``s name the writer's classes here."""

from transformers_lab.run.checkpoints.compare import (
    RESUME_MAY_CHANGE,
    Resume,
    check_resume,
    check_weights,
    differences,
    resume_from,
)
from transformers_lab.run.checkpoints.restore import (
    Restored,
    load_task,
    restore,
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
