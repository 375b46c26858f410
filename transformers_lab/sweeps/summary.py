"""Sweep summaries: one row per job of a multirun, a grouped view over seeds, and a plot.

Every job of ``tlab-train -m ...`` writes ``result.json`` into its own directory (status,
overrides, final metrics, the best value of the monitored metric, parameter count, a
GPT's decoding state size, wall time, error). The summary is rebuilt from those files
alone, so it can be written at the end of a sweep, after a crash, on a partial sweep or
after more jobs were added, and writing it twice gives the same files::

    tlab-summarize logs/train/multiruns/<time>            # summary.csv, .md, .png
                                    # (and state.png: the metric against state size)
    tlab-summarize logs/train/multiruns/<time> --metric val/loss --mode min
    tlab-summarize <sweep or run dir> <another> ... --out cmp/   # one table over all
    tlab-summarize <run dir> --curves                     # curves.png, following resumes

A job directory without ``result.json``, or whose record still says ``running`` (a job
still running, or killed), is listed as ``incomplete`` with the last metrics of its
``csv/metrics.csv`` if it has one.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import io
import logging
import math
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from transformers_lab.errors import UnknownChoice, UnknownMetric
from transformers_lab.files import atomic_write
from transformers_lab.run.curves import history
from transformers_lab.run.overrides import SEED_KEYS, override_key, override_map
from transformers_lab.run.record import (
    NOTHING_FINISHED,
    RESULT_FILE,
    STATUSES,
    JobRecord,
    read_record,
)
from transformers_lab.sweeps.settings import labelled_values
from transformers_lab.sweeps.stats import MIN_FOR_TEST, best_of, compare, interval, metric_range
from transformers_lab.sweeps.study_report import study_section

log = logging.getLogger(__name__)

SUMMARY_FILES = ("summary.csv", "summary.md", "summary.png")


@dataclass
class Run:
    """One run as the summary sees it: its record (or what its dir shows of a job that
    never wrote one), its label in the tables, the dir given that holds it, and what tells
    it from the other runs (``settings.labelled_values``: its seed, the options and
    settings that changed, and its ``(identity)``, read from its composed config)."""

    job: str
    source: str
    record: JobRecord
    values: dict[str, str] = field(default_factory=dict)
    identity: dict[str, str] | None = None

    def same_as(self, ignore: Sequence[str] = ()) -> tuple:
        """The key of its group: its settings that change between runs (its labels where
        no composed config tells them), the ``ignore`` keys aside."""
        found = self.identity if self.identity is not None else self.values
        return tuple(sorted((k, v) for k, v in found.items() if k not in (*ignore, *SEED_KEYS)))


# ---------------------------------------------------------------- runs


def read_overrides(run_dir: Path) -> list[str]:
    """The job's task overrides as Hydra saved them (``.hydra/overrides.yaml``)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    return [str(o) for o in OmegaConf.load(path)]


def last_csv_metrics(run_dir: Path) -> dict[str, float]:
    """The last value of every metric in the run's ``metrics.csv`` files (for jobs that
    never ended), resumed parts included."""
    metrics: dict[str, float] = {}
    for row in history(run_dir)[0]:
        metrics.update({k: v for k, v in row.items() if k not in ("epoch", "step")})
    return metrics


def is_run_dir(path: Path) -> bool:
    return (path / RESULT_FILE).is_file() or (path / ".hydra").is_dir()


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job directories of a sweep: its sub-directories with a Hydra config or a
    record, in job-number order (numbers first, then names)."""
    found = [p for p in sweep_dir.iterdir() if p.is_dir() and is_run_dir(p)]
    return sorted(found, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))


def run_dirs(path: Path) -> list[Path]:
    """``path`` itself if it is one run's dir, else the job dirs of the sweep it holds."""
    if not path.is_dir():
        raise FileNotFoundError(f"no sweep or run directory at {path}")
    return [path] if is_run_dir(path) else job_dirs(path)


