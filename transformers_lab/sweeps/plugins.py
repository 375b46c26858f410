"""The project's Hydra plugins (its sweepers and its joblib launcher), entered into Hydra's
plugin namespace at start-up, so that no separate package has to be installed."""

from __future__ import annotations

import sys

from hydra.core.plugins import Plugins

PLUGIN_PACKAGE = "hydra_plugins"


def register(cls: type, module: str) -> None:
    """Enter the plugin ``cls`` into Hydra's plugins as ``hydra_plugins.<module>.<name>``,
    the ``_target_`` its config gives (Hydra instantiates plugins only from that
    namespace), so that no separate package has to be installed."""
    plugins = Plugins.instance()
    path = f"{PLUGIN_PACKAGE}.{module}"
    if f"{path}.{cls.__name__}" not in plugins.class_name_to_class:
        original = sys.modules[cls.__module__]
        cls.__module__ = path
        sys.modules.setdefault(path, original)
        plugins.register(cls)


def register_plugins() -> None:
    """The grid sweeper (the default), the Optuna study sweeper and the joblib launcher,
    as their configs' ``_target_`` name them (``conf/hydra/sweeper/``,
    ``conf/hydra/launcher/``)."""
    from transformers_lab.sweeps.grid_sweeper import GridSweeper
    from transformers_lab.sweeps.joblib_launcher import JoblibLauncher
    from transformers_lab.sweeps.optuna_sweeper import StudySweeper

    register(GridSweeper, "tlab_grid_sweeper")
    register(StudySweeper, "tlab_optuna_sweeper")
    register(JoblibLauncher, "tlab_joblib_launcher")
