"""sweeps.stats, and the summary's statistics on constructed records with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from transformers_lab.errors import UnknownChoice
from transformers_lab.run.record import JobRecord, Monitor, read_record, write_record
from transformers_lab.sweeps.report.cli import summarize
from transformers_lab.sweeps.report.stats import (
    best_of,
    compare,
    interval,
    metric_range,
    t_interval,
)


def test_the_t_interval_is_students_and_scipys():
    interval = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    # mean 3, s = sqrt(2.5), t(4, 0.975) = 2.7764451: half-width 1.9632
    assert interval.mean == 3.0 and interval.n == 5
    assert interval.low == pytest.approx(3 - 1.963243, abs=1e-6)
    assert interval.high == pytest.approx(3 + 1.963243, abs=1e-6)
    values = [0.72, 0.98, 0.91, 0.43]
    low, high = scipy_stats.t.interval(
        0.95, len(values) - 1, loc=sum(values) / 4, scale=scipy_stats.sem(values)
    )
    ours = t_interval(values)
    assert (ours.low, ours.high) == pytest.approx((low, high), rel=1e-12)
    assert t_interval([0.5]).low is None  # one seed: no interval
    with pytest.raises(ValueError):
        t_interval([])


def test_a_real_difference_is_significant_and_noise_is_not():
    base = {"0": 1.00, "1": 0.99, "2": 1.00, "3": 0.98}
    worse = {"0": 0.52, "1": 0.55, "2": 0.49, "3": 0.51}
    noisy = {"0": 0.99, "1": 1.00, "2": 0.97, "3": 1.00}
    big = compare(worse, base)
    assert big.test == "paired t" and big.significant() and big.difference < -0.4
    small = compare(noisy, base)
    assert small.test == "paired t" and not small.significant() and small.p > 0.5
    expected = scipy_stats.ttest_rel(list(worse.values()), list(base.values())).pvalue
    assert big.p == pytest.approx(expected)
    unpaired = compare({"5": 0.5, "6": 0.6, "7": 0.55}, base)  # other seeds: Welch
    welch = scipy_stats.ttest_ind([0.5, 0.6, 0.55], list(base.values()), equal_var=False)
    assert unpaired.test == "Welch t" and unpaired.p == pytest.approx(welch.pvalue)
    assert compare({"0": 1.0}, {"1": 1.0}).p is None  # one run a side: no test
    same = compare({"0": 1.0, "1": 1.0}, {"0": 1.0, "1": 1.0})
    assert same.p == 1.0 and not same.significant()


def test_a_side_all_at_one_value_is_tested_exactly_and_quietly():
    """Accuracy 1 on both seeds against 0.917 and 1: Welch's t is exactly 1 on 1 degree
    of freedom (p = 0.5); scipy warned of a precision loss into every such summary."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        welch = compare({"0": 1.0, "1": 1.0}, {"0": 0.917, "1": 1.0}, paired=False)
        paired = compare({"0": 1.0, "1": 1.0, "2": 1.0}, {"0": 0.9, "1": 0.95, "2": 0.97})
    assert welch.statistic == pytest.approx(1.0) and welch.p == pytest.approx(0.5)
    expected = scipy_stats.ttest_rel([1.0, 1.0, 1.0], [0.9, 0.95, 0.97]).pvalue
    assert paired.p == pytest.approx(expected)


def test_best_of_skips_missing_values():
    assert best_of([0.2, None, 0.9, float("nan")], "max") == 2
    assert best_of([0.2, None, 0.9], "min") == 0
    assert best_of([None, math.nan], "max") is None


def started(seed: str, extra: dict[str, str] | None = None) -> dict:
    """A run's ``seeded`` record: the same for the same seed, as for kernels without
    parameters of their own (``extra``: a kernel's own, shifting nothing here)."""
    return {"data": "d0", "rng": f"r{seed}", "params": {"w": f"w{seed}", **(extra or {})}}


def job(folder, overrides, acc, status="ok", seeded="auto", params=None):
    record = JobRecord(status=status, overrides=overrides, monitor=Monitor("val/acc", "max"))
    if status == "ok":
        record.metrics = {"val/acc": acc}
        seed = next((o.split("=")[1] for o in overrides if o.startswith("seed=")), "0")
        record.seeded = started(seed) if seeded == "auto" else seeded
        record.params = params
    write_record(folder, record)


