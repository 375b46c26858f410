"""The summary's figures: the grouped bars, the metric against state size, Zoology's
grid, and learning curves joined across resumes."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers_lab.files import atomic_write
from transformers_lab.run.curves import history
from transformers_lab.run.overrides import override_key
from transformers_lab.run.record import read_record
from transformers_lab.sweeps.report.collect import Run, check_metric, default_out, run_dirs
from transformers_lab.sweeps.report.groups import grid_rows, length_rows
from transformers_lab.sweeps.report.tables import as_number, markdown_table, natural


def summary_figure(groups: Sequence[dict[str, Any]], metric: str, title: str) -> Any:
    """Each choice's mean of ``metric`` (a dot), its 95% interval over seeds (an error
    bar, where there is one: 3 seeds or more) and each seed's value (small dots), on an
    axis scaled to the values: choices 1% apart are told apart (bars from 0 hid that). A
    searched grid's winning values (``won``) are named under each choice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [g for g in groups if g["mean"] is not None]
    width = max(4.5, 0.9 * len(shown) + 2.0)
    fig, ax = plt.subplots(figsize=(width, 4.2), dpi=120, layout="constrained")
    xs = range(len(shown))
    ax.errorbar(xs, [g["mean"] for g in shown], yerr=error_bars(shown), fmt="o",
                color="#4c72b0", markersize=7, capsize=5, elinewidth=1.5, zorder=3)  # fmt: skip
    for i, g in enumerate(shown):  # each seed's value, beside its mean
        ax.plot([i + 0.12] * len(g["values"]), g["values"], "o", color="#555555",
                markersize=3, alpha=0.8, zorder=2)  # fmt: skip
    labels, keys = tick_labels(shown)
    long = max((len(line) for x in labels for line in x.splitlines()), default=0) > 16
    ax.set_xticks(list(xs), labels, rotation=90 if long else 0, fontsize=8)
    ax.set_xlabel(keys)
    ax.set_xlim(-0.6, len(shown) - 0.4)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylabel(f"final {metric}")
    bars = "95% t-interval" if any(g.get("ci") for g in shown) else "no interval below 3 seeds"
    ax.set_title(f"{title}\nmean (large dot), {bars}, seeds (small dots)", fontsize=8)
    failed = [g["choice"] for g in groups if g["mean"] is None]
    if failed:
        ax.text(0.99, 0.98, "no result: " + ", ".join(failed), transform=ax.transAxes,
                ha="right", va="top", fontsize=7, color="#c44e52", wrap=True)  # fmt: skip
    return fig


def tick_labels(groups: Sequence[dict[str, Any]]) -> tuple[list[str], str]:
    """The choices' labels under the axis, and the axis's name: where every choice sets the
    same keys (``attention=...``), their values under the keys' name, else the whole
    choices; each with the values of a searched grid that won its cell (``lr=0.001``)."""
    pairs = [dict(g["values_of"]) for g in groups]
    same = bool(pairs) and all(p and p.keys() == pairs[0].keys() for p in pairs)
    labels = []
    for g, p in zip(groups, pairs, strict=True):
        label = " ".join(p.values()) if same else g["choice"]
        won = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in g.get("won", {}).items())
        labels.append(f"{label}\n{won}" if won else label)
    return labels, " ".join(pairs[0]) if same else ""


def plot(groups: Sequence[dict[str, Any]], metric: str, title: str, path: Any) -> None:
    """``summary.png``: ``summary_figure``, saved."""
    save(summary_figure(groups, metric, title), path)


def save(fig: Any, path: Any) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, format="png")
    plt.close(fig)


def error_bar(g: dict[str, Any]) -> tuple[float, float]:
    """How far a group's interval reaches below and above its mean (0 without an
    interval; one clipped to the metric's range need not be symmetric)."""
    if g.get("ci") is None:
        return (0.0, 0.0)
    return (max(0.0, g["mean"] - g["ci"][0]), max(0.0, g["ci"][1] - g["mean"]))


def error_bars(groups: Sequence[dict[str, Any]]) -> list[list[float]]:
    """The groups' error bars as matplotlib takes them: [[below...], [above...]]."""
    bars = [error_bar(g) for g in groups]
    return [[b[0] for b in bars], [b[1] for b in bars]]


