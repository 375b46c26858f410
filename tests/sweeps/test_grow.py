"""The edge of a searched grid: the summary marks a choice whose best rate is the lowest or
highest tried, and ``hydra.sweeper.grow`` runs the next rates into the same sweep dir
until every best lies inside its grid."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import lightning as L
import pytest
from omegaconf import OmegaConf

from transformers_lab.run.record import read_record
from transformers_lab.sweeps.grid_sweeper import GridSweeper
from transformers_lab.sweeps.report.cli import summarize
from transformers_lab.sweeps.report.collect import collect
from transformers_lab.sweeps.report.edges import (
    HIGHEST,
    LOWEST,
    find_edges,
    grow_jobs,
    next_value,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_summary import make_run  # noqa: E402
from test_sweeps import TESTS_ON_PATH, TINY, sweep_dir_of, tlab_train  # noqa: E402


def rate_sweep(folder: Path, losses: dict[str, dict[str, list[float]]]) -> Path:
    """A sweep of ``attention=<kernel> optimizer.lr=<rate> seed=<i>`` jobs with the given
    final val/loss: ``{kernel: {rate: [seed 0's, seed 1's]}}``."""
    job = 0
    for kernel, by_rate in losses.items():
        for rate, values in by_rate.items():
            for seed, value in enumerate(values):
                overrides = [f"attention={kernel}", f"optimizer.lr={rate}", f"seed={seed}"]
                make_run(folder / str(job), overrides, val_loss=value)
                job += 1
    return folder


@pytest.mark.parametrize(("values", "side", "expected"), [
    ([1e-3, 3e-3, 1e-2], HIGHEST, 3e-2),     # decades: on to 3e-2
    ([1e-3, 3e-3, 1e-2], LOWEST, 3e-4),
    ([5e-4, 1.5e-3, 5e-3], HIGHEST, 1.5e-2),  # the ViT's grid
    ([3e-4, 1e-3], HIGHEST, 3e-3),           # one ratio on, to a round number
    ([3e-4, 1e-3], LOWEST, 1e-4),
    ([1e-3, 2e-3, 4e-3], HIGHEST, 8e-3),     # numbers that are not round stay as they come
    ([64, 128], HIGHEST, 256),
    ([0.0, 0.1], HIGHEST, 0.2),              # a linear grid through zero
    ([0.0, 0.1], LOWEST, None),              # nothing below zero
    ([1e-3], HIGHEST, None),                 # one value: no step
])  # fmt: skip
def test_the_next_value_keeps_the_grids_own_spacing(values, side, expected):
    found = next_value(values, side)
    assert found == expected if expected is None else math.isclose(found, expected)


def test_a_best_rate_on_the_edge_is_marked_in_the_table_and_under_it(tmp_path):
    sweep = rate_sweep(tmp_path / "sweep", {
        "softmax": {"1e-3": [2.0, 2.1], "3e-3": [1.8, 1.9], "1e-2": [1.7, 1.6]},  # highest
        "dot": {"1e-3": [2.0, 2.2], "3e-3": [1.9, 1.8], "1e-2": [2.3, 2.4]},      # inside
        "linear": {"1e-3": [1.5, 1.6], "3e-3": [1.9, 1.8], "1e-2": [2.3, 2.4]},   # lowest
    })  # fmt: skip
    summary = summarize(sweep, baseline="attention=softmax")
    sides = {e.label(): (e.side, e.value) for e in summary["edges"]}
    assert sides == {"attention=softmax": (HIGHEST, 1e-2), "attention=linear": (LOWEST, 1e-3)}
    table = (sweep / "summary.md").read_text()
    grouped = table.split("## By choice", 1)[1].split("## Jobs", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in grouped.splitlines() if line[:1] == "|"}
    assert "1e-2 (highest) ^" in rows["attention=softmax"]
    assert "1e-3 (lowest) ^" in rows["attention=linear"]
    assert "^" not in rows["attention=dot"].split("|")[2]
    note = next(line for line in table.splitlines() if line.startswith("^ marks"))
    assert "attention=softmax (optimizer.lr 0.01, the highest, next 0.03)" in note
    assert "attention=linear (optimizer.lr 0.001, the lowest, next 0.0003)" in note
    assert "attention=dot" not in note


def test_every_best_inside_gives_no_mark_and_a_rate_that_failed_counts_as_tried(tmp_path):
    sweep = rate_sweep(tmp_path / "sweep", {
        "softmax": {"1e-3": [2.0, 2.1], "3e-3": [1.8, 1.7], "1e-2": [1.9, 2.0]},
    })  # fmt: skip
    # a rate past softmax's best that diverged on both seeds: tried, so 1e-2 is inside
    for seed in (0, 1):
        overrides = ["attention=softmax", "optimizer.lr=3e-2", f"seed={seed}"]
        make_run(sweep / f"9{seed}", overrides, status="failed")
    rate_sweep(tmp_path / "dot", {"dot": {"1e-3": [2.0, 2.1], "3e-3": [1.8, 1.7]}})
    summary = summarize(sweep)
    assert summary["edges"] == []
    assert "^ marks" not in (sweep / "summary.md").read_text()
    runs = collect(tmp_path / "dot")
    (edge,) = find_edges(runs, "val/loss", "min", ["optimizer.lr"])
    assert (edge.side, edge.value, edge.next) == (HIGHEST, 3e-3, 1e-2)


def test_a_best_tied_with_a_rate_inside_the_grid_is_inside(tmp_path):
    # MQAR's kernels often reach 100% at two rates: the edge's tie with the middle is no
    # reason to grow; a tie of the two ends (a 2-rate grid) still is
    sweep = rate_sweep(tmp_path / "sweep", {
        "softmax": {"1e-4": [1.0, 1.0], "3e-4": [1.0, 1.0], "1e-3": [2.0, 2.1]},
        "dot": {"3e-4": [1.0, 1.0], "1e-3": [1.0, 1.0]},
    })  # fmt: skip
    edges = find_edges(collect(sweep), "val/loss", "min", ["optimizer.lr"])
    assert [e.label() for e in edges] == ["attention=dot"]


def test_the_grown_jobs_are_the_winning_rates_seeds_one_step_on_and_none_twice(tmp_path):
    sweep = rate_sweep(tmp_path / "sweep", {
        "softmax": {"1e-3": [2.0, 2.1], "3e-3": [1.8, 1.7]},
        "dot": {"1e-3": [1.0, 1.1], "3e-3": [1.8, 1.7]},
    })  # fmt: skip
    runs = collect(sweep)
    jobs = [
        g.overrides for g in grow_jobs(find_edges(runs, "val/loss", "min", ["optimizer.lr"]), runs)
    ]
    assert sorted(map(sorted, jobs)) == sorted([
        ["attention=softmax", "optimizer.lr=0.01", "seed=0"],
        ["attention=softmax", "optimizer.lr=0.01", "seed=1"],
        ["attention=dot", "optimizer.lr=0.0003", "seed=0"],
        ["attention=dot", "optimizer.lr=0.0003", "seed=1"],
    ])  # fmt: skip
    # softmax's next rate (written 1e-2): seed 0 failed there, seed 1 was killed midway; so
    # 1e-2 is not yet tried, seed 0 is not run again, and seed 1 runs again in its own dir
    make_run(sweep / "50", ["attention=softmax", "optimizer.lr=1e-2", "seed=0"], status="failed")
    killed = make_run(sweep / "51", ["attention=softmax", "optimizer.lr=1e-2", "seed=1"], "running")
    runs = collect(sweep)
    (edge, _) = sorted(find_edges(runs, "val/loss", "min", ["optimizer.lr"]), key=lambda e: e.side)
    assert (edge.label(), edge.side) == ("attention=softmax", HIGHEST)
    jobs = {" ".join(sorted(g.overrides)): g.rerun for g in grow_jobs([edge], runs)}
    assert jobs == {"attention=softmax optimizer.lr=0.01 seed=1 skip_finished=true": killed}


class PeakAt(L.Callback):
    """Log ``val/peak``, highest at the rate ``peak`` and falling a decade either side: a
    sweep's best rate that is known in advance."""

    def __init__(self, lr: float, peak: float) -> None:
        self.score = -abs(math.log10(lr) - math.log10(peak))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("val/peak", self.score)