def grid(tmp_path):
    """softmax and fastmax over 3 seeds x 2 learning rates: the best lr differs by seed."""
    sweep = tmp_path / "grid"
    accs = {
        ("softmax", 0): (0.99, 0.60), ("softmax", 1): (0.98, 0.97), ("softmax", 2): (0.70, 1.00),
        ("fastmax", 0): (0.40, 0.52), ("fastmax", 1): (0.55, 0.50), ("fastmax", 2): (0.45, 0.48),
    }  # fmt: skip
    n = 0
    for (kernel, seed), per_lr in accs.items():
        for lr, acc in zip(("1e-3", "1e-2"), per_lr, strict=True):
            job(sweep / str(n), [f"attention={kernel}", f"seed={seed}", f"optimizer.lr={lr}"], acc)
            n += 1
    return sweep


def test_best_over_lr_then_the_mean_over_seeds_and_the_test(tmp_path):
    summary = summarize(grid(tmp_path), best_over=["optimizer.lr"], baseline="attention=softmax")
    groups = {g["choice"]: g for g in summary["groups"]}
    assert set(groups) == {"attention=softmax", "attention=fastmax"}  # lr is not a choice
    softmax, fastmax = groups["attention=softmax"], groups["attention=fastmax"]
    # the lr with the best mean over seeds, all its seeds: softmax 0.89 at 1e-3 against
    # 0.857 at 1e-2 (each seed's best lr would give 0.99, 0.98, 1.00: its luckiest draws)
    assert softmax["seeds"] == {"0": 0.99, "1": 0.98, "2": 0.70}
    assert fastmax["seeds"] == {"0": 0.52, "1": 0.50, "2": 0.48}  # 0.50 at 1e-2 > 0.467
    comparison = fastmax["comparison"]
    assert comparison.test == "paired t" and comparison.significant()  # p = 0.044
    expected = scipy_stats.ttest_rel([0.52, 0.50, 0.48], [0.99, 0.98, 0.70]).pvalue
    assert comparison.p == pytest.approx(expected)
    spread = t_interval([0.52, 0.50, 0.48])  # inside [0, 1]: nothing to clip
    assert fastmax["ci"] == pytest.approx((spread.low, spread.high))
    chosen = [r["job"] for r in summary["jobs"] if r["best of cell"] == "yes"]
    assert chosen == ["0", "2", "4", "7", "9", "11"]
    md = (tmp_path / "grid" / "summary.md").read_text()
    assert "Each cell is the setting of optimizer.lr with the best mean over seeds" in md
    line = next(x for x in md.splitlines() if x.startswith("| attention=fastmax |"))
    assert "(paired t)" in line and "0.5 ± 0.02 [0.45, 0.55] (n=3)" in line  # t(2) = 4.30


def test_the_best_rate_spans_the_dirs_given_unless_kept_apart(tmp_path):
    """The grid's runs given one dir each (or split over sweeps): one best rate a choice
    over all of them, the rate whose mean over seeds is best; with by_source, each dir's."""
    sweep = grid(tmp_path)
    dirs = sorted(sweep.iterdir(), key=lambda d: int(d.name))
    summary = summarize(dirs, best_over=["optimizer.lr"], out=tmp_path / "out")
    assert (
        "# Sweep summary: 0, 1, 2 and 9 more dirs" in (tmp_path / "out" / "summary.md").read_text()
    )
    groups = {g["choice"]: g for g in summary["groups"]}
    assert groups["attention=softmax"]["seeds"] == {"0": 0.99, "1": 0.98, "2": 0.70}
    assert groups["attention=fastmax"]["seeds"] == {"0": 0.52, "1": 0.50, "2": 0.48}
    assert groups["attention=softmax"]["runs"] == "3/3"
    # a seed added at the winning rate joins it and leaves the choice: softmax's 1e-3 wins
    # on seeds 0-2 (0.89 against 0.857), a poor seed 3 there (mean 0.73 over four) does
    # not hand the cell to 1e-2, which has no seed 3
    job(tmp_path / "seed3", ["attention=softmax", "seed=3", "optimizer.lr=1e-3"], 0.25)
    more = summarize([*dirs, tmp_path / "seed3"], best_over=["optimizer.lr"], out=tmp_path / "o3")
    softmax = next(g for g in more["groups"] if g["choice"] == "attention=softmax")
    assert softmax["seeds"] == {"0": 0.99, "1": 0.98, "2": 0.70, "3": 0.25}
    # a rate that failed on most seeds does not win on the one it finished
    failing = tmp_path / "failing"
    accs = {"1e-2": (0.80, None, None), "1e-3": (0.75, 0.95, 0.95)}  # None: failed
    for n, (lr, seed) in enumerate((lr, seed) for lr in accs for seed in range(3)):
        acc = accs[lr][seed]
        overrides = ["attention=dot", f"seed={seed}", f"optimizer.lr={lr}"]
        job(failing / str(n), overrides, acc, status="failed" if acc is None else "ok")
    dot = summarize(failing, best_over=["optimizer.lr"])["groups"][0]
    assert dot["seeds"] == {"0": 0.75, "1": 0.95, "2": 0.95}
    # a repeat of seed 0 in another dir, at the winning rate: it joins, the choice stays
    repeat = tmp_path / "repeat"
    job(repeat / "0", ["attention=softmax", "seed=0", "optimizer.lr=1e-3"], 0.05)
    with_repeat = summarize([sweep, repeat], best_over=["optimizer.lr"], out=tmp_path / "o4")
    softmax = next(g for g in with_repeat["groups"] if g["choice"] == "attention=softmax")
    assert softmax["runs"] == "4/4" and sorted(softmax["values"])[0] == 0.05
    # kept apart, each single run is its own cell: all twelve stand
    apart = summarize(dirs, best_over=["optimizer.lr"], out=tmp_path / "o2", by_source=True)
    assert sum(r["best of cell"] == "yes" for r in apart["jobs"]) == 12


