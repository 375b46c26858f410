"""What does pruning save? The same Optuna study run with each pruner, side by side.

Usage::

    python -m transformers_lab.bench.study                       # lr_optuna on MQAR, 12 trials
    python -m transformers_lab.bench.study --pruners none median hyperband
    python -m transformers_lab.bench.study --trials 3 -- trainer.max_epochs=1   # a quick look
    python -m transformers_lab.bench.study --replay bench_out/study/0-none --pruners median asha

Each pruner runs ``tlab-train sweep=lr_optuna experiment=mqar pruner=<p>`` as a user
would, in its own sweep dir under ``--out``, with the same sampler seed; the order of
the pruners alternates from one repeat to the next (``--repeats``), so drift in the
machine's speed hits both. For each it reports the wall time, the best value, how many
trials were pruned, and the training steps all trials took together; then each pruner's
wall time and best value against the first one's. Reports go to ``--out`` as
``study_bench.csv`` and ``study_bench.md``.

``--replay <sweep dir>`` trains nothing: it replays the trials of a finished study run
without pruning (their reported values, step by step, in their order) through each
pruner, and prints the steps each would have kept and the best value it would still
have found. It answers "which pruner, for this kind of curve?" in seconds; the order of
the trials is the unpruned study's (a sampler that learns from pruned trials would have
asked others).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

COLUMNS = ["repeat", "pruner", "wall_s", "best", "complete", "pruned", "failed", "steps"]


def run_study(pruner: str, sweep: Path, trials: int, extra: Sequence[str]) -> dict:
    """Run one study; its wall time and what its study holds."""
    import optuna

    command = [
        sys.executable, "-m", "transformers_lab.train", "sweep=lr_optuna", "experiment=mqar",
        f"pruner={pruner}", f"hydra.sweeper.n_trials={trials}", f"hydra.sweep.dir={sweep}",
        "trainer.enable_progress_bar=false", "logger=csv", *extra,
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline"}
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"pruner={pruner} failed:\n{proc.stderr[-3000:]}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{sweep / 'study.db'}")
    states = [t.state.name for t in study.trials]
    return {
        "pruner": pruner,
        "wall_s": round(wall, 1),
        "best": study.best_value,
        "complete": states.count("COMPLETE"),
        "pruned": states.count("PRUNED"),
        "failed": states.count("FAIL"),
        "steps": sum(t.last_step or 0 for t in study.trials),
    }


def pruner(name: str):
    """The Optuna pruner of the ``conf/pruner`` option ``name``."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from transformers_lab.cli import group_options, unknown_option
    from transformers_lab.config import CONF_DIR

    if name not in group_options("pruner"):
        raise SystemExit(f"error: {unknown_option('pruner', name)}")
    return instantiate(OmegaConf.load(CONF_DIR / "pruner" / f"{name}.yaml"))


def replay(trials: Sequence, pruner_name: str, direction: str = "maximize") -> dict:
    """What ``pruner_name`` would have given on ``trials``, finished without pruning:
    each trial's reports in order, stopped where the pruner says. Returns the steps
    kept, the best final value among the trials it let finish, and how many it pruned."""
    import optuna

    study = optuna.create_study(direction=direction, pruner=pruner(pruner_name))
    steps, pruned, finals = 0, 0, []
    for frozen in trials:
        trial, last = study.ask(), 0
        for step, value in sorted(frozen.intermediate_values.items()):
            trial.report(value, step)
            last = step
            if trial.should_prune():
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                pruned += 1
                break
        else:
            study.tell(trial, frozen.value)
            finals.append(frozen.value)
        steps += last
    best = (max if direction == "maximize" else min)(finals) if finals else None
    return {"pruner": pruner_name, "steps": steps, "best": best, "pruned": pruned}


