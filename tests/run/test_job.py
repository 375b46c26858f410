"""run.job: the job wrapper records every job from start to end."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from transformers_lab.run import job as job_module
from transformers_lab.run.job import run_job
from transformers_lab.run.record import Outcome, read_record


@pytest.fixture(autouse=True)
def outside_hydra(monkeypatch):
    """As a job run from Python: no overrides, no multirun (whatever Hydra state other
    tests left behind)."""
    monkeypatch.setattr(job_module, "job_overrides", lambda: [])
    monkeypatch.setattr(job_module, "in_multirun", lambda: False)


def cfg_for(run_dir, **kw):
    base = {
        "paths": {"output_dir": str(run_dir)},
        "monitor": {"metric": "val/acc", "mode": "max"},
        "ckpt_path": None,
        "skip_finished": False,
        "fail_fast": False,
    }
    return OmegaConf.create(base | kw)


def test_a_finished_job_records_its_outcome_and_returns_the_metric(tmp_path):
    def fit(cfg, checkpoint):
        assert read_record(tmp_path).status == "running"  # known as running meanwhile
        return Outcome({"val/acc": 0.5, "val/loss": 1.0}, 0.6, 10, {"best": "b", "last": "l"}, 7)

    assert run_job(cfg_for(tmp_path), fit) == 0.5
    record = read_record(tmp_path)
    assert (record.status, record.objective, record.monitor.best) == ("ok", 0.5, 0.6)
    assert (record.params, record.state_size, record.error) == (10, 7, None)
    assert record.time_s is not None and record.run_dir == str(tmp_path)


def test_a_failed_job_is_recorded_then_raises_outside_a_sweep(tmp_path):
    def fit(cfg, checkpoint):
        raise ValueError("bad size")

    with pytest.raises(ValueError, match="bad size"):
        run_job(cfg_for(tmp_path), fit)
    record = read_record(tmp_path)
    assert (record.status, record.error) == ("failed", "ValueError: bad size")


def test_in_a_sweep_a_failure_is_nan_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(job_module, "in_multirun", lambda: True)

    def fit(cfg, checkpoint):
        raise RuntimeError("boom")

    assert math.isnan(run_job(cfg_for(tmp_path), fit))
    assert "job failed: RuntimeError: boom" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        run_job(cfg_for(tmp_path, fail_fast=True), fit)
    assert exit_.value.code == 1


def test_skip_finished_returns_the_recorded_value_without_fitting(tmp_path, monkeypatch):
    run_job(cfg_for(tmp_path), lambda cfg, checkpoint: Outcome({"val/acc": 0.9}, 0.9, 1, {}))
    monkeypatch.setattr(job_module, "job_overrides", lambda: ["skip_finished=true"])

    def never(cfg, checkpoint):
        raise AssertionError("fitted again")

    assert run_job(cfg_for(tmp_path, skip_finished=True), never) == 0.9
    monkeypatch.setattr(job_module, "job_overrides", lambda: ["seed=1"])  # another job here
    assert (
        run_job(cfg_for(tmp_path, skip_finished=True), lambda c, _: Outcome({}, None, 1, {}))
        is None
    )
    assert read_record(tmp_path).overrides == ["seed=1"]


def test_a_resumed_job_s_wall_time_counts_its_earlier_parts(tmp_path):
    """time_s of a job resumed from a checkpoint starts from the fitting time that
    checkpoint recorded (a stopped job resumed counted only its second part)."""
    import torch

    from transformers_lab.run.checkpoints import Checkpoint

    earlier = Checkpoint(dirpath=str(tmp_path / "checkpoints"))
    state = {**earlier.state_dict(), "time_s": 100.0}  # a part that fitted for 100 s
    resumed = Checkpoint(dirpath=str(tmp_path / "checkpoints"))
    resumed.load_state_dict(state)
    assert resumed.state_dict()["time_s"] >= 100.0  # and counts on in its own saves
    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 5, "callbacks": {"Checkpoint{'monitor': 'x'}": state}}, path)

    def fit(cfg, checkpoint):
        return Outcome({"val/acc": 0.5}, 0.5, 10, {"best": None, "last": None})

    run_job(cfg_for(tmp_path / "run", ckpt_path=str(path)), fit)
    assert 100.0 <= read_record(tmp_path / "run").time_s < 130.0
    run_job(cfg_for(tmp_path / "fresh"), fit)  # a job that starts afresh starts from 0
    assert read_record(tmp_path / "fresh").time_s < 30.0
