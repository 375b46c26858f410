"""A run budgeted in tokens, as the field budgets one (GLA and DeltaNet: 340M parameters on
15B tokens, batches of 0.5M): ``trainer.max_tokens`` ends the run at the last whole
optimizer step within it (over ``trainer.max_steps``, a preset's), ``trainer.batch_tokens``
sizes each step (gradient accumulation over the processes' micro-batches), and
``scheduler.warmup_tokens`` gives the warm-up in tokens. ``plan`` turns them into the steps
and accumulation Lightning counts, written into the run's config before anything is built
(``apply``); a resumed run counts the tokens its checkpoint had. A token is one input
token of a training window: a batch of B windows of T tokens on P processes is B T P."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, open_dict

from transformers_lab.errors import ConfigError

log = logging.getLogger(__name__)

TOKEN_KEYS = ("max_tokens", "batch_tokens")  # the trainer's keys that Lightning does not take


def whole(value: Any) -> int | None:
    """A count written as an integer or as a whole float (``15e9``); None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if float(value).is_integer() else None


@dataclass(frozen=True)
class TokenPlan:
    """The steps of a run budgeted in tokens.

    window: tokens a training window (``data.block_size``); batch_size: windows a
    micro-batch on one process; processes: all of them, nodes times devices; accumulate:
    micro-batches an optimizer step; max_steps: the optimizer step the run ends at (None:
    the trainer's own limits)."""

    window: int
    batch_size: int
    processes: int
    accumulate: int
    max_steps: int | None

    @property
    def step_tokens(self) -> int:
        """The tokens of one optimizer step, every process and micro-batch together."""
        return self.window * self.batch_size * self.processes * self.accumulate


def processes(trainer: Any) -> int | None:
    """How many processes ``trainer`` (its config) trains on: nodes times devices a node,
    ``auto`` and -1 being every GPU torch sees on a GPU accelerator, else one. None where
    the devices are given in a form this does not read."""
    devices, nodes = trainer.get("devices", "auto"), whole(trainer.get("num_nodes", 1) or 1)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    elif isinstance(devices, str) and "," in devices:  # "0,1": the devices by index
        devices = [d for d in devices.split(",") if d.strip()]
    if devices in ("auto", -1):
        gpu = str(trainer.get("accelerator", "auto")) in ("auto", "gpu", "cuda")
        per_node = torch.cuda.device_count() if gpu and torch.cuda.is_available() else 1
    elif whole(devices) is not None and devices >= 1:
        per_node = int(devices)
    elif not isinstance(devices, str) and hasattr(devices, "__len__"):  # a list of indices
        per_node = len(devices)
    else:
        return None
    return per_node * (nodes or 1)


def plan(
    trainer: Any,
    window: int | None,
    batch_size: int,
    world: int,
    done_steps: int = 0,
    done_tokens: int | None = None,
    data: str = "the data",
) -> TokenPlan | None:
    """The ``TokenPlan`` of a trainer config with ``max_tokens`` or ``batch_tokens`` (None
    without either), for windows of ``window`` tokens in micro-batches of ``batch_size`` on
    ``world`` processes; a resumed run has trained ``done_steps`` steps and
    ``done_tokens`` tokens (None: as many steps of this plan's size). Each mistake is one
    ``ConfigError`` that names the fix."""
    max_tokens, batch_tokens = (trainer.get(k) for k in TOKEN_KEYS)
    if max_tokens is None and batch_tokens is None:
        return None
    for key, value in zip(TOKEN_KEYS, (max_tokens, batch_tokens), strict=True):
        if value is not None and (whole(value) is None or whole(value) < 1):
            raise ConfigError(f"trainer.{key} must be a whole number of tokens >= 1, got {value!r}")
    if window is None:
        raise ConfigError(
            f"trainer.max_tokens and trainer.batch_tokens count the tokens of fixed windows "
            f"(data with a block_size: a corpus, Shakespeare, MQAR); {data} has none: "
            "budget the run in trainer.max_steps"
        )
    micro = window * batch_size * world
    accumulate = whole(trainer.get("accumulate_grad_batches", 1)) or 1
    if batch_tokens is not None:
        batch_tokens = whole(batch_tokens)
        if batch_tokens % micro:
            raise ConfigError(
                f"trainer.batch_tokens={batch_tokens:,} is no whole number of micro-batches: "
                f"one is data.batch_size={batch_size} x data.block_size={window} x {world} "
                f"process{'es' if world > 1 else ''} = {micro:,} tokens; give a multiple of "
                f"it (e.g. {max(1, round(batch_tokens / micro)) * micro}), or change "
                "data.batch_size"
            )
        if accumulate != 1 and accumulate * micro != batch_tokens:
            raise ConfigError(
                f"trainer.batch_tokens={batch_tokens:,} and trainer.accumulate_grad_batches="
                f"{accumulate} disagree (that accumulation makes {accumulate * micro:,} "
                "tokens a step): set one of them"
            )
        accumulate = batch_tokens // micro
    step_tokens = micro * accumulate
    if max_tokens is None:
        return TokenPlan(window, batch_size, world, accumulate, None)
    max_tokens = whole(max_tokens)
    if max_tokens < step_tokens:
        raise ConfigError(
            f"trainer.max_tokens={max_tokens:,} is below one optimizer step of "
            f"{step_tokens:,} tokens (data.batch_size={batch_size} x data.block_size={window} "
            f"x {world} process{'es' if world > 1 else ''} x {accumulate} accumulated): give "
            "a budget of at least one step, or a smaller batch"
        )
    if done_tokens is None:
        done_tokens = done_steps * step_tokens
    steps = done_steps + max(0, max_tokens - done_tokens) // step_tokens
    return TokenPlan(window, batch_size, world, accumulate, steps)


