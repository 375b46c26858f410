"""The reports of a run: ``kernels.csv`` (every row), ``kernels.md`` (the table, the
linear kernels' FLOP bound and the ratios to softmax) and ``kernels.png``."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from transformers_lab.bench.kernels.specs import BASELINE, COLUMNS, PAIRED, Row
from transformers_lab.bench.kernels.worker import RATE_SIZE


def is_ok(row: Row) -> bool:
    return row["status"] == "ok"


def fmt(x: float | None) -> str:
    """A number for a table cell: a few significant digits, '–' when missing."""
    if x is None or not math.isfinite(x):
        return "–"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if abs(x) >= 0.1 or x == 0 else f"{x:.3f}"


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def write_csv(rows: Sequence[Row], path: Path) -> None:
    """All rows, ``COLUMNS`` in order; missing numbers are empty cells."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row[k] is None else row[k] for k in COLUMNS})


def markdown_table(header: Sequence[str], body: Iterable[Sequence[Any]]) -> list[str]:
    """Lines of a markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in cells) + " |" for cells in body]
    return lines


def bound_ms(row: Row, rate: float | None) -> float | None:
    """The time of a row's matmul FLOPs at ``rate`` GFLOP/s: a floor on its time."""
    if rate is None or row.get("gflop") in (None, ""):
        return None
    return 1e3 * float(row["gflop"]) / rate


def results_table(rows: Sequence[Row], rate: float | None = None) -> list[str]:
    """The main table: one line per measurement; for the linear kernels, the time their
    matmul FLOPs take at ``rate`` (the bound) and their time over it; for every kernel
    measured on CPU, the time in matrix products, and that over the bound."""
    body = (
        (
            r["variant"],
            "causal" if r["causal"] else "noncausal",
            r["n"],
            fmt(r["time_ms"]),
            fmt(r["peak_mib"]),
            f"{r['state_numbers']:,}" if r.get("state_numbers") is not None else "",
            fmt(bound_ms(r, rate)),
            fmt(ratio(r["time_ms"], bound_ms(r, rate))),
            fmt(r.get("matmul_ms")),
            fmt(ratio(r.get("matmul_ms"), bound_ms(r, rate))),
            r["status"],
        )
        for r in rows
    )
    header = ("variant", "mode", "N", "time (ms)", "extra peak (MiB)", "decode state",
              "FLOP bound (ms)", "÷ bound", "matmuls (ms)", "matmuls ÷ bound",
              "status")  # fmt: skip
    return markdown_table(header, body)


def ratio_table(rows: Sequence[Row], causal: bool) -> list[str]:
    """Time and memory relative to softmax at each N, and memory growth from the previous N."""
    ok = {(r["variant"], r["n"]): r for r in rows if r["causal"] == causal and is_ok(r)}
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["causal"] == causal))
    ns = sorted({r["n"] for r in rows if r["causal"] == causal})
    body = []
    for n in ns:
        base = ok.get((BASELINE, n))
        for variant in variants:
            row = ok.get((variant, n))
            if row is None:
                continue
            previous = [m for m in ns if m < n and (variant, m) in ok]
            prev = ok[(variant, previous[-1])] if previous else None
            body.append(
                (
                    n,
                    variant,
                    fmt(ratio(row["time_ms"], base and base["time_ms"])),
                    fmt(ratio(row["peak_mib"], base and base["peak_mib"])),
                    fmt(ratio(row["peak_mib"], prev and prev["peak_mib"])),
                )
            )
    header = ("N", "variant", "time ÷ softmax", "peak ÷ softmax", "peak ÷ peak at previous N")
    return markdown_table(header, body)


def timing_note(rows: Sequence[Row]) -> str:
    """How the rows' times were taken, for the report's first line."""
    timings = {r["timing"] for r in rows if is_ok(r)}
    if timings == {PAIRED}:
        return "the variants of each mode and N timed in one process, their passes alternated"
    if PAIRED in timings:
        return "timed as the csv's `timing` says (paired: with the other variants in one process)"
    return "each variant in its own process"


def markdown_report(rows: Sequence[Row], rate: float | None = None) -> str:
    """The whole ``kernels.md``: set-up, results, and a ratio table per causal mode;
    ``rate``: the machine's matmul GFLOP/s, for the linear kernels' FLOP bound."""
    if not rows:
        return "# Attention kernels: forward + backward\n\nNo measurements.\n"
    first = rows[0]
    methods = sorted({r["mem_method"] for r in rows if r["mem_method"]}) or ["–"]
    lines = [
        "# Attention kernels: forward + backward",
        "",
        f"batch={first['batch']}, heads={first['heads']}, head_dim={first['head_dim']}, "
        f"dtype={first['dtype']}, device={first['device']}; time is the median over the "
        f"timed repeats, {timing_note(rows)}; extra peak memory by {', '.join(methods)}.",
        "",
        *(
            [
                f"FLOP bound: a linear kernel's matmul FLOPs (its `matmul_flops`) at this "
                f"machine's measured matmul rate, {rate:.0f} GFLOP/s (square {RATE_SIZE} "
                f"products, {torch.get_num_threads()} threads). Matmuls: the time one pass "
                "spends in matrix products (`torch.profiler`, CPU), at the shapes the kernel "
                "uses; the rest of its time is its other work.",
                "",
            ]
            if rate
            else []
        ),
        *results_table(rows, rate),
    ]
    for causal in (True, False):
        if any(r["causal"] == causal for r in rows):
            mode = "causal" if causal else "non-causal"
            lines += ["", f"## Ratios, {mode}", "", *ratio_table(rows, causal)]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: Path) -> None:
    """Time and extra peak memory against N, log-log; solid causal, dashed non-causal."""
    from transformers_lab.analysis.plots import plot_kernel_benchmark

    plot_kernel_benchmark([r for r in rows if is_ok(r)]).savefig(path, dpi=120, bbox_inches="tight")


def write_reports(
    rows: Sequence[Row], out_dir: Path | str, rate: float | None = None
) -> dict[str, Path]:
    """Write ``kernels.csv``, ``kernels.md`` and ``kernels.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"kernels.{ext}" for ext in ("csv", "md", "png")}
    write_csv(rows, paths["csv"])
    paths["md"].write_text(markdown_report(rows, rate))
    plot(rows, paths["png"])
    return paths
