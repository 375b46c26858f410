"""checkpoints: reading one, once and safely, its step, and refusing one that does not fit
the run."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from transformers_lab.errors import ConfigError
from transformers_lab.run.checkpoints import (
    SavedCheckpoint,
    check_resume,
    check_weights,
    checkpoint_step,
    differences,
    read_checkpoint,
)


def load_checkpoint(path):
    return read_checkpoint(path).contents


def saved(contents, path="c.ckpt"):
    return SavedCheckpoint(path, contents)


def test_a_missing_or_foreign_file_is_refused_with_what_to_give(tmp_path):
    with pytest.raises(ConfigError, match=r"no checkpoint at .*nope.ckpt; give ckpt_path="):
        load_checkpoint(tmp_path / "nope.ckpt")
    (tmp_path / "junk.ckpt").write_text("junk")
    with pytest.raises(ConfigError, match="junk.ckpt is not a checkpoint"):
        load_checkpoint(tmp_path / "junk.ckpt")
    torch.save([1, 2], tmp_path / "list.ckpt")
    with pytest.raises(ConfigError, match="it holds a list"):
        load_checkpoint(tmp_path / "list.ckpt")


def test_an_earlier_version_s_context_key_is_read_as_block_size(tmp_path):
    """Transformer, EncoderClassifier and the translation data called their context
    ``max_len``: a checkpoint saved then loads with ``block_size`` (a user's class keeps
    its own names), and a kernel whose module moved is found in its new one."""
    old_kernel = {"_target_": "transformers_lab.attention.elu.LinearAttention"}
    config = {
        "model": {
            "_target_": "transformers_lab.models.Transformer",
            "max_len": 32,
            "attention": old_kernel,
        },
        "data": {"_target_": "transformers_lab.data.TranslationDataModule", "max_len": 32},
        "task": {"_target_": "my.Task", "max_len": 5},
    }
    torch.save({"state_dict": {}, "tlab_config": config}, tmp_path / "old.ckpt")
    saved = load_checkpoint(tmp_path / "old.ckpt")["tlab_config"]
    new_kernel = {"_target_": "transformers_lab.attention.linear.LinearAttention"}
    assert saved["model"] == {
        "_target_": "transformers_lab.models.Transformer",
        "block_size": 32,
        "attention": new_kernel,  # the module that moved, followed
    }
    assert saved["data"]["block_size"] == 32 and "max_len" not in saved["data"]
    assert saved["task"]["max_len"] == 5
    mine = {"model": {"_target_": "my.Model", "max_len": 7}}
    torch.save({"state_dict": {}, "tlab_config": mine}, tmp_path / "mine.ckpt")
    assert load_checkpoint(tmp_path / "mine.ckpt")["tlab_config"]["model"]["max_len"] == 7


def test_the_step_a_checkpoint_was_saved_at(tmp_path):
    torch.save({"global_step": 42, "state_dict": {}}, tmp_path / "a.ckpt")
    assert checkpoint_step(tmp_path / "a.ckpt") == 42
    assert checkpoint_step(tmp_path / "gone.ckpt") is None


def test_differences_name_keys_and_values_and_swapped_classes():
    old = {"model": {"d_model": 64, "attention": {"_target_": "a.Soft", "p": 1}}, "data": {"x": 1}}
    new = {"model": {"d_model": 32, "attention": {"_target_": "a.Fast", "q": 2}}, "data": {}}
    assert differences(old, new) == [
        "data.x: 1 -> (absent)",
        "model.attention._target_: 'a.Soft' -> 'a.Fast'",
        "model.d_model: 64 -> 32",
    ]
    assert differences(old, new, allowed=["model", "data.x"]) == []


def test_an_option_added_later_with_a_null_default_is_no_difference():
    """A checkpoint saved before GPT had ``bottleneck`` resumes into today's config, where
    it is null; a value that means something is still a difference."""
    old = {"model": {"d_model": 64}}
    assert differences(old, {"model": {"d_model": 64, "bottleneck": None}}) == []
    assert differences(old, {"model": {"d_model": 64, "bottleneck": True}}) == [
        "model.bottleneck: (absent) -> True"
    ]


def test_an_option_added_later_at_its_classs_default_is_no_difference():
    """A MNIST checkpoint saved before ``as_sequence`` existed resumes into today's
    config, where it is false, the data module's default; true is a difference, and a
    class that cannot be found gives no default."""
    target = "transformers_lab.data.MNISTDataModule"
    old = {"data": {"_target_": target, "batch_size": 64}}
    same = {"data": {"_target_": target, "batch_size": 64, "as_sequence": False}}
    assert differences(old, same) == [] and differences(same, old) == []
    other = {"data": {"_target_": target, "batch_size": 64, "as_sequence": True}}
    assert differences(old, other) == ["data.as_sequence: (absent) -> True"]
    gone = {"data": {"_target_": "no.such.Module", "batch_size": 64, "as_sequence": False}}
    old_gone = {"data": {"_target_": "no.such.Module", "batch_size": 64}}
    assert differences(old_gone, gone) == ["data.as_sequence: (absent) -> False"]


def test_weights_of_another_shape_are_refused_with_the_config_that_changed():
    module = torch.nn.Linear(2, 3)
    shapes = {"state_dict": {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}}
    with pytest.raises(ConfigError, match=r"different model config \(1 tensors \(weight\)\)"):
        check_weights(saved(shapes), module)
    changed = check_resume(
        saved({"tlab_config": {"model": {"d": 4}}}), {"model": {"d": 2}}, ["model"]
    )
    assert changed == ["model.d: 4 -> 2"]  # allowed to change, and named when shapes differ
    with pytest.raises(ConfigError, match=r"\(model.d: 4 -> 2\)"):
        check_weights(saved(shapes), module, changed)
    check_weights(saved({"state_dict": module.state_dict()}), module)


def test_a_resume_with_another_config_names_each_change(tmp_path):
    checkpoint = {"tlab_config": {"model": {"n": 2}, "data": {"root": "/a", "size": 1}}}
    check_resume(saved(checkpoint), {"model": {"n": 2}, "data": {"root": "/b", "size": 1}})
    with pytest.raises(ConfigError, match=r"data.size: 1 -> 2.*resume_may_change"):
        check_resume(saved(checkpoint), {"model": {"n": 2}, "data": {"root": "/a", "size": 2}})
    check_resume(saved(checkpoint), {"model": {"n": 2}, "data": {"size": 2}}, ["data"])
    check_resume(saved({}), {"model": {"n": 3}})  # no saved config: shapes only, later


def test_a_key_resume_may_change_does_not_have_is_refused_with_the_nearest():
    """``optimizer.lr`` is ``task.optimizer.lr`` in the sections a checkpoint holds: listed
    as it is, it would allow nothing, and the run would be refused for the change anyway."""
    config = {"task": {"optimizer": {"lr": 1e-3}}, "model": {"dropout": 0.1}}
    checkpoint = {"tlab_config": config}
    now = {"task": {"optimizer": {"lr": 1e-2}}, "model": {"dropout": 0.1}}
    with pytest.raises(ConfigError, match=r"optimizer.lr names no key .*did you mean task.opt"):
        check_resume(saved(checkpoint), now, ["optimizer.lr"])
    with pytest.raises(ConfigError, match=r"model.drpout names no .*did you mean model.dropout\?"):
        check_resume(saved(checkpoint), now, ["model.drpout"])
    with pytest.raises(ConfigError, match=r"nope names no key .*\(--cfg job prints them\)"):
        check_resume(saved({}), now, ["nope"])  # checked without a saved config too
    check_resume(saved(checkpoint), now, ["task.optimizer.lr"])
    check_resume(saved(checkpoint), now, ["task.optimizer", "model"])  # whole sections


def test_a_saved_run_takes_the_command_lines_data_options():
    checkpoint = {"tlab_config": {"model": {"d": 1}, "data": {"batch_size": 8, "root": "/a"}}}
    run = saved(checkpoint).run_config(OmegaConf.create({"batch_size": 64}))
    assert run.data == {"batch_size": 64, "root": "/a"} and run.model == {"d": 1}
    with pytest.raises(ConfigError, match="c.ckpt holds no tlab_config: it was not written"):
        saved({}).run_config()


def test_weights_that_do_not_fit_are_refused_and_fitting_ones_pass():
    task = torch.nn.Module()
    task.model = torch.nn.Linear(2, 2)  # a task's parameter names are "model.*"
    state = {f"model.{k}": torch.ones_like(v) for k, v in task.model.state_dict().items()}
    check_weights(saved({"state_dict": state}), task)
    state["model.weight"] = torch.ones(3, 2)
    with pytest.raises(ConfigError, match="c.ckpt was saved from a different model config"):
        check_weights(saved({"state_dict": state}), task)


def test_only_our_models_checkpoints_have_their_block_keys_renamed(tmp_path):
    """``blocks.0.attn`` of an earlier version is ``blocks.0.mixer``; a model of the user's
    whose own keys say ``attn`` keeps them."""
    from transformers_lab.nn.layers import migrate_block_keys

    state = {"model.blocks.0.attn.w": torch.ones(1), "model.blocks.0.norm_attn.w": torch.ones(1)}
    theirs = {"tlab_config": {"model": {"_target_": "mine.Net"}}, "state_dict": dict(state)}
    ours = {"tlab_config": {"model": {"_target_": "transformers_lab.models.GPT"}}}
    ours["state_dict"] = dict(state)
    for name, checkpoint in (("theirs", theirs), ("ours", ours)):
        torch.save(checkpoint, tmp_path / f"{name}.ckpt")
    assert set(load_checkpoint(tmp_path / "theirs.ckpt")["state_dict"]) == set(state)
    renamed = {"model.blocks.0.mixer.w", "model.blocks.0.norm_mixer.w"}
    assert set(load_checkpoint(tmp_path / "ours.ckpt")["state_dict"]) == renamed
    keys = {"a.0.attn.w": 1, "b.0.attn.w": 2}
    assert migrate_block_keys(keys, prefix="a.0.") == 1 and set(keys) == {
        "a.0.mixer.w",
        "b.0.attn.w",
    }


class Planted:
    """Pickled, a call of ``exec`` that writes ``path``: what a crafted checkpoint does."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return exec, (f"open({str(self.path)!r}, 'w').write('ran')",)


