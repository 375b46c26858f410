"""Throughput in the logs: training tokens a second and the share of the hardware's peak
FLOPs a run uses (MFU), at each logging step, on the progress bar, to every logger and in
the run's result (``Throughput``). A token's FLOPs are the model's own count
(``GPT.flops_per_token``: each kernel's, softmax's growing with the context); the peak
comes from ``PEAK_TFLOPS``, the GPU torch names, or ``peak_tflops``."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import lightning as L
import torch

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks, in TFLOPS, from the makers' data sheets (no sparsity; fp16
# where the GPU has no bf16). A name matches the longest key that the device's name holds.
PEAK_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "A6000": 155.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,
    "T4": 65.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
}


def known_peak(name: str) -> tuple[str, float] | None:
    """The table's entry for a device named ``name`` (``NVIDIA H100 80GB HBM3``): the
    longest key it holds, as a word, and its peak in FLOP/s; None where none is."""
    words = f" {name.upper().replace('-', ' ')} "
    found = [key for key in PEAK_TFLOPS if f" {key.upper()} " in words]
    if not found:
        return None
    key = max(found, key=len)
    return key, PEAK_TFLOPS[key] * 1e12


def peak_of(hardware: str, peak_tflops: float | None) -> tuple[str | None, float | None]:
    """The hardware's name and peak FLOP/s a device: ``peak_tflops`` where given, else
    the table's for ``hardware`` (``auto``: found when the run starts). A name the table
    lacks, without ``peak_tflops``, is a ``ValueError`` that says what to give."""
    if peak_tflops is not None:
        if isinstance(peak_tflops, bool) or not isinstance(peak_tflops, int | float):
            raise ValueError(f"peak_tflops must be a number > 0, got {peak_tflops!r}")
        if not peak_tflops > 0:
            raise ValueError(f"peak_tflops must be a number > 0, got {peak_tflops!r}")
        return (None if hardware == "auto" else hardware), float(peak_tflops) * 1e12
    if hardware == "auto":
        return None, None
    entry = known_peak(str(hardware))
    if entry is None:
        raise ValueError(
            f"hardware={hardware!r} is not in the table of peaks ({', '.join(PEAK_TFLOPS)}); "
            "give callbacks.throughput.peak_tflops=<its dense bf16 TFLOPS> for it"
        )
    return entry[0], entry[1]


class Throughput(L.Callback):
    """Logs, at each step whose training loss is logged (``Task.logs_train_step``):

    - ``train/tokens``: training tokens so far, all processes, a resumed run's included;
    - ``perf/tokens_per_s``: tokens a second since the last such step, all processes,
      validation time left out;
    - ``perf/mfu``: that rate times the model's FLOPs a token over the peak of all the
      run's devices, where a peak is known.

    When training ends, the run's mean over every step but the first (which pays for
    start-up and compiling) goes to the loggers and the result under the same names.

    Args:
        hardware: the device's name in ``PEAK_TFLOPS`` (``H100``), or ``auto``: the GPU
            torch names, none on a CPU (tokens a second only).
        peak_tflops: the peak of one device in TFLOPS, over the table (a CPU's, a GPU the
            table lacks).
    """

    def __init__(self, hardware: str = "auto", peak_tflops: float | None = None) -> None:
        self.hardware, self.peak = peak_of(hardware, peak_tflops)
        self.flops: dict[int, float] = {}  # FLOPs a token, by window length
        self.window = 0
        self.last: float | None = None  # when the current interval began
        self.last_tokens = 0
        self.paused = 0.0  # validation time inside the interval
        self.paused_at: float | None = None
        self.intervals = 0
        self.timed = [0.0, 0.0, 0.0]  # tokens, seconds, FLOPs after the first interval

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.peak is not None:
            return
        device = trainer.strategy.root_device
        if device.type != "cuda":
            return
        name = torch.cuda.get_device_name(device)
        entry = known_peak(name)
        if entry is None:
            log.warning(
                "MFU is not logged: %s is not in the table of peaks; give "
                "callbacks.throughput.peak_tflops=<its dense bf16 TFLOPS>",
                name,
            )
            return
        self.hardware, self.peak = entry

    def flops_per_token(self, pl_module: L.LightningModule, window: int) -> float | None:
        if window not in self.flops:
            count = getattr(getattr(pl_module, "model", None), "flops_per_token", None)
            self.flops[window] = float(count(window)) if callable(count) else math.nan
        value = self.flops[window]
        return None if math.isnan(value) else value

    def now(self, trainer: L.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.last is None and hasattr(pl_module, "tokens_seen"):  # a task of ours
            self.last, self.last_tokens = self.now(trainer), pl_module.tokens_seen
        x = batch[0] if isinstance(batch, list | tuple) else batch
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            self.window = int(x.shape[1])

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self.last is not None:
            self.paused_at = self.now(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.paused_at is not None:
            self.paused += self.now(trainer) - self.paused_at
            self.paused_at = None

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        logs = getattr(pl_module, "logs_train_step", None)
        if self.last is None or (callable(logs) and not logs()):
            return
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if (batch_idx + 1) % trainer.accumulate_grad_batches and not last_batch:
            return  # a micro-batch within an optimizer step: measured at the step's end
        now, tokens = self.now(trainer), pl_module.tokens_seen
        seconds, new = now - self.last - self.paused, tokens - self.last_tokens
        self.last, self.last_tokens, self.paused = now, tokens, 0.0
        if seconds <= 0 or new <= 0:  # a batch of images: no tokens to count
            return
        pl_module.log("train/tokens", float(tokens))
        rate = new / seconds
        pl_module.log("perf/tokens_per_s", rate, prog_bar=True)
        flops = self.flops_per_token(pl_module, self.window)
        if flops is not None and self.peak is not None:
            pl_module.log("perf/mfu", rate * flops / self.total_peak(trainer), prog_bar=True)
        self.intervals += 1
        if self.intervals > 1:
            spent = [new, seconds, new * (flops or 0.0)]
            self.timed = [a + b for a, b in zip(self.timed, spent, strict=True)]

    def total_peak(self, trainer: L.Trainer) -> float:
        return float(self.peak) * trainer.world_size

    def means(self, trainer: L.Trainer) -> dict[str, float]:
        """The run's rate and MFU over every timed interval but the first."""
        tokens, seconds, flops = self.timed
        if seconds <= 0:
            return {}
        out = {"perf/tokens_per_s": tokens / seconds}
        if self.peak is not None and flops > 0:
            out["perf/mfu"] = flops / seconds / self.total_peak(trainer)
        return out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        means = self.means(trainer)
        if not means:
            return
        for key, value in means.items():
            trainer.callback_metrics[key] = torch.tensor(value)
        for logger in trainer.loggers:
            logger.log_metrics(means, step=trainer.global_step)
        said = ", ".join(f"{k.split('/')[1]} {v:.4g}" for k, v in means.items())
        if trainer.is_global_zero:
            log.info("throughput over the run (its first logged step left out): %s", said)
