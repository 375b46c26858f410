"""Weights & Biases that works on a machine without an account: offline by default there."""

from __future__ import annotations

import logging
import netrc
import os
import uuid
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from transformers_lab.files import atomic_write
from transformers_lab.run.checkpoints.saved import WANDB_ID
from transformers_lab.run.overrides import (
    SEED_KEYS,
    in_multirun,
    job_overrides,
    override_key,
    sweep_parameters,
)

log = logging.getLogger(__name__)


def wandb_account() -> bool:
    """Whether wandb could log in: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        hosts = netrc.netrc(path).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


def wandb_logger(
    *,
    project: str,
    save_dir: str,
    offline: bool | None = None,
    **kwargs: Any,
) -> WandbLogger:
    """A ``WandbLogger`` whose mode follows the machine.

    Args:
        project: the wandb project.
        save_dir: the run dir; wandb writes its ``wandb/`` folder there.
        offline: True or False to force the mode; None (the default) means online only
            when an account is configured (``WANDB_API_KEY`` or ``wandb login``) and
            ``WANDB_MODE`` does not say offline or disabled. An offline run can be
            uploaded later with ``wandb sync <run dir>/wandb/offline-run-*``.
        kwargs: the rest of ``WandbLogger`` and ``wandb.init`` (group, job_type, tags,
            name, ...).
    """
    if offline is None:
        mode = os.environ.get("WANDB_MODE", "")
        offline = mode in ("offline", "dryrun", "disabled") or not wandb_account()
        if offline and not mode:
            log.info("wandb: no account configured, logging offline to %s/wandb", save_dir)
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    logger = WandbLogger(project=project, save_dir=save_dir, offline=offline, **kwargs)
    # Lightning 2.6 always hands wandb.init an ``anonymous`` setting (None unless asked),
    # which wandb 0.31 warns about at every run ("has no effect and will be removed"):
    # hand it over only when one was asked for
    if logger._wandb_init.get("anonymous") is None:
        logger._wandb_init.pop("anonymous", None)
    return logger


def name_wandb_run(cfg: DictConfig, checkpoint: Any = None) -> None:
    """Fill the wandb logger's settings left null: in a multirun, one group for the whole
    sweep (its directory's name), a job_type per swept choice, seeds aside, and a name
    with every swept setting, seeds included; otherwise the run name and the task name.
    Its id is the job's (``wandb_run_id``), with ``resume="allow"``: a job resumed from
    its ``checkpoint`` (a ``SavedCheckpoint``) goes on in the same wandb run, not a
    second one."""
    node = (cfg.get("logger") or {}).get("wandb")
    if node is None:
        return
    group, job_type, name = cfg.run_name, cfg.task_name, node.get("name")
    if in_multirun():
        sweep_dir = Path(cfg.paths.output_dir).parent
        group = f"{cfg.task_name}-{sweep_dir.name}"
        swept = sweep_parameters(sweep_dir)
        settings = [o for o in job_overrides() if override_key(o) in swept]
        choice = [o for o in settings if override_key(o) not in SEED_KEYS]
        job_type = " ".join(choice)[:64] or cfg.task_name
        name = " ".join([name or cfg.run_name, *settings])[:128]
    with open_dict(node):
        node.group = node.get("group") or group
        node.job_type = node.get("job_type") or job_type
        node.name = name
        node.id = node.get("id") or wandb_run_id(cfg, checkpoint)
        node.resume = node.get("resume") or "allow"


def wandb_run_id(cfg: DictConfig, checkpoint: Any = None) -> str:
    """The wandb run id of this job: a resumed job's is the one its ``checkpoint``'s run
    dir recorded (``SavedCheckpoint.wandb_id``), a new job's a fresh random one (a fresh
    run in a reused dir is a new wandb run); written to the run dir, so a resume of this
    run finds it in turn."""
    out = Path(cfg.paths.output_dir)
    run_id = (checkpoint.wandb_id if checkpoint is not None else None) or uuid.uuid4().hex[:16]
    if rank_zero_only.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / WANDB_ID, run_id + "\n")
    return run_id


def log_hyperparameters(cfg: DictConfig, task: Any, trainer: L.Trainer) -> None:
    """The whole resolved config and the parameter counts, to every logger."""
    hparams = OmegaConf.to_container(cfg, resolve=True)
    hparams.pop("hydra", None)
    hparams.update(task.counts)
    for logger in trainer.loggers:
        logger.log_hyperparams(hparams)


def finish_wandb(trainer: L.Trainer | None) -> None:
    for logger in trainer.loggers if trainer else ():
        if isinstance(logger, WandbLogger):
            import wandb

            wandb.finish()
