"""safety, unit by unit (the end-to-end runs are in test_robustness.py)."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from transformers_lab.errors import ConfigError
from transformers_lab.run.callbacks.safety import (
    NonFiniteGuard,
    all_finite,
    random_states,
    set_random_states,
)
from transformers_lab.run.checkpoints import AtomicCheckpointIO, Checkpoint
from transformers_lab.run.fit import interrupted
from transformers_lab.run.record import Interrupted


def test_all_finite_sees_a_nan_or_inf_anywhere():
    assert all_finite([]) and all_finite([torch.ones(3), torch.zeros(2, 2)])
    assert not all_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([float("-inf")])])
    assert all_finite([torch.full((4,), 3e38)])  # a norm that overflows is checked again


def test_random_states_put_back_replay_every_generator():
    states = random_states()
    first = (torch.rand(3), np.random.rand(), random.random())  # noqa: NPY002
    set_random_states(states)
    again = (torch.rand(3), np.random.rand(), random.random())  # noqa: NPY002
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


def test_an_unlogged_monitor_names_the_logged_metrics():
    callback = Checkpoint(monitor="val/los")
    with pytest.raises(ConfigError, match=r"val/los is not a metric .* logs: val/acc, val/loss"):
        callback.check_monitor({"val/loss": 1, "val/acc": 2, "epoch": 0})
    callback.check_monitor({"val/los": 1})


def test_the_first_bad_parameter_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
        model[1].bias[0] = float("inf")
    what = NonFiniteGuard.first_bad(model, "data")
    assert what == "the weight 1.weight is not finite (and 1 more)"


def fake_trainer(last: str, best: str = "", score: float | None = None, step: int = 7):
    callback = types.SimpleNamespace(
        last_model_path=last, best_model_path=best, best_model_score=score
    )
    return types.SimpleNamespace(checkpoint_callback=callback, global_step=step, callbacks=[])


def test_interrupted_says_how_to_resume_with_the_same_overrides():
    exc = interrupted(fake_trainer("/r/last.ckpt", "/r/best.ckpt", 0.5), ["a=1", "ckpt_path=x"])
    assert isinstance(exc, Interrupted) and exc.exit_code == 128 + 15  # SIGTERM
    assert str(exc).endswith("resume with tlab-train a=1 ckpt_path=/r/last.ckpt")
    assert (exc.checkpoint, exc.best, exc.best_score) == ("/r/last.ckpt", "/r/best.ckpt", 0.5)
    nothing = interrupted(fake_trainer(""), [])
    assert "nothing saved" in str(nothing) and nothing.checkpoint is None


@pytest.mark.parametrize("study", [False, True], ids=["hydra-sweeper", "optuna"])
def test_a_stopped_sweep_job_says_how_to_finish_its_sweep_not_to_rerun_the_job(
    tmp_path, monkeypatch, study
):
    """A job's own overrides hold sweep=... (and trial=N): rerun as they are, they start a
    new sweep. A sweep job names its sweep's command and dir instead."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from transformers_lab.run import overrides as hydra_job

    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    master = ["sweep=attention_kernels", "trainer.max_steps=9"]
    # a user's config dir on the search path: the command must keep it to find their kernel
    given = [
        "hydra.searchpath=[file:///u/my_conf]",
        f"hydra.sweep.dir={sweep_dir}",
        "hydra.mode=MULTIRUN",
    ]
    overrides = {"hydra": given, "task": master}
    OmegaConf.save({"hydra": {"overrides": overrides}}, sweep_dir / "multirun.yaml")
    sweeper = {"study_name": "lr"} if study else {}
    hydra_cfg = OmegaConf.create(
        {"mode": RunMode.MULTIRUN, "sweep": {"dir": str(sweep_dir)}, "sweeper": sweeper}
    )
    monkeypatch.setattr(hydra_job, "hydra_config", lambda: hydra_cfg)
    own = ["sweep=attention_kernels", "trainer.max_steps=9", "attention=dot", "trial=3"]
    exc = interrupted(fake_trainer("/r/1/last.ckpt"), own, hydra_job.sweep_resume())
    message = str(exc)
    command = (
        "tlab-train -m 'hydra.searchpath=[file:///u/my_conf]' sweep=attention_kernels "
        f"trainer.max_steps=9 hydra.sweep.dir={sweep_dir}"
    )
    if study:
        assert message.endswith(f"resume its study with {command} (this trial is given up, "
                                "its slot asked again)")  # fmt: skip
    else:
        assert message.endswith(f"finish its sweep with {command} skip_finished=true (this "
                                "job resumes from it)")  # fmt: skip
    assert "attention=dot" not in message and "trial=3" not in message
    monkeypatch.setattr(hydra_job, "hydra_config", lambda: None)  # a run of its own
    assert hydra_job.sweep_resume() is None


def test_a_checkpoint_is_written_whole_and_readable(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"w": torch.arange(3)}, tmp_path / "c" / "last.ckpt")
    assert torch.equal(torch.load(tmp_path / "c" / "last.ckpt")["w"], torch.arange(3))
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["last.ckpt"]
    with pytest.raises(TypeError, match="no storage_options"):
        io.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={})


def test_lightning_s_private_sigterm_flag_is_still_what_its_loop_reads():
    """``StopOnSignal`` sets ``trainer._signal_connector.received_sigterm`` (private; no
    public way to end fit() on Lightning's SIGTERM path, checked on 2.6.6): this fails
    when a Lightning release renames it or the property its loops read stops following it
    (the stop itself, end to end: test_robustness.py)."""
    import lightning as L

    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert trainer._signal_connector.received_sigterm is False
    assert trainer.received_sigterm is False
    trainer._signal_connector.received_sigterm = True
    assert trainer.received_sigterm is True  # the property the fit loop reads