def state_figure(groups: Sequence[dict[str, Any]], metric: str, title: str) -> Any:
    """``metric`` against the decoding state each choice keeps (log scale), as Zoology
    and Based plot recall against state size: one point per choice, its 95% interval as
    error bar (3 seeds or more). The axis labels only its decades (the labels in between
    ran into each other); choices of one state size are labelled one under another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    shown = [g for g in groups if g["mean"] is not None and g["state_size"]]
    fig, ax = plt.subplots(figsize=(6.5, 4.4), dpi=120, layout="constrained")
    stacked: dict[int, int] = {}  # labels so far at about each size (a fifth of a decade)
    for g in sorted(shown, key=lambda g: -g["mean"]):
        ax.errorbar(g["state_size"], g["mean"], yerr=error_bars([g]), fmt="o", capsize=3)
        near = round(5 * math.log10(g["state_size"]))
        k = stacked[near] = stacked.get(near, -1) + 1
        ax.annotate(g["choice"], (g["state_size"], g["mean"]), fontsize=7,
                    xytext=(5, 3 - 9 * k), textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    sizes = [g["state_size"] for g in shown] or [1]
    narrow = max(sizes) / min(sizes) < 30  # under a decade and a half: 1, 2, 5 of each
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if narrow else (1.0,)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}" if x >= 1 else f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.15, y=0.12)
    ax.grid(alpha=0.3)
    ax.set_xlabel("decoding state after block_size tokens (numbers per sequence)")
    ax.set_ylabel(f"final {metric}")
    ax.set_title(f"{title}\nmean, 95% t-interval where 3 seeds or more", fontsize=8)
    return fig


def plot_state(groups: Sequence[dict[str, Any]], metric: str, title: str, path: Any) -> None:
    """``state.png``: ``state_figure``, saved."""
    save(state_figure(groups, metric, title), path)


def plot_grid(
    rows: Sequence[dict[str, Any]], metric: str, x: str, lines: str, panels: str | None, path: Any
) -> None:
    """Zoology's Figure 2 layout: ``metric`` against ``x``, one panel per value of
    ``panels``, one line per value of ``lines``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["panel"] for r in rows}, key=natural)
    numeric = all(isinstance(as_number(r["x"]), float) for r in rows)
    fig, axes = plt.subplots(
        1, len(names), figsize=(3.6 * len(names) + 1.2, 3.4), dpi=120, squeeze=False
    )
    for ax, panel in zip(axes[0], names, strict=True):
        for line in sorted({r["line"] for r in rows if r["panel"] == panel}, key=natural):
            points = [r for r in rows if r["panel"] == panel and r["line"] == line]
            xs = [float(r["x"]) if numeric else r["x"] for r in points]
            ax.plot(xs, [r[metric] for r in points], "o-", label=line, markersize=4)
        if numeric:  # a tick at each value run, named as it was given
            ax.set_xscale("log", base=2)
            ticks = sorted({float(r["x"]) for r in rows if r["panel"] == panel})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        ax.set_title(f"{panels}={panel}" if panels else "", fontsize=9)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric)
    fig.tight_layout()  # the panels laid out first: the legend goes beside them
    # right of the last panel, where it hides no point however many lines there are
    axes[0][-1].legend(
        fontsize=7, title=lines, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1)
    )
    fig.savefig(path, format="png", bbox_inches="tight")
    plt.close(fig)


