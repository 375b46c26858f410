"""Multiruns through the real entry point: per-job records, the summary written at the end
of a sweep and rebuilt by tlab-summarize, failures that do not stop a sweep, resumed
sweeps, and one directory per job (Optuna studies: test_optuna_sweeps.py)."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
from omegaconf import OmegaConf

from transformers_lab.run.curves import history
from transformers_lab.run.job import run_job
from transformers_lab.run.overrides import identity
from transformers_lab.run.record import RESULT_FILE
from transformers_lab.sweeps.plugins import register_plugins
from transformers_lab.sweeps.report import cli as summary_module
from transformers_lab.sweeps.report.cli import SUMMARY_FILES, summarize
from transformers_lab.sweeps.report.plots import curve

TINY = [
    "experiment=mqar",
    "trainer.max_epochs=1",
    "data.train_examples=128",
    "data.val_examples=32",
    "trainer.enable_progress_bar=false",
]


def tlab_train(*args: str, cwd: Path, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "TLAB_ROOT": str(cwd), **extra_env}
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "transformers_lab.train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc


def sweep_dir_of(root: Path) -> Path:
    (found,) = list((root / "logs" / "train" / "multiruns").iterdir())
    return found


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def last_val_acc(run_dir: Path) -> float:
    rows = [r for r in read_csv(run_dir / "csv" / "metrics.csv") if r.get("val/acc")]
    return float(rows[-1]["val/acc"])


@pytest.fixture(scope="module")
def kernel_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """2 kernels x 2 seeds, with csv and (offline) wandb loggers."""
    root = tmp_path_factory.mktemp("kernels")
    proc = tlab_train("-m", "attention=softmax,fastmax_p1", "seed=0,1", *TINY, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir_of(root), proc


@pytest.fixture(scope="module")
def failing_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """model.n_head=3 cannot split d_model=64: that job fails, the other runs."""
    root = tmp_path_factory.mktemp("failing")
    proc = tlab_train("-m", "model.n_head=3,2", *TINY, "logger=csv", cwd=root)
    return sweep_dir_of(root), proc


def test_a_kernel_sweep_writes_a_summary_with_one_row_per_job(kernel_sweep):
    sweep, proc = kernel_sweep
    umask = os.umask(0)
    os.umask(umask)
    for name in SUMMARY_FILES:
        assert (sweep / name).stat().st_size > 0, name
        # written through temporary files, but as readable as any other file
        assert (sweep / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    assert (sweep / "0" / RESULT_FILE).stat().st_mode & 0o777 == 0o666 & ~umask
    rows = read_csv(sweep / "summary.csv")
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    assert {r["status"] for r in rows} == {"ok"}
    for row in rows:
        job = sweep / row["job"]
        saved = [str(o) for o in OmegaConf.load(job / ".hydra" / "overrides.yaml")]
        # what the job is: its overrides less the bookkeeping ones (its progress bar)
        assert "trainer.enable_progress_bar=False" in saved
        assert row["overrides"] == " ".join(identity(saved))
        assert float(row["val/acc"]) == pytest.approx(last_val_acc(job), rel=1e-5)
        assert float(row["best val/acc"]) >= float(row["val/acc"]) - 1e-9
        assert int(row["params"]) > 0 and float(row["time_s"]) > 0
    # the decoding state: a KV cache of 2 layers x block_size (64 numbers a token) for
    # softmax, a state of (32 + 1)(1 + 32) numbers a head for fastmax p=1, 2 heads, 2 layers
    state = {r["overrides"].split()[0]: int(r["state_size"]) for r in rows}
    block = OmegaConf.load(sweep / "0" / ".hydra" / "config.yaml").data.block_size
    assert state["attention=softmax"] == 2 * block * 2 * 64
    assert state["attention=fastmax_p1"] == 2 * 2 * 33 * 33
    assert (sweep / "state.png").stat().st_size > 0
    # the grouped view: one line per kernel, mean +- std over its two seeds
    md = (sweep / "summary.md").read_text()
    for kernel in ("softmax", "fastmax_p1"):
        accs = [float(r["val/acc"]) for r in rows if f"attention={kernel}" in r["overrides"]]
        mean = sum(accs) / 2
        line = next(x for x in md.splitlines() if x.startswith(f"| attention={kernel} |"))
        assert "| 2/2 |" in line and f"{mean:.4g} ±" in line
    # ... and the same table ends the command's output
    assert "| attention=softmax | 2/2 |" in proc.stdout
    assert f"summary: {sweep / 'summary.md'}" in proc.stdout


def test_each_job_of_a_sweep_is_its_own_wandb_run_in_one_group(kernel_sweep):
    from tests.run.test_train import read_wandb_run

    sweep, _ = kernel_sweep
    runs = []
    for job in sorted(p for p in sweep.iterdir() if p.name.isdigit()):
        (run_file,) = list(job.glob("wandb/offline-run-*/*.wandb"))
        runs.append(read_wandb_run(run_file))
    assert all(r["exit"] for r in runs), "every job's wandb run is finished"
    assert len({r["run"].run_id for r in runs}) == 4
    assert {r["run"].run_group for r in runs} == {f"train-{sweep.name}"}
    job_types = sorted(r["run"].job_type for r in runs)
    assert job_types == ["attention=fastmax_p1"] * 2 + ["attention=softmax"] * 2
    names = [r["run"].display_name for r in runs]  # they shared one name before
    assert len(set(names)) == 4 and all("seed=" in n and "attention=" in n for n in names)


# what Lightning 2.6, torch 2.14 and wandb 0.31 said at every job, telling nothing
KNOWN_NOISE = (
    "isinstance(treespec, LeafSpec)` is deprecated",  # Lightning's own use of torch's
    "💡 Tip",  # Lightning's advertisement for its cloud logger
    "The anonymous setting has no effect",  # Lightning hands wandb anonymous=None
    "You have overridden `transfer_batch_to_device`",  # the hook was the task's
)


def test_a_job_prints_none_of_the_known_warnings(kernel_sweep):
    _, proc = kernel_sweep
    said = proc.stdout + proc.stderr
    assert "wandb" in said  # the jobs logged to wandb, where its warning came from
    assert [n for n in KNOWN_NOISE if n in said] == []


def test_tlab_summarize_reproduces_the_sweep_summary_and_is_idempotent(kernel_sweep, tmp_path):
    sweep, _ = kernel_sweep
    copy = tmp_path / sweep.name
    shutil.copytree(sweep, copy)
    written = {name: (copy / name).read_bytes() for name in SUMMARY_FILES}
    for name in SUMMARY_FILES:
        (copy / name).unlink()
    for _ in range(2):
        assert summary_module.main([str(copy)]) == 0
        for name in ("summary.csv", "summary.md"):
            assert (copy / name).read_bytes() == written[name], name
        assert (copy / "summary.png").stat().st_size > 0


def test_tlab_summarize_on_a_partial_sweep_and_after_jobs_were_added(kernel_sweep, tmp_path):
    sweep, _ = kernel_sweep
    copy = tmp_path / sweep.name
    shutil.copytree(sweep, copy)
    (copy / "1" / RESULT_FILE).unlink()  # a job killed before it could record its end
    shutil.copytree(copy / "3", copy / "4")  # a job added later
    summary = summarize(copy)
    rows = {r["job"]: r for r in summary["jobs"]}
    assert sorted(rows) == ["0", "1", "2", "3", "4"]
    assert rows["1"]["status"] == "incomplete"
    assert rows["1"]["val/acc"] == pytest.approx(last_val_acc(copy / "1"), rel=1e-5)
    assert [r["status"] for k, r in rows.items() if k != "1"] == ["ok"] * 4
    assert len(read_csv(copy / "summary.csv")) == 5


def test_tlab_summarize_says_what_is_wrong_with_its_argument(tmp_path, capsys):
    assert summary_module.main([str(tmp_path / "nope")]) == 2
    assert "no sweep or run directory at" in capsys.readouterr().err
    assert summary_module.main([str(tmp_path)]) == 2
    assert "no job directories" in capsys.readouterr().err


def test_a_failed_job_is_recorded_and_the_sweep_goes_on(failing_sweep):
    sweep, proc = failing_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(sweep / "summary.csv")
    status = {r["overrides"].split()[0]: r for r in rows}
    assert status["model.n_head=3"]["status"] == "failed"
    assert "d_model=64 must be divisible by n_head=3" in status["model.n_head=3"]["error"]
    assert (
        status["model.n_head=2"]["status"] == "ok"
        and float(status["model.n_head=2"]["val/acc"]) >= 0
    )
    record = json.loads((sweep / "0" / RESULT_FILE).read_text())
    assert record["status"] == "failed" and "ConfigError" in record["error"]
    assert "model.n_head=3" in (sweep / "summary.md").read_text()


@pytest.mark.slow  # an end-to-end run through tlab-train (make test-slow)
def test_a_sweep_none_of_whose_jobs_finished_exits_non_zero(tmp_path):
    """Every job failed (d_model=64 over 3 or 5 heads): the summary is written all the
    same, and the sweep's exit code says it failed, for the scripts that run it."""
    proc = tlab_train("-m", "model.n_head=3,5", *TINY, "logger=csv", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    sweep = sweep_dir_of(tmp_path)
    assert [r["status"] for r in read_csv(sweep / "summary.csv")] == ["failed", "failed"]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {sweep}: none of its 2 jobs finished; see its summary.md"]


@pytest.mark.slow
def test_fail_fast_stops_the_sweep_at_the_first_failure(tmp_path):
    # batch_size=0 fails inside the job (its config check), where Hydra's launcher would
    # otherwise go on to the next job
    args = ["-m", "data.batch_size=0,16", *TINY, "logger=csv"]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    proc = tlab_train(*args, "fail_fast=true", cwd=tmp_path / "a")
    assert proc.returncode == 1 and "sweep stopped (fail_fast=true)" in proc.stderr
    sweep = sweep_dir_of(tmp_path / "a")
    record = json.loads((sweep / "0" / RESULT_FILE).read_text())
    assert record["status"] == "failed" and "batch_size" in record["error"]
    assert not (sweep / "1").exists()
    proc = tlab_train(*args, cwd=tmp_path / "b")  # without fail_fast, the sweep goes on
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(sweep_dir_of(tmp_path / "b") / "summary.csv")
    assert [r["status"] for r in rows] == ["failed", "ok"]


@pytest.mark.slow
def test_a_resumed_sweep_skips_the_jobs_that_finished(failing_sweep, tmp_path):
    sweep, _ = failing_sweep
    copy = tmp_path / "logs" / "train" / "multiruns" / sweep.name
    shutil.copytree(sweep, copy)
    finished = (copy / "1" / RESULT_FILE).read_text()
    args = ["-m", "model.n_head=3,2", *TINY, "logger=csv", f"hydra.sweep.dir={copy}"]
    proc = tlab_train(*args, "skip_finished=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("skipped: finished before") == 1  # job 1; job 0 failed: rerun
    assert (copy / "1" / RESULT_FILE).read_text() == finished
    assert json.loads((copy / "0" / RESULT_FILE).read_text())["status"] == "failed"
    assert [r["status"] for r in read_csv(copy / "summary.csv")] == ["failed", "ok"]


def test_a_run_started_afresh_in_a_used_dir_keeps_the_old_metrics_out_of_its_curves(tmp_path):
    """Two jobs in one dir, run in this process as tlab-train runs them (``run_job``)."""
    from transformers_lab.config import compose_config
    from transformers_lab.train import fit_as_trial

    run = tmp_path / "run"
    args = [*TINY, "logger=csv"]
    run_job(compose_config("train", [*args, "seed=0"], run), fit_as_trial)
    before = (run / "csv" / "metrics.csv").read_text()
    second = compose_config("train", [*args, "seed=1", "trainer.max_epochs=2"], run)
    run_job(second, fit_as_trial)
    kept = list((run / "abandoned.1").glob("csv/**/metrics.csv"))
    assert [p.read_text() for p in kept] == [before]  # nothing lost
    rows, resumes = history(run)  # only the second run's two epochs
    now = read_csv(next((run / "csv").glob("**/metrics.csv")))
    assert resumes == [] and len(rows) == len(now)
    assert [r["val/loss"] for r in rows if "val/loss" in r] == [
        float(r["val/loss"]) for r in now if r.get("val/loss")
    ]
    assert len([r for r in rows if "val/loss" in r]) == 2


def test_runs_started_at_the_same_moment_get_their_own_directories(monkeypatch, tmp_path):
    """Hydra's clock frozen to one instant: the run and sweep dirs still differ."""
    import datetime as real

    import hydra.core.utils
    from hydra import compose, initialize_config_dir

    from transformers_lab.config import CONF_DIR

    class Frozen(real.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 1)

    monkeypatch.setattr(hydra.core.utils, "datetime", Frozen)
    monkeypatch.setenv("TLAB_ROOT", str(tmp_path))
    dirs = []
    for _ in range(2):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", return_hydra_config=True)
        run_dir, sweep_dir = cfg.hydra.run.dir, cfg.hydra.sweep.dir
        run_id = run_dir.rsplit("-", 1)[-1]
        # stable within a run: one id drawn per config, the same in the run and sweep dirs
        # and at every reading (each reading resolves ${run_id:} again, from its cache)
        assert re.fullmatch("[0-9a-f]{6}", run_id), run_dir
        assert run_dir == f"{tmp_path}/logs/train/runs/2026-01-01_00-00-00_000000-{run_id}"
        assert sweep_dir == f"{tmp_path}/logs/train/multiruns/2026-01-01_00-00-00_000000-{run_id}"
        assert OmegaConf.to_container(cfg.hydra.run, resolve=True) == {"dir": run_dir}
        dirs.append((run_dir, sweep_dir))
    (run_a, sweep_a), (run_b, sweep_b) = dirs
    assert "runs/2026-01-01_00-00-00_000000-" in run_a
    assert run_a != run_b and sweep_a != sweep_b


@pytest.mark.slow
def test_parallel_jobs_through_joblib_get_their_own_directories(tmp_path):
    proc = tlab_train("-m", "launcher=joblib", "seed=0,1", *TINY, "logger=csv", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = sweep_dir_of(tmp_path)
    records = [json.loads((sweep / j / RESULT_FILE).read_text()) for j in ("0", "1")]
    assert [r["status"] for r in records] == ["ok", "ok"]
    assert records[0]["run_dir"] != records[1]["run_dir"]
    assert len(read_csv(sweep / "summary.csv")) == 2


@pytest.mark.parametrize(
    ("preset", "target"),
    [
        ("launcher=slurm", "hydra_plugins.tlab_slurm_launcher.SlurmLauncher"),
        ("launcher=joblib", "hydra_plugins.tlab_joblib_launcher.JoblibLauncher"),
    ],
)
def test_launcher_presets_select_their_plugin(preset, target, monkeypatch, tmp_path):
    """The plugins are installed with the project and the presets compose into them (the
    SLURM launcher on a cluster: test_slurm.py)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.plugins import Plugins

    from transformers_lab.config import CONF_DIR

    monkeypatch.setenv("TLAB_ROOT", str(tmp_path))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", [preset, "sweep=attention_kernels"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_ == target
    assert cfg.hydra.mode.name == "MULTIRUN"
    register_plugins()  # as tlab-train does
    assert target in Plugins.instance().class_name_to_class
    if "tlab_" in target:  # a stand-in until Hydra builds it: then the real plugin
        built = Plugins.instance()._instantiate(cfg.hydra.launcher)
        module = target.split(".")[1].removeprefix("tlab_")
        assert type(built).__module__ == f"transformers_lab.sweeps.{module}"
    if preset == "launcher=joblib":  # Hydra's joblib settings, the preset's n_jobs
        assert cfg.hydra.launcher.n_jobs == 2 and cfg.hydra.launcher.pre_dispatch == "2*n_jobs"


# ------------------------------------------------------------------ a sweep stopped mid-job


class StopAt(L.Callback):
    """Stop the job whose seed is ``stop_seed`` at global step ``step`` with the signal that
    ``$TLAB_TEST_STOP`` names (SIGTERM, SIGKILL); without that variable it does nothing,
    so the same command line runs uninterrupted, or resumes."""

    def __init__(self, step: int, seed: int, stop_seed: int) -> None:
        self.step, self.stopping = step, seed == stop_seed

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        name = os.environ.get("TLAB_TEST_STOP")
        if name and self.stopping and trainer.global_step == self.step:
            os.kill(os.getpid(), getattr(signal, name))


# 2 jobs of 8 steps (4 epochs of 2 batches, validated after each); job 1 stopped at step 5
STOPPED_SWEEP = [
    "-m",
    "seed=0,1",
    *TINY,
    "trainer.max_epochs=4",
    "trainer.log_every_n_steps=1",
    "logger=csv",
    "+callbacks.stop._target_=test_sweeps.StopAt",
    "+callbacks.stop.step=5",
    "+callbacks.stop.seed=${seed}",
    "+callbacks.stop.stop_seed=1",
]
HERE = Path(__file__).parent  # this file (its callbacks by module name) and tests/
TESTS_ON_PATH = {"PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), *sys.path])}


def by_choice(md: str) -> str:
    """The grouped table of a summary.md (its title names the sweep dir)."""
    return md.split("## By choice", 1)[1].split("## Jobs", 1)[0]


def comparable(row: dict[str, str]) -> dict[str, str]:
    """A summary.csv row without what differs between two runs of one job: its times
    (``time_s``, and the throughput a run measures: ``perf/``)."""
    return {k: v for k, v in row.items() if k != "time_s" and not k.startswith("perf/")}


@pytest.fixture(scope="module")
def uninterrupted_sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    proc = tlab_train(*STOPPED_SWEEP, cwd=root, **TESTS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir_of(root)


@pytest.mark.slow
@pytest.mark.parametrize(("signame", "code", "status"), [
    ("SIGTERM", 143, "interrupted"),
    ("SIGKILL", -9, "running"),
])  # fmt: skip
def test_a_sweep_stopped_mid_job_resumes_to_the_summary_of_an_uninterrupted_sweep(
    uninterrupted_sweep, signame, code, status, tmp_path
):
    """SIGTERM saves last.ckpt at step 5 and records the job as interrupted, with its best
    checkpoint; kill -9 leaves the record that the job was running and last.ckpt from step
    4. Run again with skip_finished=true, job 0 is skipped, job 1 resumes from its own
    last.ckpt, and the summary is the uninterrupted sweep's: the re-run job carries no
    skip_finished into its group."""
    stopped = tlab_train(*STOPPED_SWEEP, cwd=tmp_path, TLAB_TEST_STOP=signame, **TESTS_ON_PATH)
    assert stopped.returncode == code, stopped.stderr[-3000:]
    sweep = sweep_dir_of(tmp_path)
    record = json.loads((sweep / "1" / RESULT_FILE).read_text())
    assert record["status"] == status
    if status == "interrupted":  # the best so far is named, with its value
        assert record["checkpoints"]["best"] == str(sweep / "1" / "checkpoints" / "best.ckpt")
        assert record["monitor"]["best"] is not None
        # and how to go on: the sweep's command, its dir and skip_finished=true
        said = stopped.stdout + stopped.stderr
        assert "finish its sweep with tlab-train -m seed=0,1 " in said, said[-3000:]
        assert f"hydra.sweep.dir={sweep} skip_finished=true (this job resumes from it)" in said
    resumed = tlab_train(
        *STOPPED_SWEEP, f"hydra.sweep.dir={sweep}", "skip_finished=true", cwd=tmp_path,
        **TESTS_ON_PATH,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("skipped: finished before") == 1
    assert f"resuming from {sweep / '1' / 'checkpoints' / 'last.ckpt'}" in resumed.stdout
    want, got = uninterrupted_sweep / "summary", sweep / "summary"
    assert by_choice(got.with_suffix(".md").read_text()) == by_choice(
        want.with_suffix(".md").read_text()
    )
    rows = [comparable(r) for r in read_csv(got.with_suffix(".csv"))]
    assert rows == [comparable(r) for r in read_csv(want.with_suffix(".csv"))]
    assert all("skip_finished" not in r["overrides"] for r in rows)
    # the stopped part's metrics.csv was set aside; joined, the curve is the uninterrupted one
    assert (sweep / "1" / "csv.1" / "metrics.csv").is_file()
    joined, resumes = history(sweep / "1")
    assert len(resumes) == 1 and 4 <= resumes[0] <= 6  # where last.ckpt was saved
    whole, _ = history(uninterrupted_sweep / "1")
    for metric in ("train/loss", "val/loss"):
        steps, values = curve(joined, metric)
        want_steps, want_values = curve(whole, metric)
        assert steps and steps == want_steps and values == pytest.approx(want_values, rel=1e-4), (
            metric
        )


# ------------------------------------------------------------------ a joblib sweep stopped


class Slowly(L.Callback):
    """Mark that the job trains (a file ``training-<seed>`` in ``$TLAB_TEST_MARKS``) and
    take a second a batch, so that a signal finds it training (at full speed where
    ``$TLAB_TEST_SLOWLY`` is 0: the sweep finished after the signal)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        (Path(os.environ["TLAB_TEST_MARKS"]) / f"training-{self.seed}").touch()
        if os.environ.get("TLAB_TEST_SLOWLY") != "0":
            time.sleep(1.0)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signame", "code", "workers"), [("SIGTERM", 143, 2), ("SIGINT", 130, 6)]
)  # 6 workers for 4 jobs: two idle ones, which a forwarded signal would kill (and loky all)
def test_a_signal_to_a_joblib_sweeps_main_process_stops_every_job(signame, code, workers, tmp_path):
    """4 jobs, 2 at a time: a signal to the main process alone (``kill PID``, what
    ``timeout`` and ``make`` send) reaches both running jobs, which save and record
    themselves; the 2 queued jobs do not start; the main process prints the line that
    finishes the sweep and exits 128 + the signal's number; no process is left. That line
    then finishes the sweep (run once, after SIGTERM: the line is the same after either)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    command = [
        "-m", "launcher=joblib", "seed=0,1,2,3", *TINY, "trainer.max_epochs=3", "logger=csv",
        "+callbacks.slowly._target_=test_sweeps.Slowly", "+callbacks.slowly.seed=${seed}",
        f"hydra.launcher.n_jobs={workers}",
    ]  # fmt: skip
    running = min(workers, 4)
    env = {
        **os.environ, **TESTS_ON_PATH, "WANDB_MODE": "offline", "TLAB_ROOT": str(tmp_path),
        "TLAB_TEST_MARKS": str(marks),
    }  # fmt: skip
    main = subprocess.Popen(
        [sys.executable, "-m", "transformers_lab.train", *command],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while len(list(marks.iterdir())) < running and main.poll() is None:
            assert time.monotonic() < deadline, "the jobs never started training"
            time.sleep(0.2)
        os.kill(main.pid, getattr(signal, signame))  # the main process alone
        said, _ = main.communicate(timeout=120)
    finally:
        if group_alive(main.pid):
            os.killpg(main.pid, signal.SIGKILL)
    assert main.returncode == code, said[-3000:]
    deadline = time.monotonic() + 20
    while group_alive(main.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(main.pid), "the sweep left processes running"
    sweep = sweep_dir_of(tmp_path)
    statuses = {}
    for job in "0123":
        path = sweep / job / RESULT_FILE
        statuses[job] = json.loads(path.read_text())["status"] if path.is_file() else None
    assert list(statuses.values()).count("interrupted") == running
    assert list(statuses.values()).count(None) == 4 - running  # the queued ones never started
    assert f"sweep stopped by {signame}: {running} running job(s) saved their checkpoints" in said
    stop_line = said.split(f"sweep stopped by {signame}: ", 1)[1].splitlines()[0]
    resume = stop_line.split("finish its sweep with ", 1)[1].split(" (its")[0]
    assert resume.endswith(f"hydra.sweep.dir={sweep} skip_finished=true"), resume
    assert "'+callbacks.slowly.seed=${seed}'" in resume  # as given, for each job to resolve
    if signame != "SIGTERM":
        return
    words = shlex.split(resume)[1:]  # after tlab-train
    marks_env = {"TLAB_TEST_MARKS": str(marks), "TLAB_TEST_SLOWLY": "0", **TESTS_ON_PATH}
    finished = tlab_train(*words, cwd=tmp_path, **marks_env)
    assert finished.returncode == 0, finished.stderr[-3000:]
    records = [json.loads((sweep / j / RESULT_FILE).read_text()) for j in "0123"]
    assert [r["status"] for r in records] == ["ok"] * 4
    assert finished.stdout.count("resuming from") == running


def test_make_ablate_sweeps_the_field_s_kernels_each_an_attention_option(monkeypatch, tmp_path):
    """``make ablate``'s command composes: its kernels (ABLATE_KERNELS, quoted as one value
    of the sweeper's params) are options of the attention group, 4 of them, 2 rates and 2
    seeds to start from, grown past the grid's edge for at most 3 rounds: what the docs'
    measured time is for."""
    from hydra import compose, initialize_config_dir

    from transformers_lab.config import CONF_DIR

    root = Path(__file__).parents[2]
    plan = subprocess.run(["make", "-n", "ablate"], cwd=root, capture_output=True, text=True)
    (line,) = [x for x in plan.stdout.splitlines() if "tlab-train" in x]
    args = shlex.split(line.split("tlab-train", 1)[1])
    monkeypatch.setenv("TLAB_ROOT", str(tmp_path))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", args, return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    kernels = params.attention.split(",")
    assert len(kernels) == 4 and "softmax" in kernels and "fastmax_p2" in kernels
    assert all((CONF_DIR / "attention" / f"{k}.yaml").is_file() for k in kernels)
    assert len(str(params["optimizer.lr"]).split(",")) == 2
    assert len(str(params.seed).split(",")) == 2
    assert cfg.trainer.max_steps == 2200 and cfg.hydra.launcher.n_jobs == 2
    assert cfg.hydra.sweeper.grow == 3


@pytest.fixture(scope="module")
def causal_only() -> set[str]:
    """The attention options whose kernel is causal only (each option composed once for the
    module's tests)."""
    from hydra.utils import get_class

    from transformers_lab.config import attention_configs

    configs = attention_configs()
    return {name for name, c in configs.items() if get_class(c["_target_"]).causal_only}


@pytest.mark.parametrize(
    "sweep, model, left_out",
    [
        ("fast_paper_vit", "ViT", {"fastmax", "sliding_window"}),  # a window over all 50
        ("fast_paper_gpt", "GPT", {"fastmax"}),  # swept as fastmax_p1 and fastmax_p2
    ],
)
def test_the_fast_paper_tables_sweep_every_kernel_their_model_takes(
    sweep, model, left_out, causal_only, monkeypatch, tmp_path
):
    """The MNIST and Shakespeare tables' sweeps: their glob over the attention group is
    every option the model can take (a ViT no causal-only kernel), at 3 rates and 3 seeds."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from transformers_lab.config import CONF_DIR

    monkeypatch.setenv("TLAB_ROOT", str(tmp_path))
    options = sorted(p.stem for p in (CONF_DIR / "attention").glob("*.yaml"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", [f"sweep={sweep}"], return_hydra_config=True)
    assert cfg.model._target_.endswith(f".{model}")
    params = cfg.hydra.sweeper.params
    swept = OverridesParser.create().parse_override(f"attention={params.attention}")
    kernels = set(swept.value().filter(options))
    takes = set(options) - (causal_only if model == "ViT" else set())
    assert kernels == takes - left_out
    assert {"softmax", "fastmax_p1", "fastmax_p2"} <= kernels and len(causal_only) == 9
    assert len(str(params["optimizer.lr"]).split(",")) == 3
    assert len(str(params.seed).split(",")) == 3
