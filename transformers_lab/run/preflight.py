"""The preflight: a composed config checked before the data is read, so that a user's
mistake is caught at once, as one ``ConfigError`` line that says what was wrong and how
to fix it.

The run is built as it will be, before any data is read (``run.components.build_on_meta``: the
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

import dataclasses
import difflib
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import torch
from hydra.utils import get_object, instantiate
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT, _PRECISION_INPUT_STR
from omegaconf import DictConfig, OmegaConf

from transformers_lab.config import CONF_DIR, instantiation_refusals, unknown_option
from transformers_lab.errors import ConfigError
from transformers_lab.run import budget
from transformers_lab.run.components import build_on_meta
from transformers_lab.run.distributed import one_process_refusal
from transformers_lab.run.lengths import LengthOptions, length_options
from transformers_lab.tasks.schedules import RULES as SCHEDULE_RULES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Expect:
    """What a config value must be: a test, and the words for it in the error."""

    test: Callable[[Any], bool]
    text: str

    def __or__(self, other: Expect) -> Expect:
        return Expect(lambda v: self.test(v) or other.test(v), f"{self.text} or {other.text}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def one_of(*choices: Any) -> Expect:
    return Expect(lambda v: v in choices, f"one of {', '.join(map(str, choices))}")


def available_device(name: Any) -> bool:
    """A device that torch knows and this machine has."""
    try:
        torch.empty(0, device=name)
    except (RuntimeError, TypeError, AssertionError):  # unknown, or not built with it
        return False
    return True


NULL = Expect(lambda v: v is None, "null")
NO_LIMIT = Expect(lambda v: v == -1, "-1 (no limit)")
POSITIVE_INT = Expect(lambda v: is_int(v) and v >= 1, "an integer >= 1")
COUNT = Expect(lambda v: is_int(v) and v >= 0, "an integer >= 0")
POSITIVE = Expect(lambda v: is_number(v) and v > 0, "a number > 0")
NON_NEGATIVE = Expect(lambda v: is_number(v) and v >= 0, "a number >= 0")
PROBABILITY = Expect(lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)")
BOOL = Expect(lambda v: isinstance(v, bool), "true or false")
BETAS = Expect(
    lambda v: isinstance(v, Sequence) and len(v) == 2 and all(map(PROBABILITY.test, v)),
    "two numbers in [0, 1)",
)
BATCHES = NULL | Expect(lambda v: isinstance(v, float) and 0 <= v <= 1, "a fraction in [0, 1]")
INTERVAL = NULL | Expect(lambda v: isinstance(v, float) and 0 < v <= 1, "a fraction in (0, 1]")
# Lightning's names, and the aliases it still takes (16, 32, 64, "bf16", ...)
PRECISIONS = [value for literal in get_args(_PRECISION_INPUT) for value in get_args(literal)]
PRECISION = Expect(lambda v: v in PRECISIONS, f"one of {', '.join(get_args(_PRECISION_INPUT_STR))}")
DEVICE = Expect(available_device, "cpu or a GPU this machine has (cuda, cuda:1, mps)")

# the keys no constructor of ours owns: the entry points' own, torch's optimizer's and
# Lightning's trainer's (a key of the model, data, task or schedule is its constructor's)
RULES: dict[str, Expect] = {
    # the entry points
    "seed": COUNT,
    "cpu_threads": NULL | POSITIVE_INT,
    "keep_freed_memory": BOOL,
    "compile": BOOL,
    "monitor.mode": one_of("min", "max"),
    "optimizer.lr": POSITIVE,
    "optimizer.weight_decay": NON_NEGATIVE,
    "optimizer.momentum": NON_NEGATIVE,
    "optimizer.eps": NON_NEGATIVE,
    "optimizer.betas": BETAS,
    # the trainer (tlab-train, tlab-eval)
    "trainer.max_epochs": NULL | NO_LIMIT | POSITIVE_INT,
    "trainer.min_epochs": NULL | COUNT,
    "trainer.max_steps": NO_LIMIT | POSITIVE_INT,
    "trainer.num_nodes": POSITIVE_INT,
    "trainer.precision": PRECISION,
    "trainer.gradient_clip_val": NULL | NON_NEGATIVE,
    "trainer.accumulate_grad_batches": POSITIVE_INT,
    "trainer.check_val_every_n_epoch": NULL | POSITIVE_INT,
    "trainer.val_check_interval": INTERVAL | POSITIVE_INT,
    "trainer.limit_train_batches": BATCHES | COUNT,
    "trainer.limit_val_batches": BATCHES | COUNT,
    "trainer.limit_test_batches": BATCHES | COUNT,
    "trainer.log_every_n_steps": POSITIVE_INT,
    "trainer.num_sanity_val_steps": NO_LIMIT | COUNT,
    # tlab-sample, tlab-translate
    "device": DEVICE,
}

ABSENT = object()


def shown(value: Any) -> str:
    """A value as it is written in a config or on the command line."""
    return "null" if value is None else repr(value)


def check_rules(cfg: DictConfig) -> None:
    """Every key of ``RULES`` that ``cfg`` has holds what the rule expects."""
    for key, expect in RULES.items():
        value = OmegaConf.select(cfg, key, default=ABSENT)
        if value is not ABSENT and not expect.test(value):
            raise ConfigError(f"{key} must be {expect.text}, got {shown(value)}")


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


def check_missing(cfg: DictConfig) -> None:
    """No mandatory value (``???``) is left unset."""
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra."))
    if missing:
        raise ConfigError(f"{missing[0]} is required: give {missing[0]}=... on the command line")


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

SIMPLE = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def accepts(kind: Any, value: Any) -> bool:
    """Whether ``value`` (from a config) fits an annotation made of int, float, bool,
    str and None; an annotation of any other kind accepts anything."""
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return is_int(value)
    if kind is float:
        return is_number(value)
    if kind is str:
        return isinstance(value, str)
    return True


def simple_parts(annotation: Any) -> list[Any] | None:
    """The parts of ``int | None``-like annotations, or None for any other kind."""
    parts = (
        list(get_args(annotation)) if get_origin(annotation) in (Union, UnionType) else [annotation]
    )
    return parts if all(p in SIMPLE or p is type(None) for p in parts) else None


def in_words(parts: list[Any]) -> str:
    """An annotation's simple parts as a config's words: ``an integer or null``."""
    return " or ".join("null" if p is type(None) else SIMPLE[p] for p in parts)


def misfit(annotation: Any, value: Any) -> list[Any] | None:
    """The simple parts of ``annotation`` (``int | None``) when ``value`` fits none of
    them; None where it fits one, or the annotation is of another kind."""
    parts = simple_parts(annotation)
    return parts if parts is not None and not any(accepts(k, value) for k in parts) else None


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


def typed_options(cls: type, cfg: DictConfig) -> Any:
    """The dataclass ``cls`` of an entry point's options (``sample.SampleOptions``) from
    the keys of ``cfg`` its fields name: each value of the type its field declares, then
    the ranges its own ``__post_init__`` refuses, as one ``ConfigError`` line."""
    hints = get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        value = cfg.get(f.name, ABSENT)
        if value is ABSENT:
            continue
        if (parts := misfit(hints[f.name], value)) is not None:
            raise ConfigError(f"{f.name} must be {in_words(parts)}, got {shown(value)}")
        values[f.name] = OmegaConf.to_object(value) if OmegaConf.is_config(value) else value
    try:
        return cls(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


EXAMPLES = {"best_over": "[optimizer.lr]", "mean_over": "[data]"}


def config_groups() -> set[str]:
    """The config groups a run may choose from: the package's, and those Hydra composed
    this run from (a user's config dir's too)."""
    from hydra.core.hydra_config import HydraConfig

    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    if HydraConfig.initialized():
        groups |= {str(g) for g in HydraConfig.get().runtime.choices}
    return groups


def nearest_key(cfg: DictConfig, key: str) -> str | None:
    """The key of ``cfg`` that a misspelt dotted ``key`` most likely meant: each part that
    is no key of its node replaced by the nearest one there (None where none is near)."""
    node, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        if part not in node:
            near = difflib.get_close_matches(part, [str(k) for k in node], n=1)
            if not near:
                return None
            parts[i] = near[0]
        node = node.get(parts[i])
    return ".".join(parts)


def check_summary_keys(cfg: DictConfig) -> None:
    """The keys a sweep's summary searches or averages over (``summary.best_over``,
    ``summary.mean_over``) are keys of the config: a misspelt one was ignored, and the
    summary kept every rate without a word, after the whole sweep had run."""
    summary = cfg.get("summary") or {}
    groups = config_groups()
    for option in ("best_over", "mean_over"):
        for key in summary.get(option) or ():
            if str(key) in groups:  # a group's choice (experiment=, mqar_size=)
                continue
            if OmegaConf.select(cfg, str(key).lstrip("+"), default=ABSENT) is not ABSENT:
                continue
            close = nearest_key(cfg, str(key).lstrip("+"))
            meant = f" (did you mean {close}?)" if close else ""
            raise ConfigError(
                f"summary.{option}: {key} is no key of the config{meant}; name a swept "
                f"setting, e.g. summary.{option}={EXAMPLES[option]}"
            )


def check_config(cfg: DictConfig) -> LengthOptions | None:
    """Refuse a composed config of an entry point that cannot work (raises ``ConfigError``);
    returns its evaluation past the trained length, parsed (``length_options``; None:
    none asked). The entry point has followed a ``_target_`` of an earlier version to its
    new home first (``config.migrate_targets``)."""
    check_missing(cfg)
    check_rules(cfg)
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
    check_summary_keys(cfg)
    options = length_options(cfg)
    lengths, depths = (options.lengths, options.depths) if options else ((), None)
    # the constructors' own refusals, before the data is read; at each length to score
    build_on_meta(cfg, lengths, depths)
    return options