def collect(*dirs: str | Path) -> list[Run]:
    """One entry per run: each of ``dirs`` is a sweep dir (all its jobs) or a run dir.
    With several dirs, a job is named ``<sweep>/<job>``. A job without a record, or whose
    record still says ``running`` (killed, or running now), is ``incomplete``, with the
    last metrics of its csv."""
    runs: list[Run] = []
    found: list[tuple[list[str], Path]] = []
    for source in map(Path, dirs):
        for run_dir in run_dirs(source):
            record = read_record(run_dir) or JobRecord(
                status="incomplete", overrides=read_overrides(run_dir)
            )
            if record.status == "running":
                record.status = "incomplete"
            if record.status != "ok" and not record.metrics:
                record.metrics = last_csv_metrics(run_dir)
            several = len(dirs) > 1 and run_dir != source
            job = f"{source.name}/{run_dir.name}" if several else run_dir.name
            runs.append(Run(job, source.name, record))
            found.append((record.overrides, run_dir))
    for run, (values, identity) in zip(runs, labelled_values(found), strict=True):
        run.values, run.identity = values, identity
    return runs


# ---------------------------------------------------------------- tables


def varying_keys(runs: Sequence[Run]) -> list[str]:
    """The override keys whose value differs between jobs (what the sweep varies)."""
    maps = [r.values for r in runs]
    keys = sorted({k for m in maps for k in m})
    return [k for k in keys if len({m.get(k) for m in maps}) > 1] or keys


def choice_values(run: Run, keys: Sequence[str], by_source: bool = False) -> dict[str, str]:
    """The job's swept values, seeds aside (and the dir it came from when ``by_source``):
    what makes its group."""
    values = run.values
    chosen = {k: values[k] for k in keys if k not in SEED_KEYS and k in values}
    return {"(source)": str(run.source), **chosen} if by_source else chosen


def choice_of(run: Run, keys: Sequence[str], by_source: bool = False) -> str:
    """The label of the job's group: its swept values, seeds aside (prefixed with the
    dir it came from when ``by_source``)."""
    values = choice_values(run, keys)
    label = " ".join(f"{k}={v}" for k, v in values.items())
    label = label or ("(defaults)" if any(k not in SEED_KEYS for k in keys) else "(all)")
    return f"{run.source}: {label}" if by_source else label


def fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def job_rows(runs: Sequence[Run], metric: str) -> list[dict[str, Any]]:
    """The per-job table: job, overrides, status, final and best ``metric``, the other
    final metrics, parameters, decoding state, wall time, error."""
    names = sorted({k for r in runs for k in r.record.metrics if k != metric})
    # each layer's mixer, where a run's layers are not all alike (a hybrid stack)
    hybrid = any(len(set(r.record.layers or ())) > 1 for r in runs)
    rows = []
    for run in runs:
        r = run.record
        layers = {"layers": ", ".join(r.layers or ())} if hybrid else {}
        rows.append(
            {
                "job": run.job,
                "overrides": " ".join(r.overrides),
                "status": r.status,
                metric: r.metrics.get(metric),
                f"best {metric}": r.best_of(metric),
                **{name: r.metrics.get(name) for name in names},
                "params": r.params,
                "state_size": r.state_size,
                **layers,
                "time_s": r.time_s,
                "error": r.error or "",
            }
        )
    return rows


def seed_of(run: Run) -> str:
    """The run's seed (what repeats a choice), or its job name when it has none."""
    return next((run.values[k] for k in SEED_KEYS if k in run.values), run.job)


def by_seed(runs: Sequence[Run]) -> dict[str, Run]:
    """The runs keyed by their seed: the key a paired test matches runs by. Runs from
    several dirs (a sweep and its repeat, both with seeds 0 and 1) are keyed by dir and
    seed; where a key still repeats (the same choice and seed run twice in one dir, as an
    Optuna study may), by job: every value counts, and no pairing is made."""
    several = len({r.source for r in runs}) > 1
    keys = [f"{r.source}:{seed_of(r)}" if several else seed_of(r) for r in runs]
    if len(set(keys)) < len(keys):
        keys = [f"{r.source}:{r.job}" for r in runs]
    return dict(zip(keys, runs, strict=True))


