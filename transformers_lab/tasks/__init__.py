"""LightningModules: one per kind of task, around a plain model (``base``: the optimizer,
the schedule, split totals, the run config in every checkpoint); ``examples``: what a task
hands out for inspection and what it may ask of its model; ``schedules``."""

from transformers_lab.tasks.base import Task
from transformers_lab.tasks.classification import ClassificationTask
from transformers_lab.tasks.language_model import LanguageModelTask
from transformers_lab.tasks.schedules import noam, warmup_cosine
from transformers_lab.tasks.translation import TranslationTask

__all__ = [
    "ClassificationTask",
    "LanguageModelTask",
    "Task",
    "TranslationTask",
    "noam",
    "warmup_cosine",
]
