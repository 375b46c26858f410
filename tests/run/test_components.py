"""run.components and run.trainer: the data module sizes the model, the task gets its
detokenizer and run config, callbacks and loggers are built as their groups say."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, TQDMProgressBar
from omegaconf import OmegaConf

from transformers_lab.data import SyntheticDataModule
from transformers_lab.errors import ConfigError
from transformers_lab.models import GPT
from transformers_lab.run.components import (
    build_model,
    build_task,
    call,
    compile_model,
    model_kwargs,
)
from transformers_lab.run.trainer import build_callbacks

GPT_CONFIG = {"_target_": "transformers_lab.models.GPT", "n_layer": 1, "n_head": 2, "d_model": 16}
TASK = {
    "_target_": "transformers_lab.tasks.LanguageModelTask",
    "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3},
}


class Data:
    """A data module that provides sizes, and detokenizes."""

    def model_kwargs(self):
        return {"vocab_size": 10, "block_size": 8}

    def tokenize(self, text):
        return [int(c) for c in text]

    def detokenize(self, ids):
        return "".join(map(str, ids))


def config(**kw):
    return OmegaConf.create(GPT_CONFIG | kw)


def test_the_model_takes_what_the_data_provides_and_may_hold_more():
    assert model_kwargs(config(), Data()) == {"vocab_size": 10, "block_size": 8}
    assert model_kwargs(config(block_size=16, vocab_size=12), Data()) == {}
    model = build_model(config(), Data())
    assert isinstance(model, GPT) and model.block_size == 8


def test_sizes_that_cannot_work_are_one_line_each():
    with pytest.raises(ConfigError, match="model.block_size=4 is smaller than the data's"):
        model_kwargs(config(block_size=4), Data())
    vit = OmegaConf.create({"_target_": "transformers_lab.models.ViT"})
    expected = r"\(ViT\) cannot take data.*: .* has no block_size, vocab_size; use model=gpt"
    with pytest.raises(ConfigError, match=expected):
        model_kwargs(vit, SyntheticDataModule(train_examples=8, val_examples=8))


def test_the_task_gets_the_detokenizer_and_the_run_config():
    model = build_model(config(), Data())
    run = {"model": {"_target_": "x.Y"}}  # nodes with targets stay data, never built
    task = build_task(OmegaConf.create(TASK), model, Data(), run_config=run)
    assert task.detokenize([1, 2]) == "12" and task.run_config == run
    checkpoint: dict = {}
    task.on_save_checkpoint(checkpoint)
    assert checkpoint["tlab_config"] == run
    plain = build_task(OmegaConf.create(TASK), model, object())
    assert plain.detokenize is None and plain.run_config is None
    with pytest.raises(ConfigError, match="task: sample_every must be an integer >= 1"):
        build_task(OmegaConf.create(TASK | {"sample_every": 0}), model)


def test_callbacks_switched_off_or_pointless_are_left_out():
    group = OmegaConf.create(
        {
            "lr": {"_target_": "lightning.pytorch.callbacks.LearningRateMonitor"},
            "bar": {"_target_": "lightning.pytorch.callbacks.TQDMProgressBar"},
            "off": None,
        }
    )
    built = build_callbacks(group)
    assert [type(c) for c in built] == [LearningRateMonitor, TQDMProgressBar]
    assert build_callbacks(group, with_logger=False, progress_bar=False) == []


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_the_adam_presets_build_a_fused_optimizer_that_steps_as_the_plain_one(tmp_path, name):
    from transformers_lab.config import compose_config

    cfg = compose_config("train", ["experiment=baby_gpt", f"optimizer={name}"], tmp_path)
    model = GPT(vocab_size=10, block_size=8, n_layer=1, n_head=2, d_model=16)
    fused = build_task(cfg.task, model).optimizer_factory(params=model.parameters())
    assert fused.defaults["fused"] is True  # 2-3x faster steps on CPU than the default
    # the same update as torch's per-tensor implementation, from the same gradients
    plain = copy.deepcopy(model)
    cls = type(fused)
    accepted = set(inspect.signature(cls).parameters) - {"fused", "foreach"}
    settings = {k: v for k, v in fused.defaults.items() if k in accepted}
    reference = cls(plain.parameters(), **(settings | {"fused": None, "foreach": False}))
    for step in range(3):
        torch.manual_seed(step)
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        fused.step()
        reference.step()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_trainer_profiles_nothing_at_no_cost_unless_a_profiler_is_asked_for(tmp_path):
    from lightning.pytorch.profilers import SimpleProfiler

    from transformers_lab.config import compose_config
    from transformers_lab.run.trainer import NoProfiler, build_trainer

    cfg = compose_config("train", ["trainer.enable_progress_bar=false", "logger=csv"], tmp_path)
    trainer = build_trainer(cfg)
    assert isinstance(trainer.profiler, NoProfiler)
    with trainer.profiler.profile("a") as first, trainer.profiler.profile("b") as second:
        assert first is second is None  # one shared no-op context, nested or not
    cfg = compose_config("train", ["debug=profiler", "logger=csv"], tmp_path)
    assert isinstance(build_trainer(cfg).profiler, SimpleProfiler)


def test_compile_true_says_it_compiled_the_model(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the compiler's probe runs
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **kw: compiled.append(self))
    model = build_model(config(), Data())
    with torch._dynamo.config.patch(suppress_errors=False):  # compile_model sets it; undone
        said = compile_model(model)
    assert compiled == [model]
    assert said == (
        "compile=true: the model (GPT) runs through torch.compile (inductor), which compiles "
        "it at its first batch"
    )


def test_call_gives_the_targets_own_error_in_one_line():
    bad = OmegaConf.create({"_target_": "torch.nn.Dropout", "p": 2.0})
    with pytest.raises(ConfigError, match=r"^model: dropout probability has to be between"):
        call(bad, "model")
    missing = OmegaConf.create({"_target_": "torch.nn.NoSuchLayer"})
    with pytest.raises(ConfigError, match=r"^model: cannot import its _target_ 'torch.nn.No"):
        call(missing, "model")
    refused = OmegaConf.create(  # Lightning's own refusal, a MisconfigurationException
        {"_target_": "lightning.pytorch.callbacks.EarlyStopping", "monitor": "x", "mode": "up"}
    )
    with pytest.raises(ConfigError, match=r"^callbacks: Lightning refused it: .*mode"):
        call(refused, "callbacks")
