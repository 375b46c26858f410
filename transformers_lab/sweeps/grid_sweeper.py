"""The grid sweeper: Hydra's basic sweeper (every combination of the swept values),
whose ``glob()`` sees the user's config dirs.

Hydra's basic sweeper lists a group's options for ``attention=glob(*)`` from the config
dirs it started with, not from those a command line adds with
``hydra.searchpath=[file://DIR]``: ``sweep=attention_kernels`` with a user's dir ran
every built-in kernel and silently left the user's out. This sweeper asks with the
search path. It is the default (``conf/hydra/default.yaml``); a preset that overrides
``hydra/sweeper`` (``sweep=lr_optuna``) replaces it.

``hydra.sweeper.grow=N`` grows the grid past its edge: once the grid's jobs are done, each
choice whose best value of the summary's searched keys (``summary.best_over``, by default
the rate) is the lowest or highest the grid tried gets the next value past it, each of the
winning value's seeds, numbered on from the sweep's jobs (``report.edges``). Round after
round, until every best lies inside its grid or N rounds have run; the sweep says which.
Run into an old sweep's dir with ``skip_finished=true``, it grows that sweep: its finished
jobs are kept, and a next value that a round already ran is not run again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.object_type import ObjectType
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from transformers_lab.errors import ConfigError
from transformers_lab.run.record import say

BASIC = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


class SearchPathLoader:
    """A config loader whose group options include ``searchpath``'s dirs; everything else
    is the wrapped loader's."""

    def __init__(self, loader: Any, searchpath: list[str]) -> None:
        self.loader = loader
        self.searchpath = searchpath

    def get_group_options(
        self,
        group_name: str,
        results_filter: ObjectType | None = ObjectType.CONFIG,
        config_name: str | None = None,
        overrides: list[str] | None = None,
    ) -> list[str]:
        overrides = [*(overrides or []), f"hydra.searchpath=[{','.join(self.searchpath)}]"]
        return self.loader.get_group_options(group_name, results_filter, config_name, overrides)

    def __getattr__(self, name: str) -> Any:
        # only what this object lacks; an unpickled one (a joblib worker's) asks for its
        # own attributes before they are set, and must not ask the loader it has not got
        if name in ("loader", "searchpath") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.loader, name)


