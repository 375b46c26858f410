"""One prepared run for a GPU window: every step that needs a GPU, each with its own time
limit, a result written after each, in at most 9 min 20 s of steps on an H100 or H200::

    python -m transformers_lab.bench.gpu_window --out bench_out/gpu_window   # make gpu-window
    python -m transformers_lab.bench.gpu_window --dry-run                    # any machine

The steps, in order (``STEPS``):

1. ``env``: the GPU, the driver, torch, Triton and fla, and whether the carried autotune
   cache was made by this Triton and this fla (``pinned``);
2. ``bench_4096``, ``bench_16384``, ``bench_65536``: the kernel bench on CUDA in bf16,
   causal forward+backward, B=2, H=8, D=64: flash softmax, every kernel a fused kernel
   covers on our loop (``_loop``), on each of its backends (``_fla``, ``_flex``; fastmax
   p=2 on ours, ``_triton``) and fla's op alone (``_fla_op``), each warmed up at the timed
   N (``bench.kernels``);
3. ``gpu_tests``: the tests marked gpu (tests/gpu), their figures in ``gpu_tests.jsonl``;
4. ``bf16_backends``: every fused backend against our loop in bf16, outputs and gradients
   (``tests/gpu``'s backend tests, on their own, so a late step cannot starve them);
5. ``fastmax_long``, only when named (``--only env fastmax_long``, 7 min at most): fastmax
   p=2 on our Triton kernel against flash softmax and fla's two paths, forward and
   backward apart, B=1 and 8, N from 4096 to 131072 (``bench.fastmax_gpu``).

fla autotunes each Triton kernel at each new shape (hundreds of compiles in all) and
writes every winner to ``$TRITON_CACHE_DIR/<key>/<kernel>.autotune.json``, ``key`` a hash
of Triton's version, the GPU's architecture, the source and the environment. The window
copies the files of ``--autotune-dir`` (tests/gpu/autotune/) into its cache before the
first step, and, after every step, the autotune files, and only those, back into
``--autotune-dir`` and into ``autotune.tar.gz`` in ``--out``: the next window, carrying
them in, skips the compiles that chose them.

``--out`` holds, after every step, six files at most (a lent machine gives back eight):
``results.json`` (each step's status, seconds and summary), ``window.log`` (every step's
output), ``bench.csv`` and ``bench.md`` (the bench's rows and tables, every N so far),
``gpu_tests.jsonl`` (the tests' figures) and ``autotune.tar.gz``; with ``fastmax_long``,
its ``fastmax_gpu.csv`` and ``.md`` too (eight). A step that runs past
its limit is stopped, said so in ``results.json``, and the next step runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
AUTOTUNE_DIR = PROJECT_ROOT / "tests" / "gpu" / "autotune"
AUTOTUNE_SUFFIX = ".autotune.json"
BENCH_NS = (4096, 16384, 65536)
BENCH_SHAPE = ["--batch", "2", "--heads", "8", "--head-dim", "64", "--repeats", "10"]


def pinned() -> dict[str, str]:
    """The versions pyproject's ``gpu`` extra pins (fla-core, Triton): the autotune cache's
    key holds them."""
    text = (PROJECT_ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^gpu = \[(.*?)^\]", text, re.S | re.M)
    found = re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', extra.group(1) if extra else "")
    return dict(found)


def bench_kernels() -> list[str]:
    """The bench's variants: flash softmax, then each covered option on our loop, on each
    of its fused backends, and fla's op alone where the bench has it."""
    from transformers_lab.bench import kernels as bench

    found = bench.variants()
    names = ["softmax"]
    for name in bench.default_variants():
        for suffix in (bench.LOOP, bench.FLA, bench.FLEX, bench.TRITON, bench.FLA_OP):
            if name + suffix in found:
                names.append(name + suffix)
    return names


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    limit_s: int
    what: str
    default: bool = True  # run unless ``--only`` names others; False: only when named


