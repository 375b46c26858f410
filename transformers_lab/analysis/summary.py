"""Sweep summaries: one row per job of a multirun, a grouped view over seeds, and a plot.

Every job of ``tlab-train -m ...`` writes ``result.json`` into its own directory (status,
overrides, final metrics, the best value of the monitored metric, parameter count, wall
time, error). The summary is rebuilt from those files alone, so it can be written at the
end of a sweep, after a crash, on a partial sweep or after more jobs were added, and
writing it twice gives the same files::

    tlab-summarize logs/train/multiruns/<time>            # summary.csv, .md, .png
    tlab-summarize logs/train/multiruns/<time> --metric val/loss --mode min

A job directory without ``result.json`` (a job still running, or killed) is listed with
the status ``incomplete`` and the last metrics of its ``csv/metrics.csv`` if it has one.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from transformers_lab.data.download import move_into_place

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
SUMMARY_FILES = ("summary.csv", "summary.md", "summary.png")
SEED_KEYS = ("seed",)  # overrides that repeat a run rather than change it


# ---------------------------------------------------------------- job records


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so a reader never
    sees half a file and a crash never leaves one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        move_into_place(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_result(run_dir: str | Path, record: dict[str, Any]) -> Path:
    """Save a job's record as ``<run_dir>/result.json``."""
    path = Path(run_dir) / RESULT_FILE
    atomic_write(path, json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    return path


def read_result(run_dir: str | Path) -> dict[str, Any] | None:
    """A job's record, or None if it has none (or an unreadable one)."""
    path = Path(run_dir) / RESULT_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_overrides(run_dir: Path) -> list[str]:
    """The job's task overrides as Hydra saved them (``.hydra/overrides.yaml``)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    return [str(o) for o in OmegaConf.load(path)]


def last_csv_metrics(run_dir: Path) -> dict[str, float]:
    """The last value of every metric in ``csv/metrics.csv`` (for jobs that never ended)."""
    metrics: dict[str, float] = {}
    for path in sorted(run_dir.glob("csv/**/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if key not in ("epoch", "step") and value not in ("", None):
                        metrics[key] = float(value)
    return metrics


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job directories of a sweep: its sub-directories with a Hydra config or a
    record, in job-number order (numbers first, then names)."""
    found = [
        p
        for p in sweep_dir.iterdir()
        if p.is_dir() and ((p / RESULT_FILE).is_file() or (p / ".hydra").is_dir())
    ]
    return sorted(found, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One record per job directory of ``sweep_dir``."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"no sweep directory at {sweep_dir}")
    records = []
    for run_dir in job_dirs(sweep_dir):
        record = read_result(run_dir)
        if record is None:
            record = {
                "status": "incomplete",
                "overrides": read_overrides(run_dir),
                "metrics": last_csv_metrics(run_dir),
            }
        record["job"] = run_dir.name
        records.append(record)
    return records


# ---------------------------------------------------------------- tables


def override_map(overrides: Sequence[str]) -> dict[str, str]:
    pairs = (o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    return {key: value for key, value in pairs}


def swept_keys(records: Sequence[dict[str, Any]]) -> list[str]:
    """The override keys whose value differs between jobs (what the sweep varies)."""
    maps = [override_map(r.get("overrides", [])) for r in records]
    keys = sorted({k for m in maps for k in m})
    return [k for k in keys if len({m.get(k) for m in maps}) > 1] or keys


def choice_of(record: dict[str, Any], keys: Sequence[str]) -> str:
    """The job's swept values, seeds aside: the label of its group."""
    values = override_map(record.get("overrides", []))
    label = " ".join(f"{k}={values[k]}" for k in keys if k not in SEED_KEYS and k in values)
    return label or "(all)"


def fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def job_rows(records: Sequence[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The per-job table: job, overrides, status, final and best ``metric``, the other
    final metrics, parameters, wall time, error."""
    names = sorted({k for r in records for k in r.get("metrics", {}) if k != metric})
    rows = []
    for r in records:
        metrics = r.get("metrics", {})
        monitor = r.get("monitor") or {}
        row = {
            "job": r["job"],
            "overrides": " ".join(r.get("overrides", [])),
            "status": r.get("status", "incomplete"),
            metric: metrics.get(metric),
            f"best {metric}": monitor.get("best") if monitor.get("metric") == metric else None,
            **{name: metrics.get(name) for name in names},
            "params": r.get("params"),
            "time_s": r.get("time_s"),
            "error": r.get("error") or "",
        }
        rows.append(row)
    return rows


def group_rows(
    records: Sequence[dict[str, Any]], metric: str, keys: Sequence[str]
) -> list[dict[str, Any]]:
    """Mean ± std of ``metric`` (final and best) over the finished jobs of each choice."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(choice_of(r, keys), []).append(r)
    rows = []
    for choice, members in groups.items():
        ok = [r for r in members if r.get("status") == "ok"]
        finals = [r["metrics"][metric] for r in ok if metric in r.get("metrics", {})]
        bests = [
            r["monitor"]["best"]
            for r in ok
            if (r.get("monitor") or {}).get("metric") == metric
            and r["monitor"].get("best") is not None
        ]
        rows.append(
            {
                "choice": choice,
                "runs": f"{len(ok)}/{len(members)}",
                "mean": statistics.fmean(finals) if finals else None,
                "std": statistics.stdev(finals) if len(finals) > 1 else 0.0 if finals else None,
                "best mean": statistics.fmean(bests) if bests else None,
                "best std": statistics.stdev(bests) if len(bests) > 1 else 0.0 if bests else None,
                "values": finals,
            }
        )
    return rows


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        return fmt(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def pick_metric(records: Sequence[dict[str, Any]], metric: str | None) -> tuple[str, str]:
    """The metric to summarise and its mode: as asked, else the jobs' monitored one."""
    for r in records:
        monitor = r.get("monitor") or {}
        if monitor.get("metric") and metric in (None, monitor["metric"]):
            return monitor["metric"], monitor.get("mode", "min")
    if metric is None:
        names = sorted({k for r in records for k in r.get("metrics", {})})
        metric = next((n for n in names if n.startswith("val/")), names[0] if names else "")
    return metric, "max" if metric.endswith(("acc", "bleu")) else "min"


# ---------------------------------------------------------------- writing


def plot(groups: Sequence[dict[str, Any]], metric: str, title: str, path: Path) -> None:
    """Bars: mean of ``metric`` per choice; error bars: std over seeds; dots: the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [g for g in groups if g["mean"] is not None]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(groups) + 1.5), 3.6), dpi=120)
    ax.bar(
        range(len(shown)),
        [g["mean"] for g in shown],
        yerr=[g["std"] for g in shown],
        capsize=4,
        color="#4c72b0",
    )
    for i, g in enumerate(shown):  # each seed's value
        ax.plot([i] * len(g["values"]), g["values"], "o", color="#222222", markersize=3.5)
    ax.set_xticks(range(len(shown)), [g["choice"] for g in shown], rotation=30, ha="right")
    ax.set_ylabel(f"final {metric} (mean ± std)")
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
    fig.savefig(path)
    plt.close(fig)


def summarize(
    sweep_dir: str | Path, metric: str | None = None, mode: str | None = None
) -> dict[str, Any]:
    """Write ``summary.csv`` (one row per job), ``summary.md`` (that table and the
    grouped view) and ``summary.png`` into ``sweep_dir``; return the tables."""
    sweep_dir = Path(sweep_dir)
    records = collect(sweep_dir)
    if not records:
        raise FileNotFoundError(
            f"no job directories (with .hydra/ or {RESULT_FILE}) in {sweep_dir}"
        )
    metric, default_mode = pick_metric(records, metric)
    mode = mode or default_mode
    keys = swept_keys(records)
    rows = job_rows(records, metric)
    groups = group_rows(records, metric, keys)
    groups.sort(
        key=lambda g: (g["mean"] is None, -(g["mean"] or 0) if mode == "max" else g["mean"] or 0)
    )

    columns = list(rows[0])
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=columns)
    writer.writeheader()
    writer.writerows({c: fmt(row.get(c)) for c in columns} for row in rows)
    atomic_write(sweep_dir / "summary.csv", table.getvalue())

    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "failed", "incomplete")}
    status = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    better = "higher" if mode == "max" else "lower"
    md = [
        f"# Sweep summary: {sweep_dir.name}",
        "",
        f"{len(rows)} jobs ({status}). Metric: `{metric}` ({better} is better).",
        "",
        f"## By choice (mean ± std over seeds of the final `{metric}`)",
        "",
        markdown_table(
            [
                {
                    "choice": g["choice"],
                    "runs ok": g["runs"],
                    f"final {metric}": pm(g["mean"], g["std"]),
                    f"best {metric}": pm(g["best mean"], g["best std"]),
                }
                for g in groups
            ],
            ["choice", "runs ok", f"final {metric}", f"best {metric}"],
        ),
        "",
        "## Jobs",
        "",
        markdown_table(rows, [c for c in columns if c != "overrides"] + ["overrides"]),
        "",
    ]
    atomic_write(sweep_dir / "summary.md", "\n".join(md))
    tmp_png = sweep_dir / ".summary.png.tmp.png"
    plot(groups, metric, f"{sweep_dir.name}: {status}", tmp_png)
    os.replace(tmp_png, sweep_dir / "summary.png")
    return {"metric": metric, "mode": mode, "jobs": rows, "groups": groups}


def pm(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "—"
    return f"{mean:.4g} ± {std:.2g}"


def print_summary(summary: dict[str, Any]) -> None:
    metric = summary["metric"]
    print(
        markdown_table(
            [
                {"choice": g["choice"], "runs ok": g["runs"], metric: pm(g["mean"], g["std"])}
                for g in summary["groups"]
            ],
            ["choice", "runs ok", metric],
        )
    )
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
        try:
            summary = summarize(sweep_dir, self.metric, self.mode)
        except Exception as exc:  # the sweep itself succeeded; say how to retry
            log.warning("no summary for %s (%s); run: tlab-summarize %s", sweep_dir, exc, sweep_dir)
            return
        print_summary(summary)
        print(f"summary: {sweep_dir / 'summary.md'} (plot: summary.png)", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tlab-summarize",
        description="Rebuild a sweep's summary.csv, summary.md and summary.png from its job "
        "directories.",
    )
    parser.add_argument("sweep_dir", type=Path, help="the multirun directory (hydra.sweep.dir)")
    parser.add_argument("--metric", help="metric to summarise (default: the jobs' monitored one)")
    parser.add_argument("--mode", choices=("min", "max"), help="whether lower or higher is better")
    args = parser.parse_args(argv)
    try:
        summary = summarize(args.sweep_dir, args.metric, args.mode)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(summary)
    print(f"summary: {args.sweep_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
