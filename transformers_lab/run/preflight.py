"""The preflight: a composed config checked before the data is read, so that a user's
mistake is caught at once, as one ``ConfigError`` line that says what was wrong and how
to fix it.

First, what needs no torch (``run.values``: ``RULES``, the summary's keys, the lengths),
which each entry point has checked before importing torch. Then the run is built as it
will be, before any data is read (``run.components.build_on_meta``: the
data module constructed, the model and task on the meta device, with stand-ins for the
sizes the data gives): their own constructors refuse what cannot work, in their words;
nothing here re-states their rules. ``RULES`` holds what no constructor
owns (the trainer's, the optimizer's, the entry points' own keys); a key that the config
does not have (another model, another entry point) is skipped. The values a node gives
one of our classes must have the types its constructor declares (``check_signature``).
The checks that need the data (sizes, vocabularies, whether model and data fit together)
run when the model is sized from it (``run.components.model_kwargs``), and those of a
checkpoint's contents when it is loaded. Before all of it, the entry point has followed
a ``_target_`` of an earlier version to its new home (``config.migrate_targets``).
"""

from __future__ import annotations

import difflib
import inspect
import logging
from typing import Any, get_type_hints

import torch
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig

from transformers_lab.config import instantiation_refusals, unknown_option
from transformers_lab.errors import ConfigError
from transformers_lab.run import budget
from transformers_lab.run.components import build_on_meta
from transformers_lab.run.distributed import one_process_refusal
from transformers_lab.run.values import (
    ABSENT,
    Expect,
    LengthOptions,
    check_values,
    in_words,
    misfit,
    shown,
)
from transformers_lab.tasks.schedules import RULES as SCHEDULE_RULES

log = logging.getLogger(__name__)


def available_device(name: Any) -> bool:
    """A device that torch knows and this machine has."""
    try:
        torch.empty(0, device=name)
    except (RuntimeError, TypeError, AssertionError):  # unknown, or not built with it
        return False
    return True


DEVICE = Expect(available_device, "cpu or a GPU this machine has (cuda, cuda:1, mps)")


def check_device(cfg: DictConfig) -> None:
    """``device`` (tlab-sample, tlab-translate) is one this machine has: the one rule of
    ``RULES``' kind that needs torch."""
    value = cfg.get("device", ABSENT)
    if value is not ABSENT and not DEVICE.test(value):
        raise ConfigError(f"device must be {DEVICE.text}, got {shown(value)}")


SHARDED = "transformers_lab.run.distributed.Sharded"  # trainer=fsdp's strategy

# the torch devices each of Lightning's GPU accelerators runs on
GPU_ACCELERATORS = {"gpu": ("cuda", "mps"), "cuda": ("cuda",), "mps": ("mps",)}


def check_accelerator(trainer: Any) -> None:
    """A GPU accelerator (``trainer=gpu``, ``fsdp``) needs a GPU this machine has; without
    one, the error names the CPU preset (Lightning would say only that it found no GPU
    backend, after the data and the model were built)."""
    accelerator = str(trainer.get("accelerator"))
    devices = GPU_ACCELERATORS.get(accelerator, ())
    if devices and not any(map(available_device, devices)):
        raise ConfigError(
            f"trainer.accelerator={accelerator} needs a GPU, and torch finds none on this "
            f"machine ({' or '.join(devices)}); use trainer=cpu to train on the CPU, or run "
            "where a GPU is"
        )


def check_sharding(trainer: Any) -> None:
    """FSDP (``run.distributed.Sharded``) is built once, its constructor refusing its
    settings, and shards over two processes or more."""
    strategy = trainer.get("strategy")
    target = strategy.get("_target_") if isinstance(strategy, DictConfig) else None
    if target != SHARDED:
        return
    with instantiation_refusals("trainer.strategy"):
        instantiate(strategy)
    world = budget.processes(trainer)
    if world is not None and (why := one_process_refusal(world)) is not None:
        raise ConfigError(why)


def check_schedule(scheduler: Any) -> None:
    """A schedule of ours held to its own rule (``tasks.schedules.RULES``) before the data
    is read: it is built only once the run's optimizer is."""
    if not isinstance(scheduler, DictConfig) or "_target_" not in scheduler:
        return
    try:
        rule = SCHEDULE_RULES.get(get_object(str(scheduler._target_)))
    except Exception:  # not importable: the task's build says so, in one line
        return
    if rule is None:
        return
    keys = inspect.signature(rule).parameters
    try:
        rule(**{k: scheduler[k] for k in keys if k in scheduler})
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"scheduler.{exc}") from None


OUR_CALLBACKS = "transformers_lab.run.callbacks."  # built here: constructors that read nothing