def steps(work: Path) -> list[Step]:
    """The window's steps (the module doc), their commands and time limits; the bench
    writes its reports under ``work``."""
    py = sys.executable
    found = [
        Step(
            "env",
            [py, "-m", "transformers_lab.bench.gpu_window", "--env"],
            30,
            "the GPU, the driver, torch, Triton, fla, the cache's versions",
        ),
    ]
    for n, limit in zip(BENCH_NS, (140, 110, 100), strict=True):
        command = [
            py,
            "-m",
            "transformers_lab.bench.kernels",
            "--device",
            "cuda",
            "--in-process",
            "--causal",
            "causal",
            "--dtype",
            "bfloat16",
            "--n",
            str(n),
            *BENCH_SHAPE,
            "--timeout",
            "20",
            "--out",
            str(work / f"bench_{n}"),
            "--kernels",
            *bench_kernels(),
        ]
        found.append(Step(f"bench_{n}", command, limit, f"the kernel bench at N={n}, bf16"))
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "gpu", "tests/gpu"]
    found.append(
        Step("gpu_tests", [*pytest, "-n", "8", "-k", "not backend"], 120, "the tests marked gpu")
    )
    found.append(
        Step(
            "bf16_backends",
            [*pytest, "-k", "backend"],
            60,
            "every fused backend against our loop in bf16",
        )
    )
    found.append(
        Step(
            "fastmax_long",
            [py, "-m", "transformers_lab.bench.fastmax_gpu", "--out", str(work / "fastmax_gpu")],
            420,
            "fastmax p=2 on our Triton kernel against flash softmax and fla, N 4k to 128k",
            default=False,
        )
    )
    return found


# ------------------------------------------------------------------ the autotune cache


def autotune_files(cache: Path) -> list[Path]:
    """The autotune winners under a Triton cache dir, as paths relative to it."""
    if not cache.is_dir():
        return []
    return sorted(p.relative_to(cache) for p in cache.rglob(f"*{AUTOTUNE_SUFFIX}"))


def restore_autotune(saved: Path, cache: Path) -> int:
    """Copy the winners saved in ``saved`` (``<key>/<kernel>.autotune.json``) into the
    Triton cache dir ``cache``, where Triton looks for them; how many."""
    files = autotune_files(saved)
    for rel in files:
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(saved / rel, cache / rel)
    return len(files)


def save_autotune(cache: Path, saved: Path, archive: Path | None = None) -> int:
    """Copy the winners of the Triton cache dir ``cache``, and nothing else of it, into
    ``saved`` (and into the tar ``archive`` where given, written whole or not at all);
    how many."""
    files = autotune_files(cache)
    for rel in files:
        (saved / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cache / rel, saved / rel)
    if archive is not None and files:
        partial = archive.with_name(archive.name + ".partial")
        with tarfile.open(partial, "w:gz") as tar:
            for rel in files:
                tar.add(cache / rel, arcname=str(rel))
        partial.replace(archive)
    return len(files)


# ------------------------------------------------------------------ the steps


