"""What does the framework cost? Wall time of ``tlab-train experiment=...`` against a bare
PyTorch loop that trains the same model on the same batches, or against nanoGPT's own
``train.py`` with the same settings.

Usage::

    python -m transformers_lab.bench.training                          # baby GPT, 2000 steps
    python -m transformers_lab.bench.training --steps 300 --repeats 2  # a quick look
    python -m transformers_lab.bench.training --against nanogpt --nanogpt ~/nanoGPT --repeats 3

Both sides get the model, the data module and the optimizer settings of the composed
experiment, the same seed and the same malloc setting (``keep_freed_memory``, which
``train()`` sets for the process): the bare loop is nanoGPT's (AdamW with the same
weight-decay groups, warm-up + cosine by hand, gradient clipping, a full validation pass
every ``val_check_interval`` steps and at the end). The framework side is ``train()`` as
``tlab-train`` runs it, with the CSV logger, checkpoints, the learning-rate monitor and
no progress bar (``--framework-overrides`` changes that). The two alternate, so drift in
the machine's speed hits both. Besides wall time, the process's CPU time (user + system)
is reported: on a shared machine it moves less with the neighbours' load. Reports go to
``--out`` as CSV and markdown. Neither side draws text samples (the bare loop has none to
draw: ``task.sample_tokens=0``).

``--against nanogpt`` runs two processes instead, each timed from start to exit, imports
included, as a user runs them: ``tlab-train`` and nanoGPT's ``train.py`` from a checkout
(``--nanogpt``; it is not a dependency), on nanoGPT's data files written from our
Shakespeare data module (the same text and 90/10 split). nanoGPT's flags are the
experiment's settings; ``--max_iters`` is steps - 1, since nanoGPT steps once more than its
``max_iters``. Evaluation has the same cadence and size on both sides: nanoGPT's
``estimate_loss`` takes ``--eval-iters`` batches of each split (at steps 0, 250, ...);
``tlab-train`` validates twice that many batches of its val split (at 250, 500, ...,
``trainer.limit_val_batches``): the same number of forward passes per evaluation and the
same number of evaluations.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import pickle
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from transformers_lab.config import compose_config
from transformers_lab.nn import weight_decay_groups
from transformers_lab.run.components import build_datamodule, build_model
from transformers_lab.run.memory import keep_freed_memory
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


def schedule_length(sched_cfg, steps: int) -> tuple[int, int]:
    """(warm-up, total) steps of the schedule as Task.schedule_length sets them for a run of
    ``steps``: the run's length unless the config gives one, and a warm-up cut to a tenth
    of a run shorter than it."""
    warmup = sched_cfg.warmup_steps
    if sched_cfg.max_steps is None and warmup >= steps:
        warmup = steps // 10
    return warmup, sched_cfg.max_steps or steps


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
    schedule = warmup_cosine(optimizer, *schedule_length(sched_cfg, steps), sched_cfg.min_lr_ratio)
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
    from transformers_lab.run.fit import train

    cfg = compose_config("train", overrides, workdir)
    start = time.perf_counter()
    metrics = train(cfg)
    return time.perf_counter() - start, metrics.get("val/loss", math.nan)


NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
NO_SAMPLES = "task.sample_tokens=0"  # the bare loop and nanoGPT draw no samples while training


def process_seconds(command: list[str], cwd: Path, log: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of a process, from start to exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    log.write_text(done.stdout + done.stderr)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise SystemExit(f"{command[0]} exited with {done.returncode} (log: {log}):\n{tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, cpu, done.stdout


def tlab_train_process(
    overrides: list[str], workdir: Path, log: Path
) -> tuple[float, float, float]:
    """(wall s, CPU s, final val/loss) of ``tlab-train`` as a user runs it; its output
    goes to ``log``."""
    from transformers_lab.run.record import read_record

    script = Path(sys.executable).with_name("tlab-train")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "transformers_lab.train"]
    run_dir = workdir / "run"
    command += [*overrides, f"hydra.run.dir={run_dir}"]
    workdir.mkdir(parents=True, exist_ok=True)
    seconds, cpu, _ = process_seconds(command, workdir, log)
    record = read_record(run_dir)
    return seconds, cpu, (record.metrics if record else {}).get("val/loss", math.nan)


def nanogpt_workdir(nanogpt: Path, cfg, workdir: Path) -> None:
    """nanoGPT's scripts in ``workdir`` beside the files they read, data/shakespeare_char/
    {train,val}.bin and meta.pkl, written from the experiment's data module."""
    missing = [f for f in NANOGPT_FILES if not (nanogpt / f).is_file()]
    if missing:
        raise SystemExit(
            f"--nanogpt {nanogpt}: no {', '.join(missing)} there; give a checkout of "
            "https://github.com/karpathy/nanoGPT"
        )
    if not str(cfg.data.get("_target_", "")).endswith("ShakespeareCharDataModule"):
        raise SystemExit(
            f"--against nanogpt runs nanoGPT's shakespeare_char data; experiment trains on "
            f"{cfg.data.get('_target_')}: use an experiment with data=shakespeare_char"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    for name in NANOGPT_FILES:
        shutil.copy(nanogpt / name, workdir / name)
    datamodule = build_datamodule(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    data = workdir / "data" / "shakespeare_char"
    data.mkdir(parents=True, exist_ok=True)
    for split, stream in datamodule.streams.items():  # the prepared shards, as one file
        stream.read(0, len(stream)).astype(np.uint16).tofile(data / f"{split}.bin")
    itos = dict(enumerate(datamodule.tokenizer.chars.itos))
    meta = {"vocab_size": len(itos), "itos": itos, "stoi": {c: i for i, c in itos.items()}}
    (data / "meta.pkl").write_bytes(pickle.dumps(meta))


def nanogpt_flags(cfg, steps: int, eval_iters: int) -> list[str]:
    """nanoGPT's command-line settings for the composed experiment."""
    m, d, o, s, t = cfg.model, cfg.data, cfg.optimizer, cfg.scheduler, cfg.trainer
    warmup, decay = schedule_length(s, steps)
    flags = {
        "dataset": "shakespeare_char",
        "out_dir": "out",
        "device": "cpu",
        "compile": False,
        "dtype": "float32",
        "wandb_log": False,
        "always_save_checkpoint": False,  # nanoGPT's Shakespeare config: save when val improves
        "gradient_accumulation_steps": 1,
        "batch_size": d.batch_size,
        "block_size": d.block_size,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_embd": m.d_model,
        "dropout": m.dropout,
        "bias": m.bias,
        "learning_rate": o.lr,
        "beta1": o.betas[0],
        "beta2": o.betas[1],
        "weight_decay": o.weight_decay,
        "grad_clip": t.gradient_clip_val or 0.0,
        "warmup_iters": warmup,
        "lr_decay_iters": decay,
        "min_lr": o.lr * s.min_lr_ratio,
        "max_iters": steps - 1,  # nanoGPT takes max_iters + 1 steps
        "eval_interval": t.val_check_interval or steps,
        "eval_iters": eval_iters,
        "log_interval": 10,
    }
    return [f"--{k}={v}" for k, v in flags.items()]


def nanogpt_process(nanogpt: Path, cfg, steps: int, eval_iters: int, workdir: Path, log: Path):
    """(wall s, CPU s, last val loss nanoGPT printed, the step it printed it at) of
    nanoGPT's ``train.py``; its output goes to ``log``. nanoGPT evaluates before a step
    and stops after ``max_iters``: its last evaluation is at the last multiple of
    ``eval_interval`` below the run's end, not at the end as ``tlab-train``'s."""
    nanogpt_workdir(nanogpt, cfg, workdir)
    command = [sys.executable, "train.py", *nanogpt_flags(cfg, steps, eval_iters)]
    seconds, cpu, stdout = process_seconds(command, workdir, log)
    found = re.findall(r"step (\d+): train loss [-\d.naif]+, val loss ([-\d.naif]+)", stdout)
    if not found:
        return seconds, cpu, math.nan, "none"
    step, loss = found[-1]
    return seconds, cpu, float(loss), f"step {step}"


def pair_ratios(rows: list[dict], name: str, other: str) -> list[float]:
    """Wall time of ``name`` over ``other`` for each repeat: the two runs of a repeat are
    back to back, so a drift of the machine's speed over the whole bench (minutes to
    tens of minutes, often 10% on a shared machine) cancels in them."""
    seconds = {(r["side"], r["repeat"]): r["seconds"] for r in rows}
    repeats = sorted({r["repeat"] for r in rows})
    return [seconds[name, i] / seconds[other, i] for i in repeats]


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
    parser.add_argument(
        "--against",
        choices=["bare", "nanogpt"],
        default="bare",
        help="a bare PyTorch loop in this process, or nanoGPT's train.py as a process",
    )
    parser.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT")
    parser.add_argument(
        "--eval-iters", type=int, default=20, help="nanoGPT's batches per split per evaluation"
    )
    parser.add_argument("--out", default="bench_out/training")
    args = parser.parse_args(argv)
    if args.against == "nanogpt" and args.nanogpt is None:
        parser.error("--against nanogpt needs --nanogpt <a checkout of karpathy/nanoGPT>")

    common = [
        f"experiment={args.experiment}",
        f"trainer.max_steps={args.steps}",
        "trainer.max_epochs=-1",
        "test=false",
        NO_SAMPLES,
        *args.overrides,
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sides: list[tuple[str, Callable[[Path, Path], tuple[float, float, float, str]]]]
        if args.against == "bare":
            other, name = "bare", "tlab"
            # train() sets malloc's keep_freed_memory for the process: set it before either
            # side runs, so that both run under it, the bare loop's first run too
            keep_freed_memory()

            def timed(run, overrides):
                def side(workdir: Path, log: Path) -> tuple[float, float, float, str]:
                    cpu = time.process_time()
                    seconds, val_loss = run(overrides, args.steps, workdir)
                    return seconds, time.process_time() - cpu, val_loss, "end"

                return side

            sides = [
                ("bare", timed(bare_loop, common)),
                ("tlab", timed(framework, common + args.framework_overrides)),
            ]
        else:
            other, name = "nanogpt", "tlab-train"
            limit = f"trainer.limit_val_batches={2 * args.eval_iters}"
            cfg = compose_config("train", common, Path(tmp) / "cfg")
            sides = [
                (
                    "nanogpt",
                    lambda w, log: nanogpt_process(
                        args.nanogpt, cfg, args.steps, args.eval_iters, w, log
                    ),
                ),
                (
                    "tlab-train",
                    lambda w, log: (
                        *tlab_train_process(common + args.framework_overrides + [limit], w, log),
                        "end",
                    ),
                ),
            ]
        for repeat in range(args.repeats):
            for side, run in sides[:: -1 if repeat % 2 else 1]:
                log = out / f"{side}{repeat}.log"  # kept: the work dirs are temporary
                seconds, cpu, val_loss, val_at = run(Path(tmp) / f"{side}{repeat}", log)
                rows.append(
                    {
                        "side": side,
                        "repeat": repeat,
                        "seconds": seconds,
                        "cpu_seconds": cpu,
                        "val_loss": val_loss,
                        "val_at": val_at,
                    }
                )
                print(
                    f"{side:10s} run {repeat}: {seconds:8.1f} s wall, {cpu:8.1f} s CPU, "
                    f"val/loss {val_loss:.4f} ({val_at})",
                    flush=True,
                )
    stem = "training" if args.against == "bare" else "nanogpt"
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["side"] == side)

    last = {r["side"]: r for r in rows}  # each side's last run
    ratio = median(name, "seconds") / median(other, "seconds")
    cpu_ratio = median(name, "cpu_seconds") / median(other, "cpu_seconds")
    label = "framework / bare" if args.against == "bare" else "tlab-train / nanoGPT"
    pairs = pair_ratios(rows, name, other)
    lines = [
        f"experiment={args.experiment}, {args.steps} steps, {args.repeats} run(s) each, "
        f"{torch.get_num_threads()} threads",
        "",
        "| side | median wall s | median CPU s | last val/loss (where) |",
        "|---|---|---|---|",
        *(
            f"| {s} | {median(s, 'seconds'):.1f} | {median(s, 'cpu_seconds'):.1f} | "
            f"{last[s]['val_loss']:.4f} ({last[s]['val_at']}) |"
            for s in (other, name)
        ),
        "",
        f"{label} wall time: {ratio:.3f}",
        f"{label} CPU time: {cpu_ratio:.3f}",
        f"{label} wall time, run by run (each pair back to back): "
        f"{', '.join(f'{r:.3f}' for r in pairs)}; median {statistics.median(pairs):.3f}",
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
