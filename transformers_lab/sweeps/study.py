"""An Optuna study as the project's sweeper keeps it: its search space in Hydra's sweep
syntax, the question it answers, which of its trials hold a slot of ``n_trials``, and the
trials its dead workers left running. Where it is stored is ``sweeps.storage``.

The study is the source of truth for a sweep: a worker that starts (again) counts what
is done there, so that a killed sweep resumes and several workers share the trials.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    distribution_to_json,
)
from optuna.trial import FrozenTrial, TrialState

from transformers_lab.errors import ConfigError
from transformers_lab.run.overrides import MACHINE_KEYS, bookkeeping, override_key

# a trial's user attributes, set by the sweeper
OWNER = "tlab:owner"  # {"host", "pid", "start"}: the sweep process that asked for it
RUN_DIR = "tlab:run_dir"  # the job's run dir
ERROR = "tlab:error"  # why its job failed: a failed job holds its slot
LOST = "tlab:lost"  # why it was given up: its worker died, or it was one too many
SPACE = "tlab:search_space"  # the study's: {key: distribution as JSON}
SETTINGS = "tlab:settings"  # the study's: the overrides every trial is given, sorted
# overrides that do not change the question a study answers (how it is logged, pruned or
# run), besides the sweeps' bookkeeping keys
NOT_THE_QUESTION = ("pruner", "logger", "callbacks", "paths", *MACHINE_KEYS)

# values of a job record that can be objectives besides its logged metrics
RECORD_VALUES = ("params", "time_s", "state_size")


# ----------------------------------------------------------------------- search space


def search_space(params: Mapping[str, Any]) -> tuple[dict[str, BaseDistribution], list[str]]:
    """Hydra's sweep syntax as Optuna distributions: ``interval(a, b)`` (floats),
    ``tag(log, interval(a, b))``, ``tag(int, interval(a, b))``, ``choice(a, b, ...)`` or ``a,b``,
    ``range(start, stop, step)``. A plain value is not searched: it comes back as an
    override every job gets."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    parser = OverridesParser.create()
    space: dict[str, BaseDistribution] = {}
    fixed: list[str] = []
    for key, value in params.items():
        text = f"{key}={value}"
        try:
            override = parser.parse_override(text)
        except Exception as exc:
            raise ConfigError(f"cannot read the search space entry {text!r}: {exc}") from None
        sweep = override.value()
        if isinstance(sweep, IntervalSweep):
            log = "log" in sweep.tags
            start, end = sweep.start, sweep.end
            if "int" in sweep.tags or (isinstance(start, int) and isinstance(end, int)):
                space[key] = IntDistribution(int(start), int(end), log=log)
            else:
                space[key] = FloatDistribution(float(start), float(end), log=log)
        elif isinstance(sweep, RangeSweep):
            values = list(override.sweep_iterator())
            if all(isinstance(v, int) for v in values) and len(values) > 1:
                step = values[1] - values[0]
                space[key] = IntDistribution(values[0], values[-1], step=step)
            else:
                space[key] = CategoricalDistribution(values)
        elif isinstance(sweep, ChoiceSweep):
            space[key] = CategoricalDistribution(list(override.sweep_iterator()))
        else:
            fixed.append(text)
    return space, fixed


def space_json(space: Mapping[str, BaseDistribution]) -> dict[str, str]:
    return {k: distribution_to_json(d) for k, d in sorted(space.items())}


def as_override(key: str, value: Any) -> str:
    """A sampled value as an override: floats at full precision, strings quoted when
    Hydra would read them otherwise."""
    if isinstance(value, bool) or value is None:
        text = {True: "true", False: "false", None: "null"}[value]
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str) and not all(c.isalnum() or c in "_-./" for c in value):
        text = "'" + value.replace("'", "\\'") + "'"
    else:
        text = str(value)
    return f"{key}={text}"


# ---------------------------------------------------------------------------- the study


SPACE_WAIT_S = 10.0  # how long a worker that found the study waits for its search space


