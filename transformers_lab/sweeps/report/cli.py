"""Sweep summaries: one row per job of a multirun, a grouped view over seeds, and a plot.

Every job of ``tlab-train -m ...`` writes ``result.json`` into its own directory (status,
overrides, final metrics, the best value of the monitored metric, parameter count, the
state its attention holds of a whole context (a GPT's decoding state; an encoder's
keys and values, or its kernel's state), wall time, error). The summary is rebuilt from those files
alone, so it can be written at the end of a sweep, after a crash, on a partial sweep or
after more jobs were added, and writing it twice gives the same files::

    tlab-summarize logs/train/multiruns/<time>            # summary.csv, .md, .png
                                    # (and state.png: the metric against state size)
    tlab-summarize logs/train/multiruns/<time> --metric val/loss --mode min
    tlab-summarize <sweep or run dir> <another> ... --out cmp/   # one table over all
    tlab-summarize <run dir> --curves                     # curves.png, following resumes

Runs scored at other lengths (``eval_lengths``) add ``lengths.png`` and a table of the
metric at each length, a line per choice.

A job directory without ``result.json``, or whose record still says ``running`` (a job
still running, or killed), is listed as ``incomplete`` with the last metrics of its
``csv/metrics.csv`` if it has one. The parts: ``collect`` (the runs), ``groups`` (over
seeds, against a baseline), ``stats``, ``tables``, ``plots``, ``study`` (an Optuna
study's trials); this module writes the files and is the command line and the Hydra
callback.
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from transformers_lab.errors import UnknownChoice, UnknownMetric
from transformers_lab.files import atomic_write
from transformers_lab.run.overrides import SEED_KEYS, override_key, override_map, sweep_command
from transformers_lab.run.record import RESULT_FILE, STATUSES
from transformers_lab.sweeps.report.collect import collect, default_out, pick_metric, varying_keys
from transformers_lab.sweeps.report.edges import edge_note, find_edges
from transformers_lab.sweeps.report.groups import (
    against_baseline,
    best_in_cells,
    flag_params,
    group_rows,
    score_rows,
)
from transformers_lab.sweeps.report.plots import (
    plot,
    plot_curves,
    plot_state,
    write_grid,
    write_length_figure,
)
from transformers_lab.sweeps.report.study import study_section
from transformers_lab.sweeps.report.tables import (
    fmt,
    group_cells,
    grouping_notes,
    job_rows,
    markdown_table,
    print_summary,
    score_section,
    won_columns,
)

log = logging.getLogger(__name__)


SUMMARY_FILES = ("summary.csv", "summary.md", "summary.png")


def summarize(
    dirs: str | Path | Sequence[str | Path],
    metric: str | None = None,
    mode: str | None = None,
    out: str | Path | None = None,
    by_source: bool = False,
    baseline: str | None = None,
    best_over: Sequence[str] | None = None,
    grid: Sequence[str] = (),
    mean_over: Sequence[str] = (),
) -> dict[str, Any]:
    """Write ``summary.csv`` (one row per job), ``summary.md`` (that table and the
    grouped view) and ``summary.png`` for the runs of ``dirs`` (sweep or run dirs) into
    ``out`` (default: the one dir given, else ``logs/summaries/<time>``); return the
    tables. ``by_source`` keeps each dir's jobs in groups of their own (and its own best
    rate of each cell).

    Each group gets its mean over seeds with a 95% t-interval. ``baseline`` (a choice's
    label, such as ``attention=softmax``) compares every other choice with it: a paired
    t-test over seeds when both have the same ones, else Welch's. ``best_over`` (keys such
    as ``optimizer.lr``) first keeps the best finished run of each cell of that grid, and
    the grouped table names the values that won; None (the default): the learning rate,
    where the runs vary it and something else (each kernel at its best rate), else
    nothing; ``[]``: every run as it is.
    ``grid`` (X LINES [PANELS], override keys) also writes ``grid.png`` and ``grid.md``:
    the metric against X, a line per LINES value, a panel per PANELS value (Zoology's
    Figure 2 is ``model.d_model attention mqar_size``). ``mean_over`` (keys such as
    ``data``) adds a score per remaining choice: the mean of the group means over those
    keys' values (MAD's score: the mean over task settings of the best run of each)."""
    dirs = [Path(dirs)] if isinstance(dirs, (str, Path)) else [Path(d) for d in dirs]
    runs = collect(*dirs)
    if not runs:
        raise FileNotFoundError(
            f"no job directories (with .hydra/ or {RESULT_FILE}) in {', '.join(map(str, dirs))}"
        )
    out = Path(out) if out is not None else default_out(dirs)
    metric, default_mode = pick_metric(runs, metric)
    mode = mode or default_mode
    shown = [override_key(k) for k in grid]  # a grid over the rate shows every rate
    over = default_best_over(runs, shown) if best_over is None else list(best_over)
    keys = [k for k in varying_keys(runs) if k not in over]
    rows = job_rows(runs, metric)
    grouped = runs
    if over:
        chosen = best_in_cells(runs, metric, mode, over, by_source)
        grouped = [r for r in runs if r.job in chosen]
        for row in rows:
            row["best of cell"] = "yes" if row["job"] in chosen and row["status"] == "ok" else ""
    groups = group_rows(grouped, metric, keys, by_source, over)
    edges = find_edges(runs, metric, mode, over, by_source) if over else []
    for g in groups:
        g["edges"] = {e.key: e.side for e in edges if e.cell == g["cell"]}
    groups.sort(
        key=lambda g: (g["mean"] is None, -(g["mean"] or 0) if mode == "max" else g["mean"] or 0)
    )
    notes = []
    if baseline and not set(override_map(baseline.split())) & set(keys):
        notes.append(f"Every run has the baseline's {baseline}: there is nothing to compare.")
        baseline = None
    if baseline:
        against_baseline(groups, baseline)
    flag_params(groups)
    grid_table = None
    if grid:
        if len(grid) not in (2, 3):
            raise ValueError(f"a grid is X LINES [PANELS], got {list(grid)}")
        try:
            grid_table = write_grid(grouped, metric, grid, out, over)
        except ValueError as exc:  # the figure is lost, not the summary
            log.warning("no grid figure: %s", exc)
            notes.append(f"No grid figure: {exc}.")
    scores = score_rows(groups, [override_key(k) for k in mean_over]) if mean_over else None
    length_points, by_length = write_length_figure(grouped, metric, keys, out, by_source)

    columns = list(rows[0])
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=columns)
    writer.writeheader()
    writer.writerows({c: fmt(row.get(c)) for c in columns} for row in rows)
    atomic_write(out / "summary.csv", table.getvalue())

    statuses = [*STATUSES, *sorted({r["status"] for r in rows} - set(STATUSES))]
    counts = {s: sum(r["status"] == s for r in rows) for s in statuses}
    status = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    better = "higher" if mode == "max" else "lower"
    name = dirs_name(dirs)
    md = [
        f"# Sweep summary: {name}",
        "",
        f"{len(rows)} jobs ({status}). Metric: `{metric}` ({better} is better).",
        "",
        f"## By choice (final `{metric}`: mean ± std [95% interval] over seeds)",
        "",
        *grouping_notes(over, baseline, groups, metric, by_default=best_over is None),
        *([" ".join(notes), ""] if notes else []),
        *edge_note(edges, grow_command(dirs)),
        markdown_table(
            [group_cells(g, metric) for g in groups],
            ["choice", *won_columns(over), "runs ok", f"final {metric}", f"best {metric}"]
            + (["vs baseline", "p (test)"] if baseline else [])
            + (["params"] if any(g["params"] for g in groups) else [])
            + (["state size"] if any(g["state_size"] for g in groups) else []),
        ),
        "",
        *score_section(scores, metric, mean_over),
        *by_length,
        *(study_section(dirs[0], out) if len(dirs) == 1 else []),
        "## Jobs",
        "",
        markdown_table(rows, [c for c in columns if c != "overrides"] + ["overrides"]),
        "",
    ]
    atomic_write(out / "summary.md", "\n".join(md))
    atomic_write(out / "summary.png", lambda f: plot(groups, metric, f"{name}: {status}", f))
    if len({g["state_size"] for g in groups if g["mean"] is not None} - {None}) > 1:
        title = f"{name}: {metric} against state size"
        atomic_write(out / "state.png", lambda f: plot_state(groups, metric, title, f))
    return {
        "metric": metric,
        "mode": mode,
        "edges": edges,
        "jobs": rows,
        "groups": groups,
        "grid": grid_table,
        "scores": scores,
        "lengths": length_points,
        "out": out,
    }


GROW_ROUNDS = 3  # the rounds the summary's command grows a grid by, at most


def grow_command(dirs: Sequence[Path]) -> str | None:
    """The command that runs the next values past the grid's edges into the one sweep dir
    given (its own command line, ``hydra.sweeper.grow``); None for several dirs, or a dir
    that no grid sweeper ran."""
    if len(dirs) != 1 or not (dirs[0] / "multirun.yaml").is_file():
        return None
    sweeper = OmegaConf.load(dirs[0] / "multirun.yaml").hydra.sweeper
    if "grow" not in sweeper:  # an Optuna study, or a sweep of an older version
        return None
    return sweep_command(dirs[0], ["skip_finished=true", f"hydra.sweeper.grow={GROW_ROUNDS}"])


# what a summary keeps the best value of by default: each choice at its best learning rate
BEST_OVER_DEFAULT = ("optimizer.lr",)


def dirs_name(dirs: Sequence[Path], most: int = 4) -> str:
    """The summary's title: the dirs' names, the first few of many (a sweep and the run
    dirs given beside it)."""
    names = [d.name for d in dirs]
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[: most - 1])} and {len(names) - most + 1} more dirs"


def default_best_over(runs: Sequence[Any], shown: Sequence[str] = ()) -> list[str]:
    """``BEST_OVER_DEFAULT``'s keys the runs vary, where they vary something else too (a
    sweep of the rate alone shows every rate), and that a grid figure does not show."""
    swept = [k for k in varying_keys(runs) if k not in SEED_KEYS]
    over = [k for k in BEST_OVER_DEFAULT if k in swept and k not in shown]
    return over if len(swept) > len(over) else []


def summary_settings(options: Any) -> dict[str, Any]:
    """``summarize``'s settings from a sweep's ``summary`` node (``summary.baseline=...``,
    ``summary.best_over=[...]``; a ``best_over`` of null: the rate where it is swept with
    more)."""
    options = options or {}
    best = options.get("best_over")
    return {
        "baseline": options.get("baseline"),
        "best_over": None if best is None else list(best),
        "grid": list(options.get("grid") or ()),
        "mean_over": list(options.get("mean_over") or ()),
    }


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks.summary``): when a multirun ends, write its
    summary files and print the grouped table. A failure here never loses the jobs'
    results: ``tlab-summarize <sweep dir>`` rebuilds the summary from them."""

    def __init__(self, metric: str | None = None, mode: str | None = None) -> None:
        self.metric, self.mode = metric, mode

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        settings = summary_settings(config.get("summary"))
        try:
            try:
                summary = summarize(sweep_dir, self.metric, self.mode, **settings)
            except UnknownChoice as exc:  # a preset's baseline this sweep did not run
                log.warning("%s: the summary compares nothing", exc)
                summary = summarize(
                    sweep_dir, self.metric, self.mode, **settings | {"baseline": None}
                )
        except Exception as exc:  # the sweep itself succeeded; say how to retry
            log.warning("no summary for %s (%s); run: tlab-summarize %s", sweep_dir, exc, sweep_dir)
            return
        print_summary(summary)
        print(f"summary: {sweep_dir / 'summary.md'} (plot: summary.png)", flush=True)
        statuses = [r["status"] for r in summary["jobs"]]
        if statuses and not {"ok", "pruned"} & set(statuses):  # a sweep that is no success
            print(
                f"error: {sweep_dir}: none of its {len(statuses)} jobs finished; see its "
                "summary.md",
                file=sys.stderr,
            )
            # SystemExit, a BaseException: Hydra (checked on 1.3.8) turns an Exception
            # raised by a callback into a warning; test_sweeps' sweep of failing jobs
            # exits 1 only while it lets this through
            raise SystemExit(1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tlab-summarize",
        description="Summarise sweeps or runs: summary.csv, summary.md and summary.png "
        "(one table and plot over all the given dirs), or with --curves their learning "
        "curves, following resumes.",
    )
    parser.add_argument(
        "dirs",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="a multirun dir (hydra.sweep.dir) or one run's dir; several are compared",
    )
    parser.add_argument("--metric", help="metric to summarise (default: the jobs' monitored one)")
    parser.add_argument("--mode", choices=("min", "max"), help="whether lower or higher is better")
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write (default: the one DIR given, else logs/summaries/<time>)",
    )
    parser.add_argument(
        "--by-source",
        action="store_true",
        help="keep each DIR's runs in groups of their own, each with its own best rate "
        "(compare two sweeps of one grid)",
    )
    parser.add_argument(
        "--baseline",
        metavar="CHOICE",
        help="compare every choice with this one (its label, e.g. attention=softmax): "
        "a paired t-test over seeds, or Welch's",
    )
    parser.add_argument(
        "--best-over",
        nargs="*",
        default=None,
        metavar="KEY",
        help="keep the best run of each cell of a grid over these keys (e.g. optimizer.lr) "
        "before averaging over seeds (default: optimizer.lr where the runs vary it and "
        "something else; --best-over alone: every run)",
    )
    parser.add_argument(
        "--mean-over",
        nargs="+",
        default=[],
        metavar="KEY",
        help="also score each choice by the mean over these keys' values (e.g. data: MAD's "
        "score over tasks, after --best-over)",
    )
    parser.add_argument(
        "--grid",
        nargs="+",
        default=[],
        metavar="KEY",
        help="X LINES [PANELS]: also plot the metric against X, a line per LINES value and "
        "a panel per PANELS value (grid.png, grid.md)",
    )
    parser.add_argument(
        "--curves",
        action="store_true",
        help="write curves.png and curves.csv: train/loss and the metric against the step",
    )
    args = parser.parse_args(argv)
    try:
        if args.curves:
            png, _ = plot_curves(args.dirs, args.metric, args.out)
            print(f"curves: {png} (and curves.csv)")
            return 0
        summary = summarize(
            args.dirs,
            args.metric,
            args.mode,
            args.out,
            args.by_source,
            baseline=args.baseline,
            best_over=args.best_over,
            grid=args.grid,
            mean_over=args.mean_over,
        )
    except (FileNotFoundError, UnknownMetric, UnknownChoice, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(summary)
    print(f"summary: {summary['out'] / 'summary.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
