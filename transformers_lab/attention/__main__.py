"""The registered kernels as a markdown table (the README's, between its markers)::

python -m transformers_lab.attention                  # print the table
python -m transformers_lab.attention --readme README.md   # rewrite the README's table
python -m transformers_lab.attention --readme README.md --config-dir my_conf   # and yours

With ``--config-dir`` (repeatable; or ``make docs ARGS="--config-dir my_conf"``) the table
also has the kernels of that config dir's ``attention/`` options, the user's own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from transformers_lab.attention import KERNELS, AttentionKernel
from transformers_lab.attention.contract import call_with_heads

BEGIN = "<!-- kernel table: python -m transformers_lab.attention --readme README.md -->"
END = "<!-- end of kernel table -->"


def state(cls: type) -> str:
    kernel = call_with_heads(cls, 1, head_dim=64)
    dims = "D = Dv = 64" if kernel.qk_dim == 64 else f"D = {kernel.qk_dim}, Dv = 64"
    if cls.constant_state:
        return f"constant: {kernel.state_size(1):,} numbers a head ({dims})"
    return f"grows: {kernel.state_size(1):,} numbers a head and token ({dims})"


def user_kernels(config_dirs: Sequence[Path]) -> list[type[AttentionKernel]]:
    """The kernel classes of the attention options in the user's ``config_dirs`` (importing
    them registers them)."""
    from transformers_lab.attention.resolve import config_dirs as with_conf
    from transformers_lab.attention.resolve import kernel_class_at
    from transformers_lab.config import attention_configs, group_options

    dirs = with_conf(config_dirs)
    theirs = set(group_options("attention", dirs)) - set(group_options("attention"))
    configs = attention_configs(dirs, sorted(theirs))
    return [kernel_class_at(config["_target_"]) for config in configs.values()]


def presets(config_dirs: Sequence[Path] = ()) -> dict[str, list[str]]:
    """The attention options (``attention=<name>``) of each kernel class, by its class
    path, each with the layer parts it switches on: ``gated (short_conv=4, qk_norm=True)``."""
    from transformers_lab.attention.resolve import config_dirs as with_conf
    from transformers_lab.config import attention_configs, layer_part_defaults

    out: dict[str, list[str]] = {}
    switches = layer_part_defaults()
    for name, config in attention_configs(with_conf(config_dirs)).items():
        on = [f"{k}={v}" for k, v in config.items() if k in switches]  # the defaults dropped
        cell = f"`{name}`" + (f" ({', '.join(on)})" if on else "")
        out.setdefault(config["_target_"], []).append(cell)
    return out


def kernel_table(config_dirs: Sequence[Path] = ()) -> str:
    """One row per kernel of this package, and of the attention options in the user's
    ``config_dirs``: name, weights, what it is, rows, decode state, the fused kernels that
    ``attention.backend`` may name (``attention.backends``), and its options with the layer
    parts each switches on (``conf/layer/parts.yaml``)."""
    lines = [
        "| name | weights | what | rows sum to 1 | decode state | fused backends | options "
        "(layer parts on) |",
        "|---|---|---|---|---|---|---|",
    ]
    by_class = presets(config_dirs)
    theirs = set(user_kernels(config_dirs)) if config_dirs else set()
    for name in sorted(KERNELS):
        cls = KERNELS[name]
        if not cls.__module__.startswith("transformers_lab.") and cls not in theirs:
            continue
        summary = (cls.__doc__ or "").strip().splitlines()[0].rstrip(".").replace("``", "`")
        rows = "yes" if cls.normalized else "no"
        options = ", ".join(by_class.get(f"{cls.__module__}.{cls.__qualname__}", [])) or "—"
        fused = ", ".join(cls.fused_backends) or "none: our loop"
        cells = [f"`{name}`", cls.formula, summary, rows, state(cls), fused, options]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def with_table(text: str, table: str) -> str:
    """``text`` with the part between the markers replaced by ``table``."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"no kernel table markers in the text: put {BEGIN} and {END} around it")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformers_lab.attention")
    parser.add_argument("--readme", type=Path, help="rewrite the table in this markdown file")
    parser.add_argument(
        "--config-dir",
        action="append",
        default=[],
        type=Path,
        metavar="DIR",
        help="a config dir of yours (as on hydra.searchpath): its attention options' kernels "
        "join the table",
    )
    args = parser.parse_args(argv)
    try:
        table = kernel_table(args.config_dir)
    except ValueError as exc:  # a dir without attention/, a kernel that does not import
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.readme is None:
        print(table)
        return 0
    try:
        args.readme.write_text(with_table(args.readme.read_text(), table))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"kernel table written to {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
