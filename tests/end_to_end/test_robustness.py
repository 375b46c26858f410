"""A run that fails safely (run/callbacks/safety.py, run/checkpoints.py): last.ckpt is
always the latest state and is written atomically; a NaN stops the run with the step and
the causes; SIGTERM, Ctrl+C and kill -9 lose nothing, and resuming ends exactly where
the uninterrupted run ends; the same seed gives the same metrics."""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from transformers_lab.config import compose_config
from transformers_lab.errors import NonFiniteError
from transformers_lab.run.callbacks.safety import random_states, set_random_states
from transformers_lab.run.checkpoints import AtomicCheckpointIO, Checkpoint, differences
from transformers_lab.run.curves import history
from transformers_lab.run.fit import fit_and_test, train
from transformers_lab.run.record import Interrupted
from transformers_lab.train import main

# this file's callbacks by module name, and fake_data beside it
TESTS = os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])])
# a small ViT on digits with dropout (so the random state matters): 10 batches an epoch
RUN = [
    "logger=csv",
    "model.d_model=32",
    "model.n_layer=1",
    "model.n_head=2",
    "model.dropout=0.1",
    "data.batch_size=128",
    "trainer.max_epochs=3",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
STEPS = 30  # 3 epochs of 10 batches


class SignalAt(L.Callback):
    """Send this process a signal while it trains the batch that reaches ``step`` (as a
    signal from outside arrives, in the middle of a batch)."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step - 1:
            os.kill(os.getpid(), self.signum)


class PoisonAt(L.Callback):
    """At ``step``, make a weight (so the loss) or a gradient NaN."""

    def __init__(self, step: int, what: str) -> None:
        self.step, self.what = step, what

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *a) -> None:
        if trainer.global_step != self.step:
            return
        weight = pl_module.model.head.weight
        if self.what == "weight":
            with torch.no_grad():
                weight[0, 0] = float("nan")
        else:
            weight.register_hook(lambda grad: grad * float("nan"))


class PoisonBeforeValidationAt(L.Callback):
    """At ``step``, make a weight NaN after training and before the validation (and the
    checkpoints after it): no loss or gradient shows it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step and not trainer.sanity_checking:
            with torch.no_grad():
                pl_module.model.head.weight[0, 0] = float("nan")


def with_callback(name: str, target: type, **kwargs: object) -> list[str]:
    """Overrides that add a test callback to the run's callbacks."""
    args = [f"+callbacks.{name}._target_={target.__module__}.{target.__qualname__}"]
    return args + [f"+callbacks.{name}.{k}={v}" for k, v in kwargs.items()]


def run(tmp_path: Path, name: str, *overrides: str) -> dict[str, float]:
    return train(compose_config("train", [*RUN, *overrides], tmp_path / name))


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def load(checkpoint: Path) -> dict:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("uninterrupted")
    metrics = run(root, "run")
    return metrics, weights(root / "run" / "checkpoints" / "last.ckpt")


def assert_same_run(metrics, last: Path, uninterrupted) -> None:
    expected_metrics, expected_weights = uninterrupted
    assert metrics == expected_metrics
    got = weights(last)
    assert got.keys() == expected_weights.keys()
    assert all(torch.equal(got[k], expected_weights[k]) for k in got)


# ------------------------------------------------------------------ reproducibility


def test_the_same_seed_gives_the_same_metrics_and_weights(tmp_path, uninterrupted):
    metrics = run(tmp_path, "again")
    assert_same_run(metrics, tmp_path / "again" / "checkpoints" / "last.ckpt", uninterrupted)
    other = run(tmp_path, "other-seed", "seed=1")
    assert other["val/loss"] != metrics["val/loss"]


def test_a_checkpoint_from_more_gpus_restores_the_random_states_of_the_ones_here(monkeypatch):
    states = {**random_states(), "cuda": [torch.ones(3), torch.zeros(3)]}  # saved on 2 GPUs
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: restored.append((s, d)))
    set_random_states(states)
    assert len(restored) == 1 and torch.equal(restored[0][0], torch.ones(3))
    assert restored[0][1] == 0


# ------------------------------------------------------------------ checkpoints


def test_last_checkpoint_is_the_final_state_even_when_the_metric_got_worse(tmp_path):
    # mode=max on val/loss: the first epoch stays "best" while the loss goes down
    run(tmp_path, "run", "monitor.metric=val/loss", "monitor.mode=max", "test=false")
    checkpoints = tmp_path / "run" / "checkpoints"
    assert load(checkpoints / "best.ckpt")["global_step"] == 10
    assert load(checkpoints / "last.ckpt")["global_step"] == STEPS


