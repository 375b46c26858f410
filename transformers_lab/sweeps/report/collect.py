"""The runs a summary is made of: every job dir of the sweeps and runs given, its record
(or what its dir shows of a job that never wrote one), and what tells it from the others
(its seed, the options and settings that changed); and the metric to summarise."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from transformers_lab.errors import UnknownMetric
from transformers_lab.run.curves import history
from transformers_lab.run.overrides import SEED_KEYS
from transformers_lab.run.record import RESULT_FILE, JobRecord, read_record
from transformers_lab.sweeps.report.settings import labelled_values


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
    dir: Path | None = None

    def same_as(self, ignore: Sequence[str] = ()) -> tuple:
        """The key of its group: its settings that change between runs (its labels where
        no composed config tells them), the ``ignore`` keys aside."""
        found = self.identity if self.identity is not None else self.values
        return tuple(sorted((k, v) for k, v in found.items() if k not in (*ignore, *SEED_KEYS)))


def default_out(dirs: Sequence[Path]) -> Path:
    """Where a summary goes unless ``--out`` says: the one dir it is about, else a new
    ``logs/summaries/<time>`` under the current dir."""
    if len(dirs) == 1:
        return dirs[0]
    return Path("logs") / "summaries" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


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
            runs.append(Run(job, source.name, record, dir=run_dir))
            found.append((record.overrides, run_dir))
    unique_jobs(runs, [d for _, d in found])
    for run, (values, identity) in zip(runs, labelled_values(found), strict=True):
        run.values, run.identity = values, identity
    return runs


def unique_jobs(runs: Sequence[Run], run_dirs: Sequence[Path]) -> None:
    """Name each job once: run dirs given one by one from two sweeps (``a/3`` and ``b/3``)
    are ``a/3`` and ``b/3``, not ``3`` twice (a job's name is what the best of a grid's
    cell is chosen by)."""
    for fallback in (lambda d: f"{d.parent.name}/{d.name}", str):
        names = [r.job for r in runs]
        for run, run_dir in zip(runs, run_dirs, strict=True):
            if names.count(run.job) > 1:
                run.job = fallback(run_dir)


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


def seed_of(run: Run) -> str:
    """The run's seed (what repeats a choice), or its job name when it has none."""
    return next((run.values[k] for k in SEED_KEYS if k in run.values), run.job)


def by_seed(runs: Sequence[Run]) -> dict[str, Run]:
    """The runs keyed by their seed (``seed_keys``): the key a paired test matches runs by."""
    keys = seed_keys([runs])
    return {keys[r.job]: r for r in runs}


def seed_keys(groups: Sequence[Sequence[Run]]) -> dict[str, str]:
    """Job -> the key its seed is matched by, one kind of key for every group, unique
    within each: the seed, whichever dirs the runs came from (a grid given in parts, or one
    dir a run); where a seed repeats in a group (a sweep and its repeat, both with seeds 0
    and 1), dir and seed; where that still repeats (the same choice and seed run twice in
    one dir, as an Optuna study may), the job: every value counts, and nothing pairs."""

    def dir_and_seed(r: Run) -> str:
        return f"{r.source}:{seed_of(r)}"

    def dir_and_job(r: Run) -> str:
        return f"{r.source}:{r.job}"

    for key_of in (seed_of, dir_and_seed, dir_and_job):
        if all(len({key_of(r) for r in g}) == len(g) for g in groups):
            break
    return {r.job: key_of(r) for g in groups for r in g}


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
