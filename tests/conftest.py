"""Shared test set-up: offline logging, deterministic seeds."""

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL server (tests/postgres.py), shared by the session's tests;
    skipped, with the reason, where no PostgreSQL binaries exist."""
    import postgres

    try:
        server = postgres.start()
    except postgres.Unavailable as exc:
        pytest.skip(str(exc))
    yield server
    server.stop()