def best_in_cells(runs: Sequence[Run], metric: str, mode: str, over: Sequence[str]) -> set[str]:
    """The jobs that stand for their cell: runs that differ only in the ``over`` keys (a
    learning-rate grid) and their seeds form a cell, and the setting of the ``over`` keys
    whose finished runs have the best mean stands for it, with all its runs (a seed that
    failed there too). A cell with no finished run stands as it is. (The best rate of each
    seed apart would pick each seed's luckiest rate, and overstate the cell.)"""
    cells: dict[tuple, dict[tuple, list[Run]]] = {}
    for run in runs:
        cell = run.same_as(ignore=over)
        setting = tuple(run.values.get(k) for k in over)
        cells.setdefault((run.source, cell), {}).setdefault(setting, []).append(run)
    chosen = set()
    for settings in cells.values():
        finished = {
            setting: [r for r in members if metric in r.record.metrics and r.record.status == "ok"]
            for setting, members in settings.items()
        }
        finished = {k: v for k, v in finished.items() if v}
        means = [statistics.fmean(r.record.metrics[metric] for r in v) for v in finished.values()]
        index = best_of(means, mode)
        best = [settings[list(finished)[index]]] if index is not None else settings.values()
        chosen |= {r.job for members in best for r in members}
    return chosen


