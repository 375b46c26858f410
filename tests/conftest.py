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


# the generation entry points' tiny checkpoints (tests/tiny_checkpoints.py), one set per
# test module that asks for them: test_sample.py, test_translate.py


@pytest.fixture(scope="module")
def generation_data(tmp_path_factory):
    """Fake Tiny Shakespeare and Multi30k, and a tiny tiktoken ranks file, for the module."""
    from tests.tiny_checkpoints import fake_generation_data

    with fake_generation_data(tmp_path_factory.mktemp("data")) as root:
        yield root


@pytest.fixture(scope="module")
def gpt_ckpt(generation_data):
    from tests.tiny_checkpoints import gpt_checkpoint

    return gpt_checkpoint(generation_data)


@pytest.fixture(scope="module")
def rope_gpt_ckpt(generation_data):
    from tests.tiny_checkpoints import rope_gpt_checkpoint

    return rope_gpt_checkpoint(generation_data)


@pytest.fixture(scope="module")
def bpe_gpt_ckpt(generation_data):
    from tests.tiny_checkpoints import bpe_gpt_checkpoint

    return bpe_gpt_checkpoint(generation_data)


@pytest.fixture(scope="module")
def transformer_ckpt(generation_data):
    from tests.tiny_checkpoints import transformer_checkpoint

    return transformer_checkpoint(generation_data)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A throwaway one-node SLURM cluster (tests/slurm.py), shared by the session's tests;
    skipped, with the reason, where SLURM's binaries are missing or the tests are not root."""
    import slurm

    try:
        cluster = slurm.start()
    except slurm.Unavailable as exc:
        pytest.skip(str(exc))
    yield cluster
    cluster.stop()