def test_run_dirs_of_two_sweeps_with_the_same_names_stay_apart(tmp_path):
    """Job 3 of one sweep and job 3 of another, given as run dirs: two jobs, each in its
    own kernel's cell (one name for both had the one's best rate take the other's run)."""
    dirs = []
    for sweep, kernel, accs in (("a", "softmax", (0.9, 0.5)), ("b", "dot", (0.4, 0.8))):
        for n, (seed, lr) in enumerate((s, lr) for s in range(3) for lr in ("1e-3", "1e-2")):
            acc = accs[lr == "1e-2"] + seed / 100
            job(
                tmp_path / sweep / str(n),
                [f"attention={kernel}", f"seed={seed}", f"optimizer.lr={lr}"],
                acc,
            )
            dirs.append(tmp_path / sweep / str(n))
    summary = summarize(dirs, best_over=["optimizer.lr"], out=tmp_path / "out")
    assert [r["job"] for r in summary["jobs"]][:2] == ["a/0", "a/1"]
    groups = {g["choice"]: g for g in summary["groups"]}
    assert groups["attention=softmax"]["runs"] == groups["attention=dot"]["runs"] == "3/3"
    assert groups["attention=softmax"]["mean"] == pytest.approx(0.91)
    assert groups["attention=dot"]["mean"] == pytest.approx(0.81)


def test_a_sweep_over_rates_keeps_each_choice_at_its_best_rate_by_default(tmp_path, capsys):
    """Without best_over, a sweep that varies the rate and the kernel keeps each kernel at
    its best rate, and the grouped table (file and print) names the rate that won;
    best_over=[] shows every rate; a sweep of the rate alone shows every rate."""
    from transformers_lab.sweeps.report.tables import print_summary

    sweep = grid(tmp_path)
    summary = summarize(sweep, baseline="attention=softmax")
    groups = {g["choice"]: g for g in summary["groups"]}
    assert set(groups) == {"attention=softmax", "attention=fastmax"}
    assert groups["attention=softmax"]["won"] == {"optimizer.lr": "1e-3"}
    assert groups["attention=fastmax"]["won"] == {"optimizer.lr": "1e-2"}
    md = (sweep / "summary.md").read_text()
    assert "| choice | best optimizer.lr | runs ok |" in md
    # a grid of 2 rates: every best is on its edge, and marked so
    assert "| attention=fastmax | 1e-2 (highest) ^ | 3/3 |" in md
    print_summary(summary)
    printed = capsys.readouterr().out
    assert "| choice | best optimizer.lr | runs ok |" in printed
    assert "| 1e-3 (lowest) ^ |" in printed
    every = summarize(sweep, best_over=[])
    assert (
        len(every["groups"]) == 4 and "best optimizer.lr" not in (sweep / "summary.md").read_text()
    )
    gridded = summarize(sweep, grid=["optimizer.lr", "attention"])  # the figure shows rates
    assert len(gridded["groups"]) == 4 and not gridded["groups"][0]["won"]
    alone = tmp_path / "rates"
    for n, (lr, seed) in enumerate([("1e-3", 0), ("1e-3", 1), ("1e-2", 0), ("1e-2", 1)]):
        job(alone / str(n), [f"seed={seed}", f"optimizer.lr={lr}"], 0.5 + n / 10)
    rates = summarize(alone)
    assert sorted(g["choice"] for g in rates["groups"]) == [
        "optimizer.lr=1e-2",
        "optimizer.lr=1e-3",
    ]


