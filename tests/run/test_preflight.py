"""preflight: a composed config refused before anything is built, in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from transformers_lab.errors import ConfigError
from transformers_lab.run.components import build_on_meta
from transformers_lab.run.preflight import check_components, check_config
from transformers_lab.run.values import (
    NULL,
    POSITIVE_INT,
    PRECISION_NAMES,
    PRECISIONS,
    RULES,
    check_missing,
    check_rules,
    check_values,
)


def test_the_precisions_written_out_are_lightnings():
    from typing import get_args

    from lightning.fabric.plugins.precision.precision import (
        _PRECISION_INPUT,
        _PRECISION_INPUT_STR,
    )

    assert get_args(_PRECISION_INPUT_STR) == PRECISION_NAMES
    assert sorted(map(str, PRECISIONS)) == sorted(
        str(value) for literal in get_args(_PRECISION_INPUT) for value in get_args(literal)
    )


def test_the_values_module_imports_neither_torch_nor_lightning():
    import subprocess
    import sys

    code = (
        "import sys, transformers_lab.run.values, transformers_lab.cli;"
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_expectations_compose_with_or():
    either = NULL | POSITIVE_INT
    assert either.test(None) and either.test(3) and not either.test(0)
    assert not either.test(True)  # a bool is no integer here
    assert either.text == "null or an integer >= 1"


def test_rules_name_the_key_and_the_value_and_skip_absent_keys():
    check_rules(OmegaConf.create({"model": {"d_model": 64}}))  # keys it lacks are skipped
    with pytest.raises(
        ConfigError, match=r"^trainer.max_steps must be -1 \(no limit\) or an integer >= 1, got 0$"
    ):
        check_rules(OmegaConf.create({"trainer": {"max_steps": 0}}))
    with pytest.raises(ConfigError, match=r"optimizer.betas must be two numbers in \[0, 1\)"):
        check_rules(OmegaConf.create({"optimizer": {"betas": [0.9, 1.0]}}))
    with pytest.raises(ConfigError, match="cpu_threads must be null or an integer >= 1, got 'x'"):
        check_rules(OmegaConf.create({"cpu_threads": "x"}))
    assert all(isinstance(k, str) for k in RULES)


def test_missing_values_and_components_without_a_target():
    with pytest.raises(ConfigError, match="ckpt_path is required: give ckpt_path=..."):
        check_missing(OmegaConf.create({"ckpt_path": "???"}))
    with pytest.raises(ConfigError, match="unknown logger 'wandbb'"):
        check_components(OmegaConf.create({"logger": {"wandbb": {"project": "x"}}}))
    check_components(OmegaConf.create({"logger": {"csv": None}}))  # switched off


def model(**kw):
    """A run's config whose model is a GPT of these options, on data of context 64."""
    base = {"_target_": "transformers_lab.models.GPT", "vocab_size": None, "block_size": None}
    base |= {"d_model": 32, "n_head": 4, "n_layer": 1, "attention": "softmax"}
    return OmegaConf.create({"model": base | kw, "data": {"block_size": 64}})


def test_the_model_is_built_on_the_meta_device_and_refuses_in_its_own_words():
    build_on_meta(model())
    with pytest.raises(ConfigError, match="^model: d_model=30 must be divisible by n_head=4"):
        build_on_meta(model(d_model=30))
    with pytest.raises(ConfigError, match="^attention: rope needs an even head dim.*head_dim=9"):
        build_on_meta(model(d_model=36, pos_encoding="rope"))
    with pytest.raises(ConfigError, match="^attention: unknown attention kernel 'soft'"):
        build_on_meta(model(attention="soft"))
    with pytest.raises(ConfigError, match="^attention: pos_encoding=alibi adds a bias"):
        build_on_meta(model(attention="linear", pos_encoding="alibi"))
    cos = {"_target_": "transformers_lab.attention.cosformer.CosFormerAttention"}
    cos["_partial_"] = True
    with pytest.raises(ConfigError, match="max_len=1024, but the GPT's context is 2048"):
        build_on_meta(model(attention=cos, block_size=2048))
    typo = {"_target_": "transformers_lab.attention.CosformerAttention", "_partial_": True}
    with pytest.raises(ConfigError, match=r"^model.attention: cannot import its _target_ 'tra"):
        build_on_meta(model(attention=typo))


def test_the_data_s_context_stands_in_for_a_null_block_size():
    """A kernel that weighs positions up to 32 is refused on data of context 64 before the
    data is read; the same kernel is fine where the data's context is 32."""
    cos = {"_target_": "transformers_lab.attention.cosformer.CosFormerAttention"}
    short = cos | {"_partial_": True, "max_len": 32}
    with pytest.raises(ConfigError, match="max_len=32, but the GPT's context is 64"):
        build_on_meta(model(attention=short))
    fits = model(attention=short)
    fits.data.block_size = 32
    build_on_meta(fits)


