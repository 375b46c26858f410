"""tlab-summarize over several dirs, its errors, and learning curves joined across
resumes, on run dirs laid out as tlab-train writes them (result.json, .hydra/, csv/)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from transformers_lab.run.curves import RESUMED_AT, history, resume_chain, retire
from transformers_lab.run.overrides import BOOKKEEPING_KEYS
from transformers_lab.run.record import JobRecord, Monitor, read_record, write_record
from transformers_lab.sweeps.report import cli as summary_module
from transformers_lab.sweeps.report.cli import summarize
from transformers_lab.sweeps.report.collect import collect
from transformers_lab.sweeps.report.plots import plot_curves

MONITOR = {"metric": "val/loss", "mode": "min"}


def write_csv(folder: Path, rows: list[dict[str, float]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r})
    with (folder / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def loss_rows(steps: range, offset: float = 0.0) -> list[dict[str, float]]:
    """A train/loss row per step, and a val/loss row every 5 steps."""
    rows: list[dict[str, float]] = []
    for s in steps:
        rows.append({"step": s, "epoch": 0, "train/loss": 3.0 - 0.1 * s + offset})
        if s % 5 == 4:
            rows.append({"step": s, "epoch": 0, "val/loss": 3.2 - 0.1 * s + offset})
    return rows


def make_run(
    run_dir: Path,
    overrides: list[str],
    status: str | None = "ok",
    val_loss: float = 2.0,
    ckpt_path: str | None = None,
    cwd: Path | None = None,
) -> Path:
    """A run dir as tlab-train leaves it: .hydra/{overrides,config,hydra}.yaml and, unless
    ``status`` is None, result.json."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), hydra_dir / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"ckpt_path": ckpt_path}), hydra_dir / "config.yaml")
    hydra = {"hydra": {"runtime": {"cwd": str(cwd or run_dir.parent)}}}
    OmegaConf.save(OmegaConf.create(hydra), hydra_dir / "hydra.yaml")
    if status is not None:
        record = JobRecord(status=status, overrides=overrides, monitor=Monitor(**MONITOR))
        if status == "ok":
            record.metrics = {"val/loss": val_loss, "train/loss": val_loss + 0.1}
            record.monitor.best = val_loss
        write_record(run_dir, record)
    return run_dir


def make_sweep(folder: Path, results: dict[str, list[float]]) -> Path:
    """A sweep of ``attention=<kernel> seed=<i>`` jobs with the given final val/loss."""
    job = 0
    for kernel, values in results.items():
        for seed, value in enumerate(values):
            make_run(folder / str(job), [f"attention={kernel}", f"seed={seed}"], val_loss=value)
            job += 1
    return folder


def save_checkpoint(path: Path, step: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {"w": torch.zeros(2)}}, path)
    return path


# ------------------------------------------------------------------ several dirs


def test_several_sweeps_and_runs_make_one_table_grouped_by_choice(tmp_path, monkeypatch):
    a = make_sweep(tmp_path / "a", {"softmax": [2.0, 2.2], "dot": [2.5, 2.7]})
    b = make_sweep(tmp_path / "b", {"fastmax": [2.4, 2.6]})
    run = make_run(tmp_path / "runs" / "r1", ["attention=softmax", "seed=7"], val_loss=2.1)
    monkeypatch.chdir(tmp_path)
    summary = summarize([a, b, run])
    assert [r["job"] for r in summary["jobs"]] == ["a/0", "a/1", "a/2", "a/3", "b/0", "b/1", "r1"]
    groups = {g["choice"]: g for g in summary["groups"]}
    assert sorted(groups) == ["attention=dot", "attention=fastmax", "attention=softmax"]
    assert groups["attention=softmax"]["runs"] == "3/3"
    assert groups["attention=softmax"]["mean"] == pytest.approx((2.0 + 2.2 + 2.1) / 3)
    assert [g["choice"] for g in summary["groups"]][0] == "attention=softmax"  # lowest first
    out = summary["out"]  # several dirs: a new dir under ./logs/summaries
    assert out.parent == Path("logs") / "summaries"
    assert {p.name for p in out.iterdir()} >= {"summary.csv", "summary.md", "summary.png"}
    md = (out / "summary.md").read_text()
    assert "Sweep summary: a, b, r1" in md and "attention=fastmax" in md
    assert not (a / "summary.csv").exists()  # the inputs are left as they were


