"""The project's Hydra plugins (its sweepers, its joblib and SLURM launchers), entered into Hydra's
plugin namespace at start-up, so that no separate package has to be installed.

What is entered is a stand-in per plugin, light to define: the plugin's module (Optuna,
Lightning and the run's code behind it) is imported when Hydra builds the plugin, in a
multirun, not at every start: a command line that Hydra refuses is refused before the
heavy imports (in about half a second instead of 6)."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper

PLUGIN_PACKAGE = "hydra_plugins"

# the name its config's _target_ gives (hydra_plugins.<module>.<class>) -> where it lives
PLUGINS = {
    "tlab_grid_sweeper.GridSweeper": (Sweeper, "transformers_lab.sweeps.grid_sweeper"),
    "tlab_optuna_sweeper.StudySweeper": (Sweeper, "transformers_lab.sweeps.optuna_sweeper"),
    "tlab_joblib_launcher.JoblibLauncher": (Launcher, "transformers_lab.sweeps.joblib_launcher"),
    "tlab_slurm_launcher.SlurmLauncher": (Launcher, "transformers_lab.sweeps.slurm_launcher"),
}


def stand_in(kind: type, module: str, name: str, path: str) -> type:
    """A concrete ``kind`` (Sweeper or Launcher) named ``<path>.<name>``, whose
    construction imports ``module`` and returns its class ``name`` built with the same
    arguments (Hydra builds a plugin by calling the class it registered)."""

    def build(cls: type, *args: Any, **kwargs: Any) -> Any:
        plugin = getattr(importlib.import_module(module), name)
        return plugin(*args, **kwargs)

    def never(self: Any, *args: Any, **kwargs: Any) -> Any:  # the built plugin's own run
        raise NotImplementedError(f"{name} stands in for {module}.{name}")

    abstract = {m: never for m in getattr(kind, "__abstractmethods__", ())}
    return type(name, (kind,), {"__new__": build, "__module__": path, **abstract})


def register_plugins() -> None:
    """The grid sweeper (the default), the Optuna study sweeper and the two launchers,
    as their configs' ``_target_`` name them (``conf/hydra/sweeper/``,
    ``conf/hydra/launcher/``), each a stand-in until Hydra builds it."""
    plugins = Plugins.instance()
    for target, (kind, module) in PLUGINS.items():
        path, name = f"{PLUGIN_PACKAGE}.{target}".rsplit(".", 1)
        if f"{path}.{name}" not in plugins.class_name_to_class:
            cls = stand_in(kind, module, name, path)
            # Hydra builds it from its name: hydra_plugins.<module> must import, to it
            sys.modules.setdefault(path, types.ModuleType(path)).__dict__[name] = cls
            plugins.register(cls)
