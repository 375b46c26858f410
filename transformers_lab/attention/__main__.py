"""The registered kernels as a markdown table (the README's, between its markers)::

python -m transformers_lab.attention                  # print the table
python -m transformers_lab.attention --readme README.md   # rewrite the README's table
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from transformers_lab.attention import KERNELS

BEGIN = "<!-- kernel table: python -m transformers_lab.attention --readme README.md -->"
END = "<!-- end of kernel table -->"


def state(cls: type) -> str:
    kernel = cls(head_dim=64, num_heads=1)
    if cls.linear:
        return f"constant: {kernel.state_size(1):,} numbers a head (D = Dv = 64)"
    return f"grows: {kernel.state_size(1):,} numbers a head and token (D = Dv = 64)"


def kernel_table(everyone: bool = False) -> str:
    """One row per kernel of this package (``everyone``: every registered one, the user's
    own included): name, weights, what it is, rows, decode state."""
    lines = [
        "| name | weights | what | rows sum to 1 | decode state |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(KERNELS):
        cls = KERNELS[name]
        if not everyone and not cls.__module__.startswith("transformers_lab."):
            continue
        summary = (cls.__doc__ or "").strip().splitlines()[0].rstrip(".").replace("``", "`")
        rows = "yes" if cls.normalized else "no"
        cells = [f"`{name}`", cls.formula, summary, rows, state(cls)]
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
    args = parser.parse_args(argv)
    table = kernel_table()
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