def merge_bench(work: Path, out: Path) -> None:
    """The bench's reports of every N so far as one ``bench.csv`` and one ``bench.md``
    (the csv holds the rows of a step stopped at its limit too: the bench writes them as
    it goes)."""
    csvs = [work / f"bench_{n}" / "kernels.csv" for n in BENCH_NS]
    csvs = [p for p in csvs if p.exists()]
    if not csvs:
        return
    lines = csvs[0].read_text().splitlines()[:1]
    for path in csvs:
        lines += path.read_text().splitlines()[1:]
    (out / "bench.csv").write_text("\n".join(lines) + "\n")
    parts = [
        f"## N={p.parent.name[6:]}\n\n{p.with_suffix('.md').read_text()}"
        for p in csvs
        if p.with_suffix(".md").exists()
    ]
    (out / "bench.md").write_text("\n".join(parts))


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, object]:
    """What the window runs on, and whether the carried cache fits it."""
    import torch

    found: dict[str, object] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "arch": "sm_{}{}".format(*torch.cuda.get_device_capability(0))
        if torch.cuda.is_available()
        else None,
    }
    pins = pinned()
    for package in pins:
        found[package] = version(package)
    found["cache_fits"] = bool(pins) and all(found[p] == v for p, v in pins.items())
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        found["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        found["nvidia_smi"] = f"not run: {exc}"
    return found


def dry_run(step: Step) -> tuple[str, str]:
    """Walk a step without a GPU: its command checked as far as a CPU can (the bench's
    arguments parsed, the variants resolved; the tests collected)."""
    if step.name == "env":
        return "dry-run ok", json.dumps(environment())
    if step.name == "fastmax_long":
        from transformers_lab.bench import fastmax_gpu

        with contextlib.redirect_stdout(io.StringIO()) as plan:
            fastmax_gpu.main([*step.command[3:], "--dry-run"])
        return "dry-run ok", plan.getvalue().strip()
    if step.name.startswith("bench_"):
        from transformers_lab.bench import kernels as bench

        args = bench.build_parser().parse_args(step.command[3:])
        configs = bench.variant_configs(args.kernels, (bench.CONF_DIR,))
        return "dry-run ok", f"{len(configs)} variants at N={args.n}: {' '.join(args.kernels)}"
    command = step.command
    workers = [i for i, c in enumerate(command) if c == "-n"]  # "-n N": collected in one
    collect = [c for i, c in enumerate(command) if not {i, i - 1} & set(workers)]
    collect.append("--collect-only")
    proc = subprocess.run(collect, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300)
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    return ("dry-run ok" if proc.returncode in (0, 5) else f"collect failed: {last}"), last


def run_step(step: Step, log: Path, env: dict[str, str]) -> tuple[str, str]:
    """Run one step under its limit, its output appended to ``log``; status and summary.
    At the limit the step's whole process group is stopped (pytest's workers too): SIGTERM,
    then SIGKILL 10 s later."""
    with log.open("a") as f:
        f.write(f"\n===== {step.name}: {' '.join(step.command)} (limit {step.limit_s} s)\n")
        f.flush()
        proc = subprocess.Popen(
            step.command, stdout=f, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=step.limit_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):  # whatever of the group is left
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"stopped at its limit of {step.limit_s} s", ""
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    return ("ok" if code == 0 else f"exit {code}"), tail[0][-300:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformers_lab.bench.gpu_window")
    parser.add_argument("--out", type=Path, default=Path("bench_out/gpu_window"))
    parser.add_argument(
        "--autotune-dir",
        type=Path,
        default=AUTOTUNE_DIR,
        help="fla's autotune winners to carry in, and where to save them",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="walk every step without a GPU: commands checked, nothing timed",
    )
    parser.add_argument("--only", nargs="+", metavar="STEP", help="run these steps alone")
    parser.add_argument("--env", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.env:
        print(json.dumps(environment(), indent=1))
        return 0
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_window_"))
    plan = steps(work)
    names = [s.name for s in plan]
    if args.only and (unknown := sorted(set(args.only) - set(names))):
        print(
            f"error: unknown step(s) {', '.join(unknown)}; the steps are {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    plan = [s for s in plan if s.name in args.only] if args.only else [s for s in plan if s.default]
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "error: no CUDA GPU is visible; run this on a GPU machine, or --dry-run to walk "
            "the steps here",
            file=sys.stderr,
        )
        return 2
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or tempfile.mkdtemp(prefix="triton_cache_"))
    env = dict(
        os.environ,
        TRITON_CACHE_DIR=str(cache),
        PYTHONUNBUFFERED="1",
        TLAB_GPU_LOG=str((out / "gpu_tests.jsonl").resolve()),
        WANDB_MODE="offline",
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    results: dict[str, object] = {
        "dry_run": args.dry_run,
        "carried_in": 0 if args.dry_run else restore_autotune(args.autotune_dir, cache),
        "steps": [],
    }
    log = out / "window.log"
    for step in plan:
        start = time.monotonic()
        print(f"[{step.name}] {step.what} (limit {step.limit_s} s)", flush=True)
        status, summary = dry_run(step) if args.dry_run else run_step(step, log, env)
        if not args.dry_run:
            results["autotune_saved"] = save_autotune(
                cache, args.autotune_dir, out / "autotune.tar.gz"
            )
        if step.name.startswith("bench_") and not args.dry_run:
            merge_bench(work, out)
        for found in (work / "fastmax_gpu").glob("fastmax_gpu.*"):  # fastmax_long's table
            shutil.copy2(found, out / found.name)
        results["steps"].append(
            {  # type: ignore[union-attr]
                "step": step.name,
                "status": status,
                "seconds": round(time.monotonic() - start, 1),
                "limit_s": step.limit_s,
                "summary": summary,
                "command": step.command,
            }
        )
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"[{step.name}] {status}: {summary[:200]}", flush=True)
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