def test_a_sweep_and_its_repeat_with_the_same_seeds_count_every_run(tmp_path):
    """Two dirs summarized together, both with seeds 0 and 1: the group's statistics use
    all four runs (not the last dir's two), paired by dir and seed; the same seed run
    twice in one dir keeps both values, and the test is then Welch's."""
    accs = {"A": {"softmax": (0.90, 0.92), "fastmax": (0.50, 0.52)},
            "B": {"softmax": (0.70, 0.72), "fastmax": (0.30, 0.32)}}  # fmt: skip
    for sweep, per_kernel in accs.items():
        n = 0
        for kernel, per_seed in per_kernel.items():
            for seed, acc in enumerate(per_seed):
                job(tmp_path / sweep / str(n), [f"attention={kernel}", f"seed={seed}"], acc)
                n += 1
    summary = summarize(
        [tmp_path / "A", tmp_path / "B"], out=tmp_path / "both", baseline="attention=softmax"
    )
    groups = {g["choice"]: g for g in summary["groups"]}
    fastmax, softmax = groups["attention=fastmax"], groups["attention=softmax"]
    assert sorted(fastmax["values"]) == [0.30, 0.32, 0.50, 0.52]
    assert fastmax["mean"] == pytest.approx(0.41) and softmax["mean"] == pytest.approx(0.81)
    assert fastmax["comparison"].test == "paired t"  # 4 pairs: (A, 0), (A, 1), (B, 0), (B, 1)
    assert fastmax["comparison"].difference == pytest.approx(-0.40)

    again = tmp_path / "again"  # one dir, seed 0 of each kernel run twice
    for n, (kernel, acc) in enumerate([("softmax", 0.9), ("softmax", 0.7), ("fastmax", 0.5),
                                       ("fastmax", 0.3)]):  # fmt: skip
        job(again / str(n), [f"attention={kernel}", "seed=0"], acc)
    groups = {g["choice"]: g for g in summarize(again, baseline="attention=softmax")["groups"]}
    assert sorted(groups["attention=fastmax"]["values"]) == [0.3, 0.5]
    assert groups["attention=fastmax"]["mean"] == pytest.approx(0.4)
    assert groups["attention=fastmax"]["comparison"].test == "Welch t"


def test_the_baseline_is_matched_at_the_same_values_of_the_other_keys(tmp_path):
    """In kernels x widths, linear at width 64 is tested against softmax at width 64 (a
    real difference) and at width 128 against softmax at 128 (none)."""
    sweep = tmp_path / "widths"
    accs = {
        ("softmax", 64): (0.90, 0.92, 0.91), ("linear", 64): (0.50, 0.55, 0.52),
        ("softmax", 128): (0.60, 0.70, 0.80), ("linear", 128): (0.61, 0.69, 0.81),
        ("cosine", 256): (0.3, 0.3, 0.3),  # no softmax at 256: no comparison
    }  # fmt: skip
    n = 0
    for (kernel, width), per_seed in accs.items():
        for seed, acc in enumerate(per_seed):
            job(
                sweep / str(n),
                [f"attention={kernel}", f"model.d_model={width}", f"seed={seed}"],
                acc,
            )
            n += 1
    summary = summarize(sweep, baseline="attention=softmax")
    groups = {g["choice"]: g for g in summary["groups"]}
    at_64 = groups["attention=linear model.d_model=64"]
    at_128 = groups["attention=linear model.d_model=128"]
    assert at_64["versus"] == "attention=softmax model.d_model=64"
    assert at_64["comparison"].difference == pytest.approx(0.52333 - 0.91, abs=1e-4)
    assert at_64["comparison"].significant()
    assert at_128["versus"] == "attention=softmax model.d_model=128"
    assert at_128["comparison"].difference == pytest.approx(0.0033333, abs=1e-6)
    assert not at_128["comparison"].significant()
    assert "comparison" not in groups["attention=cosine model.d_model=256"]
    assert "comparison" not in groups["attention=softmax model.d_model=64"]


def test_an_unknown_baseline_lists_the_choices(tmp_path):
    with pytest.raises(
        UnknownChoice,
        match=r"no choice 'attention=dot'.*choices are: 'attention=softmax optimizer.lr=1e-3'",
    ):
        summarize(grid(tmp_path), baseline="attention=dot", best_over=[])


