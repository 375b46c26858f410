"""run.fit: the final test, a resume with nothing left, the metrics printed."""

from __future__ import annotations

import lightning as L
import torch
from omegaconf import OmegaConf

from transformers_lab.run.components import Components
from transformers_lab.run.fit import final_test, nothing_left_to_train
from transformers_lab.run.record import metrics_dict, print_metrics


def test_metrics_become_sorted_floats(capsys):
    metrics = metrics_dict({"val/loss": torch.tensor(1.5), "val/acc": 0.25})
    assert list(metrics) == ["val/acc", "val/loss"] and metrics["val/loss"] == 1.5
    print_metrics(metrics)
    assert capsys.readouterr().out == "final metrics:\n  val/acc: 0.25\n  val/loss: 1.5\n"


def test_a_data_module_without_a_test_split_ends_with_validation(capsys):
    class NoTest(L.LightningDataModule):
        pass

    parts = Components(NoTest(), torch.nn.Linear(1, 1), None)
    assert final_test(None, parts, "best.ckpt", trained=True, trust=False) == {}
    assert "NoTest has no test split" in capsys.readouterr().out


def test_nothing_left_to_train_says_which_limit_to_raise():
    cfg = OmegaConf.create({"ckpt_path": "l.ckpt", "trainer": {"max_epochs": 2, "max_steps": -1}})
    text = nothing_left_to_train(cfg, 40)
    assert "l.ckpt is at global step 40" in text and "max_epochs=2, max_steps=-1" in text
