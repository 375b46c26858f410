"""The summary's tables: the per-job rows, the grouped view's cells and notes, and the
markdown they are written in."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from transformers_lab.sweeps.report.collect import Run
from transformers_lab.sweeps.report.stats import MIN_FOR_TEST, metric_range


def fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        return fmt(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def as_number(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


def natural(value: str) -> tuple:
    """A sort key that orders ``64x4`` before ``128x8`` and ``64`` before ``128``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", value))


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


def grouping_notes(
    over: Sequence[str],
    baseline: str | None,
    groups: Sequence[dict[str, Any]],
    metric: str,
    by_default: bool = False,
) -> list[str]:
    """The lines that say how the grouped table was made, and what it cannot show."""
    notes = []
    methods = {g["ci_method"] for g in groups if g.get("ci") is not None}
    if "t, clipped" in methods:
        low, high = metric_range(metric) or (0, 1)
        notes.append(
            f"The interval is Student's t over seeds (95%); `{metric}` lies in "
            f"[{low:g}, {high:g}], and its interval is clipped to that range."
        )
    elif methods:
        notes.append("The interval is Student's t over seeds (95%).")
    if over:
        notes.append(
            f"Each cell is the setting of {', '.join(over)} with the best mean over seeds "
            "(the seeds every setting of the cell ran), all its seeds kept"
            + (
                " (the default for a sweep over rates: summary.best_over=[], or "
                "tlab-summarize --best-over alone, shows every rate)."
                if by_default
                else "."
            )
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
            f"Fewer than {MIN_FOR_TEST} seeds: no interval or test is meaningful, and none "
            "is given (—); n=1 has no spread."
        )
    params = [g for g in groups if g.get("params_off")]
    if params:
        notes.append(
            "! marks a parameter count more than 1% away from "
            + ("the baseline's" if baseline else "the most common one")
            + ": the comparison is not at equal size."
        )
    return [" ".join(notes), ""] if notes else []


def won_columns(over: Sequence[str]) -> list[str]:
    """The grouped table's columns for the keys of a searched grid: the value that won."""
    return [f"best {k}" for k in over]


def group_cells(g: dict[str, Any], metric: str) -> dict[str, Any]:
    """One row of the grouped table."""
    off = g.get("params_off")
    edges = g.get("edges", {})
    won = {k: v + (f" ({edges[k]}) ^" if k in edges else "") for k, v in g.get("won", {}).items()}
    row = {
        "choice": g["choice"],
        **dict(zip(won_columns(won), won.values(), strict=True)),
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
    won = summary["groups"][0].get("won", {}) if summary["groups"] else {}
    columns = ["choice", *won_columns(won), "runs ok", f"final {metric}"]
    columns += ["vs baseline", "p (test)"] if compared else []
    columns += [c for c in ("params", "state size") if any(row[c] for row in rows)]
    print(markdown_table(rows, columns))
    failed = [r for r in summary["jobs"] if r["status"] != "ok"]
    for r in failed:
        print(f"job {r['job']} {r['status']}: {r['overrides']} {r['error']}".rstrip())
