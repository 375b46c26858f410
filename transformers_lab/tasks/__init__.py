"""LightningModules: one per kind of task, around a plain model."""

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
