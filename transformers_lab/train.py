"""tlab-train: compose the config, build data, model, task and trainer, fit, test.

tlab-train                                        # ViT on digits, offline, ~1 min
tlab-train experiment=baby_gpt                    # nanoGPT's CPU run on Tiny Shakespeare
tlab-train model=gpt data=mqar attention=fastmax attention.p=2
tlab-train ckpt_path=logs/train/runs/<time>/checkpoints/last.ckpt   # resume
tlab-train sweep=attention_kernels experiment=mqar   # a multirun, summarised at its end
python -m transformers_lab.train --help

Every run is a job (``run.job``): it records its outcome in ``<run dir>/result.json``;
in a multirun a failed job is recorded there and the sweep goes on (``fail_fast=true``
stops it); ``skip_finished=true`` with ``hydra.sweep.dir=<old sweep>`` skips the jobs that
already finished. The run itself is ``run.fit.fit_and_test``; a trial of an Optuna study
gets its pruning callback here (``sweeps.pruning``), handed to the trainer.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from transformers_lab.cli import refusals_leave_no_run_dir, run_hydra, user_errors
from transformers_lab.config import CONF_DIR
from transformers_lab.errors import RunStopped
from transformers_lab.sweeps.plugins import register_plugins

if TYPE_CHECKING:
    from transformers_lab.run.checkpoints import SavedCheckpoint
    from transformers_lab.run.record import Outcome

# Lightning, torch and the run's code are imported once Hydra has composed the config
# (in the functions below): a command line it refuses is refused in about half a second.


def fit_as_trial(cfg: DictConfig, checkpoint: SavedCheckpoint | None = None) -> Outcome:
    """``fit_and_test`` (resuming ``checkpoint``, which the job read), reporting to the
    job's Optuna trial and pruned by its pruner when the job is one (``trial`` and
    ``pruner`` set), else as it is."""
    from transformers_lab.run.fit import fit_and_test
    from transformers_lab.sweeps.pruning import pruning_callback

    pruning = pruning_callback(cfg)
    return fit_and_test(cfg, checkpoint, callbacks=() if pruning is None else (pruning,))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def hydra_main(cfg: DictConfig) -> float | None:
    from transformers_lab.run.overrides import hydra_config, in_multirun
    from transformers_lab.run.values import check_launcher, check_values

    with user_errors(), refusals_leave_no_run_dir():
        if not in_multirun():  # a sweep checked its jobs' values before launching them
            check_launcher(hydra_config())
            check_values(cfg)  # in about a second: torch is not imported yet
        from transformers_lab.run.job import run_job
        from transformers_lab.run.record import Interrupted, say

        try:
            return run_job(cfg, fit_as_trial)
        except RunStopped as exc:  # a NaN, or a signal: one line, no traceback
            say(str(exc) if isinstance(exc, Interrupted) else f"error: {exc}", file=sys.stderr)
            raise SystemExit(exc.exit_code) from None


def main() -> None:
    register_plugins()
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
