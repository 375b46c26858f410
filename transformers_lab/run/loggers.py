"""Weights & Biases that works on a machine without an account: offline by default there
(``wandb_logger``, the ``_target_`` of ``conf/logger/wandb.yaml``). A run's W&B run is
named, resumed and finished with its trainer (``run.trainer``)."""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import WandbLogger

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
