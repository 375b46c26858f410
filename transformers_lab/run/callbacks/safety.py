"""A run that fails safely: no lost work, no broken checkpoint, no silent divergence.

- ``Checkpoint``: ModelCheckpoint whose ``last.ckpt`` is always the latest state, which
  also saves it on SIGTERM (and Ctrl+C), and keeps the best one when a run is resumed
  into a new run dir.
- ``AtomicCheckpointIO``: every checkpoint is written to a temporary file next to it and
  renamed into place, so a kill during a save leaves the previous one whole.
- ``NonFiniteGuard``: the first NaN or infinity in the loss or a gradient stops the run
  before the optimizer applies it, with one line that names the step and likely causes.
- ``StopOnSignal``: SIGINT (Ctrl+C) stops at the next batch boundary like SIGTERM does,
  and so does SIGUSR2 (SLURM's warning before a time limit, whose default would kill the
  run), so all end in a checkpoint and a clean exit.
- ``ExactResume`` (with ``data.loader.ResumableLoader``): a checkpoint holds the random
  generators and the position in the epoch's data order, so a resumed run continues
  exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
from typing import Any

import lightning as L
import numpy as np
import torch

from transformers_lab.errors import NonFiniteError
from transformers_lab.tasks.clipping import CheckedNorm, TakesCheckedNorm

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- checkpoints


# ---------------------------------------------------------------- NaN / Inf guard

LIKELY_CAUSES = (
    "likely causes: a learning rate too high (the largest is {lr}; lower optimizer.lr or "
    "lengthen the warm-up), no gradient clipping (set trainer.gradient_clip_val=1.0), "
    "fp16 overflow (use trainer.precision=bf16-mixed or 32-true), or a NaN or inf in the data"
)


def all_finite(tensors: list[torch.Tensor], norm: torch.Tensor | None = None) -> bool:
    """Whether every entry is finite, in one fused norm (``norm``, their total 2-norm, if
    taken already): a NaN or inf anywhere makes the norm non-finite (a norm that overflows
    on huge finite entries is checked entry-wise)."""
    if not tensors:
        return True
    if norm is None:
        norm = torch.nn.utils.get_total_norm(tensors)
    if bool(torch.isfinite(norm)):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def norm_is_clipping_norm(trainer: L.Trainer) -> bool:
    """Whether the 2-norm of an optimizer's gradients taken in ``on_before_optimizer_step``
    is the one Lightning's clipping takes next: full-precision gradients (no mixed-precision
    plugin) held whole by every process (one device or DDP; not FSDP's shards, not
    DeepSpeed, which clips itself)."""
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    strategy = trainer.strategy
    return (
        type(trainer.precision_plugin) is Precision
        and isinstance(strategy, SingleDeviceStrategy | DDPStrategy)
        and not isinstance(strategy, DeepSpeedStrategy)
        and hasattr(torch.nn.utils, "clip_grads_with_norm_")  # torch >= 2.6
    )


class NonFiniteGuard(L.Callback):
    """Stop at the first NaN or infinity, before it reaches the weights or a checkpoint.

    The loss is checked before every backward pass, the gradients before every optimizer
    step (after unscaling, before clipping), and the weights before every checkpoint is
    written. Under DDP every process stops together. With fp16's gradient scaler the
    gradients are not checked: an infinite gradient there is how the scaler lowers its
    scale, and the step is skipped.

    Args:
        check_gradients: also check the gradients (one norm per optimizer step).
    """

    def __init__(self, check_gradients: bool = True) -> None:
        self.check_gradients = check_gradients
        self.hands_norm_on = False  # whether the task's clipping takes the norm (set per fit)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # decided once a fit, not every step: a Protocol's isinstance walks its methods
        self.hands_norm_on = norm_is_clipping_norm(trainer) and isinstance(
            pl_module, TakesCheckedNorm
        )

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        bad = not bool(torch.isfinite(loss.detach()).all())
        if trainer.strategy.reduce_boolean_decision(bad, all=False):
            value = f"{loss.item()}" if bad and loss.numel() == 1 else "not finite"
            self.stop(trainer, f"the training loss is {value}")

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if not self.check_gradients or getattr(trainer.precision_plugin, "scaler", None):
            return
        # the gradients this optimizer applies; their norm is kept for the clipping that
        # comes next (``clip_with_checked_norm``), which would otherwise take it again
        params = (p for group in optimizer.param_groups for p in group["params"])
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else None
        bad = not all_finite(grads, norm)
        if trainer.strategy.reduce_boolean_decision(bad, all=False):
            self.stop(trainer, self.first_bad(pl_module, "grad") if bad else "a gradient")
        if norm is not None and self.hands_norm_on:
            pl_module.take_checked_norm(CheckedNorm(optimizer, pl_module.global_step, norm))

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict
    ) -> None:
        # every process saves together; under FSDP each holds a different shard, so they
        # decide together (one stopping alone would leave the others at the save's barrier)
        bad = not all_finite([p.detach() for p in pl_module.parameters()])
        if trainer.strategy.reduce_boolean_decision(bad, all=False):
            elsewhere = "a weight of another process is not finite"
            what = self.first_bad(pl_module, "data") if bad else elsewhere
            self.stop(trainer, f"{what} before a checkpoint")

    @staticmethod
    def first_bad(pl_module: L.LightningModule, field: str) -> str:
        """'the gradient of <name> is not finite (and N more)' for grads or weights."""
        names = [
            name
            for name, p in pl_module.named_parameters()
            if getattr(p, field) is not None and not bool(torch.isfinite(getattr(p, field)).all())
        ]
        what = "the gradient of" if field == "grad" else "the weight"
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        return f"{what} {names[0] if names else '?'} is not finite{more}"

    @staticmethod
    def stop(trainer: L.Trainer, what: str) -> None:
        loop = trainer.fit_loop.epoch_loop
        where = (
            f"at global step {trainer.global_step} (epoch {trainer.current_epoch}, "
            f"batch {loop.batch_idx})"
        )
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or None
        kept = f"the last good checkpoint is {last}" if last else "no checkpoint was saved yet"
        lrs = [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]
        causes = LIKELY_CAUSES.format(lr=f"{max(lrs):.3g}" if lrs else "?")
        raise NonFiniteError(f"{what} {where}: training stopped; {kept}; {causes}")


# ---------------------------------------------------------------- signals


_noted: list[str] = []  # the signal noted by ``note_signals``' handler, if one came


def note_signals() -> None:
    """From now on, SIGTERM, SIGINT and SIGUSR2 are noted rather than fatal in this
    process, until training takes them (``StopOnSignal`` starts from the note, stops after
    one batch and saves). For a sweep's worker process, whose main process forwards a
    stop to it at any moment of a job: while it builds the job's data, between jobs, or
    while it trains; and for a SLURM job from its start. A second signal, before training
    took them, stops at once. ``clear_noted_signal`` starts the next job afresh."""
    if threading.current_thread() is threading.main_thread():
        for signum in StopOnSignal.SIGNALS:
            signal.signal(signum, _note)


def _note(signum: int, frame: Any) -> None:
    if _noted:  # a second signal: at once, as a second Ctrl+C in training
        raise KeyboardInterrupt
    _noted.append(signal.Signals(signum).name)


def noted_signal() -> str | None:
    """The signal ``note_signals``' handler noted, or None."""
    return _noted[0] if _noted else None