def group_rows(
    runs: Sequence[Run],
    metric: str,
    keys: Sequence[str],
    by_source: bool = False,
    ignore: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """The mean of ``metric`` (final and best) over the finished jobs of each choice (runs
    with the same settings, ``settings.IDENTITY``), its std and its 95% interval over seeds
    (``stats.interval``: a bootstrap for a bounded metric), the ``ignore`` keys (a grid
    searched over) aside; ``seeds`` maps each seed to its
    final value and ``starts`` to what the seed fixed (``by_seed``); the choice's parameter
    count and decoding state."""
    bounds = metric_range(metric)
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        key = (run.source if by_source else "", run.same_as(ignore))
        groups.setdefault(key, []).append(run)
    rows = []
    for members in groups.values():
        ok = [r for r in members if r.record.status == "ok"]
        seeded = by_seed([r for r in ok if metric in r.record.metrics])
        seeds = {key: r.record.metrics[metric] for key, r in seeded.items()}
        finals = list(seeds.values())
        bests = [b for r in ok if (b := r.record.best_of(metric)) is not None]
        sizes = {r.record.state_size for r in members} - {None}
        params = {r.record.params for r in members} - {None}
        spread = interval(finals, bounds) if finals else None
        rows.append(
            {
                "choice": choice_of(members[0], keys, by_source),
                "values_of": choice_values(members[0], keys, by_source),
                "runs": f"{len(ok)}/{len(members)}",
                "params": params.pop() if len(params) == 1 else None,
                "state_size": sizes.pop() if len(sizes) == 1 else None,
                "mean": spread.mean if spread else None,
                "std": statistics.stdev(finals) if len(finals) > 1 else 0.0 if finals else None,
                "ci": (spread.low, spread.high) if spread and spread.low is not None else None,
                "ci_method": spread.method if spread else None,
                "n": len(finals),
                "best mean": statistics.fmean(bests) if bests else None,
                "best std": statistics.stdev(bests) if len(bests) > 1 else 0.0 if bests else None,
                "values": finals,
                "seeds": seeds,
                "starts": {key: r.record.seeded for key, r in seeded.items()},
            }
        )
    return rows


def alike(a: dict | None, b: dict | None) -> bool:
    """Whether two runs started alike (``record.seeded``): the same data, the same random
    state when training began (the order of the batches is drawn from it), and the same
    initial values of every parameter both have. Unknown (an older record): no."""
    if not a or not b:
        return False
    shared = set(a.get("params", {})) & set(b.get("params", {}))
    return (
        a.get("data") == b.get("data")
        and a.get("rng") == b.get("rng")
        and all(a["params"][name] == b["params"][name] for name in shared)
    )


def pairable(starts: dict[str, dict | None], base: dict[str, dict | None]) -> bool:
    """Whether two groups may be paired by seed: the same seeds, each pair started alike."""
    return set(starts) == set(base) and all(alike(starts[k], base[k]) for k in starts)


def against_baseline(groups: Sequence[dict[str, Any]], baseline: str) -> None:
    """Add to each group its comparison with its baseline (``comparison``, ``versus``).

    ``baseline`` sets some keys (``attention=softmax``, or several, space-separated); a
    group is compared with the group that differs from it only in those keys, set to the
    baseline's values: in a grid of kernels x widths, each kernel against softmax at the
    same width. A group with no such partner gets no comparison. The test is paired by
    seed only where each seed started both runs alike (``pairable``), else Welch's."""
    wanted = override_map(baseline.split())
    if not wanted:
        raise UnknownChoice(f"the baseline {baseline!r} sets no key; give one as key=value")
    by_values = {frozenset(g["values_of"].items()): g for g in groups}
    for g in groups:
        target = frozenset({**g["values_of"], **wanted}.items())
        base = by_values.get(target)
        if base is None:
            continue
        g["base"] = base
        if base is not g and g["seeds"] and base["seeds"]:
            paired = pairable(g["starts"], base["starts"])
            g["comparison"] = compare(g["seeds"], base["seeds"], paired)
            g["versus"] = base["choice"]
    if not any(frozenset(wanted.items()) <= frozenset(g["values_of"].items()) for g in groups):
        choices = ", ".join(repr(g["choice"]) for g in groups)
        raise UnknownChoice(f"no choice {baseline!r} to compare with; the choices are: {choices}")


def score_rows(groups: Sequence[dict[str, Any]], over: Sequence[str]) -> list[dict[str, Any]]:
    """The mean of the groups' means over the values of the ``over`` keys, for each
    setting of the other keys (a kernel's MAD score over tasks), in the groups' order.

    A score is only given over every value the sweep has for those keys: a choice with a
    task that failed, or was not run, gets none, and the missing values are listed."""

    def part(g: dict[str, Any]) -> str:
        return " ".join(f"{k}={v}" for k, v in g["values_of"].items() if k in over) or "(all)"

    everything = {part(g) for g in groups}
    cells: dict[tuple, dict[str, float | None]] = {}
    for g in groups:
        rest = tuple((k, v) for k, v in g["values_of"].items() if k not in over)
        cells.setdefault(rest, {})[part(g)] = g["mean"]
    rows = []
    for rest, means in cells.items():
        done = {k: v for k, v in means.items() if v is not None}
        missing = sorted(everything - set(done), key=natural)
        rows.append(
            {
                "choice": " ".join(f"{k}={v}" for k, v in rest) or "(all)",
                "score": statistics.fmean(done.values()) if done and not missing else None,
                "cells": f"{len(done)}/{len(everything)}",
                "missing": ", ".join(missing),
            }
        )
    return rows


def score_section(
    scores: list[dict[str, Any]] | None, metric: str, over: Sequence[str]
) -> list[str]:
    if scores is None:
        return []
    return [
        f"## Score: mean of `{metric}` over {', '.join(over)}",
        "",
        markdown_table(scores, ["choice", "score", "cells", "missing"]),
        "",
    ]


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        return fmt(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def logged_metrics(runs: Sequence[Run]) -> list[str]:
    """Every metric some run logged (its final metrics, or its csv for unfinished ones)."""
    return sorted({k for r in runs for k in r.record.metrics})


def check_metric(metric: str, logged: Sequence[str]) -> None:
    """Refuse a metric that no run logged, naming the logged ones (and the nearest)."""
    if not logged or metric in logged:
        return
    near = difflib.get_close_matches(metric, logged, n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    raise UnknownMetric(f"no run logged the metric {metric!r}{hint}; logged: {', '.join(logged)}")


def pick_metric(runs: Sequence[Run], metric: str | None) -> tuple[str, str]:
    """The metric to summarise and its mode: as asked, else the jobs' monitored one."""
    if metric is not None:
        check_metric(metric, logged_metrics(runs))
    for run in runs:
        monitor = run.record.monitor
        if monitor.metric and metric in (None, monitor.metric):
            return monitor.metric, monitor.mode or "min"
    if metric is None:
        names = logged_metrics(runs)
        metric = next((n for n in names if n.startswith("val/")), names[0] if names else "")
    return metric, "max" if metric.endswith(("acc", "bleu")) else "min"


# ---------------------------------------------------------------- writing


def plot(groups: Sequence[dict[str, Any]], metric: str, title: str, path: Any) -> None:
    """Bars: mean of ``metric`` per choice; error bars: its 95% t-interval over seeds
    (none with one seed); dots: the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [g for g in groups if g["mean"] is not None]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(groups) + 1.5), 3.6), dpi=120)
    ax.bar(
        range(len(shown)),
        [g["mean"] for g in shown],
        yerr=error_bars(shown),
        capsize=4,
        color="#4c72b0",
    )
    for i, g in enumerate(shown):  # each seed's value
        ax.plot([i] * len(g["values"]), g["values"], "o", color="#222222", markersize=3.5)
    ax.set_xticks(range(len(shown)), [g["choice"] for g in shown], rotation=30, ha="right")
    ax.set_ylabel(f"final {metric} (mean, 95% interval)")
    ax.set_title(title, fontsize=9)
    failed = [g["choice"] for g in groups if g["mean"] is None]
    if failed:
        ax.text(
            0.99,
            0.98,
            "no result: " + ", ".join(failed),
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=7,
            color="#c44e52",
        )
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def error_bar(g: dict[str, Any]) -> tuple[float, float]:
    """How far a group's interval reaches below and above its mean (0 with one seed; a
    bootstrap interval need not be symmetric)."""
    if g.get("ci") is None:
        return (0.0, 0.0)
    return (max(0.0, g["mean"] - g["ci"][0]), max(0.0, g["ci"][1] - g["mean"]))


def error_bars(groups: Sequence[dict[str, Any]]) -> list[list[float]]:
    """The groups' error bars as matplotlib takes them: [[below...], [above...]]."""
    bars = [error_bar(g) for g in groups]
    return [[b[0] for b in bars], [b[1] for b in bars]]


def plot_state(groups: Sequence[dict[str, Any]], metric: str, title: str, path: Any) -> None:
    """``metric`` against the decoding state each choice keeps (log scale), as Zoology
    and Based plot recall against state size: one point per choice, std as error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [g for g in groups if g["mean"] is not None and g["state_size"]]
    fig, ax = plt.subplots(figsize=(6.0, 4.0), dpi=120)
    for g in shown:
        ax.errorbar(g["state_size"], g["mean"], yerr=error_bars([g]), fmt="o", capsize=3)
        ax.annotate(g["choice"], (g["state_size"], g["mean"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("decoding state after block_size tokens (numbers per sequence)")
    ax.set_ylabel(f"final {metric} (mean, 95% interval)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def as_number(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


def natural(value: str) -> tuple:
    """A sort key that orders ``64x4`` before ``128x8`` and ``64`` before ``128``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", value))


def grid_rows(
    runs: Sequence[Run],
    metric: str,
    x: str,
    lines: str,
    panels: str | None,
    ignore: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """The mean of ``metric`` over seeds for every (panel, line, x) of the finished
    ``runs`` (already the best of their cells, when a grid is searched: the ``ignore``
    keys). Runs that share a point and differ in another key are refused: the grid would
    average what it does not show."""
    shown = {x, lines, panels, *SEED_KEYS, *ignore}
    cells: dict[tuple[str, str, str], dict[tuple, list[float]]] = {}
    for run in runs:
        values = run.values
        if run.record.status != "ok" or metric not in run.record.metrics or x not in values:
            continue
        panel = values.get(panels, "(all)") if panels else "(all)"
        key = (panel, values.get(lines, "(default)"), values[x])
        rest = tuple(sorted((k, v) for k, v in values.items() if k not in shown))
        cells.setdefault(key, {}).setdefault(rest, []).append(run.record.metrics[metric])
    rows = []
    for (p, ln, v), by_rest in cells.items():
        if len(by_rest) > 1:
            differ = sorted({k for rest in by_rest for k, _ in rest})
            raise ValueError(
                f"the grid's point ({panels}={p}, {lines}={ln}, {x}={v}) holds runs that "
                f"differ in {', '.join(differ)}, which the grid does not show; make one of "
                f"them the PANELS key or summarise those runs apart"
            )
        (vals,) = by_rest.values()
        rows.append(
            {"panel": p, "line": ln, "x": v, metric: statistics.fmean(vals), "runs": len(vals)}
        )
    return sorted(rows, key=lambda r: (natural(r["panel"]), natural(r["line"]), natural(r["x"])))


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
        if numeric:
            ax.set_xscale("log", base=2)
        ax.set_title(f"{panels}={panel}" if panels else "", fontsize=9)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric)
    axes[0][-1].legend(fontsize=7, title=lines, title_fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
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


def default_out(dirs: Sequence[Path]) -> Path:
    """Where a summary goes unless ``--out`` says: the one dir it is about, else a new
    ``logs/summaries/<time>`` under the current dir."""
    if len(dirs) == 1:
        return dirs[0]
    return Path("logs") / "summaries" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def summarize(
    dirs: str | Path | Sequence[str | Path],
    metric: str | None = None,
    mode: str | None = None,
    out: str | Path | None = None,
    by_source: bool = False,
    baseline: str | None = None,
    best_over: Sequence[str] = (),
    grid: Sequence[str] = (),
    mean_over: Sequence[str] = (),
) -> dict[str, Any]:
    """Write ``summary.csv`` (one row per job), ``summary.md`` (that table and the
    grouped view) and ``summary.png`` for the runs of ``dirs`` (sweep or run dirs) into
    ``out`` (default: the one dir given, else ``logs/summaries/<time>``); return the
    tables. ``by_source`` keeps each dir's jobs in groups of their own.

    Each group gets its mean over seeds with a 95% t-interval. ``baseline`` (a choice's
    label, such as ``attention=softmax``) compares every other choice with it: a paired
    t-test over seeds when both have the same ones, else Welch's. ``best_over`` (keys such
    as ``optimizer.lr``) first keeps the best finished run of each cell of that grid.
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
    over = list(best_over)
    keys = [k for k in varying_keys(runs) if k not in over]
    rows = job_rows(runs, metric)
    grouped = runs
    if over:
        chosen = best_in_cells(runs, metric, mode, over)
        grouped = [r for r in runs if r.job in chosen]
        for row in rows:
            row["best of cell"] = "yes" if row["job"] in chosen and row["status"] == "ok" else ""
    groups = group_rows(grouped, metric, keys, by_source, over)
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
    name = ", ".join(d.name for d in dirs)
    md = [
        f"# Sweep summary: {name}",
        "",
        f"{len(rows)} jobs ({status}). Metric: `{metric}` ({better} is better).",
        "",
        f"## By choice (final `{metric}`: mean ± std [95% interval] over seeds)",
        "",
        *grouping_notes(over, baseline, groups, metric),
        *([" ".join(notes), ""] if notes else []),
        markdown_table(
            [group_cells(g, metric) for g in groups],
            ["choice", "runs ok", f"final {metric}", f"best {metric}"]
            + (["vs baseline", "p (test)"] if baseline else [])
            + (["params"] if any(g["params"] for g in groups) else [])
            + (["state size"] if any(g["state_size"] for g in groups) else []),
        ),
        "",
        *score_section(scores, metric, mean_over),
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
        "jobs": rows,
        "groups": groups,
        "grid": grid_table,
        "scores": scores,
        "out": out,
    }


# ---------------------------------------------------------------- curves


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


def grouping_notes(
    over: Sequence[str], baseline: str | None, groups: Sequence[dict[str, Any]], metric: str
) -> list[str]:
    """The lines that say how the grouped table was made, and what it cannot show."""
    notes = []
    methods = {g["ci_method"] for g in groups if g.get("ci") is not None}
    if "bootstrap" in methods:
        low, high = metric_range(metric) or (0, 1)
        notes.append(
            f"`{metric}` lies in [{low:g}, {high:g}]: its interval is the percentile "
            "bootstrap over seeds (every resample for up to 6 seeds), which stays in that "
            "range; few seeds give a narrow one."
        )
    elif methods:
        notes.append("The interval is Student's t over seeds.")
    if over:
        notes.append(
            f"Each cell is the setting of {', '.join(over)} with the best mean over seeds, "
            "all its seeds kept."
        )
    if baseline:
        notes.append(
            f"Compared with {baseline} at the same values of the other keys: the difference "
            "of means, and the two-sided p of a t-test, paired by seed only where each seed "
            "started both runs alike (the same data and order, the same initial values of "
            "the parameters both have; `result.json`'s `seeded`), else Welch's; * marks "
            "p < 0.05."
        )
    if any(0 < g["n"] < MIN_FOR_TEST for g in groups):
        notes.append(
            f"Fewer than {MIN_FOR_TEST} seeds a side: no test is meaningful, and none is "
            "given (—); n=1 has no spread."
        )
    params = [g for g in groups if g.get("params_off")]
    if params:
        notes.append(
            "! marks a parameter count more than 1% away from "
            + ("the baseline's" if baseline else "the most common one")
            + ": the comparison is not at equal size."
        )
    return [" ".join(notes), ""] if notes else []


def flag_params(groups: Sequence[dict[str, Any]]) -> None:
    """Mark (``params_off``, the relative difference) each group whose parameter count is
    more than 1% away from its baseline's (``base``, set by ``against_baseline``), or,
    without a baseline, from the most common count."""
    counts = [g["params"] for g in groups if g.get("params")]
    if not counts:
        return
    common = max(sorted(set(counts)), key=counts.count)
    for g in groups:
        reference = g["base"]["params"] if g.get("base") else common
        if g.get("params") and reference and abs(g["params"] / reference - 1) > 0.01:
            g["params_off"] = g["params"] / reference - 1


def group_cells(g: dict[str, Any], metric: str) -> dict[str, Any]:
    """One row of the grouped table."""
    off = g.get("params_off")
    row = {
        "choice": g["choice"],
        "runs ok": g["runs"],
        f"final {metric}": with_ci(g),
        f"best {metric}": pm(g["best mean"], g["best std"], g["n"]),
        "params": ""
        if g.get("params") is None
        else f"{g['params']:,}" + (f" ({off:+.1%}) !" if off else ""),
        "state size": "" if g.get("state_size") is None else f"{g['state_size']:,}",
    }
    if (c := g.get("comparison")) is not None:
        row["vs baseline"] = f"{c.difference:+.3g}"
        few = min(g["n"], g["base"]["n"]) < MIN_FOR_TEST
        p = "—" if c.p is None or few else f"{c.p:.2g}{'*' if c.significant() else ''}"
        row["p (test)"] = f"{p} ({c.test}{', n<3' if few else ''})"
    return row


def with_ci(g: dict[str, Any]) -> str:
    """``mean ± std [low, high] (n=…)``; one seed: ``mean (n=1)``, no spread."""
    text = pm(g["mean"], g["std"], g["n"])
    if g.get("ci") is not None:
        text += f" [{g['ci'][0]:.3g}, {g['ci'][1]:.3g}]"
    return text if g["mean"] is None else f"{text} (n={g['n']})"


def pm(mean: float | None, std: float | None, n: int = 2) -> str:
    if mean is None:
        return "—"
    return f"{mean:.4g}" if n < 2 else f"{mean:.4g} ± {std:.2g}"


def print_summary(summary: dict[str, Any]) -> None:
    metric = summary["metric"]
    rows = [group_cells(g, metric) for g in summary["groups"]]
    compared = any("vs baseline" in row for row in rows)
    columns = ["choice", "runs ok", f"final {metric}"]
    columns += ["vs baseline", "p (test)"] if compared else []
    columns += [c for c in ("params", "state size") if any(row[c] for row in rows)]
    print(markdown_table(rows, columns))
    failed = [r for r in summary["jobs"] if r["status"] != "ok"]
    for r in failed:
        print(f"job {r['job']} {r['status']}: {r['overrides']} {r['error']}".rstrip())


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks.summary``): when a multirun ends, write its
    summary files and print the grouped table. A failure here never loses the jobs'
    results: ``tlab-summarize <sweep dir>`` rebuilds the summary from them."""

    def __init__(self, metric: str | None = None, mode: str | None = None) -> None:
        self.metric, self.mode = metric, mode

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        options = config.get("summary") or {}  # summary.baseline=..., summary.best_over=[...]
        settings = {
            "baseline": options.get("baseline"),
            "best_over": list(options.get("best_over") or ()),
            "grid": list(options.get("grid") or ()),
            "mean_over": list(options.get("mean_over") or ()),
        }
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
        if statuses and not {"ok", "pruned"} & set(statuses):
            NOTHING_FINISHED.append(f"{sweep_dir}: none of its {len(statuses)} jobs finished")


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
        help="keep each DIR's runs in groups of their own (compare two sweeps of one grid)",
    )
    parser.add_argument(
        "--baseline",
        metavar="CHOICE",
        help="compare every choice with this one (its label, e.g. attention=softmax): "
        "a paired t-test over seeds, or Welch's",
    )
    parser.add_argument(
        "--best-over",
        nargs="+",
        default=[],
        metavar="KEY",
        help="keep the best run of each cell of a grid over these keys (e.g. optimizer.lr) "
        "before averaging over seeds",
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