def write_grid(
    runs: Sequence[Run], metric: str, grid: Sequence[str], out: Path, ignore: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """``grid.png`` and ``grid.md``: ``metric`` against ``grid[0]``, a line per value of
    ``grid[1]``, a panel per value of ``grid[2]`` (if given)."""
    if len(grid) not in (2, 3):
        raise ValueError(f"a grid is X LINES [PANELS], got {list(grid)}")
    x, lines, panels = grid[0], grid[1], grid[2] if len(grid) == 3 else None
    x, lines = override_key(x), override_key(lines)
    panels = override_key(panels) if panels else None
    rows = grid_rows(runs, metric, x, lines, panels, ignore)
    if not rows:
        raise ValueError(f"no finished run sets {x}: nothing to plot against it")
    atomic_write(out / "grid.png", lambda f: plot_grid(rows, metric, x, lines, panels, f))
    table = markdown_table(rows, ["panel", "line", "x", metric, "runs"])
    atomic_write(out / "grid.md", f"# {metric} against {x}\n\n{table}\n")
    return rows


def write_length_figure(
    runs: Sequence[Run], metric: str, keys: Sequence[str], out: Path, by_source: bool = False
) -> tuple[list[dict[str, Any]], list[str]]:
    """``lengths.png`` (``metric`` against the length each run was scored at, a line per
    choice) where the runs were scored at other lengths (``eval_lengths``): its points,
    and the summary's section of them (a row per choice, a column per length)."""
    rows = length_rows(runs, metric, keys, by_source)
    if not rows:
        return [], []
    atomic_write(
        out / "lengths.png", lambda f: plot_grid(rows, metric, "length", "choice", None, f)
    )
    lengths = sorted({r["x"] for r in rows})
    choices = list(dict.fromkeys(r["line"] for r in rows))
    at = {(r["line"], r["x"]): r[metric] for r in rows}
    table = [{"choice": c, **{str(n): at.get((c, n)) for n in lengths}} for c in choices]
    return rows, [
        f"## By length (`{metric}` at each length scored: mean over seeds; lengths.png)",
        "",
        markdown_table(table, ["choice", *map(str, lengths)]),
        "",
    ]


def curve(rows: Sequence[dict[str, float]], metric: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[metric]) for r in rows if metric in r and "step" in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


Histories = dict[str, tuple[list[dict[str, float]], list[int]]]


def write_curves(histories: Histories, metrics: Sequence[str], out: Path) -> tuple[Path, Path]:
    """``curves.csv`` (run, step, metric, value) and ``curves.png`` (one panel per
    metric, one line per run, dotted lines where a run was resumed) in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = io.StringIO(newline="")
    writer = csv.writer(table)
    writer.writerow(["run", "step", "metric", "value"])
    fig, axes = plt.subplots(
        1, len(metrics), figsize=(4.2 * len(metrics), 3.4), dpi=120, squeeze=False
    )
    for label, (rows, resumes) in histories.items():
        for ax, metric in zip(axes[0], metrics, strict=True):
            steps, values = curve(rows, metric)
            writer.writerows(
                [label, int(s), metric, f"{v:.6g}"] for s, v in zip(steps, values, strict=True)
            )
            if steps:
                (line,) = ax.plot(steps, values, label=label, linewidth=1.2)
                for step in resumes:
                    ax.axvline(step, color=line.get_color(), linestyle=":", linewidth=0.8)
    for ax, metric in zip(axes[0], metrics, strict=True):
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    resumed = any(resumes for _, resumes in histories.values())
    if len(histories) > 1 or resumed:
        axes[0][-1].legend(fontsize=7, title="dotted: resumed" if resumed else None)
    fig.tight_layout()
    atomic_write(out / "curves.csv", table.getvalue())
    atomic_write(out / "curves.png", lambda f: fig.savefig(f, format="png"))
    plt.close(fig)
    return out / "curves.png", out / "curves.csv"


def plot_curves(
    dirs: Sequence[str | Path], metric: str | None = None, out: str | Path | None = None
) -> tuple[Path, Path]:
    """Learning curves of every run in ``dirs`` (a sweep dir: each of its jobs), each
    joined across its resumes: ``train/loss`` and ``metric`` (default: the runs'
    monitored metric), written to ``out`` (default as for the summary)."""
    dirs = [Path(d) for d in dirs]
    histories: Histories = {}
    monitored = []
    for source in dirs:
        for run_dir in run_dirs(source):
            label = (
                run_dir.name
                if len(dirs) == 1 or run_dir == source
                else (f"{source.name}/{run_dir.name}")
            )
            histories[label] = history(run_dir)
            record = read_record(run_dir)
            monitored.append(record.monitor.metric if record is not None else None)
    names = sorted({k for rows, _ in histories.values() for row in rows for k in row})
    names = [n for n in names if n not in ("step", "epoch")]
    if not names:
        raise FileNotFoundError(
            f"no csv/metrics.csv in {', '.join(map(str, dirs))} (runs log one with logger=csv)"
        )
    if metric is None:
        metric = next((m for m in monitored if m in names), "val/loss")
    check_metric(metric, names)
    metrics = list(dict.fromkeys(m for m in ("train/loss", metric) if m in names))
    return write_curves(histories, metrics, Path(out) if out is not None else default_out(dirs))