def test_a_run_resumed_into_a_new_dir_keeps_its_best_checkpoint_and_score(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    (old / "best.ckpt").write_bytes(b"the best weights")
    best = str(old / "best.ckpt")
    state = {
        "monitor": "val/acc", "best_model_score": torch.tensor(0.9), "best_model_path": best,
        "current_score": torch.tensor(0.8), "dirpath": str(old),
        "best_k_models": {best: torch.tensor(0.9)}, "kth_best_model_path": best,
        "kth_value": torch.tensor(0.9), "last_model_path": str(old / "last.ckpt"),
    }  # fmt: skip
    callback = Checkpoint(dirpath=new, filename="best", monitor="val/acc", mode="max")
    callback.load_state_dict(state)
    assert (new / "best.ckpt").read_bytes() == b"the best weights"
    assert callback.best_model_path == str(new / "best.ckpt")
    assert callback.best_k_models == {str(new / "best.ckpt"): torch.tensor(0.9)}
    assert float(callback.best_model_score) == pytest.approx(0.9)
    assert callback.last_model_path == ""  # the new run writes its own


def test_a_checkpoint_write_that_dies_half_way_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, path)
    before = path.read_bytes()

    def dies_half_way(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # what a kill during the write would leave

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": 2, "w": torch.zeros(1000)}, path)
    assert path.read_bytes() == before and load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no partial file left


def test_checkpoints_are_renamed_into_place_from_their_own_folder(tmp_path, monkeypatch):
    renames = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: renames.append((a, b)) or real(a, b))
    run(tmp_path, "run", "trainer.max_epochs=1", "test=false")
    assert renames and all(Path(a).parent == Path(b).parent for a, b in renames)
    assert {Path(b).name for _, b in renames} == {"best.ckpt", "last.ckpt"}


# ------------------------------------------------------------------ NaN / Inf


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("weight", "the training loss is nan at global step 15 (epoch 1, batch 5)"),
        ("grad", "the gradient of model.head.weight is not finite at global step 15"),
    ],
)
def test_a_nan_stops_the_run_at_its_step_and_keeps_the_last_good_checkpoint(
    tmp_path, what, message
):
    with pytest.raises(NonFiniteError) as err:
        run(tmp_path, "run", *with_callback("poison", PoisonAt, step=15, what=what))
    text = str(err.value)
    assert message in text and "\n" not in text
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert f"the last good checkpoint is {last}" in text
    assert "lower optimizer.lr" in text and "gradient_clip_val" in text
    saved = load(last)
    assert saved["global_step"] == 10  # the end of epoch 0, before the NaN
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())


def test_a_nan_weight_is_never_written_to_a_checkpoint(tmp_path):
    with pytest.raises(NonFiniteError) as err:
        run(tmp_path, "run", *with_callback("poison", PoisonBeforeValidationAt, step=20))
    assert (
        "the weight model.head.weight is not finite before a checkpoint at global step 20"
        in str(err.value)
    )
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert load(last)["global_step"] == 10  # the end of epoch 0, not the poisoned weights