class GridSweeper(Sweeper):
    """Hydra's basic sweeper, with ``glob()`` over every config dir of the run. It holds
    the basic sweeper as Hydra's plugins loaded it (their module is their own copy, so a
    subclass of an imported one would not be theirs)."""

    def __init__(
        self, max_batch_size: int | None = None, params: Any = None, grow: int = 0
    ) -> None:
        if not isinstance(grow, int) or isinstance(grow, bool) or grow < 0:
            raise ConfigError(
                f"hydra.sweeper.grow must be the most rounds to grow the grid by, an integer "
                f">= 0, got {grow!r}; e.g. hydra.sweeper.grow=3"
            )
        basic = Plugins.instance().class_name_to_class[BASIC]
        self.basic = basic(max_batch_size=max_batch_size, params=params)
        self.grow = grow
        self.config: DictConfig | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        check_launcher_options(config.hydra.launcher)
        searchpath = [str(entry) for entry in config.hydra.searchpath]
        if searchpath:
            loader = SearchPathLoader(hydra_context.config_loader, searchpath)
            hydra_context = dataclasses.replace(hydra_context, config_loader=loader)
        self.basic.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.config = config
        # Hydra composes every job of a batch before launching it; so do its values get
        # checked, torch not imported: a mistake is refused before any job trains
        self.basic.validate_batch_is_legal = self.check_batch

    def check_batch(self, batch: Sequence[Sequence[str]]) -> None:
        """Compose each job of ``batch`` as its launcher will (its number, Hydra's config
        of it) and check its values (``run.values``)."""
        from hydra.core.hydra_config import HydraConfig

        from transformers_lab.run.values import check_values

        loader = self.basic.hydra_context.config_loader
        try:
            for number, overrides in enumerate(batch):
                cfg = loader.load_sweep_config(self.basic.config, list(overrides))
                with open_dict(cfg.hydra.job):
                    cfg.hydra.job.num, cfg.hydra.job.id = number, f"check_{number}"
                HydraConfig.instance().set_config(cfg)
                try:
                    check_values(cfg)
                except ConfigError as exc:
                    job = " ".join(overrides)
                    raise ConfigError(f"{exc} (job {number}: {job}); no job was run") from None
        finally:
            HydraConfig.instance().set_config(self.basic.config)

    def sweep(self, arguments: list[str]) -> Any:
        sweep_dir = Path(str(self.config.hydra.sweep.dir)) if self.config else None
        existed = sweep_dir is not None and sweep_dir.exists()
        try:
            returns = self.basic.sweep(arguments)
        except ConfigError:  # refused before a job ran: the new sweep dir goes too
            if sweep_dir is not None and not existed:
                (sweep_dir / "multirun.yaml").unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # kept where something else is in it
                    sweep_dir.rmdir()
            raise
        if self.grow:
            returns = [*returns, *self.grow_grid()]
        return returns

    def grow_grid(self) -> list[Any]:
        """Run the next value past each edge of the grid, round after round (``grow``)."""
        from transformers_lab.sweeps.report.cli import summary_settings
        from transformers_lab.sweeps.report.edges import find_edges, grow_jobs

        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        returns = []
        for round_ in range(self.grow + 1):
            runs, metric, mode, over = searched(
                sweep_dir, summary_settings(self.config.get("summary"))
            )
            if not over:
                say(
                    "grow: nothing to grow: the summary searches no key of this sweep "
                    "(summary.best_over); e.g. summary.best_over=[optimizer.lr]"
                )
                return returns
            edges = find_edges(runs, metric, mode, over)
            if not edges:
                say(
                    f"grow: every best {' and '.join(over)} lies inside its grid"
                    + (f" after {round_} round(s)" if round_ else "")
                )
                return returns
            jobs = grow_jobs(edges, runs)
            if round_ == self.grow or not jobs:
                still = "; ".join(map(str, edges))
                why = f"its bound of {self.grow} round(s)" if jobs else "no next value to run"
                say(f"grow: stopped at {why}; still on the edge: {still}")
                return returns
            number = next_job_number(sweep_dir)
            new = [g.overrides for g in jobs if g.rerun is None]
            again = [g for g in jobs if g.rerun is not None]
            say(
                f"grow: round {round_ + 1}, {len(jobs)} job(s) past the edge of "
                f"{len(edges)} choice(s): {len(new)} numbered from {number}"
                + (f", {len(again)} run again in their own dirs" if again else "")
            )
            for job in again:  # stopped midway: in its own dir, where it resumes
                assert job.rerun is not None
                returns.append(self.basic.launcher.launch([job.overrides], int(job.rerun.name)))
            if new:
                returns.append(self.basic.launcher.launch(new, initial_job_idx=number))
        return returns


def check_launcher_options(launcher: Any) -> None:
    """The launcher's own options, refused before it is built (building the joblib
    launcher imports Lightning, some 10 s) or asks a cluster: joblib's ``n_jobs``, SLURM's
    time limit and warning signal."""
    target = str(launcher.get("_target_", ""))
    if target.endswith("JoblibLauncher"):
        n_jobs = launcher.get("n_jobs")
        if n_jobs is not None and (
            not isinstance(n_jobs, int) or isinstance(n_jobs, bool) or n_jobs == 0
        ):
            raise ConfigError(
                f"hydra.launcher.n_jobs={n_jobs!r} runs no job: give how many jobs run at "
                "once, an integer >= 1 (-1: one a core), e.g. hydra.launcher.n_jobs=2"
            )
    elif target.endswith("SlurmLauncher"):
        from transformers_lab.sweeps.slurm_launcher import check_options

        check_options(launcher)


def searched(sweep_dir: Path, settings: dict[str, Any]) -> tuple[list[Any], str, str, list[str]]:
    """The sweep's runs, its metric and mode, and the keys its summary searches over."""
    from transformers_lab.sweeps.report.cli import default_best_over
    from transformers_lab.sweeps.report.collect import collect, pick_metric

    runs = collect(sweep_dir)
    metric, mode = pick_metric(runs, None)
    best = settings["best_over"]
    return runs, metric, mode, default_best_over(runs) if best is None else list(best)


def next_job_number(sweep_dir: Path) -> int:
    """The number after every job dir of the sweep."""
    numbers = [int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return max([-1, *numbers]) + 1
