"""The configs: where they live, the resolvers they use, composing them from Python, and
instantiating a node with the error of its target rather than Hydra's wrapping of it.

The resolvers are registered on import; every entry point imports this module (through
``builders``)."""

from __future__ import annotations

import importlib
import math
import secrets
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from transformers_lab.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# the sections of a run's config that rebuild its model; stored in every checkpoint
MODEL_SECTIONS = ("model", "data", "task")


def optuna_direction(mode: str) -> str:
    """``${optuna_direction:${monitor.mode}}``: min/max as Optuna's minimize/maximize."""
    directions = {"min": "minimize", "max": "maximize"}
    if mode not in directions:
        raise ConfigError(f"monitor.mode must be min or max, got {mode!r}")
    return directions[mode]


def run_id() -> str:
    """``${run_id:}``: 6 random hex digits, drawn once per config (the resolver is cached),
    so two runs that start in the same microsecond still get different run dirs."""
    return secrets.token_hex(3)


def epoch_steps(epochs: int, examples: int, batch_size: int) -> int:
    """``${epoch_steps:64,${data.train_examples},${data.batch_size}}``: the optimizer steps
    of ``epochs`` epochs on one device (a schedule's horizon given in epochs, as Zoology's
    cosine over 64 epochs, when the run itself may be shorter)."""
    if min(epochs, examples, batch_size) < 1:
        raise ConfigError(
            f"epoch_steps needs positive epochs, examples and batch size, got {epochs}, "
            f"{examples} and {batch_size}"
        )
    return epochs * math.ceil(examples / batch_size)


OmegaConf.register_new_resolver("optuna_direction", optuna_direction, replace=True)
OmegaConf.register_new_resolver("epoch_steps", epoch_steps, replace=True)


OmegaConf.register_new_resolver("run_id", run_id, use_cache=True, replace=True)


def call(config: DictConfig, what: str, **kwargs: Any) -> Any:
    """``instantiate`` with the error of the target itself, not Hydra's wrapping of it."""
    try:
        return instantiate(config, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if str(exc).startswith("Error locating target"):  # an import path that is not there
            target = config.get("_target_") if isinstance(config, DictConfig) else None
            why = str(cause).strip().splitlines()[-1] if cause else ""  # Hydra's question
            raise ConfigError(
                f"{what}: cannot import its _target_ {target!r}: {why} Give the dotted path "
                "of a class or function that exists, its package importable"
            ) from exc
        if isinstance(cause, ImportError):  # an optional package the choice needs
            raise ConfigError(f"{what}: {cause}") from cause
        if isinstance(cause, MisconfigurationException):  # Lightning's own refusal
            raise ConfigError(f"{what}: Lightning refused it: {cause}") from cause
        if isinstance(cause, ValueError | TypeError | FileNotFoundError | RuntimeError):
            raise ConfigError(f"{what}: {cause}") from cause
        raise ConfigError(f"{what}: {exc}") from exc


def compose_config(name: str, overrides: list[str], output_dir: str | Path) -> DictConfig:
    """The config that ``tlab-<name> <overrides>`` would run, writing into ``output_dir``,
    for running the entry points from Python (benchmarks, notebooks, tests). Hydra's own
    interpolations (``${hydra:...}``) resolve as in a real run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    output_dir = Path(output_dir)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir)
        cfg.hydra.runtime.cwd = str(output_dir.parent)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    return cfg


def attention_configs() -> dict[str, dict[str, Any]]:
    """Every option of the ``attention`` group in ``conf/attention/``, composed (its
    defaults applied), as plain dicts with ``_target_``, by option name."""
    from hydra import compose, initialize_config_dir

    options = sorted(p.stem for p in (CONF_DIR / "attention").glob("*.yaml"))
    configs = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for name in options:
            cfg = compose("train", overrides=[f"attention={name}"])
            configs[name] = OmegaConf.to_container(cfg.attention, resolve=True)
    return configs


def target_class(config: DictConfig) -> type:
    """The class (or function) a config's ``_target_`` names."""
    module, _, name = str(config._target_).rpartition(".")
    return getattr(importlib.import_module(module), name)


def option(name: str) -> str:
    """The group option chosen for ``name`` in the running Hydra app, else ``name``."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return f"{name}={HydraConfig.get().runtime.choices.get(name, '?')}"
    return name


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of a nested plain config as ``{"model.attention.p": 2, ...}`` (lists are
    leaves, empty sections have none)."""
    if not isinstance(config, dict):
        return {prefix[:-1]: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def resolved_sections(config: DictConfig, keys: tuple[str, ...] = MODEL_SECTIONS) -> dict:
    """Plain, resolved copies of the config sections that rebuild a run's model."""
    return {k: OmegaConf.to_container(config[k], resolve=True) for k in keys if k in config}