def test_a_model_that_needs_a_size_only_its_data_gives_is_left_to_the_real_build():
    odd = OmegaConf.create({"model": {"_target_": "torch.nn.Linear", "bias": True}})
    build_on_meta(odd)  # in_features, out_features: no stand-in, no build, no refusal


def test_a_run_that_never_stops_or_validates_for_nothing():
    with pytest.raises(ConfigError, match="never stops"):
        check_config(OmegaConf.create({"trainer": {"max_epochs": -1, "max_steps": -1}}))
    stopper = {"_target_": "lightning.pytorch.callbacks.EarlyStopping", "monitor": "val/acc"}
    no_val = {"trainer": {"limit_val_batches": 0}, "callbacks": {"early_stopping": stopper}}
    with pytest.raises(ConfigError, match="limit_val_batches=0 runs no validation, but callbac"):
        check_config(OmegaConf.create(no_val))
    no_val["callbacks"]["early_stopping"] = None
    check_config(OmegaConf.create(no_val))  # nothing watches validation: fine
    # a checkpoint path with nothing there is refused before torch (its contents are read
    # when it is loaded: test_bad_inputs); a folder may be a sharded checkpoint
    with pytest.raises(ConfigError, match="^no checkpoint at /nowhere.ckpt; give ckpt_path="):
        check_values(OmegaConf.create({"ckpt_path": "/nowhere.ckpt"}))
    check_values(OmegaConf.create({"ckpt_path": str(Path(__file__).parent)}))


def test_values_have_the_types_their_constructor_declares():
    gpt = {"_target_": "transformers_lab.models.GPT", "block_size": None, "bias": "yes"}
    with pytest.raises(ConfigError, match=r"^model.bias must be true or false \(GPT takes bias"):
        check_config(OmegaConf.create({"model": gpt}))
    vit = {"_target_": "transformers_lab.models.ViT", "act": 1}  # through EncoderClassifier
    with pytest.raises(ConfigError, match=r"^model.act must be a string \(ViT takes act: str\)"):
        check_config(OmegaConf.create({"model": vit}))
    fastmax = {"_target_": "transformers_lab.attention.FastmaxAttention", "p": "two"}
    with pytest.raises(ConfigError, match=r"^model.attention.p must be an integer"):
        check_config(OmegaConf.create({"model": {"attention": fastmax}}))
    data = {"_target_": "transformers_lab.data.DigitsDataModule", "seed": 1.5}
    with pytest.raises(ConfigError, match=r"^data.seed must be an integer"):
        check_config(OmegaConf.create({"data": data}))
    fine = {"_target_": "transformers_lab.models.GPT", "block_size": None, "mlp_ratio": 4}
    check_config(OmegaConf.create({"model": fine}))  # an int is a number; null is the data's
    other = {"_target_": "torch.nn.Linear", "bias": "yes"}  # not ours: its own checks
    check_config(OmegaConf.create({"model": other}))


def test_a_build_that_reads_its_values_falls_back_from_meta_to_the_cpu():
    """The meta device has no values: a user's kernel that reads a tensor's value while it
    is built (.numpy(), .item()) is built on the CPU instead, not refused; a refusal of its
    own (ValueError) goes up."""
    import torch

    from transformers_lab.run.components import on_meta

    assert on_meta(lambda: torch.ones(2).numpy()).tolist() == [1.0, 1.0]
    assert on_meta(lambda: torch.ones(2)).device.type == "meta"  # the cheap path first
    with pytest.raises(ValueError, match="mine"):
        on_meta(lambda: (_ for _ in ()).throw(ValueError("mine")))


def test_a_hybrid_layer_is_held_to_the_model_s_rules_before_the_data():
    gpt = {"_target_": "transformers_lab.models.GPT", "n_layer": 2}
    cos = {"_target_": "transformers_lab.attention.cosformer.CosFormerAttention"}
    short = OmegaConf.create(cos | {"_partial_": True, "max_len": 8})
    with pytest.raises(ConfigError, match=r"layer 1 .*max_len=8, but the GPT's context is 64"):
        build_on_meta(model(**gpt, block_size=64, hybrid={1: short}))
    fast = {"_target_": "transformers_lab.attention.fastmax.FastmaxAttention", "_partial_": True}
    future = OmegaConf.create(fast | {"normalize": "sequence_max"})
    with pytest.raises(ConfigError, match=r"^model.hybrid, layer 0 .*GPT attends causally"):
        build_on_meta(model(**gpt, block_size=64, hybrid={0: future}))