def window_of(data: Any) -> int | None:
    """The tokens of a training window of a data config: its ``block_size``."""
    size = data.get("block_size") if hasattr(data, "get") else None
    return whole(size) if size is not None else None


def plan_of(cfg: DictConfig, checkpoint: Any = None) -> TokenPlan | None:
    """The run's ``TokenPlan`` (None: no token budget), counting the steps and tokens of
    the ``checkpoint`` (a ``SavedCheckpoint``) it resumes."""
    trainer, data = cfg.get("trainer") or {}, cfg.get("data") or {}
    if all(trainer.get(k) is None for k in TOKEN_KEYS):
        scheduler = cfg.get("scheduler")
        warmup = scheduler.get("warmup_tokens") if isinstance(scheduler, DictConfig) else None
        if warmup is not None:
            raise ConfigError(
                f"scheduler.warmup_tokens={warmup} needs the run's batch in tokens: give "
                "trainer.batch_tokens or trainer.max_tokens, or scheduler.warmup_steps"
            )
        return None
    scheduler = cfg.get("scheduler")
    warmup = scheduler.get("warmup_tokens") if isinstance(scheduler, DictConfig) else None
    if warmup is not None and (whole(warmup) is None or whole(warmup) < 0):
        raise ConfigError(
            f"scheduler.warmup_tokens must be a whole number of tokens >= 0, got {warmup!r}"
        )
    world = processes(trainer)
    if world is None:
        raise ConfigError(
            f"a token budget needs the number of processes: give trainer.devices as a number "
            f"or a list, got {trainer.get('devices')!r}"
        )
    done_steps = (checkpoint.step or 0) if checkpoint is not None else 0
    done_tokens = checkpoint.tokens if checkpoint is not None else 0
    name = str(data.get("_target_", "the data")).rpartition(".")[2]
    batch_size = whole(data.get("batch_size")) or 1
    return plan(trainer, window_of(data), batch_size, world, done_steps, done_tokens, name)


def apply(cfg: DictConfig, checkpoint: Any = None) -> TokenPlan | None:
    """Write the run's ``TokenPlan`` into its config: the trainer's ``max_steps`` (the
    epochs no limit: the budget ends the run), its ``accumulate_grad_batches``, and the
    schedule's ``warmup_steps`` from its ``warmup_tokens``. Says the plan in one line."""
    token_plan = plan_of(cfg, checkpoint)
    if token_plan is None:
        return None
    scheduler = cfg.get("scheduler")
    warmup = scheduler.get("warmup_tokens") if isinstance(scheduler, DictConfig) else None
    steps = cfg.trainer.get("max_steps", -1)
    if token_plan.max_steps is not None and steps not in (-1, None):
        log.info("trainer.max_tokens ends the run: trainer.max_steps=%s is set aside", steps)
    with open_dict(cfg.trainer):
        cfg.trainer.accumulate_grad_batches = token_plan.accumulate
        if token_plan.max_steps is not None:
            cfg.trainer.max_steps = token_plan.max_steps
            cfg.trainer.max_epochs = -1
    if warmup is not None:
        with open_dict(scheduler):
            scheduler.warmup_steps = -(-whole(warmup) // token_plan.step_tokens)
            scheduler.warmup_tokens = None
    log.info("%s", describe(token_plan, cfg.trainer.get("max_tokens")))
    return token_plan


def describe(token_plan: TokenPlan, max_tokens: Any = None) -> str:
    """The plan in one line, for the run's log."""
    processes = f"{token_plan.processes} process{'es' if token_plan.processes > 1 else ''}"
    step = (
        f"{token_plan.step_tokens:,} tokens a step ({token_plan.batch_size} x "
        f"{token_plan.window} tokens x {processes} x {token_plan.accumulate} accumulated)"
    )
    if token_plan.max_steps is None:
        return f"token budget: {step}"
    budget = whole(max_tokens) or 0
    steps = token_plan.max_steps
    left = "" if steps * token_plan.step_tokens == budget else " (its last whole step)"
    return f"token budget: {step}; {budget:,} tokens end the run at step {steps:,}{left}"


def check_world(token_plan: TokenPlan | None, world_size: int) -> None:
    """The trainer Lightning built runs the processes the plan counted."""
    if token_plan is not None and token_plan.processes != world_size:
        raise ConfigError(
            f"the token budget counted {token_plan.processes} processes, and the trainer runs "
            f"{world_size}: give trainer.devices and trainer.num_nodes as numbers"
        )