def test_state_sizes_give_a_column_and_a_plot_of_the_metric_against_them(tmp_path):
    sweep = make_sweep(tmp_path / "s", {"softmax": [2.0, 2.2], "linear": [2.5, 2.7]})
    for job, size in (("0", 4096), ("1", 4096), ("2", 130), ("3", 130)):
        record = read_record(sweep / job)
        record.state_size = size
        write_record(sweep / job, record)
    summary = summarize(sweep)
    groups = {g["choice"]: g["state_size"] for g in summary["groups"]}
    assert groups == {"attention=softmax": 4096, "attention=linear": 130}
    assert [r["state_size"] for r in summary["jobs"]] == [4096, 4096, 130, 130]
    header = next(x for x in (sweep / "summary.md").read_text().splitlines() if "| choice |" in x)
    assert header.endswith("| state size |")
    assert (sweep / "state.png").stat().st_size > 0
    bare = make_sweep(tmp_path / "t", {"softmax": [2.0], "linear": [2.5]})  # no sizes
    summarize(bare)
    assert not (bare / "state.png").exists()
    assert "state size" not in (bare / "summary.md").read_text().split("## Jobs")[0]


def test_by_source_keeps_each_dirs_runs_apart_and_out_says_where(tmp_path, capsys):
    before = make_sweep(tmp_path / "before", {"softmax": [2.0, 2.2]})
    after = make_sweep(tmp_path / "after", {"softmax": [1.0, 1.2]})
    assert len(summarize([before, after], out=tmp_path / "o1")["groups"]) == 1
    out = tmp_path / "cmp"
    code = summary_module.main([str(before), str(after), "--by-source", "--out", str(out)])
    assert code == 0
    assert f"summary: {out / 'summary.md'}" in capsys.readouterr().out
    with (out / "summary.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4
    md = (out / "summary.md").read_text()
    # two seeds: no interval keeps its coverage, none is given
    assert "| after: (all) | 2/2 | 1.1 ± 0.14 (n=2) |" in md
    assert "| before: (all) | 2/2 | 2.1 ± 0.14 (n=2) |" in md
    assert "Fewer than 3 seeds: no interval or test is meaningful" in md


def test_one_sweep_dir_keeps_its_summary_in_place(tmp_path):
    sweep = make_sweep(tmp_path / "s", {"softmax": [2.0], "dot": [3.0]})
    summary = summarize(sweep)
    assert summary["out"] == sweep and (sweep / "summary.md").is_file()
    assert [r["job"] for r in summary["jobs"]] == ["0", "1"]


def test_runs_without_the_swept_key_form_a_defaults_group(tmp_path):
    plain = make_run(tmp_path / "plain", ["experiment=baby_gpt"], val_loss=2.0)
    other = make_run(tmp_path / "fm", ["experiment=baby_gpt", "attention=fastmax"], val_loss=3.0)
    groups = [g["choice"] for g in summarize([plain, other], out=tmp_path / "o")["groups"]]
    assert groups == ["(defaults)", "attention=fastmax"]


# ------------------------------------------------------------------ records


def test_bookkeeping_keys_never_split_a_group(tmp_path):
    sweep = tmp_path / "s"
    make_run(sweep / "0", ["attention=dot", "seed=0"], val_loss=2.0)
    make_run(sweep / "1", ["attention=dot", "seed=1", "skip_finished=true"], val_loss=2.4)
    make_run(sweep / "2", ["attention=dot", "seed=2", "+fail_fast=true"], val_loss=2.2)
    make_run(sweep / "3", ["attention=softmax", "seed=0", "trial=3"], val_loss=1.0)
    make_run(sweep / "4", ["attention=softmax", "seed=1", "trainer.enable_progress_bar=false"])
    assert set(BOOKKEEPING_KEYS) == {"skip_finished", "fail_fast", "summary", "trial"}
    groups = {g["choice"]: g["runs"] for g in summarize(sweep)["groups"]}
    assert groups == {"attention=dot": "3/3", "attention=softmax": "2/2"}


def test_running_and_interrupted_records_are_counted_with_their_last_metrics(tmp_path):
    sweep = tmp_path / "s"
    make_run(sweep / "0", ["attention=dot", "seed=0"], val_loss=2.0)
    make_run(sweep / "1", ["attention=dot", "seed=1"], status="running")
    make_run(sweep / "2", ["attention=dot", "seed=2"], status="interrupted")
    make_run(sweep / "3", ["attention=dot", "seed=3"], status=None)  # no record at all
    for job, value in (("1", 2.5), ("2", 2.7)):
        write_csv(sweep / job / "csv", [{"step": 9, "val/loss": value}])
    summary = summarize(sweep)
    rows = {r["job"]: r for r in summary["jobs"]}
    assert [rows[j]["status"] for j in "0123"] == ["ok", "incomplete", "interrupted", "incomplete"]
    assert rows["1"]["val/loss"] == 2.5 and rows["2"]["val/loss"] == 2.7
    assert summary["groups"][0]["runs"] == "1/4"  # only the finished job is averaged
    md = (sweep / "summary.md").read_text()
    assert "4 jobs (1 ok, 1 interrupted, 2 incomplete)" in md


def test_an_unknown_metric_is_one_line_that_lists_the_logged_ones(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "s", {"softmax": [2.0]})
    assert summary_module.main([str(sweep), "--metric", "val/los"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "'val/los' (did you mean val/loss?)" in err
    assert "logged: train/loss, val/loss" in err
    assert not (sweep / "summary.csv").exists()
    assert summary_module.main([str(sweep), "--metric", "train/loss"]) == 0


def test_collect_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no sweep or run directory at .*nope"):
        collect(tmp_path / "nope")


# ------------------------------------------------------------------ curves across resumes


def test_a_run_resumed_in_a_new_dir_is_joined_at_its_checkpoints_step(tmp_path):
    """A ran to step 11 but its last.ckpt is from step 6: B resumed from it, so A's rows
    from step 6 on are not part of B's history."""
    a = make_run(tmp_path / "a", [])
    write_csv(a / "csv", loss_rows(range(12)))
    ckpt = save_checkpoint(a / "checkpoints" / "last.ckpt", 6)
    b = make_run(tmp_path / "b", [f"ckpt_path={ckpt}"], ckpt_path=str(ckpt))
    write_csv(b / "csv", loss_rows(range(6, 15), offset=0.5))
    assert [d for d, _ in resume_chain(b)] == [a, b]
    rows, resumes = history(b)
    assert resumes == [6]
    train = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
    assert [s for s, _ in train] == list(range(15))
    assert train[5][1] == pytest.approx(2.5) and train[6][1] == pytest.approx(2.9)  # B's from 6
    vals = [r["step"] for r in rows if "val/loss" in r]
    assert vals == [4, 9, 14]


def test_a_relative_checkpoint_path_is_read_from_the_runs_cwd(tmp_path):
    a = make_run(tmp_path / "logs" / "a", [])
    write_csv(a / "csv", loss_rows(range(10)))
    save_checkpoint(a / "checkpoints" / "last.ckpt", 4)
    rel = "logs/a/checkpoints/last.ckpt"
    b = make_run(tmp_path / "logs" / "b", [], ckpt_path=rel, cwd=tmp_path)
    write_csv(b / "csv", loss_rows(range(4, 8)))
    assert [d for d, _ in resume_chain(b)] == [a, b]
    assert history(b)[1] == [4]


def test_without_the_checkpoint_the_next_part_cuts_where_its_rows_begin(tmp_path):
    a = make_run(tmp_path / "a", [])
    write_csv(a / "csv", loss_rows(range(12)))
    gone = a / "checkpoints" / "last.ckpt"  # deleted since: its step is unknown
    b = make_run(tmp_path / "b", [], ckpt_path=str(gone))
    write_csv(b / "csv", loss_rows(range(8, 12)))
    rows, resumes = history(b)
    assert resumes == [8]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(12))


def test_parts_set_aside_in_a_jobs_own_dir_are_joined_in_order(tmp_path):
    job = make_run(tmp_path / "0", [])
    write_csv(job / "csv.1", loss_rows(range(7)))
    (job / "csv.1" / RESUMED_AT).write_text(json.dumps({"step": 5}))
    write_csv(job / "csv.2", loss_rows(range(5, 11), offset=1.0))
    (job / "csv.2" / RESUMED_AT).write_text(json.dumps({"step": 9}))
    write_csv(job / "csv", loss_rows(range(9, 13), offset=2.0))
    rows, resumes = history(job)
    assert resumes == [5, 9]
    train = {int(r["step"]): r["train/loss"] for r in rows if "train/loss" in r}
    assert sorted(train) == list(range(13))
    assert [train[s] - (3.0 - 0.1 * s) for s in (4, 5, 8, 9)] == pytest.approx([0, 1, 1, 2])


def test_a_run_resumed_in_a_new_dir_then_in_its_own_goes_back_to_the_first(tmp_path):
    """B started from A's step-6 checkpoint; stopped, B resumed in its own dir from its
    step-9 one, so its saved config names B's own checkpoint: the chain still reaches A
    through what B's first part logged."""
    a = make_run(tmp_path / "a", [])
    write_csv(a / "csv", loss_rows(range(12)))
    first = save_checkpoint(a / "checkpoints" / "last.ckpt", 6)
    own = save_checkpoint(tmp_path / "b" / "checkpoints" / "last.ckpt", 9)
    b = make_run(tmp_path / "b", [], ckpt_path=str(own))
    write_csv(b / "csv.1", loss_rows(range(6, 11), offset=0.5))
    OmegaConf.save(OmegaConf.create({"ckpt_path": str(first)}), b / "csv.1" / "hparams.yaml")
    (b / "csv.1" / RESUMED_AT).write_text(json.dumps({"step": 9}))
    write_csv(b / "csv", loss_rows(range(9, 15), offset=1.0))
    assert [d for d, _ in resume_chain(b)] == [a, b]
    rows, resumes = history(b)
    assert resumes == [6, 9]
    train = {int(r["step"]): r["train/loss"] for r in rows if "train/loss" in r}
    assert sorted(train) == list(range(15))
    assert [train[s] - (3.0 - 0.1 * s) for s in (5, 6, 8, 9)] == pytest.approx([0, 0.5, 0.5, 1])
    # a job of a sweep resumed in its own dir: its first part started afresh, from nothing
    OmegaConf.save(OmegaConf.create({"ckpt_path": None}), b / "csv.1" / "hparams.yaml")
    assert [d for d, _ in resume_chain(b)] == [b]


def test_retire_moves_an_earlier_attempts_parts_out_of_the_curves(tmp_path):
    job = make_run(tmp_path / "0", [])
    assert retire(job) is None  # nothing to move
    write_csv(job / "csv.1", loss_rows(range(7)))
    (job / "csv.1" / RESUMED_AT).write_text(json.dumps({"step": 5}))
    write_csv(job / "csv", loss_rows(range(5, 9)))
    assert retire(job) == job / "abandoned.1"
    assert history(job) == ([], [])
    assert (job / "abandoned.1" / "csv.1" / "metrics.csv").is_file()
    write_csv(job / "csv", loss_rows(range(3)))
    assert retire(job) == job / "abandoned.2"  # a second one is numbered on
    assert (job / "abandoned.2" / "csv" / "metrics.csv").is_file()


def test_a_checkpoint_pointing_back_into_its_own_run_does_not_loop(tmp_path):
    a = tmp_path / "a"
    make_run(a, [], ckpt_path=str(a / "checkpoints" / "last.ckpt"))
    write_csv(a / "csv", loss_rows(range(3)))
    assert [d for d, _ in resume_chain(a)] == [a]
    assert len(history(a)[0]) == 3


def test_tlab_summarize_curves_writes_the_joined_curves(tmp_path, capsys):
    a = make_run(tmp_path / "a", [])
    write_csv(a / "csv", loss_rows(range(10)))
    ckpt = save_checkpoint(a / "checkpoints" / "last.ckpt", 5)
    b = make_run(tmp_path / "b", [], ckpt_path=str(ckpt))
    write_csv(b / "csv", loss_rows(range(5, 10)))
    assert summary_module.main([str(b), "--curves"]) == 0
    assert f"curves: {b / 'curves.png'}" in capsys.readouterr().out
    assert (b / "curves.png").stat().st_size > 0
    with (b / "curves.csv").open() as f:
        table = list(csv.DictReader(f))
    assert {r["metric"] for r in table} == {"train/loss", "val/loss"}  # the monitored one
    assert [int(r["step"]) for r in table if r["metric"] == "train/loss"] == list(range(10))
    assert [int(r["step"]) for r in table if r["metric"] == "val/loss"] == [4, 9]


def test_curves_of_a_sweep_and_their_errors(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "s", {"softmax": [2.0], "dot": [3.0]})
    assert summary_module.main([str(sweep), "--curves"]) == 2
    assert "no csv/metrics.csv in" in capsys.readouterr().err
    for job in ("0", "1"):
        write_csv(sweep / job / "csv", loss_rows(range(5)))
    png, table = plot_curves([sweep], "val/loss")
    assert png == sweep / "curves.png"
    with table.open() as f:
        assert {r["run"] for r in csv.DictReader(f)} == {"0", "1"}
    assert summary_module.main([str(sweep), "--curves", "--metric", "val/acc"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run logged the metric 'val/acc'" in err