def test_a_summary_key_is_a_key_of_the_config_or_a_config_group():
    """A misspelt key is refused with the key meant; a group's choice (``mqar_size``, a
    global package with no node of its own) and a node (``data``) are keys a summary
    groups by, as tlab-summarize takes them."""
    from transformers_lab.run.values import check_summary_keys

    cfg = OmegaConf.create({"optimizer": {"lr": 1e-3}, "data": {"n": 1}, "summary": {}})
    for keys in (["optimizer.lr"], ["data"], ["mqar_size"], ["experiment"]):
        cfg.summary = {"best_over": keys, "mean_over": []}
        check_summary_keys(cfg)
    cfg.summary = {"best_over": ["optimizer.lrr"]}
    with pytest.raises(ConfigError, match=r"optimizer.lrr is no key .*did you mean optimizer.lr"):
        check_summary_keys(cfg)


def test_an_entry_point_s_options_are_typed_then_held_to_their_own_rules():
    """``typed_options``: a value of the wrong type is refused with the type its field
    declares; a value in range goes to the dataclass, whose own rule refuses the rest."""
    from dataclasses import dataclass

    from transformers_lab.run.values import typed_options

    @dataclass(frozen=True)
    class Options:
        count: int = 1
        limit: int | None = None

        def __post_init__(self):
            if self.count < 1:
                raise ValueError(f"count must be >= 1, got {self.count}")

    assert typed_options(Options, OmegaConf.create({"count": 3, "other": "x"})) == Options(3)
    with pytest.raises(ConfigError, match=r"^limit must be an integer or null, got 'x'$"):
        typed_options(Options, OmegaConf.create({"limit": "x"}))
    with pytest.raises(ConfigError, match=r"^count must be >= 1, got 0$"):
        typed_options(Options, OmegaConf.create({"count": 0}))


def test_a_key_of_the_rules_is_no_constructor_s_own():
    """A key is validated in one place. ``RULES`` holds only keys that no constructor of
    ours owns (the entry points', the optimizer's, Lightning's trainer's): a key of the
    model, data, task or schedule is its constructor's, which the preflight calls early
    (``build_on_meta``, ``check_schedule``). Each of those keys is then refused by that
    constructor, in its own words, and RULES has no second rule for it."""
    ours = ("model.", "data.", "task.", "scheduler.")
    assert not [key for key in RULES if key.startswith(ours)]
    mqar = ["experiment=mqar"]  # a GPT, MQAR's data, the language-model task, warm-up cosine
    owners = {  # a key of each section, and the constructor's refusal of a bad value
        "data.batch_size=0": "refuses data.batch_size=0: batch_size must be an integer >= 1",
        "model.n_head=0": "model.n_head must be an integer >= 1, got 0",
        "task.sample_tokens=-1": "task: sample_tokens must be an integer >= 0, got -1",
        "scheduler.min_lr_ratio=2.0": "scheduler.min_lr_ratio must be a number in [0, 1]",
    }
    from transformers_lab.config import compose_config

    for override, said in owners.items():
        cfg = compose_config("train", [*mqar, override], "/tmp/r")
        with pytest.raises(ConfigError, match=re.escape(said)):
            check_config(cfg)
    cfg = compose_config(
        "train", ["experiment=transformer_multi30k", "task.max_decode_len=0"], "/r"
    )
    with pytest.raises(ConfigError, match="task: max_decode_len must be an integer >= 1, got 0"):
        check_config(cfg)


def test_stand_ins_are_only_what_the_data_gives():
    """An encoder of token data (patch_size null) gets a vocabulary, not an image: its own
    refusal of both or neither is not met by a stand-in."""
    encoder = {"_target_": "transformers_lab.models.EncoderClassifier", "num_classes": None}
    encoder |= {"image_size": None, "patch_size": None, "in_channels": None, "n_head": 2}
    build_on_meta(OmegaConf.create({"model": encoder, "data": {"block_size": 16}}))
    patches = encoder | {"patch_size": 4}
    build_on_meta(OmegaConf.create({"model": patches, "data": {}}))


def test_each_schedule_is_held_to_its_own_rule_in_one_line():
    from transformers_lab.config import compose_config

    cases = {
        ("scheduler.min_lr_ratio=low",): "scheduler.min_lr_ratio must be a number in [0, 1]",
        ("scheduler.warmup_steps=-5",): "scheduler.warmup_steps must be an integer >= 0",
        ("scheduler=noam", "scheduler.warmup_steps=0"): "scheduler.warmup_steps must be an",
    }
    for overrides, said in cases.items():
        cfg = compose_config("train", ["experiment=mqar", *overrides], "/tmp/r")
        with pytest.raises(ConfigError, match=re.escape(said)):
            check_config(cfg)