def run_replay(sweep: Path, pruners: Sequence[str]) -> list[str]:
    """Replay the study of ``sweep`` (its ``study.json`` names it) through each pruner."""
    import json

    import optuna

    for name in pruners:  # every name checked before anything is read
        pruner(name)
    if not (sweep / "study.json").is_file():
        raise SystemExit(
            f"error: {sweep} holds no study.json; give the sweep dir of a study sweep "
            "(its hydra.sweep.dir)"
        )
    info = json.loads((sweep / "study.json").read_text())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(
        study_name=info["study_name"], storage=f"sqlite:///{sweep / 'study.db'}"
    )
    trials = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if len(trials) < len(study.trials) or not trials:
        raise SystemExit(
            f"error: {sweep} holds pruned, failed or no trials; replay a study run with pruner=none"
        )
    direction = study.direction.name.lower()
    total = sum(t.last_step or 0 for t in trials)
    lines = [f"replay of {len(trials)} trials of {sweep} ({total} steps without pruning):"]
    for name in pruners:
        r = replay(trials, name, direction)
        best = "none finished" if r["best"] is None else f"{r['best']:.4f}"
        lines.append(
            f"pruner={name}: {r['steps']} steps ({1 - r['steps'] / total:.0%} fewer), "
            f"{r['pruned']} pruned, best {best}"
        )
    return lines


def compare(rows: Sequence[dict], pruners: Sequence[str]) -> list[str]:
    """Each pruner's mean wall time and best value against the first pruner's."""

    def mean(pruner: str, key: str) -> float:
        values = [r[key] for r in rows if r["pruner"] == pruner]
        return sum(values) / len(values)

    base = pruners[0]
    lines = []
    for pruner in pruners[1:]:
        saved = 1 - mean(pruner, "wall_s") / mean(base, "wall_s")
        delta = mean(pruner, "best") - mean(base, "best")
        steps = mean(pruner, "steps") / mean(base, "steps")
        lines.append(
            f"pruner={pruner} against pruner={base}: {saved:.0%} less wall time, "
            f"{steps:.2f}x the training steps, best value {delta:+.4f}"
        )
    return lines


def markdown(rows: Sequence[dict], summary: Sequence[str], header: str) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    body = "".join(
        "| " + " | ".join(
            f"{r[c]:.4f}" if c == "best" else str(r[c]) for c in COLUMNS
        ) + " |\n"
        for r in rows
    )  # fmt: skip
    return f"{header}\n\n{head}{body}\n" + "".join(f"- {line}\n" for line in summary)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m transformers_lab.bench.study", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--pruners", nargs="+", default=["none", "median"])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench_out/study"))
    parser.add_argument(
        "--replay",
        type=Path,
        metavar="SWEEP_DIR",
        help="replay a finished unpruned study through --pruners; trains nothing",
    )
    parser.add_argument("overrides", nargs="*", help="after --: overrides for every trial")
    args = parser.parse_args(argv)
    if args.replay is not None:
        for line in run_replay(args.replay, args.pruners):
            print(line)
        return 0
    rows = []
    for repeat in range(args.repeats):
        order = args.pruners if repeat % 2 == 0 else list(reversed(args.pruners))
        for pruner in order:
            sweep = args.out / f"{repeat}-{pruner}"
            if sweep.exists():
                raise SystemExit(f"error: {sweep} exists; give another --out")
            row = {"repeat": repeat, **run_study(pruner, sweep, args.trials, args.overrides)}
            print(" ".join(f"{c}={row[c]}" for c in COLUMNS), flush=True)
            rows.append(row)
    summary = compare(rows, args.pruners)
    for line in summary:
        print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "study_bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    header = (
        f"# lr_optuna ({args.trials} trials, experiment=mqar) by pruner; "
        f"overrides: {' '.join(args.overrides) or 'none'}; {os.cpu_count()} CPUs"
    )
    (args.out / "study_bench.md").write_text(markdown(rows, summary, header))
    print(f"report: {args.out / 'study_bench.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
