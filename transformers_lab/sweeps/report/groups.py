"""The summary's grouped view: runs grouped by their settings over seeds, the best
setting of each cell of a searched grid, each group against its baseline, scores over
tasks, and the points of a grid figure."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers_lab.errors import UnknownChoice
from transformers_lab.run.overrides import SEED_KEYS, override_map
from transformers_lab.sweeps.report.collect import Run, by_seed, choice_of, choice_values, seed_keys
from transformers_lab.sweeps.report.stats import best_of, compare, interval, metric_range
from transformers_lab.sweeps.report.tables import natural


@dataclass
class Cell:
    """A cell of a searched grid: its runs by their setting of the searched keys, and the
    setting that stands for it (None where no run of the cell finished)."""

    settings: dict[tuple, list[Run]]
    winner: tuple | None
    means: dict[tuple, float] = field(default_factory=dict)  # of the settings it scored


def grid_cells(
    runs: Sequence[Run], metric: str, mode: str, over: Sequence[str], by_source: bool = False
) -> dict[tuple, Cell]:
    """The cells of a grid searched over the ``over`` keys, keyed as ``group_rows`` keys
    its groups (the dir given, with ``by_source``, and the settings that are not searched).

    Runs that differ only in the ``over`` keys (a learning-rate grid) and their seeds form a
    cell, and the setting of the ``over`` keys whose finished runs have the best mean
    stands for it, with all its runs (a seed that failed there too). (The best rate of
    each seed apart would pick each seed's luckiest rate, and overstate the cell.) The
    means are over the seeds that every setting of the cell ran, and a setting that did
    not finish all of them stands behind those that did: a seed added later at the winning
    rate joins its runs and leaves the choice as it was, and a rate that failed on most
    seeds does not win on the one it finished. Without such seeds, the mean of each
    setting's finished runs decides. The cells span the dirs given (a grid run in parts,
    or single runs' dirs), each dir's own with ``by_source``, as the groups do."""
    grouped: dict[tuple, dict[tuple, list[Run]]] = {}
    for run in runs:
        setting = tuple(run.values.get(k) for k in over)
        key = (run.source if by_source else "", run.same_as(ignore=over))
        grouped.setdefault(key, {}).setdefault(setting, []).append(run)
    cells = {}
    for key, settings in grouped.items():
        seeds = seed_keys(list(settings.values()))
        common = set.intersection(*({seeds[r.job] for r in m} for m in settings.values()))
        finished = {
            setting: [r for r in members if metric in r.record.metrics and r.record.status == "ok"]
            for setting, members in settings.items()
        }
        finished = {k: v for k, v in finished.items() if v}
        complete = {s: v for s, v in finished.items() if common <= {seeds[r.job] for r in v}}
        if common and complete:
            scored = {s: [r for r in v if seeds[r.job] in common] for s, v in complete.items()}
        else:
            scored = finished
        means = [statistics.fmean(r.record.metrics[metric] for r in v) for v in scored.values()]
        index = best_of(means, mode)
        winner = list(scored)[index] if index is not None else None
        cells[key] = Cell(settings, winner, dict(zip(scored, means, strict=True)))
    return cells


def best_in_cells(
    runs: Sequence[Run], metric: str, mode: str, over: Sequence[str], by_source: bool = False
) -> set[str]:
    """The jobs that stand for their cell of the grid searched over ``over``
    (``grid_cells``): the winning setting's runs; every run of a cell with no finished
    run, which stands as it is."""
    chosen = set()
    for cell in grid_cells(runs, metric, mode, over, by_source).values():
        best = cell.settings.values() if cell.winner is None else [cell.settings[cell.winner]]
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
    (``stats.interval``: Student's t, clipped for a bounded metric, none below 3 seeds),
    the ``ignore`` keys (a grid searched over) aside; ``seeds`` maps each seed to its
    final value and ``starts`` to what the seed fixed (``by_seed``); ``won`` the values of
    the ``ignore`` keys its runs had (the winners of a searched grid); the choice's
    parameter count and decoding state."""
    bounds = metric_range(metric)
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        key = (run.source if by_source else "", run.same_as(ignore))
        groups.setdefault(key, []).append(run)
    rows = []
    for key, members in groups.items():
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
                "cell": key,  # grid_cells' key of its cell, where a grid was searched
                "choice": choice_of(members[0], keys, by_source),
                "values_of": choice_values(members[0], keys, by_source),
                # the setting of the searched keys that won its cell (several: none finished)
                "won": {
                    k: ", ".join(sorted({r.values.get(k, "?") for r in members}, key=natural))
                    for k in ignore
                },  # fmt: skip
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


def length_rows(
    runs: Sequence[Run], metric: str, keys: Sequence[str], by_source: bool = False
) -> list[dict[str, Any]]:
    """The mean over seeds of ``metric`` at each length the finished ``runs`` were scored
    at (``<metric>@<length>``, a run's ``eval_lengths``), a row per (choice, length), in
    ``grid_rows``' layout: the choice is the line, the length is x."""
    cells: dict[tuple[str, int], list[float]] = {}
    for run in runs:
        if run.record.status != "ok":
            continue
        for key, value in run.record.metrics.items():
            name, _, length = key.rpartition("@")
            if name == metric and length.isdigit():
                cells.setdefault((choice_of(run, keys, by_source), int(length)), []).append(value)
    rows = [
        {"panel": "(all)", "line": line, "x": n, metric: statistics.fmean(v), "runs": len(v)}
        for (line, n), v in cells.items()
    ]
    return sorted(rows, key=lambda r: (natural(r["line"]), r["x"]))