def clear_noted_signal() -> None:
    _noted.clear()


class StopOnSignal(L.Callback):
    """SIGTERM, Ctrl+C (SIGINT) and SIGUSR2 (what a SLURM job gets ``--signal``'s delay
    before its time limit) stop training after the current batch, on every process
    at the same step, so ``Checkpoint`` saves ``last.ckpt`` and the entry point exits
    cleanly. A second Ctrl+C stops at once, without saving. ``received`` names the signal.

    While training, this replaces Lightning's own SIGTERM handler: under DDP that one
    forwards the signal to the other processes and broadcasts from inside the handler, so
    a signal sent to the whole process group (Ctrl+C in a terminal, ``kill -- -PGID``)
    reached a process twice and left the processes waiting on each other for ever. Here
    the handler only notes the signal; after each training batch the processes agree
    (one all-reduce) and all raise Lightning's own stop flag together.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)

    def __init__(self) -> None:
        self.received: str | None = None
        self.previous: dict[int, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received = noted_signal()  # a sweep worker's, sent before training began
        if self.received is not None:
            log.warning("%s before training: saving a checkpoint after one batch", self.received)
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.on_signal) for s in self.SIGNALS}

    def on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signal.Signals(signum).name
            again = " (again: stop at once)" if signum == signal.SIGINT else ""
            log.warning("%s: saving a checkpoint after this batch%s", self.received, again)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            # Lightning's flag: the loop saves nothing itself, it raises SIGTERMException at
            # the end of this batch (after its counters and any validation), on each process.
            # Private: Lightning has no public way to end fit() with its SIGTERM path
            # (``trainer.received_sigterm`` is read-only). Checked on Lightning 2.6.6;
            # tests/run/test_safety.py fails when the attribute goes or the loops' property stops
            # following it.
            trainer._signal_connector.received_sigterm = True

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for signum, handler in self.previous.items():
            if signal.getsignal(signum) == self.on_signal:
                signal.signal(signum, handler)
        self.previous = {}


# ---------------------------------------------------------------- exact resume


def random_states() -> dict[str, Any]:
    """torch's (CPU and CUDA), numpy's and Python's global random states, as tensors and
    plain values (a checkpoint stays loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # noqa: NPY002 (seed_everything's)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "python": random.getstate(),
    }


