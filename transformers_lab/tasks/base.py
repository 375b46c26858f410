"""What every task shares: the optimizer with weight-decay groups, the schedule, the
parameter counts, and the run's config inside every checkpoint."""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from transformers_lab.errors import ConfigError
from transformers_lab.models.common import layer_names
from transformers_lab.nn import weight_decay_groups
from transformers_lab.tasks.clipping import CheckedNorm, clip_with_checked_norm
from transformers_lab.tasks.examples import Detokenizer, Example

log = logging.getLogger(__name__)

OptimizerFactory = Callable[..., Optimizer]
SchedulerFactory = Callable[..., LRScheduler]


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Total and trainable parameters (a tied weight is counted once)."""
    params = list(model.parameters())  # nn.Module.parameters() yields each tensor once
    return {
        "model/params": sum(p.numel() for p in params),
        "model/params_trainable": sum(p.numel() for p in params if p.requires_grad),
    }


def log_text(module: L.LightningModule, key: str, text: str) -> None:
    """Log a qualitative sample to the run's log and to every logger that takes text."""
    if module.trainer.sanity_checking:
        return
    step = module.global_step
    log.info("%s at step %d:\n%s", key, step, text)
    for logger in module.loggers:
        experiment = logger.experiment
        if hasattr(experiment, "add_text"):  # tensorboard
            experiment.add_text(key, text, step)
        elif hasattr(logger, "log_text"):  # wandb
            logger.log_text(key=key, columns=["step", "text"], data=[[step, text]])


