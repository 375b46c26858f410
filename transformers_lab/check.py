"""``tlab-check``: an attention kernel checked against the contract, and the layer around it::

    tlab-check fastmax p=1
    tlab-check fastmax_p2 short_conv=4                 # the layer's checks too
    tlab-check mine --config-dir my_conf               # a kernel of your own
    tlab-check my_package.kernels.MyKernel scale=0.5
    tlab-check softmax --alibi
    tlab-check gla --device cuda                       # on a GPU, and placed there

The kernel's contract is ``attention.check``'s (its docstring lists the checks and the
targets it takes); the layer's checks, where the kernel's config switches on a part of the
layer or the kernel declares gate inputs, and the placement on a GPU, are ``nn.check``'s.
One line per failure, and exit status 1 if any; ``ok`` and exit status 0 otherwise; a
target that cannot be built, one ``error:`` line and exit status 2.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers_lab.attention.check import (
    BUILD_ERRORS,
    command_line,
    kernel_checks,
    read_target,
    refused,
    report,
    run_checks,
)
from transformers_lab.nn.check import check_placement, layer_failures


def main(argv: Sequence[str] | None = None) -> int:
    """``tlab-check TARGET [key=value ...]``: its exit status (the module docstring)."""
    args = command_line("tlab-check").parse_args(argv)
    try:
        target = read_target(args)
        failures, ran = kernel_checks(target)
        with target.device:
            layer, layer_ran = layer_failures(target.layer, alibi=target.alibi)
        failures, ran = failures + layer, ran + layer_ran
        if target.device.type != "cpu":
            failures += run_checks(
                {"placement": lambda: check_placement(target.layer, target.device, target.alibi)}
            )
            ran.append("placement")
    except BUILD_ERRORS as exc:  # it cannot be built
        return refused(exc)
    return report(target, failures, ran)


if __name__ == "__main__":
    raise SystemExit(main())