def test_tlab_summarize_takes_the_baseline_and_the_grid(tmp_path, capsys):
    from transformers_lab.sweeps.report import cli as summary_module

    sweep = grid(tmp_path)
    args = [str(sweep), "--best-over", "optimizer.lr", "--baseline", "attention=softmax"]
    assert summary_module.main(args) == 0
    out = capsys.readouterr().out
    assert "| attention=fastmax | 1e-2 (highest) ^ | 3/3 |" in out and "(paired t)" in out
    assert summary_module.main([str(sweep), "--best-over"]) == 0  # none: every rate
    assert "| attention=fastmax optimizer.lr=1e-2 | 3/3 |" in capsys.readouterr().out
    assert summary_module.main([str(sweep), "--baseline", "attention=nope"]) == 2
    assert capsys.readouterr().err.startswith("error: no choice 'attention=nope'")


def test_a_grid_figure_of_the_best_runs(tmp_path):
    """Zoology's Figure 2 layout: accuracy against d_model, a panel per size, a line per
    kernel, the best learning rate of each cell."""
    sweep, n = tmp_path / "zoo", 0
    for size in ("64x4", "128x8"):
        for kernel, base in (("softmax", 0.9), ("linear", 0.4)):
            for width in (64, 128):
                for lr, bonus in (("1e-3", 0.0), ("1e-2", 0.05)):
                    overrides = [f"attention={kernel}", f"model.d_model={width}",
                                 f"mqar_size={size}", f"optimizer.lr={lr}"]  # fmt: skip
                    acc = base + bonus + (0.02 if width == 128 else 0.0)
                    job(sweep / str(n), overrides, acc)
                    n += 1
    summary = summarize(
        sweep, best_over=["optimizer.lr"], grid=["model.d_model", "attention", "mqar_size"]
    )
    rows = {(r["panel"], r["line"], r["x"]): r["val/acc"] for r in summary["grid"]}
    assert len(rows) == 8
    assert rows[("64x4", "softmax", "128")] == pytest.approx(0.97)  # the better lr
    assert rows[("128x8", "linear", "64")] == pytest.approx(0.45)
    assert (sweep / "grid.png").stat().st_size > 0
    assert "| 64x4 | softmax | 128 | 0.97 | 1 |" in (sweep / "grid.md").read_text()
    with pytest.raises(ValueError, match="a grid is X LINES"):
        summarize(sweep, grid=["model.d_model"])


def test_mean_over_tasks_is_the_mad_score_of_each_kernel(tmp_path):
    """MAD's score: the best lr of each (kernel, task), then the mean over tasks."""
    sweep = tmp_path / "mad"
    accs = {
        ("softmax", "mad_a"): (0.9, 1.0), ("softmax", "mad_b"): (0.6, 0.5),
        ("linear", "mad_a"): (0.7, 0.2), ("linear", "mad_b"): (0.1, 0.3),
    }  # fmt: skip
    n = 0
    for (kernel, task), per_lr in accs.items():
        for lr, acc in zip(("1e-3", "5e-4"), per_lr, strict=True):
            job(sweep / str(n), [f"attention={kernel}", f"data={task}", f"optimizer.lr={lr}"], acc)
            n += 1
    summary = summarize(sweep, best_over=["optimizer.lr"], mean_over=["data"])
    scores = {r["choice"]: r for r in summary["scores"]}
    assert scores["attention=softmax"]["score"] == pytest.approx((1.0 + 0.6) / 2)
    assert scores["attention=linear"]["score"] == pytest.approx((0.7 + 0.3) / 2)
    assert scores["attention=linear"]["cells"] == "2/2"
    md = (sweep / "summary.md").read_text()
    assert "## Score: mean of `val/acc` over data" in md
    assert "| attention=softmax | 0.8 | 2/2 |" in md


def test_a_score_is_only_given_over_every_task(tmp_path):
    """A kernel whose task failed (or was not run) gets no score, and the gap is named."""
    sweep = tmp_path / "partial"
    job(sweep / "0", ["attention=softmax", "data=mad_a"], 0.9)
    job(sweep / "1", ["attention=softmax", "data=mad_b"], 0.7)
    job(sweep / "2", ["attention=linear", "data=mad_a"], 0.5)
    job(sweep / "3", ["attention=linear", "data=mad_b"], None, status="failed")
    job(sweep / "4", ["attention=cosine", "data=mad_a"], 0.4)
    scores = {r["choice"]: r for r in summarize(sweep, mean_over=["data"])["scores"]}
    assert scores["attention=softmax"]["score"] == pytest.approx(0.8)
    for kernel in ("linear", "cosine"):
        row = scores[f"attention={kernel}"]
        assert row["score"] is None and row["cells"] == "1/2" and row["missing"] == "data=mad_b"


