"""Checks of a composed config, run before anything is built: a user's mistake is caught
at once, as one ``ConfigError`` line that says what was wrong and how to fix it."""

from __future__ import annotations

from omegaconf import DictConfig


def validate_config(cfg: DictConfig) -> None:
    """Refuse a composed ``tlab-train`` config that cannot work (raises ``ConfigError``)."""