class SplitTotals(nn.Module):
    """The loss and accuracy of a whole split: the summed loss (mean x count), correct
    predictions and count of its batches, in one float64 vector (float32 on MPS, which has
    no float64), summed over the processes under DDP when read. A NaN loss is kept, never
    dropped. (A plain attribute, not a buffer: DDP would broadcast rank 0's buffers over
    the others' partial sums.)"""

    def __init__(self) -> None:
        super().__init__()
        self.sums = torch.zeros(3, dtype=torch.float64)

    def start(self, device: torch.device) -> None:
        """Empty totals on ``device``, at the start of a split."""
        dtype = torch.float32 if device.type == "mps" else torch.float64
        self.sums = torch.zeros(3, dtype=dtype, device=device)

    def update(self, mean_loss: torch.Tensor, correct: torch.Tensor, count: torch.Tensor) -> None:
        dtype = self.sums.dtype
        loss = (mean_loss.detach() * count).to(dtype)
        self.sums += torch.stack((loss, correct.to(dtype), count.to(dtype)))

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean loss and accuracy over everything added, on every process."""
        sums = self.sums
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            sums = sums.clone()
            torch.distributed.all_reduce(sums)
        count = sums[2].clamp_min(1)
        return (sums[0] / count).float(), (sums[1] / count).float()


PLAIN_ATTRIBUTES = ("_current_fx_name", "checked_norm", "tokens_seen")  # see __setattr__
TOKENS_SEEN = "tlab_tokens"  # a checkpoint's entry: the training tokens seen before it


class Task(L.LightningModule):
    """A LightningModule around a plain ``nn.Module`` model.

    Args:
        model: the network (``GPT``, ``Transformer``, ``ViT``, ...).
        optimizer: a partial optimizer (Hydra ``_partial_: true``), completed with the
            parameter groups of ``weight_decay_groups``; its ``weight_decay`` applies to
            the decayed group.
        scheduler: a partial schedule completed with the optimizer, stepped every
            training step; None for a constant learning rate. A schedule with a
            ``max_steps`` argument left unset (or None) gets the trainer's total number of
            optimizer steps (and a warm-up of a tenth of them if its own is longer).

        detokenize: token ids -> text (the data module's), to log samples and label maps;
            None: ids are shown as numbers and no text is logged.
        run_config: the run's resolved model, data and task sections (a plain dict, given
            by ``tlab-train``), saved in every checkpoint as ``checkpoint["tlab_config"]``
            so that ``tlab-eval`` and ``tlab-sample`` can rebuild the model and its data
            from the checkpoint alone.
    """

    # the names of the model classes a task trains, matched along a model's class
    # hierarchy; empty: any model. ``run.components.build_task`` refuses a model of the project's
    # own classes (``MODEL_CLASSES``) that the task does not train
    trains: tuple[str, ...] = ()

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        detokenize: Detokenizer | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.detokenize = detokenize
        self.run_config = run_config
        ignore = ["model", "optimizer", "scheduler", "detokenize", "run_config"]
        self.save_hyperparameters(ignore=ignore)
        self.counts = parameter_counts(model)
        self.num_params = self.counts["model/params"]
        self.layers = layer_names(model)  # each layer's mixer as built, for the job record
        self.totals = SplitTotals()  # of the validation or test split under way
        self.checked_norm: CheckedNorm | None = None  # from NonFiniteGuard, for the clipping
        self.tokens_seen = 0  # training tokens, all processes (``batch_tokens``), resumed too

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets the hook under way twice around every hook call, some 60 times a
        # training step, and the guard's norm is handed over and taken back every step:
        # plain attributes, which nn.Module's checks would only slow down
        if name in PLAIN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def log_train_loss(self, loss: torch.Tensor, batch_size: int | None = None) -> None:
        """Log ``train/loss`` (to the progress bar too) on the steps where it is read: the
        steps a logger writes (every ``trainer.log_every_n_steps``) and the progress bar
        refreshes, the last batch of an epoch and the run's last step. A ``self.log``
        call is about half a millisecond of Lightning's bookkeeping, a fifth of a small
        model's step on a CPU; logging every step bought nothing that is shown."""
        if self.logs_train_step():
            self.log("train/loss", loss, prog_bar=True, batch_size=batch_size, sync_dist=True)

    def logs_train_step(self) -> bool:
        """Whether this training step's metrics are read (see ``log_train_loss``)."""
        trainer = self._trainer
        if trainer is None or trainer.fast_dev_run:
            return True
        every = trainer.log_every_n_steps
        bar = trainer.progress_bar_callback
        refresh = getattr(bar, "refresh_rate", 0) if bar is not None and bar.is_enabled else 0
        if refresh > 0:
            every = math.gcd(every, refresh)  # a divisor of both: every logger step is one
        if every <= 1:
            return True
        loop = trainer.fit_loop.epoch_loop
        if (loop._batches_that_stepped + 1) % every == 0:  # Lightning's own count
            return True
        if loop.batch_progress.is_last_batch:
            return True
        return 0 < trainer.max_steps <= trainer.global_step + 1

    def batch_tokens(self, batch: Any) -> int:
        """The tokens of a training batch on this process: the ids the model reads, where
        its input is a tensor of token ids (B x T); 0 where it is not (images)."""
        x = batch[0] if isinstance(batch, list | tuple) else batch
        integer = isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex())
        return x.numel() if integer else 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Count the batch's tokens, every process's (their batches are of one size), as
        it starts: a checkpoint, written after a batch ends, counts it."""
        self.tokens_seen += self.batch_tokens(batch) * self.trainer.world_size

    def configure_model(self) -> None:
        """Under a strategy that shards the model (``run.distributed.Sharded``, FSDP2),
        shard it: Lightning calls this once the processes are up, before the optimizer is
        built. Any other strategy leaves the model as it is."""
        shard = getattr(self._trainer.strategy, "shard", None) if self._trainer else None
        if callable(shard):
            shard(self.model)

    def configure_optimizers(self) -> Any:
        # the partial's weight_decay goes to the decayed group only
        keywords = getattr(self.optimizer_factory, "keywords", {})
        weight_decay = keywords.get("weight_decay", 0.0)
        extra = {}
        if keywords.get("fused") and self.clips_under_mixed_precision():
            # Lightning refuses to clip the gradients of a fused step under mixed precision
            # (the step unscales them itself): the per-tensor step instead, said once
            log.info(
                "optimizer.fused=true is set aside: gradient clipping under %s precision "
                "needs the per-tensor step",
                self.trainer.precision,
            )
            extra["fused"] = None
        optimizer = self.optimizer_factory(
            params=weight_decay_groups(self.model, weight_decay), **extra
        )
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer, **self.schedule_length())
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def configure_gradient_clipping(
        self,
        optimizer: Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        # the norm NonFiniteGuard took of these gradients, when it did: one norm a step
        checked, self.checked_norm = self.checked_norm, None
        step, algorithm = self.global_step, gradient_clip_algorithm
        if not clip_with_checked_norm(checked, optimizer, step, gradient_clip_val, algorithm):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def take_checked_norm(self, checked: CheckedNorm) -> None:
        """The norm ``NonFiniteGuard`` took of the gradients about to be clipped."""
        self.checked_norm = checked

    def clips_under_mixed_precision(self) -> bool:
        """Whether the run clips gradients under a mixed precision (``16-mixed``,
        ``bf16-mixed``), where Lightning cannot clip a fused optimizer step."""
        if self._trainer is None:
            return False
        clip = self.trainer.gradient_clip_val
        return bool(clip) and str(self.trainer.precision).endswith("-mixed")

    def schedule_length(self) -> dict[str, int]:
        """``max_steps`` for a schedule that takes one and was not given it; a warning when
        the one given differs from the run's number of optimizer steps."""
        factory = self.scheduler_factory
        try:
            takes = "max_steps" in inspect.signature(getattr(factory, "func", factory)).parameters
        except (TypeError, ValueError):  # a builtin or odd callable: leave it alone
            return {}
        if not takes:
            return {}
        given = getattr(factory, "keywords", {}).get("max_steps")
        if given is not None:
            if self._trainer is None:  # configured outside a run: nothing to compare with
                return {}
            total = self.trainer.estimated_stepping_batches
            if math.isfinite(total) and int(total) != given and self.trainer.is_global_zero:
                log.warning(
                    "scheduler.max_steps=%d but the run has %d optimizer steps: the schedule "
                    "%s; set scheduler.max_steps=null to make it follow the run",
                    given,
                    total,
                    "is cut short (the learning rate never reaches its floor)"
                    if given > total
                    else "ends early (the rest of the run stays at the floor)",
                )
            return {}
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ConfigError(
                "the schedule needs a length and the trainer has no finite number of steps; "
                "set scheduler.max_steps or trainer.max_steps"
            )
        if total < 1:
            raise ConfigError(
                "the run has no optimizer step to schedule (trainer.limit_train_batches=0, "
                "an empty training set, or max_steps=0); give it at least one training batch"
            )
        length = {"max_steps": int(total)}
        warmup = getattr(factory, "keywords", {}).get("warmup_steps")
        if warmup is not None and warmup >= total:  # a debug run far shorter than the warm-up
            length["warmup_steps"] = int(total) // 10
            log.warning(
                "the run has %d optimizer steps, fewer than warmup_steps=%d: warming up for %d",
                total,
                warmup,
                length["warmup_steps"],
            )
        return length

    def example(self, batch: Any, index: int = 0) -> Example:
        """Example ``index`` of a batch as the task feeds it to the model, with labels for
        the axes of its attention maps (see ``analysis.attention``)."""
        raise NotImplementedError(f"{type(self).__name__} does not define example()")

    def on_fit_start(self) -> None:
        for logger in self.loggers:
            logger.log_hyperparams(self.counts)

    def on_train_start(self) -> None:
        if self.trainer.ckpt_path:  # resumed: the optimizer's state came from the checkpoint
            apply_optimizer_settings(self.trainer, getattr(self.optimizer_factory, "keywords", {}))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.run_config is not None:
            checkpoint["tlab_config"] = self.run_config
        checkpoint[TOKENS_SEEN] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A resumed run counts on from the tokens its checkpoint had (an earlier version's
        checkpoint, which has none: from 0)."""
        self.tokens_seen = int(checkpoint.get(TOKENS_SEEN, 0))


# settings of an optimizer's constructor that are not per-group hyperparameters
NOT_HYPERPARAMETERS = frozenset({"fused", "foreach", "capturable", "differentiable", "maximize"})


def apply_optimizer_settings(trainer: L.Trainer, settings: dict[str, Any]) -> None:
    """Give the optimizers of a resumed run the settings of its config (``settings``: the
    optimizer's keywords, lr, betas, weight_decay...), over those the checkpoint restored:
    a change that ``resume_may_change`` allowed takes effect, where Lightning would keep the
    checkpoint's. The weight decay goes to the decayed group only; a new lr becomes the
    schedule's base, at the step the run resumes at. The same settings change nothing."""
    hyper = {k: v for k, v in settings.items() if k not in NOT_HYPERPARAMETERS}
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for key, value in hyper.items():
                if key not in group or (key == "weight_decay" and group[key] == 0):
                    continue
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
    if "lr" not in hyper:
        return
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            continue
        scheduler.base_lrs = [hyper["lr"]] * len(scheduler.base_lrs)
        for group, rate in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["initial_lr"] = hyper["lr"]
            group["lr"] = hyper["lr"] * rate(scheduler.last_epoch)