def test_a_grid_refuses_to_average_what_it_does_not_show(tmp_path):
    """Two vocab sizes at one (kernel, width) point: no figure, but the summary stands."""
    sweep = tmp_path / "mixed"
    for n, (vocab, acc) in enumerate((("64", 0.9), ("128", 0.5))):
        job(
            sweep / str(n),
            ["attention=softmax", "model.d_model=64", f"data.vocab_size={vocab}"],
            acc,
        )
    summary = summarize(sweep, grid=["model.d_model", "attention"])
    assert summary["grid"] is None and not (sweep / "grid.png").exists()
    md = (sweep / "summary.md").read_text()
    assert "No grid figure: the grid's point" in md and "differ in data.vocab_size" in md


def test_a_baseline_that_every_run_shares_compares_nothing(tmp_path):
    sweep = tmp_path / "one"
    for seed in (0, 1):
        job(sweep / str(seed), ["attention=softmax", f"data=mad_{seed}"], 0.5 + seed / 10)
    summary = summarize(sweep, baseline="attention=softmax")  # no error: softmax is all
    assert all("comparison" not in g for g in summary["groups"])
    assert "Every run has the baseline's attention=softmax" in (sweep / "summary.md").read_text()


# ---------------------------------------------------------------- intervals, pairing, n


def test_an_interval_on_a_bounded_metric_stays_in_its_range():
    assert metric_range("val/acc") == (0.0, 1.0) and metric_range("test/bleu") == (0.0, 100.0)
    assert metric_range("val/loss") is None
    accs = [0.28, 0.98, 0.99]
    assert t_interval(accs).high > 1.0  # Student's interval runs past an accuracy of 1
    bounded = interval(accs, metric_range("val/acc"))  # t: [-0.26, 1.76]
    assert bounded.method == "t, clipped" and (bounded.low, bounded.high) == (0.0, 1.0)
    # Student's interval computed apart, by scipy: mean ± t(n - 1) * sem
    inside = [0.80, 0.85, 0.90]  # t: [0.726, 0.974], inside [0, 1]: nothing to clip
    students = scipy_stats.t.interval(0.95, 2, loc=0.85, scale=scipy_stats.sem(inside))
    assert interval(inside, (0.0, 1.0)).low == pytest.approx(students[0], rel=1e-12)
    loss = interval(accs, None)  # a loss keeps Student's t, unclipped: [-0.26, 1.76]
    students = scipy_stats.t.interval(0.95, 2, loc=0.75, scale=scipy_stats.sem(accs))
    assert (loss.mean, loss.n, loss.method) == (pytest.approx(0.75), 3, "t")
    assert (loss.low, loss.high) == pytest.approx(students, rel=1e-12)
    assert loss.low == pytest.approx(-0.2612, abs=1e-4) and loss.high > 1.0
    assert t_interval([0.7]).low is None


@pytest.mark.parametrize("values", [[0.293, 0.318], [0.5], [2.0, 2.2]])
def test_below_three_seeds_no_interval_is_given(values):
    """Two seeds' bootstrap interval is their range, narrower than one sd (0.3053 in
    [0.293, 0.318] where Student's gives [0.15, 0.46]); Student's own at n=2 spans 12.7
    standard errors. Neither keeps 95%: none is given."""
    for bounds in ((0.0, 1.0), None):
        spread = interval(values, bounds)
        assert (spread.low, spread.high, spread.method) == (None, None, "none")
        assert spread.mean == pytest.approx(sum(values) / len(values))


def test_the_interval_keeps_its_coverage_at_three_seeds():
    """Of 4,000 draws of three accuracies around 0.6 (sd 0.05), the clipped t-interval
    holds the true mean about 95% of the time."""
    rng = np.random.default_rng(0)
    draws = rng.normal(0.6, 0.05, size=(4000, 3)).clip(0, 1)
    held = [(s.low <= 0.6 <= s.high) for s in (interval(d, (0.0, 1.0)) for d in draws)]
    assert 0.93 < np.mean(held) < 0.97


