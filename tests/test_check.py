"""``tlab-check``: the kernel's contract and the layer around it, one entry point; and the
kernel's own command line, ``python -m transformers_lab.attention.check``, which imports
nothing above ``attention``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from transformers_lab.attention import check as kernel_check
from transformers_lab.attention.resolve import kernel_factory
from transformers_lab.attention.testbed import build
from transformers_lab.check import main

ROOT = Path(__file__).resolve().parents[1]
LAYER = ["layer decode", "layer future", "layer state", "layer padding", "layer gradcheck"]


def ok_line(out: str, target: str) -> list[str]:
    """The checks an ``ok`` line says ran (it must be the output's first line)."""
    ok = re.match(rf"ok: {re.escape(target)} passes the (\d+) checks \((.*)\)\n", out)
    assert ok, out
    ran = ok[2].split(", ")
    assert int(ok[1]) == len(ran)
    return ran


def test_tlab_check_checks_the_kernel_and_the_layer_around_it(capsys):
    kernel = kernel_check.checks_for(build(kernel_factory("linear")))
    assert main(["linear", "short_conv=2"]) == 0
    assert ok_line(capsys.readouterr().out, "linear") == kernel + LAYER
    assert main(["linear"]) == 0  # no part of the layer switched on: the kernel's checks
    assert ok_line(capsys.readouterr().out, "linear") == kernel


def test_the_kernel_check_alone_runs_without_nn_and_points_to_tlab_check():
    """``python -m transformers_lab.attention.check`` (run as ``-m`` runs it) checks the
    kernel, says where the layer is checked, and never imports ``nn`` or above."""
    script = (
        "import runpy, sys\n"
        "sys.argv = ['check', 'linear', 'short_conv=2']\n"
        "try:\n"
        "    runpy.run_module('transformers_lab.attention.check', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    ours = {m.split('.')[1] for m in sys.modules if m.startswith('transformers_lab.')}\n"
        "    print('packages:', ' '.join(sorted(ours)), 'status:', exc.code)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernel = kernel_check.checks_for(build(kernel_factory("linear")))
    assert ok_line(proc.stdout, "linear") == kernel
    lines = proc.stdout.splitlines()
    assert lines[1] == "the kernel alone; the layer around it too: tlab-check linear short_conv=2"
    packages = lines[2].split("packages: ")[1].split(" status: ")
    assert packages[1] == "0"
    assert set(packages[0].split()) <= {"attention", "config", "errors", "files"}, packages
