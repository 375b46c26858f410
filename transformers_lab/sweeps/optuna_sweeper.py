"""The project's Optuna sweeper: a Hydra ``Sweeper`` over Optuna's ask-and-tell interface,
with the study in a database (``hydra.sweeper.storage``, by default
``<sweep dir>/study.db``).

- **Resume.** The study says what is done: the same command with the same sweep dir
  (or storage) continues it, ``n_trials`` counting the whole study; a trial whose worker
  died is given up and its slot asked again.
- **Many workers.** Processes with one storage and study name share the trials: each
  asks for one while the study has a free slot; numbers are given by the storage, so no
  two workers run the same trial, and a worker that took one slot too many gives it back.
- **Pruning.** Each job reports the study's objective to its trial after every validation
  (``sweeps.pruning``) and stops when ``pruner=median|hyperband`` says so; the job is
  recorded ``pruned``, the trial told so.
- **Several objectives.** ``hydra.sweeper.objectives`` with one direction each; the summary
  draws the Pareto front.

Jobs run in ``<sweep dir>/<trial number>``, through any launcher (basic, joblib, SLURM).
Hydra accepts sweepers only from its ``hydra_plugins`` namespace; ``sweeps.plugins`` enters
this one there under the name the config's ``_target_`` gives, so no separate package has
to be installed.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import sys
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from transformers_lab.errors import ConfigError
from transformers_lab.files import atomic_write
from transformers_lab.run.record import read_record
from transformers_lab.sweeps import study as st
from transformers_lab.sweeps.report.study import STUDY_FILE, TRIALS_FILE
from transformers_lab.sweeps.storage import (
    JOURNAL_PREFIX,
    open_storage,
    printable_url,
    setup_lock,
    with_driver,
)

log = logging.getLogger(__name__)

# what Optuna says when a study with heartbeats asks for a trial outside Study.optimize, as
# this sweeper does: it records the heartbeats of the trials it runs itself (``Heartbeat``)
HEARTBEAT_WARNING = "Heartbeat of storage is supposed to be used with Study.optimize"


class StudySweeper(Sweeper):
    """Ask a persistent Optuna study for trials, run each as a job, tell it the outcome."""

    def __init__(
        self,
        storage: str,
        study_name: str,
        n_trials: int,
        n_jobs: int = 1,
        objectives: Sequence[str] = (),
        directions: Sequence[str] = (),
        sampler: Any = None,
        params: dict[str, Any] | None = None,
        heartbeat_interval: int | None = 60,
    ) -> None:
        self.storage_url = str(storage)
        self.study_name = str(study_name)
        self.n_trials = int(n_trials)
        self.n_jobs = max(1, int(n_jobs))
        self.objectives = [str(o) for o in objectives]
        self.directions = [str(d).lower() for d in directions]
        self.sampler_cfg = sampler
        self.params = dict(params or {})
        self.heartbeat_interval = heartbeat_interval
        self.config: DictConfig | None = None
        self.launcher = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    # ------------------------------------------------------------------------ the loop

    def sweep(self, arguments: list[str]) -> None:
        assert self.config is not None and self.launcher is not None
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep says what it does
        self.check_settings()
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        space, fixed = self.search_space(arguments)
        pruner_cfg = self.config.get("pruner")
        pruner = instantiate(pruner_cfg) if pruner_cfg else None
        sampler = self.sampler_cfg  # Hydra builds the sweeper's nodes with it
        if sampler is not None and not isinstance(sampler, optuna.samplers.BaseSampler):
            sampler = instantiate(sampler)
        where = f" in {printable_url(self.storage_url)}"
        with setup_lock(self.storage_url):  # workers started together take turns
            storage = open_storage(self.storage_url, self.heartbeat_interval)
            study = st.load_or_create(
                storage, self.study_name, self.directions, space, sampler, pruner, where, fixed
            )
            reclaim(study, storage)
        self.save_study_file(sweep_dir)
        done = st.slots_taken(study)
        print(
            f"study {self.study_name!r}{where}: {done} of {self.n_trials} trials taken; "
            f"searching {', '.join(space) or 'nothing'}",
            flush=True,
        )
        heartbeat = Heartbeat(storage, self.heartbeat_interval)
        try:
            while trials := self.ask(study, space):
                self.run(study, trials, fixed, sweep_dir, heartbeat)
                self.save_trials(study, sweep_dir)
                reclaim(study, storage)  # a trial of another worker that died meanwhile
        finally:
            heartbeat.stop()
            self.save_trials(study, sweep_dir)
        self.report(study)
        if not self.storage_url.startswith(JOURNAL_PREFIX):
            url = printable_url(with_driver(self.storage_url))  # as SQLAlchemy reads it
            print(f"dashboard: optuna-dashboard {url}", flush=True)

    def check_settings(self) -> None:
        if self.n_trials < 1:
            raise ConfigError(f"hydra.sweeper.n_trials={self.n_trials}: give at least 1")
        if not self.objectives or len(self.objectives) != len(self.directions):
            raise ConfigError(
                f"hydra.sweeper.objectives {self.objectives} and directions "
                f"{self.directions} must be lists of the same length, one direction "
                "(maximize or minimize) per objective"
            )
        bad = [d for d in self.directions if d not in ("maximize", "minimize")]
        if bad:
            raise ConfigError(f"hydra.sweeper.directions: {bad} is not maximize or minimize")
        pruner = (self.config.get("pruner") or {}).get("_target_", "")
        if len(self.objectives) > 1 and pruner and not pruner.endswith("NopPruner"):
            raise ConfigError(
                f"Optuna prunes only single-objective studies; this one has "
                f"{len(self.objectives)} objectives ({', '.join(self.objectives)}): "
                "give pruner=none"
            )

    def search_space(self, arguments: list[str]) -> tuple[dict, list[str]]:
        """The space of ``hydra.sweeper.params`` and the command line's sweep overrides
        (``optimizer.lr=interval(1e-4,1e-2)``); the command line's other overrides are
        given to every job."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = {str(k): str(v) for k, v in self.params.items()}
        fixed: list[str] = []
        for override in OverridesParser.create().parse_overrides(arguments):
            if override.is_sweep_override():
                params[override.key_or_group] = override.input_line.split("=", 1)[1]
            else:
                fixed.append(override.input_line)
        space, plain = st.search_space(params)
        return space, fixed + plain

    def ask(self, study: optuna.Study, space: dict) -> list[optuna.Trial]:
        """Up to ``n_jobs`` new trials while the study has free slots."""
        trials = []
        for _ in range(min(self.n_jobs, self.n_trials - st.slots_taken(study))):
            with warnings.catch_warnings():  # the trials' heartbeats are ours (``Heartbeat``)
                warnings.filterwarnings("ignore", HEARTBEAT_WARNING, UserWarning)
                trial = study.ask(space)
            trial.set_user_attr(st.OWNER, st.this_worker())
            if st.rank(study, trial.number) > self.n_trials:  # another worker took it first
                st.give_up(study, trial, "asked beyond n_trials (another worker took the slot)")
                break
            trials.append(trial)
        return trials

    def run(
        self,
        study: optuna.Study,
        trials: list[optuna.Trial],
        fixed: list[str],
        sweep_dir: Path,
        heartbeat: Heartbeat,
    ) -> None:
        """Launch one job per trial, each in ``<sweep dir>/<trial number>``, and tell the
        study how each ended, from the job's record."""
        batch = []
        for trial in trials:
            trial.set_user_attr(st.RUN_DIR, str(sweep_dir / str(trial.number)))
            params = [st.as_override(k, v) for k, v in trial.params.items()]
            batch.append(
                [*fixed, *params, f"trial={trial.number}", f"hydra.sweep.subdir={trial.number}"]
            )
        self.validate_batch_is_legal(batch)
        heartbeat.watch(trials)
        try:
            self.launcher.launch(batch, initial_job_idx=trials[0].number)
        finally:  # a job that raised (a signal) stops the sweep: tell what did finish first
            heartbeat.watch([])
            for trial in trials:
                self.tell(study, trial, sweep_dir / str(trial.number))

    def tell(self, study: optuna.Study, trial: optuna.Trial, run_dir: Path) -> None:
        record = read_record(run_dir)
        status = record.status if record is not None else "running"
        if status == "ok":
            values = st.objective_values(record, self.objectives)
            if isinstance(values, str):
                trial.set_user_attr(st.ERROR, values)
                study.tell(trial, state=TrialState.FAIL)
            else:
                study.tell(trial, values)
            said = values if isinstance(values, str) else ", ".join(f"{v:.4g}" for v in values)
            print(f"trial {trial.number}: {said} ({' '.join(record.overrides)})", flush=True)
        elif status == "pruned":
            study.tell(trial, state=TrialState.PRUNED)
            print(f"trial {trial.number}: pruned", flush=True)
        elif status == "failed":
            trial.set_user_attr(st.ERROR, record.error or "failed")
            study.tell(trial, state=TrialState.FAIL)
        else:  # interrupted, or never ended: its slot is asked again
            st.give_up(study, trial, f"its job did not end ({status})")

    # ------------------------------------------------------------------------ outputs

    def save_study_file(self, sweep_dir: Path) -> None:
        info = {
            "study_name": self.study_name,
            "storage": printable_url(self.storage_url),
            "objectives": self.objectives,
            "directions": self.directions,
            "n_trials": self.n_trials,
        }
        atomic_write(sweep_dir / STUDY_FILE, json.dumps(info, indent=2) + "\n")

    def save_trials(self, study: optuna.Study, sweep_dir: Path) -> None:
        """``trials.csv``: every trial of the study, for the sweep summary."""
        atomic_write(sweep_dir / TRIALS_FILE, trials_csv(study, self.objectives))

    def report(self, study: optuna.Study) -> None:
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not complete:
            print("study: no trial completed", file=sys.stderr)
        elif len(self.directions) == 1:
            best = study.best_trial
            print(
                f"best: trial {best.number}, {self.objectives[0]} {best.value:.4g}, {best.params}",
                flush=True,
            )
        else:
            front = sorted(t.number for t in study.best_trials)
            print(f"Pareto front: trials {front}", flush=True)


