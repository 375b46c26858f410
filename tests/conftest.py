"""Shared test set-up: offline logging, deterministic seeds."""

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