def load_or_create(
    storage: optuna.storages.BaseStorage,
    name: str,
    directions: Sequence[str],
    space: Mapping[str, BaseDistribution],
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    where: str = "",
    settings: Sequence[str] = (),
) -> optuna.Study:
    """The study ``name``, created if new. One that exists must have these directions
    and this search space: a sweep never adds trials to a study of another question. Only
    the worker that creates the study samples from ``sampler``'s seed; one that loads it
    reseeds its sampler at random, so as not to ask for the first worker's draws again.

    Of workers that start together, the storage lets exactly one create the study (its
    name is a unique key); that one records the search space. The others wait for it
    (``SPACE_WAIT_S``) and compare theirs, so a worker with another space is refused even
    on a database server, where recording is an upsert that no lock guards.
    """
    try:
        study = optuna.create_study(
            storage=storage,
            study_name=name,
            directions=list(directions),
            sampler=sampler,
            pruner=pruner,
        )
        created = True
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
        # A worker that joins or resumes the study would replay, from the same seed, the
        # draws its first worker made (the same parameters again): it draws afresh.
        study.sampler.reseed_rng()
        created = False
    have = [d.name.lower() for d in study.directions]
    hint = "give another hydra.sweeper.study_name, or the same settings to continue it"
    if have != [d.lower() for d in directions]:
        raise ConfigError(
            f"study {name!r}{where} exists with directions {have}; this sweep asks "
            f"{list(directions)}: {hint}"
        )
    wanted, given = space_json(space), question(settings)
    if created:  # the settings first: the others wait for the space, then read both
        study.set_user_attr(SETTINGS, given)
        study.set_user_attr(SPACE, wanted)
        return study
    stored = recorded_space(study)
    if stored is None:  # a study made by Optuna itself: this sweep's space is its question
        study.set_user_attr(SPACE, wanted)
        stored = wanted
    if stored != wanted:
        raise ConfigError(
            f"study {name!r}{where} exists with the search space {describe(stored)}; this "
            f"sweep has {describe(wanted)}: {hint}"
        )
    had = study.user_attrs.get(SETTINGS)
    if had is None:  # recorded by an older sweeper, or none: this sweep's are its own
        study.set_user_attr(SETTINGS, given)
    elif had != given:
        only_had = [o for o in had if o not in given] or ["nothing"]
        only_given = [o for o in given if o not in had] or ["nothing"]
        raise ConfigError(
            f"study {name!r}{where} ran its trials with {' '.join(only_had)} where this sweep "
            f"gives {' '.join(only_given)}: its trials would not compare; {hint}"
        )
    return study


def question(settings: Sequence[str]) -> list[str]:
    """The overrides given to every trial that change what a study measures, sorted, a
    leading ``+`` dropped (``+experiment=mqar`` is ``experiment=mqar``): bookkeeping,
    logging, pruning and paths left out."""

    def asks(override: str) -> bool:
        key = override_key(override)
        head = key.split(".", 1)[0].split("/", 1)[0]
        return not bookkeeping(key) and head not in NOT_THE_QUESTION

    return sorted(o.lstrip("+") for o in settings if asks(o))


def recorded_space(study: optuna.Study) -> dict[str, str] | None:
    """The search space recorded with ``study``; a study just created by another worker
    gets it within moments, so this waits up to ``SPACE_WAIT_S`` for it."""
    deadline = time.monotonic() + SPACE_WAIT_S
    while True:
        stored = study.user_attrs.get(SPACE)
        if stored is not None or time.monotonic() >= deadline:
            return stored
        time.sleep(0.1)


def describe(space: Mapping[str, str]) -> str:
    """A stored search space, briefly: ``{optimizer.lr: Float(0.0001..0.01, log)}``."""
    parts = []
    for key, text in space.items():
        data = json.loads(text)
        kind, attrs = data["name"].replace("Distribution", ""), data["attributes"]
        if "choices" in attrs:
            parts.append(f"{key}: {kind}{tuple(attrs['choices'])}")
        else:
            log = ", log" if attrs.get("log") else ""
            parts.append(f"{key}: {kind}({attrs['low']}..{attrs['high']}{log})")
    return "{" + ", ".join(parts) + "}"


def holds_slot(trial: FrozenTrial) -> bool:
    """Whether a trial counts towards ``n_trials``: finished, pruned, running or waiting,
    or failed by its job (the same setting would fail again). A trial given up because its
    worker died (or one asked beyond ``n_trials``) holds none: its slot is given again."""
    if trial.state == TrialState.FAIL:
        return ERROR in trial.user_attrs
    return True


def slots_taken(study: optuna.Study) -> int:
    return sum(holds_slot(t) for t in study.get_trials(deepcopy=False))


