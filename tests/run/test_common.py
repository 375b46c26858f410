"""runs: what the entry points share about a run."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from transformers_lab.errors import ConfigError
from transformers_lab.run.common import (
    final_test,
    load_weights,
    metrics_dict,
    nothing_left_to_train,
    print_metrics,
    saved_run,
)


def test_metrics_become_sorted_floats(capsys):
    metrics = metrics_dict({"val/loss": torch.tensor(1.5), "val/acc": 0.25})
    assert list(metrics) == ["val/acc", "val/loss"] and metrics["val/loss"] == 1.5
    print_metrics(metrics)
    assert capsys.readouterr().out == "final metrics:\n  val/acc: 0.25\n  val/loss: 1.5\n"


def test_a_saved_run_takes_the_command_lines_data_options():
    checkpoint = {"tlab_config": {"model": {"d": 1}, "data": {"batch_size": 8, "root": "/a"}}}
    run = saved_run(checkpoint, "c.ckpt", OmegaConf.create({"batch_size": 64}))
    assert run.data == {"batch_size": 64, "root": "/a"} and run.model == {"d": 1}
    with pytest.raises(ConfigError, match="c.ckpt holds no tlab_config: it was not written"):
        saved_run({}, "c.ckpt", None)


def test_weights_that_do_not_fit_are_refused_and_fitting_ones_load():
    model = torch.nn.Linear(2, 2)
    state = {f"model.{k}": torch.ones_like(v) for k, v in model.state_dict().items()}
    run = OmegaConf.create({"model": {}})
    loaded = load_weights(model, {"state_dict": state}, "c.ckpt", run)
    assert not loaded.training and torch.equal(loaded.weight, torch.ones(2, 2))
    state["model.weight"] = torch.ones(3, 2)
    with pytest.raises(ConfigError, match="c.ckpt was saved from a different model config"):
        load_weights(torch.nn.Linear(2, 2), {"state_dict": state}, "c.ckpt", run)


def test_a_data_module_without_a_test_split_ends_with_validation(capsys):
    class NoTest(L.LightningDataModule):
        pass

    assert final_test(None, None, NoTest(), "best.ckpt", True) == {}
    assert "NoTest has no test split" in capsys.readouterr().out


def test_nothing_left_to_train_says_which_limit_to_raise():
    cfg = OmegaConf.create({"ckpt_path": "l.ckpt", "trainer": {"max_epochs": 2, "max_steps": -1}})
    text = nothing_left_to_train(cfg, 40)
    assert "l.ckpt is at global step 40" in text and "max_epochs=2, max_steps=-1" in text