def test_the_command_line_reports_a_nan_in_one_line(tmp_path, monkeypatch, capsys):
    argv = [*RUN, *with_callback("poison", PoisonAt, step=3, what="weight")]
    monkeypatch.setattr(sys, "argv", ["tlab-train", *argv, f"hydra.run.dir={tmp_path}/run"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[-1].startswith("error: the training loss is nan at global step 3")
    assert "Traceback" not in "".join(errors)


def test_the_nan_error_gets_a_line_of_its_own_after_the_progress_bar(tmp_path, monkeypatch, capsys):
    """The bar's last state stayed on its line (on stdout, without a newline), and the
    error line (stderr) was printed after it: ``tlab-train ... 2>&1 | grep ^error:``
    missed it."""
    bar = ["trainer.enable_progress_bar=true", "callbacks.progress_bar.refresh_rate=1"]
    plain = [o for o in RUN if not o.startswith("trainer.enable_progress_bar")]
    argv = [*plain, *bar, *with_callback("poison", PoisonAt, step=3, what="weight")]
    monkeypatch.setattr(sys, "argv", ["tlab-train", *argv, f"hydra.run.dir={tmp_path}/run"])
    with pytest.raises(SystemExit):
        main()
    out, err = capsys.readouterr()
    assert "Epoch 0" in out  # the bar was drawn (on stdout, the error on stderr)
    assert out.endswith("\n"), repr(out[-200:])  # its line ended before the error came
    assert err.startswith("error: the training loss is nan at global step 3")


# ---------------------------------------------- resume: the checkpoint's config holds


@pytest.fixture(scope="module")
def fastmax_last(tmp_path_factory) -> Path:
    """last.ckpt of one epoch of the RUN model with attention=fastmax, trained through the
    command line (so its run dir holds .hydra/overrides.yaml)."""
    run_dir = tmp_path_factory.mktemp("fastmax") / "run"
    argv = [*RUN, "attention=fastmax", "trainer.max_epochs=1", "test=false"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["tlab-train", *argv, f"hydra.run.dir={run_dir}"])
        main()
    return run_dir / "checkpoints" / "last.ckpt"


def resume_main(tmp_path, monkeypatch, capsys, ckpt: Path, *overrides: str) -> list[str]:
    """``tlab-train RUN <overrides> ckpt_path=<ckpt>``: the error lines (exit code 2)."""
    argv = [*RUN, *overrides, f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path}/resumed"]
    monkeypatch.setattr(sys, "argv", ["tlab-train", *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


FASTMAX = "'transformers_lab.attention.fastmax.FastmaxAttention'"
SOFTMAX = "'transformers_lab.attention.softmax.SoftmaxAttention'"


@pytest.mark.parametrize(
    ("overrides", "changes"),
    [
        # attention= left out: the default kernel, softmax, would have trained on
        ([], f"model.attention._target_: {FASTMAX} -> {SOFTMAX}; resume"),
        (["attention=fastmax", "model.n_head=4"], "model.n_head: 2 -> 4; resume"),
        (["attention=fastmax", "attention.p=1"], "model.attention.p: 2 -> 1; resume"),
        (["attention=fastmax", "data.batch_size=64"], "data.batch_size: 128 -> 64; resume"),
    ],
)
def test_resuming_with_another_model_kernel_or_data_is_refused_in_one_line(
    fastmax_last, overrides, changes, tmp_path, monkeypatch, capsys
):
    (error,) = resume_main(tmp_path, monkeypatch, capsys, fastmax_last, *overrides)
    assert error.startswith(
        f"error: checkpoint {fastmax_last} was trained with another config: {changes}"
    )
    assert "attention=fastmax" in error.split("it was trained with: tlab-train ")[1]
    assert not (tmp_path / "resumed" / "checkpoints").exists()  # refused before training


def test_a_resume_may_change_the_trainer_and_the_keys_it_lists(fastmax_last, tmp_path):
    """The trainer's limits change on resume by design; a key of the model, data or task
    config changes when resume_may_change lists it."""
    metrics = run(
        tmp_path,
        "resumed",
        "attention=fastmax",
        "trainer.max_epochs=2",
        "model.dropout=0.0",
        "resume_may_change=[model.dropout]",
        f"ckpt_path={fastmax_last}",
    )
    assert load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")["global_step"] == 20
    assert math.isfinite(metrics["val/loss"])


def test_an_optimizer_setting_changed_on_resume_takes_effect(fastmax_last, tmp_path):
    """Lightning restores the optimizer's groups and the schedule's base from the
    checkpoint; a resume that changes the lr and weight decay (listed in
    resume_may_change) trains with the new ones, at the schedule's position it resumed at."""
    before = load(fastmax_last)
    old_groups = before["optimizer_states"][0]["param_groups"]
    old_lr = old_groups[0]["initial_lr"]
    run(
        tmp_path,
        "resumed",
        "attention=fastmax",
        "trainer.max_epochs=2",
        f"optimizer.lr={old_lr / 10}",
        "optimizer.weight_decay=0.3",
        "resume_may_change=[task.optimizer.lr,task.optimizer.weight_decay]",
        f"ckpt_path={fastmax_last}",
    )
    after = load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    groups = after["optimizer_states"][0]["param_groups"]
    assert [g["initial_lr"] for g in groups] == [old_lr / 10] * len(groups)
    assert after["lr_schedulers"][0]["base_lrs"] == [old_lr / 10] * len(groups)
    # the decayed group takes the new decay, the group without decay keeps none
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.3]
    assert sorted(g["weight_decay"] for g in old_groups) == [0.0, 0.01]
    assert all(0 < g["lr"] <= old_lr / 10 for g in groups)  # the new base x the schedule


def test_config_differences_name_each_key_with_both_values():
    saved = {"model": {"n_head": 2, "attention": {"p": 2}}, "data": {"root": "/a", "bs": 8}}
    now = {"model": {"n_head": 4, "attention": {}}, "data": {"root": "/b", "bs": 8, "new": 1}}
    assert differences(saved, now, allowed=("data.root",)) == [
        "data.new: (absent) -> 1",
        "model.attention.p: 2 -> (absent)",
        "model.n_head: 2 -> 4",
    ]
    assert differences(saved, saved) == []


# ------------------------------------------------------------------ interruptions


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_last_and_resuming_ends_as_the_uninterrupted_run(
    tmp_path, uninterrupted, signum, code
):
    # step 14 is in the middle of the second epoch: the data order must be replayed
    overrides = [*RUN, *with_callback("signal", SignalAt, step=14, signum=int(signum))]
    cfg = compose_config("train", overrides, tmp_path / "stopped")
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a background job, not the default
    with pytest.raises(Interrupted) as err:
        fit_and_test(cfg)
    last = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    assert err.value.checkpoint == str(last) and err.value.exit_code == code
    name = signal.Signals(signum).name
    assert str(err.value) == (
        f"stopped by {name} at global step 14: saved {last}; resume with tlab-train "
        f"{shlex.join(overrides)} ckpt_path={last}"
    )
    assert load(last)["global_step"] == 14
    assert signal.getsignal(signal.SIGINT) is before  # handler restored
    metrics = run(tmp_path, "resumed", f"ckpt_path={last}")
    assert_same_run(metrics, tmp_path / "resumed" / "checkpoints" / "last.ckpt", uninterrupted)


def test_the_command_line_prints_a_resume_command_that_works(
    tmp_path, uninterrupted, monkeypatch, capsys
):
    """The printed command keeps the run's overrides: with the defaults instead, the
    resumed run would be another model (refused) or train to another length. Run in the
    stopped run's own dir, it keeps that run's metrics (Lightning's CSV logger would
    delete them), and the joined curve is the one resumed in a new dir."""
    argv = [*RUN, *with_callback("signal", SignalAt, step=14, signum=int(signal.SIGTERM))]
    monkeypatch.setattr(sys, "argv", ["tlab-train", *argv, f"hydra.run.dir={tmp_path}/stopped"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 143
    said = capsys.readouterr().err.strip().splitlines()[-1]
    last = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    assert said.startswith("stopped by SIGTERM at global step 14: saved ")
    command = shlex.split(said.split("; resume with ", 1)[1])
    assert command[0] == "tlab-train" and command[-1] == f"ckpt_path={last}"
    assert command[1:-1] == argv
    monkeypatch.setattr(sys, "argv", [*command, f"hydra.run.dir={tmp_path}/resumed"])
    main()  # returns: Hydra's main exits only on an error
    got, expected = weights(tmp_path / "resumed" / "checkpoints" / "last.ckpt"), uninterrupted[1]
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    elsewhere = history(tmp_path / "resumed")
    monkeypatch.setattr(sys, "argv", [*command, f"hydra.run.dir={tmp_path}/stopped"])
    main()
    assert (tmp_path / "stopped" / "csv.1" / "metrics.csv").is_file()
    rows, resumes = history(tmp_path / "stopped")
    assert resumes == elsewhere[1] == [14]
    assert min(r["step"] for r in rows) < 14  # the first part's rows too
    assert rows == elsewhere[0]


class SignalInTest(L.Callback):
    """Send this process SIGTERM after the first test batch."""

    def on_test_batch_end(self, *args: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_while_testing_stops_with_the_command_that_tests_the_best_checkpoint(tmp_path):
    cfg = compose_config(
        "train", [*RUN, "trainer.max_epochs=1", *with_callback("term", SignalInTest)],
        tmp_path / "run",
    )  # fmt: skip
    with pytest.raises(Interrupted) as err:
        fit_and_test(cfg)
    best = tmp_path / "run" / "checkpoints" / "best.ckpt"
    assert err.value.exit_code == 143
    assert str(err.value) == (
        f"stopped by SIGTERM while testing: test it again with tlab-eval ckpt_path={best} "
        "split=test"
    )


@pytest.mark.slow  # a real process killed, then resumed (make test-slow)
def test_after_kill_9_resuming_from_last_ends_as_the_uninterrupted_run(tmp_path, uninterrupted):
    """A real process killed with SIGKILL at step 25, after last.ckpt was saved mid-epoch
    (validation every 4 batches), then resumed from that checkpoint."""
    every_4 = ["trainer.val_check_interval=4"]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(TESTS)}
    killed = [*every_4, *with_callback("kill", SignalAt, step=25, signum=int(signal.SIGKILL))]
    command = [sys.executable, "-m", "transformers_lab.train", *RUN, *killed]
    done = subprocess.run(
        [*command, f"hydra.run.dir={tmp_path / 'killed'}"], env=env, capture_output=True
    )
    assert done.returncode == -signal.SIGKILL
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    assert load(last)["global_step"] == 24  # the validation at batch 4 of epoch 2
    expected = run(tmp_path, "uninterrupted", *every_4)
    expected = (expected, weights(tmp_path / "uninterrupted" / "checkpoints" / "last.ckpt"))
    metrics = run(tmp_path, "resumed", *every_4, f"ckpt_path={last}")
    assert_same_run(metrics, tmp_path / "resumed" / "checkpoints" / "last.ckpt", expected)
