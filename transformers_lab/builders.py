"""From a composed config to Lightning objects: data, model, task, callbacks, loggers.

The data flows one way: the data module is built first and tells the model what it
needs (``model_kwargs()``: vocabulary, context, image geometry); the model is built with
the kernel factory; the task wraps the model; the trainer gets callbacks and loggers.
Whatever is wrong with the combination is reported here as a ``ConfigError``: one line
that names the fix.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ProgressBar
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# the sections of a run's config that rebuild its model; stored in every checkpoint
MODEL_SECTIONS = ("model", "data", "task")


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""


def override_key(override: str) -> str:
    """The key a command-line override sets: ``+trainer.x=1`` -> ``trainer.x``."""
    return override.split("=", 1)[0].lstrip("+~")


# resolvers the configs use (registered on import: every entry point imports this module)


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


OmegaConf.register_new_resolver("optuna_direction", optuna_direction, replace=True)
OmegaConf.register_new_resolver("run_id", run_id, use_cache=True, replace=True)


def call(config: DictConfig, what: str, **kwargs: Any) -> Any:
    """``instantiate`` with the error of the target itself, not Hydra's wrapping of it."""
    try:
        return instantiate(config, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
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


def build_datamodule(config: DictConfig) -> L.LightningDataModule:
    return call(config, "data")


def option(name: str) -> str:
    """The group option chosen for ``name`` in the running Hydra app, else ``name``."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return f"{name}={HydraConfig.get().runtime.choices.get(name, '?')}"
    return name


def data_compatible_models(provided: set[str]) -> list[str]:
    """The model options in ``conf/model`` whose class takes every key in ``provided``."""
    names = []
    for path in sorted(CONF_DIR.glob("model/*.yaml")):
        try:
            params = inspect.signature(target_class(OmegaConf.load(path))).parameters
        except (AttributeError, ImportError, ValueError):  # pragma: no cover - broken file
            continue
        if provided <= set(params):
            names.append(path.stem)
    return names


# data keys where the model may hold more than the data needs (spare positions or ids)
AT_LEAST = {"block_size", "max_len", "vocab_size", "src_vocab_size", "tgt_vocab_size"}


def model_kwargs(config: DictConfig, datamodule: Any) -> dict[str, Any]:
    """The data module's ``model_kwargs()`` merged into the model config.

    A key the model config leaves null comes from the data. A key set in both must agree:
    positions and vocabulary may be larger in the model (``block_size``, ``max_len``,
    vocab sizes), everything else (image size, classes, special ids) must be equal. A key
    the model class does not take means the model and the data do not fit together.
    """
    provided = dict(datamodule.model_kwargs()) if hasattr(datamodule, "model_kwargs") else {}
    cls = target_class(config)
    params = inspect.signature(cls).parameters
    unknown = sorted(set(provided) - set(params))
    if unknown:
        fits = data_compatible_models(set(provided))
        hint = f"use model={' or model='.join(fits)}" if fits else "pick another model"
        raise ConfigError(
            f"{option('model')} ({cls.__name__}) cannot take {option('data')}: the data "
            f"provides {', '.join(provided)} but {cls.__name__} has no "
            f"{', '.join(unknown)}; {hint}, or choose data that {cls.__name__} takes"
        )
    merged = {}
    for key, value in provided.items():
        mine = config.get(key)
        if mine is None:
            merged[key] = value
        elif key in AT_LEAST and mine < value:
            raise ConfigError(
                f"model.{key}={mine} is smaller than the data's {key}={value}: the model "
                f"would meet {'positions' if key in ('block_size', 'max_len') else 'ids'} it "
                f"has no embedding for; set model.{key}={value} (or null to take the data's) "
                f"or make the data smaller"
            )
        elif key not in AT_LEAST and mine != value:
            raise ConfigError(
                f"model.{key}={mine} does not match the data's {key}={value}; set "
                f"model.{key}=null to take it from the data"
            )
    return merged


def build_model(config: DictConfig, datamodule: Any) -> torch.nn.Module:
    """The model of ``config`` sized for ``datamodule``."""
    return call(config, "model", **model_kwargs(config, datamodule))


def compile_model(model: torch.nn.Module) -> str | None:
    """``torch.compile`` the model in place (its state dict keeps its keys); a part that
    fails to compile later runs eagerly (dynamo's ``suppress_errors``). Returns None, or
    why the compiler cannot run here (the model is left as it was)."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(2))
    except Exception as exc:  # no C++ compiler, an unsupported platform or Python
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    torch._dynamo.config.suppress_errors = True
    model.compile()
    return None


def build_task(config: DictConfig, model: torch.nn.Module, datamodule: Any = None) -> Any:
    """The LightningModule of ``config`` around ``model``; a data module with a ``decode``
    (ids -> text) lets the task log samples."""
    task = call(config, "task", model=model)
    decode = getattr(datamodule, "decode", None)
    if decode is not None and hasattr(task, "decode"):
        task.decode = decode
    return task


def build_callbacks(
    config: DictConfig | None, with_logger: bool = True, progress_bar: bool = True
) -> list[Callback]:
    """The callbacks of the ``callbacks`` group (null entries are switched off); the
    learning-rate monitor is left out without a logger, the bar when the trainer has none."""
    callbacks = []
    for name, node in (config or {}).items():
        if node is None:
            continue
        callback = call(node, f"callbacks.{name}")
        if isinstance(callback, LearningRateMonitor) and not with_logger:
            log.info("no logger: the learning-rate monitor is left out")
        elif not (isinstance(callback, ProgressBar) and not progress_bar):
            callbacks.append(callback)
    return callbacks


def build_loggers(config: DictConfig | None) -> list[Logger]:
    """The loggers of the ``logger`` group (null entries are switched off)."""
    return [
        call(node, f"logger.{name}") for name, node in (config or {}).items() if node is not None
    ]


# what a user should give where a checkpoint is asked for
GIVE_CHECKPOINT = "give ckpt_path=<run dir>/checkpoints/last.ckpt (or best) of a tlab-train run"


def checkpoint_file(path: str | Path) -> Path:
    """``path`` if a file is there, else a ``ConfigError`` that says what to give."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {path}; {GIVE_CHECKPOINT}")
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint as a dict, with a clear error when the file is not there or
    is not a checkpoint."""
    path = checkpoint_file(path)
    try:  # our checkpoints hold configs and tokenizer tables besides tensors
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch.load fails in many ways on a file that is no checkpoint
        raise ConfigError(f"{path} is not a checkpoint ({exc}); {GIVE_CHECKPOINT}") from exc
    if not isinstance(checkpoint, dict):
        raise ConfigError(
            f"{path} is not a checkpoint (it holds a {type(checkpoint).__name__}); "
            f"{GIVE_CHECKPOINT}"
        )
    return checkpoint


def checkpoint_step(path: str | Path) -> int | None:
    """The training step a checkpoint was saved at, or None if it cannot be read (the
    file is memory-mapped: its tensors are not read)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        return int(checkpoint["global_step"])
    except Exception:  # gone, or not a Lightning checkpoint: the caller falls back
        return None


ABSENT = "(absent)"


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of a nested plain config as ``{"model.attention.p": 2, ...}`` (lists are
    leaves, empty sections have none)."""
    if not isinstance(config, dict):
        return {prefix[:-1]: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def differences(saved: Any, current: Any, allowed: Sequence[str] = ()) -> list[str]:
    """``key: old -> new`` for every dotted key where two plain configs differ, a key that
    one of them lacks shown as ``(absent)``; keys in ``allowed`` (or under them) are left
    out, and a node whose ``_target_`` differs is named by that key alone."""
    old, new = flatten(saved), flatten(current)
    # a node whose class changed is named by its _target_ alone, not by all its options
    swapped = [
        key[: -len("_target_")]
        for key in set(old) & set(new)
        if key.rsplit(".", 1)[-1] == "_target_" and old[key] != new[key]
    ]
    out = []
    for key in sorted(set(old) | set(new)):
        if any(key == a or key.startswith(f"{a}.") for a in allowed):
            continue
        if any(key.startswith(node) and not key.endswith("_target_") for node in swapped):
            continue
        before, after = old.get(key, ABSENT), new.get(key, ABSENT)
        if before != after:
            out.append(f"{key}: {shown(before)} -> {shown(after)}")
    return out


def shown(value: Any) -> str:
    return value if value is ABSENT else repr(value)


def check_checkpoint(
    checkpoint: dict[str, Any], module: torch.nn.Module, path: Any, config: dict | None = None
) -> None:
    """Refuse, in one line, a checkpoint whose weights do not fit ``module``; ``config``
    (the sections of ``resolved_sections``) names the options that differ from the
    checkpoint's own."""
    own = module.state_dict()
    saved = checkpoint.get("state_dict", {})
    mismatched = [
        key
        for key in sorted(set(own) | set(saved))
        if key not in own or key not in saved or own[key].shape != saved[key].shape
    ]
    if not mismatched:
        return
    changed = []
    if config is not None and checkpoint.get("tlab_config"):
        changed = differences(checkpoint["tlab_config"], config, RESUME_MAY_CHANGE)
    what = "; ".join(changed) if changed else f"{len(mismatched)} tensors ({mismatched[0]})"
    raise ConfigError(
        f"checkpoint {path} was saved from a different model config ({what}); use the "
        f"model options it was trained with, or drop ckpt_path to start afresh"
    )


# Keys of the saved sections (model, data, task) that a resumed run may change: where the
# data lives and how it is read, and how often samples are logged. Every other key of
# those sections must be as the checkpoint says; keys outside them (the trainer's limits,
# loggers, callbacks, paths, seed) may change. ``resume_may_change=[key, ...]`` adds keys.
RESUME_MAY_CHANGE = (
    "data.root",
    "data.download",
    "data.bpe_file",
    "data.num_workers",
    "task.sample_every",
    "task.sample_tokens",
)


def check_resume(
    checkpoint: dict[str, Any], config: dict, path: Any, may_change: Sequence[str] = ()
) -> None:
    """Refuse to resume ``checkpoint`` into a run whose model, data or task config (the
    kernel's class and options included) differs from the one it was trained with; the
    one-line error names each key with its old and new value."""
    saved = checkpoint.get("tlab_config")
    if not saved:  # not written by tlab-train: only the tensor shapes can be checked
        return
    changed = differences(
        {k: saved.get(k, {}) for k in config}, config, (*RESUME_MAY_CHANGE, *may_change)
    )
    if not changed:
        return
    overrides = Path(path).resolve().parent.parent / ".hydra" / "overrides.yaml"
    given = ""
    if overrides.is_file():
        kept = [str(o) for o in OmegaConf.load(overrides) if override_key(str(o)) != "ckpt_path"]
        given = " ".join(kept)
        given = f" (it was trained with: tlab-train {given})" if given else ""
    raise ConfigError(
        f"checkpoint {path} was trained with another config: {'; '.join(changed)}; resume "
        f"with the options it was trained with{given}, list a key in "
        f"resume_may_change=[...] to change it on purpose, or drop ckpt_path to start afresh"
    )


def resolved_sections(config: DictConfig, keys: tuple[str, ...] = MODEL_SECTIONS) -> dict:
    """Plain, resolved copies of the config sections that rebuild a run's model."""
    return {k: OmegaConf.to_container(config[k], resolve=True) for k in keys if k in config}


def metrics_dict(metrics: dict[str, Any]) -> dict[str, float]:
    """Tensor metrics as plain floats, sorted by name."""
    return {k: float(v) for k, v in sorted(metrics.items())}
