"""Shared test set-up: offline logging and Hugging Face, scratch folders for prepared
corpora and Hugging Face's caches, deterministic seeds, glibc's own malloc settings in the
tests' processes."""

import os
import tempfile

import pytest
import torch

from transformers_lab.run import memory

os.environ.setdefault("WANDB_MODE", "offline")
# corpora the tests prepare (Tiny Shakespeare's among them) go to a scratch folder, not to
# ~/.cache; the runs the tests start in processes of their own inherit it
os.environ.setdefault("TLAB_CORPUS_DIR", tempfile.mkdtemp(prefix="tlab-corpora-"))
# Hugging Face's libraries offline, their caches (data sets, the code of exported models)
# in a scratch folder of this test session
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="tlab-hf-"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _glibc_malloc(monkeypatch) -> None:
    """A run trained in the test's own process leaves its malloc as glibc set it: what
    ``keep_freed_memory`` sets lasts for the process (a pytest worker runs hundreds of
    tests). Runs in a process of their own (``tlab-train``) and tests/run/test_memory.py
    set it."""
    monkeypatch.setattr(memory, "libc_mallopt", lambda: None)


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
