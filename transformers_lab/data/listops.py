"""LRA's ListOps generator (Nangia and Bowman, 2018, as LRA generates it in
``lra_benchmarks/data/listops.py``): nested ``[MAX``, ``[MIN``, ``[MED`` and ``[SM`` (sum
modulo 10) over the digits 0-9, closed by ``]``; the label is the expression's value, 10
classes. A node below ``max_depth`` is an operator with probability 0.25, over 2 to
``max_args`` arguments, else a digit; trees are drawn until ``min_length < tokens <
max_length`` (LRA: depth 10, 10 arguments, 500 to 2000 tokens, 96000/2000/2000 unique
examples). LRA's input pipeline drops the tree's brackets ``(`` ``)``; the tokens are the
operators, digits and ``]``.

Plain Python from a seed; ``lra.ListOpsDataModule`` pads the tokens to tensors.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from transformers_lab.errors import at_least, must_be

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
PAD = "<pad>"
LISTOPS_VOCAB = (PAD, *map(str, range(10)), *OPERATORS, END)  # id 0 pads
LISTOPS_IDS = {token: i for i, token in enumerate(LISTOPS_VOCAB)}
OPERATOR_P = 0.25  # LRA's VALUE_P: below max_depth a node is an operator with this chance
# the generator and the evaluator recurse once a level: well inside Python's 1000 frames
LISTOPS_MAX_DEPTH = 100

Tree = int | tuple[str, list["Tree"]]


class TooLong(Exception):
    """A tree grew past the longest kept: drawing it further would be thrown away."""


def listops_tree(
    rng: random.Random, depth: int, max_depth: int, max_args: int, budget: list[int] | None = None
) -> Tree:
    """A random ListOps tree drawn as LRA's ``generate_tree``: below ``max_depth`` a node is
    an operator with probability 0.25, over 2 to ``max_args`` arguments, else a digit.

    ``budget`` ([tokens left]) stops a tree that grows past it (``TooLong``): a tree LRA
    would reject for its length is rejected before it is drawn whole, which leaves the
    distribution of the kept ones as it was."""
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            raise TooLong
    if depth < max_depth and rng.random() <= OPERATOR_P:
        if budget is not None:
            budget[0] -= 1  # the closing bracket
        count = rng.randint(2, max_args)
        args = [listops_tree(rng, depth + 1, max_depth, max_args, budget) for _ in range(count)]
        return (rng.choice(OPERATORS), args)
    return rng.randrange(10)


def listops_value(tree: Tree) -> int:
    """The value of a ListOps tree: MED is the median rounded down (numpy's median of an
    even count, then ``int``, as LRA labels it), SM the sum modulo 10."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    values = sorted(listops_value(arg) for arg in args)
    if op == "[MIN":
        return values[0]
    if op == "[MAX":
        return values[-1]
    if op == "[SM":
        return sum(values) % 10
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else int((values[mid - 1] + values[mid]) / 2)


def listops_tokens(tree: Tree) -> list[str]:
    """The tree written as LRA's model reads it: operators, digits and ``]``."""
    if isinstance(tree, int):
        return [str(tree)]
    op, args = tree
    return [op, *(token for arg in args for token in listops_tokens(arg)), END]


def check_listops(max_depth: int, max_args: int, min_length: int, max_length: int) -> None:
    """Refuse ListOps sizes no tree can meet."""
    at_least(1, max_depth=max_depth)
    at_least(2, max_args=max_args)
    at_least(0, min_length=min_length)
    if max_depth > LISTOPS_MAX_DEPTH:
        raise ValueError(
            must_be("max_depth", f"at most {LISTOPS_MAX_DEPTH} (LRA uses 10)", max_depth)
        )
    # the longest tree: every node above the last level an operator of max_args arguments
    operators = sum(max_args**level for level in range(max_depth - 1))
    longest = 2 * operators + max_args ** (max_depth - 1)
    if max_length <= min_length + 1:
        raise ValueError(
            f"max_length={max_length} must exceed min_length={min_length} + 1: the lengths "
            "kept lie strictly between them (LRA: 500 and 2000)"
        )
    if min_length + 1 > longest:
        raise ValueError(
            f"min_length={min_length} is out of reach: trees of max_depth={max_depth} and "
            f"max_args={max_args} are at most {longest} tokens long; lower min_length or "
            "raise max_depth or max_args"
        )


def listops(
    num_examples: int,
    seed: int,
    max_depth: int = 10,
    max_args: int = 10,
    min_length: int = 500,
    max_length: int = 2000,
    kept: Callable[[], Any] | None = None,
) -> tuple[list[list[str]], list[int]]:
    """``num_examples`` distinct ListOps expressions (token lists) and their values, drawn
    from ``seed`` as LRA draws them: a tree is kept when ``min_length < tokens <
    max_length`` and it is new. ``kept`` is called at each one kept (a progress bar)."""
    check_listops(max_depth, max_args, min_length, max_length)
    rng = random.Random(seed)
    seen: set[tuple[str, ...]] = set()
    expressions: list[list[str]] = []
    values: list[int] = []
    misses = 0  # draws since the last one kept: LRA's sizes keep about 1 in 12
    while len(expressions) < num_examples:
        misses += 1
        if misses > 100_000:
            raise ValueError(
                f"ListOps trees of max_depth={max_depth} and max_args={max_args} rarely fall "
                f"between min_length={min_length} and max_length={max_length} tokens, or too "
                f"few differ for {num_examples} examples; widen the lengths or raise the depth"
            )
        try:
            tree = listops_tree(rng, 1, max_depth, max_args, budget=[max_length - 1])
        except TooLong:
            continue
        tokens = listops_tokens(tree)
        key = tuple(tokens)
        if min_length < len(tokens) < max_length and key not in seen:
            seen.add(key)
            expressions.append(tokens)
            if kept is not None:
                kept()
            values.append(listops_value(tree))
            misses = 0
    return expressions, values