def test_seeds_are_paired_only_where_each_seed_started_both_runs_alike(tmp_path):
    """The same three seeds: fastmax's differences from softmax are steady, so a paired
    test finds them (p < 0.05); Based's own projections shift the initial values of the
    parameters it shares with softmax, so its seeds are not pairs and Welch's test, on the
    same numbers, finds nothing. A record with no ``seeded`` (an older run) is not paired."""
    sweep = tmp_path / "pairs"
    soft, other = [0.30, 1.00, 0.60], [0.25, 0.93, 0.52]
    n = 0
    for kernel, accs in (("softmax", soft), ("fastmax", other), ("based", other)):
        for seed, acc in enumerate(accs):
            seeded = started(str(seed))
            if kernel == "based":  # its projection drawn between the layers: w shifts too
                seeded = {**seeded, "params": {"w": f"shifted{seed}", "proj": "p"}}
            job(sweep / str(n), [f"attention={kernel}", f"seed={seed}"], acc, seeded=seeded)
            n += 1
    for seed, acc in enumerate(other):  # no record of what the seed fixed
        job(sweep / str(n), ["attention=linear", f"seed={seed}"], acc, seeded=None)
        n += 1
    groups = {
        g["choice"]: g["comparison"]
        for g in summarize(sweep, baseline="attention=softmax")["groups"]
        if "comparison" in g
    }
    paired = scipy_stats.ttest_rel(other, soft).pvalue
    welch = scipy_stats.ttest_ind(other, soft, equal_var=False).pvalue
    assert groups["attention=fastmax"].test == "paired t"
    assert groups["attention=fastmax"].p == pytest.approx(paired) and paired < 0.05
    for kernel in ("based", "linear"):
        assert groups[f"attention={kernel}"].test == "Welch t"
        assert groups[f"attention={kernel}"].p == pytest.approx(welch) and welch > 0.5
    md = (sweep / "summary.md").read_text()
    assert "paired by seed only where each seed started both runs alike" in md


def test_one_seed_shows_n1_and_two_give_no_test(tmp_path):
    sweep = tmp_path / "few"
    job(sweep / "0", ["attention=softmax", "seed=0"], 0.9)
    job(sweep / "1", ["attention=softmax", "seed=1"], 0.8)
    job(sweep / "2", ["attention=linear", "seed=0"], 0.4)
    job(sweep / "3", ["attention=linear", "seed=1"], 0.3)
    job(sweep / "4", ["attention=cosine", "seed=0"], 0.2)
    summarize(sweep, baseline="attention=softmax")
    lines = (sweep / "summary.md").read_text().splitlines()
    cosine = next(x for x in lines if x.startswith("| attention=cosine |"))
    assert "| 0.2 (n=1) |" in cosine and "±" not in cosine
    linear = next(x for x in lines if x.startswith("| attention=linear |"))
    # two seeds: the mean and sd, no interval (a bootstrap gave their range, [0.304, 0.396])
    assert "| 0.35 ± 0.071 (n=2) |" in linear and "| — (paired t, n<3) |" in linear
    assert any("Fewer than 3 seeds: no interval or test is meaningful" in x for x in lines)


def test_the_grouped_table_shows_parameters_and_flags_an_unequal_count(tmp_path):
    """Based carries 3.9% more parameters than softmax: the table says so."""
    sweep = tmp_path / "sizes"
    sizes = {"softmax": 10_000, "fastmax": 10_000, "based": 10_390, "linear": 10_050}
    for n, (kernel, params) in enumerate(sizes.items()):
        job(sweep / str(n), [f"attention={kernel}"], 0.5, params=params)
    summary = summarize(sweep, baseline="attention=softmax")
    off = {g["choice"]: g.get("params_off") for g in summary["groups"]}
    assert off["attention=based"] == pytest.approx(0.039)
    assert off["attention=fastmax"] is None and off["attention=linear"] is None  # 0.5%: within 1%
    md = (sweep / "summary.md").read_text()
    based = next(x for x in md.splitlines() if x.startswith("| attention=based |"))
    assert "| 10,390 (+3.9%) ! |" in based
    assert "! marks a parameter count more than 1% away from the baseline's" in md


def hydra_run(folder, overrides, config, choices, acc):
    """A job dir as Hydra leaves it: its composed config and the option of each group."""
    from omegaconf import OmegaConf

    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(config, folder / ".hydra" / "config.yaml")
    OmegaConf.save({"hydra": {"runtime": {"choices": choices}}}, folder / ".hydra" / "hydra.yaml")
    OmegaConf.save(overrides, folder / ".hydra" / "overrides.yaml")
    job(folder, overrides, acc)