def check_components(cfg: DictConfig) -> None:
    """Every logger and callback entry names a class to build (``_target_``); this
    package's own callbacks are built once, so that their constructors refuse a setting
    (the throughput's hardware) before the data is read."""
    for group in ("logger", "callbacks"):
        for name, node in (cfg.get(group) or {}).items():
            if node is not None and not (isinstance(node, DictConfig) and "_target_" in node):
                raise unknown_option(group, name)
    for name, node in (cfg.get("callbacks") or {}).items():
        if node is not None and str(node._target_).startswith(OUR_CALLBACKS):
            with instantiation_refusals(f"callbacks.{name}"):
                instantiate(node)


# ---------------------------------------------------------------- from the signatures


def node_class(node: Any) -> Any:
    """The class (or function) of ours a config node builds, or None: not a node with a
    ``_target_`` of ``transformers_lab``, or not importable (the build will say)."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return None
    if not str(node._target_).startswith("transformers_lab."):
        return None
    try:
        return get_object(str(node._target_))
    except Exception:
        return None


def check_signature(section: str, node: Any, cls: Any) -> None:
    """The values a config node gives its own class ``cls`` (``node_class``) have the
    types its constructor declares: ``model.bias=yes`` is refused here rather than taken
    as true. Limits are ``RULES``' and the constructors' own."""
    try:
        hints: dict[str, Any] = {}
        # a class's own hints first, then those of the classes it passes its options to
        for owner in reversed(cls.__mro__ if isinstance(cls, type) else (cls,)):
            hints |= get_type_hints(owner.__init__ if isinstance(cls, type) else owner)
    except Exception:  # unresolvable hints
        return
    for key, value in node.items():
        if key in ("_target_", "_partial_") or value is None:
            continue  # null: the default, or the data's value (model.block_size: null)
        if (parts := misfit(hints.get(str(key)), value)) is not None:
            expected = in_words(parts)
            raise ConfigError(
                f"{section}.{key} must be {expected} ({cls.__name__} takes {key}: "
                f"{' | '.join('None' if p is type(None) else p.__name__ for p in parts)}), "
                f"got {shown(value)}"
            )


def check_keys(section: str, node: Any, cls: Any) -> None:
    """A config node gives its own class ``cls`` (``node_class``) only options its
    constructor takes: ``+model.hybrid=...`` on the Transformer is refused with the
    options it has, not met as Python's ``unexpected keyword argument``."""
    params = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for key in node:
        if str(key).startswith("_") or key in params:
            continue
        close = difflib.get_close_matches(str(key), list(params), n=1)
        meant = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"{section}.{key}: {cls.__name__} takes no {key}{meant}; remove it, or choose a "
            f"{section} that takes it"
        )


def check_config(cfg: DictConfig) -> LengthOptions | None:
    """Refuse a composed config of an entry point that cannot work (raises ``ConfigError``);
    returns its evaluation past the trained length, parsed (``length_options``; None:
    none asked). The entry point has followed a ``_target_`` of an earlier version to its
    new home first (``config.migrate_targets``)."""
    options = check_values(cfg)  # what needs no torch: the entry points checked it first
    check_device(cfg)
    for section in ("model", "data", "task"):
        node = cfg.get(section)
        if (cls := node_class(node)) is not None:
            check_keys(section, node, cls)
            check_signature(section, node, cls)
        for key in ("attention", "cross_attention") if section == "model" and node else ():
            if (kernel := node_class(node.get(key))) is not None:
                check_signature(f"model.{key}", node.get(key), kernel)
    check_components(cfg)
    check_schedule(cfg.get("scheduler"))
    trainer = cfg.get("trainer") or {}
    check_accelerator(trainer)
    check_sharding(trainer)
    budget.plan_of(cfg)  # a budget in tokens that cannot be met
    if trainer.get("max_epochs") == -1 and trainer.get("max_steps") == -1:
        raise ConfigError("trainer.max_epochs=-1 with trainer.max_steps=-1 never stops; set one")
    stopper = (cfg.get("callbacks") or {}).get("early_stopping")
    if trainer.get("limit_val_batches") == 0 and stopper and "val/" in str(stopper.get("monitor")):
        raise ConfigError(
            f"trainer.limit_val_batches=0 runs no validation, but callbacks.early_stopping "
            f"watches {stopper.get('monitor')}: validate (limit_val_batches > 0) or switch "
            f"early stopping off (callbacks.early_stopping=null)"
        )
    lengths, depths = (options.lengths, options.depths) if options else ((), None)
    # the constructors' own refusals, before the data is read; at each length to score
    build_on_meta(cfg, lengths, depths)
    return options