PEAKED = [
    "-m",
    *TINY,
    "logger=csv",
    "+callbacks.peak._target_=test_grow.PeakAt",
    "+callbacks.peak.lr=${optimizer.lr}",
    "+callbacks.peak.peak=1e-3",
    "monitor.metric=val/peak",
    "monitor.mode=max",
    "summary.best_over=[optimizer.lr]",
]


def test_a_grid_grows_past_its_edge_until_the_best_rate_is_inside(tmp_path):
    # the rate peaks at 1e-3; the grid starts at 1e-5 and 1e-4, on the low side of it
    proc = tlab_train(
        *PEAKED,
        "optimizer.lr=1e-5,1e-4",
        "seed=0,1",
        "hydra.sweeper.grow=3",
        cwd=tmp_path,
        **TESTS_ON_PATH,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = sweep_dir_of(tmp_path)
    jobs = {p.name: read_record(p) for p in sweep.iterdir() if p.name.isdigit()}
    rates = {name: r.overrides for name, r in jobs.items()}
    # the grid's 4 jobs, then 1e-3 (the best so far, on the edge), then 1e-2: inside
    assert sorted(jobs, key=int) == [str(i) for i in range(8)]
    assert all(r.status == "ok" for r in jobs.values())
    grown = [sorted(rates[str(i)]) for i in range(4, 8)]
    assert [o for o in grown[0] if o.startswith("optimizer.lr")] == ["optimizer.lr=0.001"]
    assert [o for o in grown[2] if o.startswith("optimizer.lr")] == ["optimizer.lr=0.01"]
    assert {o for g in grown for o in g if o.startswith("seed")} == {"seed=0", "seed=1"}
    assert "every best optimizer.lr lies inside its grid after 2 round(s)" in proc.stdout
    table = (sweep / "summary.md").read_text()
    assert "^ marks" not in table and "| 0.001 |" in table

    # run again into its dir with a bound of 1 round: nothing left to run, nothing run
    again = tlab_train(
        *PEAKED, "optimizer.lr=1e-5,1e-4", "seed=0,1", "hydra.sweeper.grow=1", "skip_finished=true",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path, **TESTS_ON_PATH,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == sorted(jobs)


def test_growing_stops_at_its_bound_and_the_summary_gives_the_command_that_goes_on(tmp_path):
    proc = tlab_train(*PEAKED, "optimizer.lr=1e-7,1e-6", "seed=0", "hydra.sweeper.grow=1",
                      cwd=tmp_path, **TESTS_ON_PATH)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = sweep_dir_of(tmp_path)
    assert len([p for p in sweep.iterdir() if p.name.isdigit()]) == 3  # 2, then 1e-5
    assert "grow: stopped at its bound of 1 round(s); still on the edge" in proc.stdout
    note = next(
        line for line in (sweep / "summary.md").read_text().splitlines() if line.startswith("^")
    )
    assert "(optimizer.lr 1e-05, the highest, next 0.0001)" in note
    command = note.split("`")[1]
    assert command.startswith("tlab-train -m ") and f"hydra.sweep.dir={sweep}" in command
    assert "skip_finished=true" in command and "hydra.sweeper.grow=3" in command
    assert "'optimizer.lr=1e-7,1e-6'" in command or "optimizer.lr=1e-7,1e-6" in command


def test_growing_a_sweep_that_searches_no_key_says_there_is_nothing_to_grow(tmp_path, capsys):
    sweep = rate_sweep(
        tmp_path / "sweep", {"softmax": {"1e-3": [2.0, 2.1]}, "dot": {"1e-3": [2.2, 2.3]}}
    )
    sweeper = GridSweeper(grow=2)
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}, "summary": {}})
    assert sweeper.grow_grid() == []
    out = capsys.readouterr()
    assert "grow: nothing to grow: the summary searches no key" in out.out + out.err
    assert "lies inside" not in out.out + out.err