def test_runs_group_by_what_they_ran_not_by_their_command_lines(tmp_path):
    """attention=softmax given and softmax by default are one group; fastmax and
    fastmax_p2, which compose to the same settings, are one group; a setting swept by hand
    is named by its key."""
    sweep = tmp_path / "resolved"
    softmax = {"_target_": "Softmax", "p": None}
    fastmax = {"_target_": "Fastmax", "p": 2}
    runs = [
        (["attention=softmax", "seed=0"], softmax, "softmax", 0.9),
        (["seed=1"], softmax, "softmax", 0.8),
        (["attention=fastmax", "seed=0"], fastmax, "fastmax", 0.5),
        (["attention=fastmax_p2", "seed=1"], fastmax, "fastmax_p2", 0.4),
        (["attention=fastmax", "seed=0", "optimizer.lr=0.01"], fastmax, "fastmax", 0.3),
    ]
    for n, (overrides, attention, option, acc) in enumerate(runs):
        lr = 0.01 if "optimizer.lr=0.01" in overrides else 0.001
        config = {"seed": int(overrides[-1][-1]) if "seed=1" in overrides else 0,
                  "attention": attention, "optimizer": {"lr": lr}}  # fmt: skip
        choices = {"attention": option, "optimizer": "adamw", "hydra/sweeper": "grid"}
        hydra_run(sweep / str(n), overrides, config, choices, acc)
    groups = {g["choice"]: g for g in summarize(sweep, best_over=[])["groups"]}
    assert sorted(groups) == [
        "attention=fastmax optimizer.lr=0.001",
        "attention=fastmax optimizer.lr=0.01",
        "attention=softmax optimizer.lr=0.001",
    ]
    assert sorted(groups["attention=softmax optimizer.lr=0.001"]["values"]) == [0.8, 0.9]
    assert sorted(groups["attention=fastmax optimizer.lr=0.001"]["values"]) == [0.4, 0.5]


def test_two_sweeps_that_differ_only_in_what_they_show_are_one_table(tmp_path):
    """A sweep run without its progress bar, joined with one run with it: the bar changes
    nothing a run computes, so softmax's runs of both are one group, named as before."""
    runs = [
        ("a", ["attention=softmax", "seed=0", "trainer.enable_progress_bar=false"], False, 0.9),
        ("a", ["attention=dot", "seed=0", "trainer.enable_progress_bar=false"], False, 0.5),
        ("b", ["attention=softmax", "seed=1"], True, 0.8),
        ("b", ["attention=dot", "seed=1"], True, 0.4),
    ]
    for n, (sweep, overrides, bar, acc) in enumerate(runs):
        config = {"seed": n // 2, "attention": {"_target_": overrides[0]},
                  "trainer": {"enable_progress_bar": bar, "max_steps": 10}}  # fmt: skip
        choices = {"attention": overrides[0].split("=")[1], "trainer": "cpu"}
        hydra_run(tmp_path / sweep / str(n), overrides, config, choices, acc)
    summary = summarize([tmp_path / "a", tmp_path / "b"], best_over=[])
    groups = {g["choice"]: sorted(g["values"]) for g in summary["groups"]}
    assert groups == {"attention=softmax": [0.8, 0.9], "attention=dot": [0.4, 0.5]}


def test_runs_scored_at_other_lengths_get_a_table_and_a_figure_by_length(tmp_path):
    """eval_lengths' metrics (val/acc@L) of each choice at its best rate, over seeds."""
    sweep, n = tmp_path / "lengths", 0
    for kernel, falls in (("softmax", 0.5), ("gla", 0.1)):
        for seed in (0, 1):
            for lr, acc in (("1e-3", 0.8), ("1e-2", 1.0)):
                overrides = [f"attention={kernel}", f"seed={seed}", f"optimizer.lr={lr}"]
                job(sweep / str(n), overrides, acc)
                record = read_record(sweep / str(n))
                record.metrics |= {f"val/acc@{m}": acc - falls * i + seed / 100 for i, m in
                                   enumerate((64, 128, 256))}  # fmt: skip
                record.metrics["val/acc@128:d0.5"] = 0.0  # a needle depth: not a length
                write_record(sweep / str(n), record)
                n += 1
    summary = summarize(sweep, best_over=["optimizer.lr"])
    points = {(r["line"], r["x"]): r["val/acc"] for r in summary["lengths"]}
    assert len(points) == 6
    assert points["attention=softmax", 256] == pytest.approx(1.0 - 1.0 + 0.005)
    assert points["attention=gla", 128] == pytest.approx(1.0 - 0.1 + 0.005)
    assert (sweep / "lengths.png").stat().st_size > 0
    text = (sweep / "summary.md").read_text()
    assert "| choice | 64 | 128 | 256 |" in text
    # without lengths: no section, no figure
    plain = summarize(grid(tmp_path))
    assert plain["lengths"] == [] and not (tmp_path / "grid" / "lengths.png").exists()
