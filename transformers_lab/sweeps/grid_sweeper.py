"""The grid sweeper: Hydra's basic sweeper (every combination of the swept values),
whose ``glob()`` sees the user's config dirs.

Hydra's basic sweeper lists a group's options for ``attention=glob(*)`` from the config
dirs it started with, not from those a command line adds with
``hydra.searchpath=[file://DIR]``: ``sweep=attention_kernels`` with a user's dir ran
every built-in kernel and silently left the user's out. This sweeper asks with the
search path. It is the default (``conf/hydra/default.yaml``); a preset that overrides
``hydra/sweeper`` (``sweep=lr_optuna``) replaces it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.core.object_type import ObjectType
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

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

    def __init__(self, max_batch_size: int | None = None, params: Any = None) -> None:
        basic = Plugins.instance().class_name_to_class[BASIC]
        self.basic = basic(max_batch_size=max_batch_size, params=params)

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        searchpath = [str(entry) for entry in config.hydra.searchpath]
        if searchpath:
            loader = SearchPathLoader(hydra_context.config_loader, searchpath)
            hydra_context = dataclasses.replace(hydra_context, config_loader=loader)
        self.basic.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        return self.basic.sweep(arguments)
