"""The study section of a sweep summary: every trial of an Optuna study with its state
(complete, pruned, failed, lost, running), and with several objectives the Pareto front,
in ``summary.md`` and ``pareto.png``. It reads the files the study sweeper leaves in the
sweep dir (``study.json``, ``trials.csv``), so ``tlab-summarize`` rebuilds it without the
database."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers_lab.sweeps.report.tables import markdown_table

STUDY_FILE = "study.json"  # the study's name, storage (password hidden), objectives
TRIALS_FILE = "trials.csv"  # every trial, as the sweeper last saw it
STATES = ("complete", "pruned", "failed", "lost", "running", "waiting")


def pareto_front(points: Sequence[Sequence[float]], directions: Sequence[str]) -> list[int]:
    """The indices of the points no other point dominates (as good in every objective and
    better in one), ``maximize`` or ``minimize`` per objective."""
    signs = [1.0 if d.lower().startswith("max") else -1.0 for d in directions]
    scored = [[s * v for s, v in zip(signs, p, strict=True)] for p in points]

    def dominates(a: list[float], b: list[float]) -> bool:
        pairs = list(zip(a, b, strict=True))
        return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)

    return [
        i
        for i, p in enumerate(scored)
        if not any(dominates(q, p) for j, q in enumerate(scored) if j != i)
    ]


def read_study(sweep_dir: Path) -> tuple[dict[str, Any], list[dict[str, str]]] | None:
    """``study.json`` and the rows of ``trials.csv``, or None if the dir holds no study."""
    try:
        info = json.loads((sweep_dir / STUDY_FILE).read_text())
        with open(sweep_dir / TRIALS_FILE, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, ValueError):
        return None
    return info, rows


def front_of(info: dict[str, Any], rows: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """The complete trials on the Pareto front of the study's objectives."""
    objectives = info["objectives"]
    done = [r for r in rows if r["state"] == "complete" and all(r.get(o) for o in objectives)]
    points = [[float(r[o]) for o in objectives] for r in done]
    return [done[i] for i in pareto_front(points, info["directions"])]


def study_section(sweep_dir: Path, out: Path) -> list[str]:
    """Markdown lines of the study section (none without a study); ``pareto.png`` in
    ``out`` when the study has several objectives."""
    found = read_study(sweep_dir)
    if found is None:
        return []
    info, rows = found
    shown = [{k: number(v) for k, v in r.items()} for r in rows]
    objectives, directions = info["objectives"], info["directions"]
    counts = {s: sum(r["state"] == s for r in rows) for s in STATES}
    said = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    goal = ", ".join(f"{d} {o}" for o, d in zip(objectives, directions, strict=True))
    lines = [
        f"## Study `{info['study_name']}` ({info['storage']})",
        "",
        f"{len(rows)} trials ({said}) of n_trials={info['n_trials']}; {goal}. A pruned trial "
        "stopped at its last step; a lost one was given up when its worker died, and its "
        "slot asked again.",
        "",
    ]
    columns = ["trial", "state", *objectives, "last_step"]
    params = [c for c in (rows[0] if rows else {}) if c not in (*columns, "run_dir", "note")]
    lines += [markdown_table(shown, [*columns, *params, "note"]), ""]
    if len(objectives) > 1:
        front = front_of(info, rows)
        lines += [
            f"### Pareto front ({len(front)} trials; pareto.png)",
            "",
            markdown_table([shown[rows.index(r)] for r in front], ["trial", *objectives, *params]),
            "",
        ]
        from transformers_lab.files import atomic_write

        atomic_write(out / "pareto.png", lambda f: plot_front(info, rows, front, f))
    return lines


def number(text: str) -> float | str:
    """A CSV cell as a float where it is one that is not a whole number (the summary
    prints it to 6 significant digits), else as it is."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return text
    return text if value.is_integer() else value


def plot_front(info: dict[str, Any], rows: Sequence[dict[str, str]], front: Sequence, f: Any):
    """The first two objectives of every complete trial, the front joined by a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, y = info["objectives"][:2]
    done = [r for r in rows if r["state"] == "complete" and r.get(x) and r.get(y)]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.scatter([float(r[x]) for r in done], [float(r[y]) for r in done], c="0.6", label="trial")
    ordered = sorted(front, key=lambda r: float(r[x]))
    ax.plot(
        [float(r[x]) for r in ordered],
        [float(r[y]) for r in ordered],
        "o-",
        c="C3",
        label="Pareto front",
    )
    for r in ordered:
        ax.annotate(
            r["trial"],
            (float(r[x]), float(r[y])),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    d = info["directions"]
    ax.set_xlabel(f"{x} ({d[0]})")
    ax.set_ylabel(f"{y} ({d[1]})")
    ax.set_title(f"study {info['study_name']}: {len(front)} of {len(done)} on the front")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
