"""The values of a composed config that can be checked before torch or Lightning is
imported: the keys that no constructor of ours owns (``RULES``: the entry points' own,
the optimizer's, the trainer's), a mandatory value left unset, a checkpoint path with
nothing there, the summary's keys, the lengths to score past the trained one, and the
launcher of a single run. An entry point checks them first (``check_values``), in about a
second; the preflight (``run.preflight``) then builds the run on the meta device, and its
constructors refuse what they own.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, NamedTuple, Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf

from transformers_lab.config import CONF_DIR
from transformers_lab.errors import ConfigError, no_checkpoint


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
# Lightning's names of a precision (its ``_PRECISION_INPUT_STR``), and the aliases it
# still takes (its ``_PRECISION_INPUT``): written out, so that this module imports no
# Lightning (tests/run/test_preflight.py holds them to Lightning's)
PRECISION_NAMES = (
    "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true",
    "bf16-mixed", "32-true", "64-true",
)  # fmt: skip
PRECISIONS = [64, 32, 16, *PRECISION_NAMES, "64", "32", "16", "bf16"]
PRECISION = Expect(lambda v: v in PRECISIONS, f"one of {', '.join(PRECISION_NAMES)}")

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


def check_missing(cfg: DictConfig) -> None:
    """No mandatory value (``???``) is left unset (Hydra's own node aside: a sweep's job is
    checked before its launcher fills it in)."""
    if "hydra" in cfg:
        cfg = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]} is required: give {missing[0]}=... on the command line")


def check_checkpoint_path(cfg: DictConfig) -> None:
    """A ``ckpt_path`` given names a file or a sharded checkpoint's folder (its contents
    are read, safely, once torch is imported: ``run.checkpoints``)."""
    path = OmegaConf.select(cfg, "ckpt_path", default=None)
    if isinstance(path, str) and not Path(path).exists():
        raise no_checkpoint(path)


LENGTH_KEYS = ("eval_lengths", "eval_depths", "loss_by_position")


class LengthOptions(NamedTuple):
    """What a run or ``tlab-eval`` scores past the trained length, parsed once
    (``length_options``): the lengths, the needle depths at each, and the buckets of the
    loss by position (None: not asked)."""

    lengths: list[int]
    depths: list[float] | None = None
    buckets: int | None = None


def length_options(cfg: DictConfig) -> LengthOptions | None:
    """``eval_lengths``, ``eval_depths`` and ``loss_by_position`` of ``cfg`` checked and
    parsed (None where none is given), else one line that says what to give."""
    given = [key for key in LENGTH_KEYS if cfg.get(key) is not None]
    if not given:
        return None
    if cfg.get("eval_lengths") is None:
        raise ConfigError(
            f"{given[0]} needs eval_lengths, the lengths to score at, e.g. eval_lengths=[256,512]"
        )
    depths = check_depths(cfg.eval_depths) if cfg.get("eval_depths") is not None else None
    buckets = cfg.get("loss_by_position")
    if buckets is not None and not (isinstance(buckets, int) and buckets >= 1):
        raise ConfigError(f"loss_by_position={buckets!r}: give a number of buckets >= 1, e.g. 16")
    return LengthOptions(check_lengths(cfg.eval_lengths), depths, buckets)


def is_list(value: Any) -> bool:
    """A list from the command line (a ListConfig) or from Python."""
    return OmegaConf.is_list(value) or isinstance(value, list | tuple)


def listed(words: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, (", ".join(words[:-1]), *words[-1:])))


def check_lengths(lengths: Any, key: str = "eval_lengths") -> list[int]:
    """``lengths`` as a list of positive ints, else one line that says what to give (every
    value that is not one)."""
    if not is_list(lengths):
        raise ConfigError(
            f"{key}={shown(lengths)} is not a list: write the lengths in brackets, e.g. "
            f"{key}=[{lengths if is_int(lengths) else 256}] or {key}=[64,128,256,512]"
        )
    values = list(lengths)
    wrong = [n for n in values if not (is_int(n) and n >= 1)]
    if not values or wrong:
        named = listed([shown(n) for n in wrong]) or "nothing"
        raise ConfigError(
            f"{key}: each length must be an integer >= 1; {named} "
            f"{'is' if len(wrong) < 2 else 'are'} not, e.g. {key}=[64,128,256,512]"
        )
    return values


def check_depths(depths: Any) -> list[float]:
    """``eval_depths`` as a list of numbers in [0, 1], else one line (every value that is
    not one)."""
    if not is_list(depths):
        raise ConfigError(
            f"eval_depths={shown(depths)} is not a list: write the depths in brackets, e.g. "
            f"eval_depths=[{depths if is_number(depths) else 0.5}] or "
            "eval_depths=[0,0.25,0.5,0.75,1]"
        )
    values = list(depths)
    wrong = [d for d in values if not (is_number(d) and 0 <= d <= 1)]
    if not values or wrong:
        named = listed([shown(d) for d in wrong]) or "nothing"
        raise ConfigError(
            f"eval_depths: each depth must be a number in [0, 1] (0: the haystack's start, "
            f"1: its end); {named} {'is' if len(wrong) < 2 else 'are'} not, e.g. "
            "eval_depths=[0,0.25,0.5,0.75,1]"
        )
    return [float(d) for d in values]


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
    ``summary.mean_over``) are a list of keys of the config: a misspelt one was ignored,
    and the summary kept every rate without a word, after the whole sweep had run; one
    key given as a string was read letter by letter."""
    summary = cfg.get("summary") or {}
    groups = config_groups()
    for option in ("best_over", "mean_over"):
        keys = summary.get(option)
        if keys is not None and not is_list(keys):
            raise ConfigError(
                f"summary.{option} is a list of keys, got {shown(keys)}; write it in "
                f"brackets: summary.{option}=[{keys}]"
            )
        for key in keys or ():
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


# ---------------------------------------------------------------- typed options

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


def check_launcher(hydra_cfg: Any) -> None:
    """A launcher (``launcher=joblib``, ``launcher=slurm``) runs a multirun's jobs: given
    to a single run, it was ignored, and the run trained here."""
    choices = hydra_cfg.runtime.choices if hydra_cfg is not None else {}
    launcher = choices.get("launcher")
    if launcher is not None and str(hydra_cfg.mode) != "RunMode.MULTIRUN":
        raise ConfigError(
            f"launcher={launcher} launches the jobs of a multirun, and this is one run: add "
            f"-m (tlab-train -m ... launcher={launcher}) to run it through {launcher}, or "
            "drop launcher= to run it here"
        )


def check_values(cfg: DictConfig) -> LengthOptions | None:
    """Everything here (see the module's note), in the preflight's order; returns the
    lengths to score at, parsed (None: none asked)."""
    check_missing(cfg)
    check_rules(cfg)
    check_checkpoint_path(cfg)
    check_summary_keys(cfg)
    return length_options(cfg)