def set_random_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        # a checkpoint from a machine with more GPUs: the ones there are get their states
        for device, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))  # noqa: NPY002
    random.setstate(states["python"])


def train_loaders(trainer: L.Trainer) -> list[Any]:
    """The trainer's training loaders that can resume mid-epoch: those with a state (ours,
    ``data.base.ResumableLoader``'s kin, and litdata's ``StreamingDataLoader``; torch's own
    ``DataLoader`` has none)."""
    loaders = trainer.train_dataloader
    loaders = loaders if isinstance(loaders, list | tuple) else [loaders]
    return [loader for loader in loaders if hasattr(loader, "load_state_dict")]


class ExactResume(L.Callback):
    """Make a resumed run continue exactly as the uninterrupted one would have.

    Lightning restores the weights, the optimizer, the schedule and the loop counters;
    this adds, in every checkpoint, the global random states (dropout masks, the next
    epoch's order) and where each ``ResumableLoader`` was in its epoch's order, and puts
    them back when training resumes. The loaders' positions are applied at the start of
    training: Lightning builds the training iterator before it restores the loops (the
    schedule asks for the number of steps), too early for its own loader states.

    Exact on one process with the data loaded in the main process (``num_workers=0``, the
    configs' default), at an optimizer step: with gradient accumulation, a stop between
    two steps loses the gradients accumulated since the last one. Under DDP the checkpoint
    holds rank 0's random states (every rank starts from the same seed); with worker
    processes, random augmentations drawn in the workers are not replayed. A checkpoint
    loaded to validate or test changes nothing.
    """

    KEY = "exact_resume"

    def __init__(self) -> None:
        self.positions: list[dict[str, Any]] = []

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict
    ) -> None:
        positions = [loader.state_dict() for loader in train_loaders(trainer)]
        checkpoint[self.KEY] = {"random": random_states(), "loaders": positions}

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict
    ) -> None:
        state = checkpoint.get(self.KEY)
        if state is None or trainer.state.fn != "fit":
            return
        set_random_states(state["random"])
        self.positions = state["loaders"]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        positions, self.positions = self.positions, []
        for loader, position in zip(train_loaders(trainer), positions, strict=False):
            loader.load_state_dict(position)
