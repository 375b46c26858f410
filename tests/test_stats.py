"""sweeps.stats, and the summary's statistics on constructed records with known answers."""

from __future__ import annotations

import math

import pytest
from scipy import stats as scipy_stats

from transformers_lab.errors import UnknownChoice
from transformers_lab.sweeps.record import JobRecord, Monitor, write_record
from transformers_lab.sweeps.stats import best_of, compare, t_interval
from transformers_lab.sweeps.summary import summarize


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


def test_best_of_skips_missing_values():
    assert best_of([0.2, None, 0.9, float("nan")], "max") == 2
    assert best_of([0.2, None, 0.9], "min") == 0
    assert best_of([None, math.nan], "max") is None


def job(folder, overrides, acc, status="ok"):
    record = JobRecord(status=status, overrides=overrides, monitor=Monitor("val/acc", "max"))
    if status == "ok":
        record.metrics = {"val/acc": acc}
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
    assert softmax["seeds"] == {"0": 0.99, "1": 0.98, "2": 1.00}  # the best lr of each seed
    assert fastmax["seeds"] == {"0": 0.52, "1": 0.55, "2": 0.48}
    assert fastmax["comparison"].test == "paired t" and fastmax["comparison"].significant()
    low, high = fastmax["ci"]
    assert low < 0.5166 < high
    chosen = [r["job"] for r in summary["jobs"] if r["best of cell"] == "yes"]
    assert chosen == ["0", "2", "5", "7", "8", "11"]
    md = (tmp_path / "grid" / "summary.md").read_text()
    assert "Each cell is the best finished run over optimizer.lr." in md
    line = next(x for x in md.splitlines() if x.startswith("| attention=fastmax |"))
    assert "(paired t)" in line and "*" in line and "[" in line


def test_an_unknown_baseline_lists_the_choices(tmp_path):
    with pytest.raises(
        UnknownChoice,
        match=r"no choice 'attention=dot'.*choices are: 'attention=softmax optimizer.lr=1e-3'",
    ):
        summarize(grid(tmp_path), baseline="attention=dot")


def test_tlab_summarize_takes_the_baseline_and_the_grid(tmp_path, capsys):
    from transformers_lab.sweeps import summary as summary_module

    sweep = grid(tmp_path)
    args = [str(sweep), "--best-over", "optimizer.lr", "--baseline", "attention=softmax"]
    assert summary_module.main(args) == 0
    out = capsys.readouterr().out
    assert "| attention=fastmax | 3/3 |" in out and "(paired t)" in out
    assert summary_module.main([str(sweep), "--baseline", "attention=nope"]) == 2
    assert capsys.readouterr().err.startswith("error: no choice 'attention=nope'")
