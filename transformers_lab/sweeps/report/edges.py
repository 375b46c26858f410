"""The edge of a searched grid: a choice whose best rate is the grid's lowest or highest
value may do better past it, and its comparison with the others is then not at its best
rate. The summary marks such choices (``find_edges``); ``hydra.sweeper.grow`` runs the
next rate past each edge into the same sweep dir (``grow_jobs``, ``sweeps.grid_sweeper``)
until every best lies inside its grid.

Where an edge is: in each cell of the grid (the runs that differ only in the searched
keys and their seeds, ``groups.grid_cells``), the winning setting's value of a searched
key is the lowest or the highest of the values the cell tried with the other searched keys
at their winning values. A value counts as tried once every seed of the winning value has
ended there, finished or failed: a rate that diverged is worse, and the winner below it is
inside; a value with a seed still to run (a round stopped midway) is not yet tried. Only
numbers have edges (``optimizer=adam,sgd`` has none), and a key with one value has no grid
to speak of.

The next value keeps the grid's own spacing: a grid that repeats by decades (1e-3, 3e-3,
1e-2) goes on to 3e-2 and down to 3e-4; a geometric grid of round numbers (3e-4, 1e-3)
goes one ratio further, to the nearest round number (3e-3); a grid through zero or below
goes one step of its own width further."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers_lab.run.overrides import override_key, override_map
from transformers_lab.sweeps.report.collect import (
    Run,
    choice_of,
    read_overrides,
    seed_of,
    varying_keys,
)
from transformers_lab.sweeps.report.groups import grid_cells

LOWEST, HIGHEST = "lowest", "highest"
ENDED = ("ok", "failed")  # a job that ran to its end
ROUND_MANTISSAS = (1.0, 1.5, 2.0, 3.0, 5.0)  # the numbers a rate grid is made of


@dataclass
class Edge:
    """A cell whose best value of ``key`` is the grid's ``side``: ``value`` among
    ``values`` (those the cell tried), and the runs of its winning setting (each seed)."""

    cell: tuple
    key: str
    side: str
    value: float
    values: list[float]
    runs: list[Run]
    choice: str = ""

    @property
    def next(self) -> float | None:
        return next_value(self.values, self.side)

    def label(self) -> str:
        """The choice it is, as the summary's table names it."""
        return self.choice or "(all)"

    def __str__(self) -> str:
        step = self.next
        further = f", next {written(step)}" if step is not None else ", no step past it"
        return f"{self.label()} ({self.key} {written(self.value)}, the {self.side}{further})"


def number(text: str | None) -> float | None:
    try:
        value = float(str(text))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def find_edges(
    runs: Sequence[Run], metric: str, mode: str, over: Sequence[str], by_source: bool = False
) -> list[Edge]:
    """Every cell whose winning value of a searched key is its grid's lowest or highest."""
    keys = [k for k in varying_keys(runs) if k not in over]
    edges = []
    for key, cell in grid_cells(runs, metric, mode, over, by_source).items():
        if cell.winner is None:
            continue
        for i, name in enumerate(over):
            won = number(cell.winner[i])
            # the values tried along this key, the other searched keys as they won
            line = [
                s
                for s in cell.settings
                if s[:i] + s[i + 1 :] == cell.winner[:i] + cell.winner[i + 1 :]
            ]
            seeds = {seed_of(r) for r in cell.settings[cell.winner]}
            tried = [s for s in line if seeds <= ended_seeds(cell.settings[s])]
            values = sorted({v for s in tried if (v := number(s[i])) is not None})
            if won is None or len(values) < 2:
                continue
            side = LOWEST if won == values[0] else HIGHEST if won == values[-1] else None
            best = cell.means[cell.winner]
            tied = [number(s[i]) for s in tried if math.isclose(cell.means.get(s, math.nan), best)]
            if any(values[0] < v < values[-1] for v in tied if v is not None):
                side = None  # as good inside the grid: the best is inside
            if side is not None:
                winners = cell.settings[cell.winner]
                choice = choice_of(winners[0], keys, by_source)
                edges.append(Edge(key, name, side, won, values, winners, choice))
    return edges


def ended_seeds(runs: Sequence[Run]) -> set[str]:
    return {seed_of(r) for r in runs if r.record.status in ENDED}


def round_number(value: float) -> bool:
    mantissa = abs(value) / 10 ** math.floor(math.log10(abs(value)))
    return any(math.isclose(mantissa, m, rel_tol=1e-9) for m in (*ROUND_MANTISSAS, 10.0))


