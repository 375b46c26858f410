"""The summary's figures: on an axis scaled to the values, every label inside the figure,
no tick label over another."""

from __future__ import annotations

import itertools

import matplotlib
import pytest

from transformers_lab.sweeps.report.plots import state_figure, summary_figure

matplotlib.use("Agg")


def group(choice, values, state=None, ci=True, lr="0.001"):
    mean = sum(values) / len(values)
    return {
        "choice": choice, "values_of": dict(p.split("=", 1) for p in choice.split() if "=" in p),
        "mean": mean, "values": values, "state_size": state,
        "ci": (mean - 0.01, mean + 0.01) if ci else None, "won": {"optimizer.lr": lr},
    }  # fmt: skip


SIX = [
    group("attention=softmax", [1.905, 1.91, 1.915], 16384),
    group("attention=fastmax_p1", [1.93, 1.935, 1.94], 4160),
    group("attention=fastmax_p2", [1.92, 1.925, 1.93], 139328),
    group("attention=gated_deltanet", [1.95, 1.94, 1.945], 4096),
    group("attention=sliding_window", [1.96, 1.955, 1.95], 8192),
    group("attention=based", [1.925, 1.93, 1.92], 36928),
]


def text_boxes(fig, texts):
    renderer = fig.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in texts if t.get_visible() and t.get_text()]


def labels_fit(fig):
    """Every label of the figure (title, axis labels, notes, the tick labels inside the
    axis's limits: those drawn) lies inside it, and no two tick labels of an axis
    overlap."""
    fig.canvas.draw()
    ax = fig.axes[0]
    (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
    xticks = [t for t in ax.get_xticklabels(which="both") if x0 <= t.get_position()[0] <= x1]
    yticks = [t for t in ax.get_yticklabels(which="both") if y0 <= t.get_position()[1] <= y1]
    texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts, *xticks, *yticks]
    inside = fig.bbox.padded(1)
    for box in text_boxes(fig, texts):
        assert inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1), box
    for ticks in (xticks, yticks):
        for a, b in itertools.combinations(text_boxes(fig, ticks), 2):
            assert not a.overlaps(b), (a, b)


def test_the_summary_figure_scales_to_the_values_and_fits_its_labels():
    fig = summary_figure(SIX, "val/loss", "sweep: 18 ok")
    low, high = fig.axes[0].get_ylim()
    assert 1.85 < low < 1.905 and 1.96 < high < 2.0  # not from 0: 1% apart shows
    labels_fit(fig)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks[0] == "softmax\nlr=0.001"  # the rate that won, under its choice
    assert fig.axes[0].get_xlabel() == "attention"
    (bars,) = [c for c in fig.axes[0].containers]  # one error bar per choice with seeds >= 3
    assert len(bars.lines[2][0].get_segments()) == 6


def test_no_error_bars_below_3_seeds():
    few = [group("a", [1.0, 1.1], ci=False), group("b", [1.2, 1.3], ci=False)]
    fig = summary_figure(few, "val/loss", "two seeds")
    (bars,) = fig.axes[0].containers
    assert all(len(s) == 0 or (s[0] == s[1]).all() for s in bars.lines[2][0].get_segments())
    assert "no interval below 3 seeds" in fig.axes[0].get_title()


@pytest.mark.parametrize("spread", [1, 40])  # state sizes within 4x, and over 34x
def test_the_state_figure_labels_do_not_run_into_each_other(spread):
    groups = [dict(g, state_size=int(g["state_size"] ** (1 if spread == 40 else 0.1) * 1000))
              for g in SIX]  # fmt: skip
    fig = state_figure(groups, "val/acc", "sweep: accuracy against state size")
    labels_fit(fig)
    assert sum(bool(t.get_text()) for t in fig.axes[0].get_xticklabels()) >= 2


def test_choices_of_one_state_size_are_labelled_apart():
    """Linear kernels of one feature size keep one state size: their labels stack."""
    same = [dict(g, state_size=4096, values=[0.9], mean=0.9 + i / 1000) for i, g in enumerate(SIX)]
    fig = state_figure(same, "val/acc", "one size")
    labels_fit(fig)
    for a, b in itertools.combinations(text_boxes(fig, fig.axes[0].texts), 2):
        assert not a.overlaps(b), (a, b)
    assert sum(bool(t.get_text()) for t in fig.axes[0].get_xticklabels()) >= 2
