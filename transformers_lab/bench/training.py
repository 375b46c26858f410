"""What does the framework cost? Wall time of ``tlab-train experiment=...`` against a bare
PyTorch loop that trains the same model on the same batches.

Usage::

    python -m transformers_lab.bench.training                          # baby GPT, 2000 steps
    python -m transformers_lab.bench.training --steps 300 --repeats 2  # a quick look

Both sides get the model, the data module and the optimizer settings of the composed
experiment, and the same seed: the bare loop is nanoGPT's (AdamW with the same
weight-decay groups, warm-up + cosine by hand, gradient clipping, a full validation pass
every ``val_check_interval`` steps and at the end). The framework side is ``train()`` as
``tlab-train`` runs it, with the CSV logger, checkpoints, the learning-rate monitor and
no progress bar (``--framework-overrides`` changes that). The two alternate, so drift in
the machine's speed hits both. Besides wall time, the process's CPU time (user + system)
is reported: on a shared machine it moves less with the neighbours' load. Reports go to
``--out`` as CSV and markdown.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from transformers_lab.builders import build_datamodule, build_model
from transformers_lab.config import compose_config
from transformers_lab.nn import weight_decay_groups
from transformers_lab.tasks import warmup_cosine


@torch.no_grad()
def validate(model: torch.nn.Module, loader) -> float:
    """Mean next-token loss over the validation loader, weighted by batch size."""
    model.eval()
    total, count = 0.0, 0
    for x, y in loader:
        logits = model(x)
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).item() * len(
            x
        )
        count += len(x)
    model.train()
    return total / count


def train_step(model: torch.nn.Module, optimizer, x, y, clip: float | None) -> None:
    """One optimizer step of next-token prediction, as nanoGPT takes it."""
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def bare_loop(overrides: list[str], steps: int, workdir: Path) -> tuple[float, float]:
    """(seconds, final validation loss) of a hand-written loop over the experiment."""
    cfg = compose_config("train", overrides, workdir)
    L.seed_everything(cfg.seed, workers=True)
    start = time.perf_counter()
    datamodule = build_datamodule(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    model = build_model(cfg.model, datamodule)
    sched_cfg = cfg.scheduler
    make_optimizer = instantiate(cfg.optimizer)  # the same class and settings as the task's
    optimizer = make_optimizer(weight_decay_groups(model, cfg.optimizer.weight_decay))
    # the schedule's length as Task.schedule_length sets it: the run's, and a warm-up cut to
    # a tenth of a run shorter than it
    warmup = sched_cfg.warmup_steps
    if sched_cfg.max_steps is None and warmup >= steps:
        warmup = steps // 10
    schedule = warmup_cosine(
        optimizer, warmup, sched_cfg.max_steps or steps, sched_cfg.min_lr_ratio
    )
    clip = cfg.trainer.gradient_clip_val
    every = cfg.trainer.val_check_interval or steps
    val_loader = datamodule.val_dataloader()
    step, val_loss = 0, math.nan
    model.train()
    while step < steps:
        for x, y in datamodule.train_dataloader():
            train_step(model, optimizer, x, y, clip)
            schedule.step()
            step += 1
            if step % every == 0 or step == steps:
                val_loss = validate(model, val_loader)
            if step == steps:
                break
    return time.perf_counter() - start, val_loss


def framework(overrides: list[str], steps: int, workdir: Path) -> tuple[float, float]:
    """(seconds, final validation loss) of ``train()``, as tlab-train runs it."""
    from transformers_lab.train import train

    cfg = compose_config("train", overrides, workdir)
    start = time.perf_counter()
    metrics = train(cfg)
    return time.perf_counter() - start, metrics.get("val/loss", math.nan)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformers_lab.bench.training")
    parser.add_argument("--experiment", default="baby_gpt")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, alternated")
    parser.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides for both")
    parser.add_argument(
        "--framework-overrides",
        nargs="*",
        default=["logger=csv", "trainer.enable_progress_bar=false"],
        help="extra overrides for the framework side only",
    )
    parser.add_argument("--out", default="bench_out/training")
    args = parser.parse_args(argv)

    common = [
        f"experiment={args.experiment}",
        f"trainer.max_steps={args.steps}",
        "trainer.max_epochs=-1",
        "test=false",
        *args.overrides,
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            sides = [
                ("bare", bare_loop, common),
                ("tlab", framework, common + args.framework_overrides),
            ]
            if repeat % 2:
                sides.reverse()
            for name, run, overrides in sides:
                cpu = time.process_time()
                seconds, val_loss = run(overrides, args.steps, Path(tmp) / f"{name}{repeat}")
                cpu = time.process_time() - cpu
                rows.append(
                    {
                        "side": name,
                        "repeat": repeat,
                        "seconds": seconds,
                        "cpu_seconds": cpu,
                        "val_loss": val_loss,
                    }
                )
                print(
                    f"{name:5s} run {repeat}: {seconds:8.1f} s wall, {cpu:8.1f} s CPU, "
                    f"val/loss {val_loss:.4f}",
                    flush=True,
                )
    with open(out / "training.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["side"] == side)

    ratio = median("tlab", "seconds") / median("bare", "seconds")
    cpu_ratio = median("tlab", "cpu_seconds") / median("bare", "cpu_seconds")
    lines = [
        f"experiment={args.experiment}, {args.steps} steps, {args.repeats} run(s) each, "
        f"{torch.get_num_threads()} threads",
        "",
        "| side | median wall s | median CPU s | last val/loss |",
        "|---|---|---|---|",
        *(
            f"| {s} | {median(s, 'seconds'):.1f} | {median(s, 'cpu_seconds'):.1f} | "
            f"{[r for r in rows if r['side'] == s][-1]['val_loss']:.4f} |"
            for s in ("bare", "tlab")
        ),
        "",
        f"framework / bare wall time: {ratio:.3f}",
        f"framework / bare CPU time: {cpu_ratio:.3f}",
    ]
    (out / "training.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