def nearest_round(value: float) -> float:
    """The round number (``ROUND_MANTISSAS`` times a power of ten) nearest ``value`` on a
    log scale."""
    exponent = math.floor(math.log10(value))
    candidates = [
        m * 10.0**e for e in (exponent - 1, exponent, exponent + 1) for m in ROUND_MANTISSAS
    ]
    return min(candidates, key=lambda c: abs(math.log(c / value)))


def next_value(values: Sequence[float], side: str) -> float | None:
    """The value one grid step past ``side`` of ``values`` (see the module's note); None
    where the grid has fewer than 2 values."""
    ordered = sorted(set(values), reverse=side == LOWEST)  # the edge last
    if len(ordered) < 2:
        return None
    edge, inner = ordered[-1], ordered[-2]
    integers = all(float(v).is_integer() for v in ordered)
    if min(ordered) <= 0:  # a linear grid; nothing below a floor of 0 (a decay, dropout)
        return None if edge == 0 and side == LOWEST else edge + (edge - inner)
    if len(ordered) >= 3 and math.isclose(
        max(edge, ordered[-3]) / min(edge, ordered[-3]), 10, rel_tol=1e-6
    ):
        value = inner * 10 if side == HIGHEST else inner / 10  # a grid of decades
    else:
        value = edge * edge / inner
        if all(round_number(v) for v in ordered) and nearest_round(value) != edge:
            value = nearest_round(value)
    value = float(f"{value:.6g}")
    return float(round(value)) if integers else value


def written(value: float) -> str:
    """A value as an override writes it: ``0.03``, ``1.5e-05``, ``256``."""
    return str(int(value)) if value.is_integer() and abs(value) >= 1 else f"{value:.6g}"


def same_overrides(a: Sequence[str], b: Sequence[str]) -> bool:
    """Whether two jobs' overrides run the same job: the same keys, and values that are
    equal as written or as numbers (``optimizer.lr=0.03`` and ``optimizer.lr=3e-2``)."""
    first, second = override_map(a), override_map(b)
    if first.keys() != second.keys():
        return False
    for key, value in first.items():
        other = second[key]
        x, y = number(value), number(other)
        if value != other and not (x is not None and y is not None and math.isclose(x, y)):
            return False
    return True


def moved(overrides: Sequence[str], key: str, value: float) -> list[str]:
    """A job's overrides with ``key`` set to ``value`` (added where it was not given)."""
    out = [o for o in overrides if override_key(o) != key]
    return [*out, f"{key}={written(value)}"]


@dataclass
class Grown:
    """A job past an edge: its overrides, and the job dir it runs in again where one was
    started and did not end (a round stopped midway), else None: a new job."""

    overrides: list[str]
    rerun: Path | None = None


def grow_jobs(edges: Sequence[Edge], runs: Sequence[Run]) -> list[Grown]:
    """The jobs that run one step past each edge: each seed of the winning setting at the
    next value, the others as they were; none that ``runs`` holds ended already, none
    twice; one that was started and did not end runs again in its own dir."""
    jobs: list[Grown] = []
    for edge in edges:
        value = edge.next
        if value is None:
            continue
        for run in edge.runs:
            # as Hydra gave the job its overrides: with the sweep's bookkeeping ones too
            given = read_overrides(run.dir) if run.dir is not None else []
            job = moved(given or run.record.overrides, edge.key, value)
            if any(same_overrides(job, other.overrides) for other in jobs):
                continue
            known = [r for r in runs if same_overrides(job, r.record.overrides)]
            if any(r.record.status in ENDED for r in known):
                continue
            started = next((r.dir for r in known if r.dir and r.dir.name.isdigit()), None)
            if started is not None:  # resumes from its own last.ckpt
                job = [
                    *(o for o in job if override_key(o) != "skip_finished"),
                    "skip_finished=true",
                ]
            jobs.append(Grown(job, started))
    return jobs


def edge_note(edges: Sequence[Edge], command: str | None) -> list[str]:
    """The line under the grouped table: which choices' best sits on the grid's edge, the
    next value of each, and the command that runs those into the same sweep dir."""
    if not edges:
        return []
    line = (
        f"^ marks a best value on the grid's edge, the lowest or highest tried, past which "
        f"the choice may do better ({len(edges)}): {'; '.join(map(str, edges))}."
    )
    if command:
        line += (
            f" To run the next values into this sweep dir until every best is inside: `{command}`"
        )
    else:
        line += " Grow the grid of each sweep with its command and hydra.sweeper.grow=3."
    return [line, ""]
