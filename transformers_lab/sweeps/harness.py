"""A sweep's models scored together on lm-evaluation-harness's tasks:

    tlab-eval sweep_dir=logs/train/multiruns/<time> harness=field

Each kernel is scored at its best rate: the jobs that stand for their cell in the
sweep's summary (the best learning rate by the monitored validation metric, with all its
seeds: ``report.groups.best_in_cells``), never chosen by the tasks' own scores. Each
scored job gets ``harness.json`` and the ``harness/<task>/<metric>`` metrics in its
record (``result.json``), so that the sweep's summary shows them as columns; the sweep
gets ``harness.md`` and ``harness.csv``: each choice's mean over its seeds, with its 95%
interval, on each task, beside its parameter count and decoding state.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from transformers_lab.errors import ConfigError, UnknownChoice
from transformers_lab.run.checkpoints import read_checkpoint
from transformers_lab.run.harness import is_stderr, score_checkpoint, write_results
from transformers_lab.run.record import read_record, write_record
from transformers_lab.sweeps.report.cli import default_best_over, summarize, summary_settings
from transformers_lab.sweeps.report.collect import Run, collect, pick_metric, varying_keys
from transformers_lab.sweeps.report.groups import best_in_cells, group_rows


def saved_settings(folder: Path) -> dict[str, Any]:
    """The sweep's own summary settings (its jobs' ``summary`` node: a preset's baseline,
    its ``best_over``), as its summary was made with."""
    for config in sorted(folder.glob("*/.hydra/config.yaml")):
        return summary_settings(OmegaConf.load(config).get("summary"))
    return summary_settings(None)


def chosen_runs(
    runs: list[Run], best_over: list[str] | None = None
) -> tuple[list[Run], list[str], list[str]]:
    """The finished jobs at each cell's best rate (``best_over``, the sweep's summary
    setting; None: the rate where it is swept with more), the keys that make the groups
    and the keys searched over."""
    metric, mode = pick_metric(runs, None)
    over = default_best_over(runs) if best_over is None else list(best_over)
    keys = [k for k in varying_keys(runs) if k not in over]
    chosen = best_in_cells(runs, metric, mode, over) if over else {r.job for r in runs}
    kept = [r for r in runs if r.job in chosen and r.record.status == "ok"]
    return kept, keys, over


def checkpoint_of(run: Run, folder: Path) -> str:
    """The job's best checkpoint (its last where it kept no best), found in the job's dir
    of ``folder`` where the path it saved is not there (a sweep moved, or run elsewhere)."""
    saved = run.record.checkpoints
    path = saved.get("best") or saved.get("last")
    if path and not Path(path).is_file():
        moved = folder / run.job / "checkpoints" / Path(path).name
        path = str(moved) if moved.is_file() else path
    if not path or not Path(path).is_file():
        raise ConfigError(
            f"job {run.job} of the sweep kept no checkpoint to score ({path or 'none'}); "
            "train with checkpoints (the default callbacks) and score the sweep again"
        )
    return path


def score_sweep(
    sweep_dir: str | Path, options: Any, trust: bool = False, data: Any = None
) -> list[dict[str, Any]]:
    """Score the sweep's jobs at their cells' best rate on ``options.tasks`` (``tlab-eval``'s
    ``harness`` node); write their records, ``harness.md`` and ``harness.csv``, and the
    summary again. Returns the table's rows."""
    folder = Path(sweep_dir)
    if not folder.is_dir():
        raise ConfigError(f"sweep_dir={sweep_dir} is not a folder; give a multirun's dir")
    runs = collect(folder)
    settings = saved_settings(folder)
    kept, keys, over = chosen_runs(runs, settings["best_over"])
    if not kept:
        raise ConfigError(f"sweep_dir={sweep_dir} has no finished job to score")
    paths = [checkpoint_of(run, folder) for run in kept]  # all found before the first is scored
    names: list[str] = []
    for run, path in zip(kept, paths, strict=True):
        print(f"scoring job {run.job} ({', '.join(run.values.values())}): {path}", flush=True)
        metrics, results = score_checkpoint(read_checkpoint(path, trust), path, options, data)
        job_dir = folder / run.job  # where collect found it, wherever it ran
        write_results(results, job_dir)
        record = read_record(job_dir) or run.record
        record.metrics.update(metrics)
        run.record.metrics.update(metrics)
        write_record(job_dir, record)
        names += [n for n in metrics if n not in names and not is_stderr(n)]
    rows = table_rows(kept, names, keys, over)
    write_tables(rows, names, folder)
    try:
        summarize(folder, **settings)
    except UnknownChoice:  # a preset's baseline this sweep did not run, as its summary did
        summarize(folder, **settings | {"baseline": None})
    return rows


def table_rows(
    runs: list[Run], names: list[str], keys: list[str], over: list[str]
) -> list[dict[str, Any]]:
    """One row per choice: its label, parameters, decoding state, the rate that won,
    and each metric's mean, its 95% interval and its seeds' count."""
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        for group in group_rows(runs, name, keys, ignore=over):
            row = rows.setdefault(
                group["choice"],
                {
                    "choice": group["choice"],
                    "params": group["params"],
                    "state_size": group["state_size"],
                    **{f"best {k}": v for k, v in group["won"].items()},
                },
            )
            row[name] = group["mean"]
            row[f"{name} ci"] = group["ci"]
            row[f"{name} n"] = group["n"]
    return list(rows.values())


def shown(value: Any, ci: Any = None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return f"{text} [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else text


def write_tables(rows: list[dict[str, Any]], names: list[str], folder: Path) -> None:
    """``harness.csv`` (every column) and ``harness.md`` (a row per choice, a column per
    task metric: mean [95% interval] over seeds)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(folder / "harness.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    fixed = [c for c in columns if c in ("choice", "params", "state_size") or c.startswith("best ")]
    header = [*fixed, *(n.removeprefix("harness/") for n in names)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [shown(row.get(c)) for c in fixed]
        cells += [shown(row.get(n), row.get(f"{n} ci")) for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    note = (
        "Each choice at its best rate by the sweep's monitored metric; the mean over its "
        "seeds, [95% interval] from 3 seeds up."
    )
    (folder / "harness.md").write_text("\n".join(["# Harness scores", "", note, "", *lines]) + "\n")
    print("\n".join(lines))