def rank(study: optuna.Study, number: int) -> int:
    """The place of trial ``number`` among the trials that hold a slot, from 1 (trial
    numbers are given in order by the storage, so every worker sees the same ranks)."""
    trials = study.get_trials(deepcopy=False)
    return sum(holds_slot(t) for t in trials if t.number <= number)


# ------------------------------------------------------------------ workers and losses


def process_start(pid: int) -> str | None:
    """A process's start time as the kernel counts it (Linux), which tells a process
    from a later one given the same pid; None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def this_worker() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": process_start(pid)}


def worker_alive(owner: Mapping[str, Any]) -> bool | None:
    """Whether the worker that asked for a trial still runs: True or False on this host,
    None for another host (its heartbeat, where the storage keeps one, tells)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = int(owner.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user's
    except (OSError, ValueError):
        return False
    start = owner.get("start")
    return start is None or process_start(pid) in (None, start)


def give_up(study: optuna.Study, trial: FrozenTrial | optuna.Trial, why: str) -> None:
    """Mark a trial failed without holding a slot (``LOST``), so that it is asked again."""
    storage = study._storage
    trial_id = trial._trial_id
    with contextlib.suppress(Exception):  # finished meanwhile: nothing to give up
        storage.set_trial_user_attr(trial_id, LOST, why)
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)


def reclaim_lost(study: optuna.Study, storage: optuna.storages.BaseStorage) -> list[FrozenTrial]:
    """Give up the running trials whose worker is gone: on this host its process has
    ended; elsewhere the storage's heartbeat stopped (RDB storages opened with one).
    Returns the trials given up."""
    lost = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.user_attrs.get(OWNER) or {}
        if owner and worker_alive(owner) is False:
            give_up(study, trial, f"its worker (pid {owner.get('pid')}) is gone")
            lost.append(trial)
    if isinstance(storage, optuna.storages.RDBStorage) and storage.heartbeat_interval:
        before = {t.number for t in study.get_trials(states=(TrialState.RUNNING,))}
        with warnings.catch_warnings():  # "experimental" since Optuna 2.9, said every trial
            warnings.filterwarnings(
                "ignore",
                ".*fail_stale_trials is experimental",
                optuna.exceptions.ExperimentalWarning,
            )
            optuna.storages.fail_stale_trials(study)  # no heartbeat within the grace period
        # failed by the check: a trial its own worker ended meanwhile is complete, pruned,
        # or failed with its job's error, and not lost
        failed = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        lost += [t for t in failed if t.number in before and ERROR not in t.user_attrs]
    return lost


# ------------------------------------------------------------- objectives and trials


def objective_values(record: Any, objectives: Sequence[str]) -> list[float] | str:
    """The objectives' values in a job record (its final metrics, or ``params``,
    ``time_s``, ``state_size``), or why they cannot be had."""
    values = []
    for name in objectives:
        value = record.metrics.get(name)
        if value is None and name in RECORD_VALUES:
            value = getattr(record, name)
        if value is None:
            return f"{name} was never logged (logged: {', '.join(sorted(record.metrics))})"
        if not math.isfinite(float(value)):
            return f"{name} is {value}"
        values.append(float(value))
    return values


@dataclass
class TrialRow:
    """One trial as the sweep summary shows it."""

    number: int
    state: str  # complete, pruned, running, waiting, failed, lost
    values: list[float] | None
    params: dict[str, Any]
    run_dir: str | None
    note: str | None  # the error of a failed job, or why the trial was given up
    steps: int | None  # the last step it reported (pruning's intermediate values)


def trial_rows(study: optuna.Study) -> list[TrialRow]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        state = {"fail": "failed"}.get(t.state.name.lower(), t.state.name.lower())
        note = t.user_attrs.get(ERROR)
        if t.state == TrialState.FAIL and LOST in t.user_attrs:
            state, note = "lost", t.user_attrs[LOST]
        elif t.state == TrialState.FAIL and ERROR not in t.user_attrs:
            state, note = "lost", "no heartbeat: its worker stopped"
        rows.append(
            TrialRow(
                number=t.number,
                state=state,
                values=list(t.values) if t.values is not None else None,
                params=dict(t.params),
                run_dir=t.user_attrs.get(RUN_DIR),
                note=note,
                steps=t.last_step,
            )
        )
    return rows