def reclaim(study: optuna.Study, storage: Any) -> None:
    """Give up the trials whose worker died, saying so."""
    for trial in st.reclaim_lost(study, storage):
        print(f"trial {trial.number}: its worker is gone; its slot is asked again", flush=True)


def trials_csv(study: optuna.Study, objectives: Sequence[str]) -> str:
    """The study's trials as CSV: number, state, one column per objective, the steps a
    pruned trial reported, its params, run dir and note."""
    rows = st.trial_rows(study)
    params = sorted({k for r in rows for k in r.params})
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["trial", "state", *objectives, "last_step", *params, "run_dir", "note"])
    for r in rows:
        values = r.values or [None] * len(objectives)
        writer.writerow(
            [
                r.number,
                r.state,
                *values,
                r.steps,
                *(r.params.get(k) for k in params),
                r.run_dir,
                r.note,
            ]
        )
    return out.getvalue()


class Heartbeat:
    """Record a heartbeat of the running trials every ``interval`` seconds, where the
    storage keeps them (RDB storages), so that workers elsewhere can tell a dead one."""

    def __init__(self, storage: Any, interval: int | None) -> None:
        self.storage, self.interval = storage, interval
        self.trials: list[optuna.Trial] = []
        self.done = threading.Event()
        self.thread = None
        if interval and isinstance(storage, optuna.storages.RDBStorage):
            self.thread = threading.Thread(target=self.beat, daemon=True)
            self.thread.start()

    def watch(self, trials: list[optuna.Trial]) -> None:
        self.trials = list(trials)
        if self.thread is not None:
            self.record()

    def record(self) -> None:
        for trial in self.trials:
            try:
                self.storage.record_heartbeat(trial._trial_id)
            except Exception as exc:  # a missed beat is retried at the next one
                log.warning("heartbeat of trial %d: %s", trial.number, exc)

    def beat(self) -> None:
        while not self.done.wait(self.interval):
            self.record()

    def stop(self) -> None:
        self.done.set()