def test_a_checkpoint_that_would_run_code_is_refused_unless_trusted(tmp_path):
    """Only tensors and plain values are unpickled: a checkpoint that calls a function
    of its own choosing is refused in one line naming it, and nothing runs; with
    ``trust_checkpoint=true`` (``trust``) it loads as torch would."""
    ran = tmp_path / "ran"
    torch.save({"state_dict": {}, "x": Planted(ran)}, tmp_path / "planted.ckpt")
    with pytest.raises(ConfigError, match=r"asks to run exec as it loads .* trust_checkpoint=t"):
        read_checkpoint(tmp_path / "planted.ckpt")
    assert not ran.exists()
    read_checkpoint(tmp_path / "planted.ckpt", trust=True)
    assert ran.read_text() == "ran"


def test_a_checkpoint_of_torchs_old_format_is_read_without_mapping(tmp_path):
    torch.save({"global_step": 3}, tmp_path / "old.ckpt", _use_new_zipfile_serialization=False)
    assert read_checkpoint(tmp_path / "old.ckpt").step == 3


def test_lightnings_own_restore_reads_as_safely(tmp_path):
    """Lightning's restore goes through the writer's ``load_checkpoint``: refused as ours
    is, loaded when the run trusts the file (Lightning's ``weights_only=False``)."""
    from transformers_lab.run.checkpoints import AtomicCheckpointIO

    ran = tmp_path / "ran"
    torch.save({"state_dict": {}, "x": Planted(ran)}, tmp_path / "planted.ckpt")
    with pytest.raises(ConfigError, match="asks to run exec as it loads"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "planted.ckpt")
    assert not ran.exists()
    AtomicCheckpointIO().load_checkpoint(tmp_path / "planted.ckpt", weights_only=False)
    assert ran.exists()
