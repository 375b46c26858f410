"""The Zoology MQAR presets (Arora et al., 2023, Figure 2): the cell's settings, the sizes
as a config group, and the grid sweep run end to end at a tiny size."""

from __future__ import annotations

import csv

import pytest
from hydra import compose, initialize_config_dir

from tests.sweeps.test_sweeps import sweep_dir_of, tlab_train
from transformers_lab.config import CONF_DIR


@pytest.fixture
def composed(monkeypatch, tmp_path):
    monkeypatch.setenv("TLAB_ROOT", str(tmp_path))

    def run(*overrides: str, hydra: bool = False):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("train", list(overrides), return_hydra_config=hydra)

    return run


def test_the_zoology_cell_holds_the_papers_settings(composed):
    cfg = composed("experiment=zoology_mqar")
    assert (cfg.data.vocab_size, cfg.data.block_size, cfg.data.num_kv_pairs) == (8192, 64, 4)
    assert (cfg.data.train_examples, cfg.data.val_examples, cfg.data.batch_size) == (
        100_000,
        3_000,
        512,
    )
    assert (cfg.data.power_a, cfg.data.random_non_queries) == (0.01, False)
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.mlp_ratio) == (2, 1, 0)
    assert (cfg.model.dropout, cfg.model.pos_encoding) == (0.1, "learned")
    assert cfg.optimizer.weight_decay == 0.1 and cfg.scheduler.min_lr_ratio == 0.0
    assert cfg.optimizer.lr == 1e-2  # the best of Zoology's grid for this cell
    assert cfg.scheduler.max_steps == 64 * 196  # Zoology's cosine horizon: 64 epochs
    assert cfg.callbacks.early_stopping.stopping_threshold == 0.99


@pytest.mark.parametrize(
    "size, expected",
    [
        ("64x4", (64, 4, 512)),
        ("128x8", (128, 8, 512)),
        ("256x16", (256, 16, 256)),
        ("512x64", (512, 64, 128)),
    ],  # fmt: skip
)
def test_each_size_sets_length_pairs_and_zoologys_batch(composed, size, expected):
    cfg = composed("experiment=zoology_mqar", f"mqar_size={size}")
    assert (cfg.data.block_size, cfg.data.num_kv_pairs, cfg.data.batch_size) == expected
    # a size given key by key still wins over the group
    cfg = composed("experiment=zoology_mqar", f"mqar_size={size}", "data.num_kv_pairs=2")
    assert cfg.data.num_kv_pairs == 2


def test_the_sweep_is_the_figure_grid_with_its_statistics(composed):
    cfg = composed("sweep=zoology_mqar", hydra=True)
    params = cfg.hydra.sweeper.params
    kernels = params.attention.split(",")
    assert kernels[0] == "softmax" and len(kernels) == 8
    assert {"fastmax_p2", "based", "linear", "performer", "cosformer", "sigmoid"} <= set(kernels)
    assert set(params) == {"attention", "model.d_model", "mqar_size", "optimizer.lr"}
    assert (str(params["model.d_model"]), params.mqar_size) == ("64", "64x4")  # the CPU scale
    assert cfg.summary.baseline == "attention=softmax"
    assert list(cfg.summary.best_over) == ["optimizer.lr"]
    assert list(cfg.summary.grid) == ["model.d_model", "attention", "mqar_size"]


@pytest.mark.slow  # a multirun of 8 jobs through tlab-train
def test_a_tiny_zoology_sweep_writes_the_figure_and_the_table(tmp_path):
    """2 kernels x 2 widths x 2 learning rates at a toy size: the grid keeps the best
    learning rate of each (kernel, width) and draws one line per kernel."""
    proc = tlab_train(
        "sweep=zoology_mqar",
        "attention=softmax,linear",  # the command line's lists replace the preset's
        "model.d_model=16,32",
        "mqar_size=64x4",
        "optimizer.lr=1e-3,1e-2",
        "data.vocab_size=64",
        "data.train_examples=64",
        "data.val_examples=32",
        "data.batch_size=32",
        "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false",
        "logger=csv",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = sweep_dir_of(tmp_path)
    with (sweep / "summary.csv").open() as f:
        jobs = list(csv.DictReader(f))
    assert len(jobs) == 8 and all(j["status"] == "ok" for j in jobs)
    grid = (sweep / "grid.md").read_text()
    for kernel in ("softmax", "linear"):
        for width in ("16", "32"):
            assert f"| 64x4 | {kernel} | {width} |" in grid
    assert (sweep / "grid.png").stat().st_size > 0
    summary = (sweep / "summary.md").read_text()
    assert "the setting of optimizer.lr with the best mean over seeds" in summary
    # each kernel is compared with softmax at its own width (one seed: no test, a difference)
    compared = [line for line in summary.splitlines() if "| — (Welch t, n<3) |" in line]
    assert sorted(line.split(" | ")[0] for line in compared) == [
        "| attention=linear model.d_model=16",
        "| attention=linear model.d_model=32",
    ]
