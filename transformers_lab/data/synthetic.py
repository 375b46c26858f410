"""Synthetic sequence tasks, generated deterministically from a seed: multi-query
associative recall (MQAR, as in the Zoology benchmark, Arora et al., 2023), copy and sort.

Every example is (inputs, labels) of length ``block_size`` for next-token prediction, with
labels -100 wherever there is nothing to predict, so the loss and the accuracy cover the
answer positions only.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from transformers_lab.data.base import IGNORE, InMemoryDataModule
from transformers_lab.errors import at_least

PROBLEMS = ("mqar", "copy", "sort")


def check_mqar_sizes(vocab_size: int, block_size: int, num_kv_pairs: int) -> None:
    """Refuse MQAR sizes that cannot hold the pairs and their queries."""
    if block_size < 4 * num_kv_pairs:
        raise ValueError(
            f"block_size={block_size} is too short for num_kv_pairs={num_kv_pairs}: MQAR needs "
            f"block_size >= 4 * num_kv_pairs = {4 * num_kv_pairs}"
        )
    half = vocab_size // 2
    if half - 1 < num_kv_pairs or vocab_size - half < num_kv_pairs:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for {num_kv_pairs} distinct keys and values "
            f"(keys from the lower half, id 0 aside; values from the upper half)"
        )


def mqar(
    num_examples: int,
    vocab_size: int = 8192,
    block_size: int = 64,
    num_kv_pairs: int = 8,
    power_a: float = 0.01,
    seed: int = 0,
    random_non_queries: bool = True,
) -> tuple[Tensor, Tensor]:
    """MQAR examples: ``num_kv_pairs`` key-value pairs, then each key again as a query.

    Keys come from the lower half of the vocabulary (id 0 excluded), values from the upper
    half. The pairs fill the first ``2 * num_kv_pairs`` positions; each key is queried once
    after them, at an even offset ``2 * gap`` whose gap follows the power law
    p(gap) ~ gap^(power_a - 1) (most queries come soon after the context). The label at a
    query position is the value bound to that key; the other positions hold random tokens
    (``random_non_queries``; else 0, as in Zoology's Figure 2) and the label -100.
    """
    check_mqar_sizes(vocab_size, block_size, num_kv_pairs)
    context = 2 * num_kv_pairs
    space = (block_size - context) // 2
    half = vocab_size // 2
    g = torch.Generator().manual_seed(seed)
    n = num_examples

    def distinct(count: int, low: int, high: int) -> Tensor:  # (n, count) without repeats
        rows = max(1, 2**24 // (high - low))  # bound the (rows, high - low) scores
        return (
            torch.cat(
                [
                    torch.rand(min(rows, n - i), high - low, generator=g).topk(count, dim=1).indices
                    for i in range(0, n, rows)
                ]
            )
            + low
        )

    keys = distinct(num_kv_pairs, 1, half)
    values = distinct(num_kv_pairs, half, vocab_size)
    # power-law gaps without replacement: Gumbel top-k on log p
    gap = torch.arange(1, space + 1, dtype=torch.float64)
    log_p = torch.log(power_a * gap ** (power_a - 1))
    gumbel = -torch.log(-torch.log(torch.rand(n, space, generator=g, dtype=torch.float64)))
    gaps = (log_p + gumbel).topk(num_kv_pairs, dim=1).indices  # (n, P) in [0, space)

    seq = torch.zeros(n, block_size + 1, dtype=torch.long)
    seq[:, 0:context:2], seq[:, 1:context:2] = keys, values
    query_pos = context + 2 * gaps
    seq.scatter_(1, query_pos, keys)
    labels = torch.full((n, block_size + 1), IGNORE, dtype=torch.long)
    labels.scatter_(1, query_pos + 1, values)
    inputs, labels = seq[:, :-1], labels[:, 1:]
    noise = torch.randint(vocab_size, inputs.shape, generator=g)  # drawn either way: the
    if random_non_queries:  # pairs and queries are the same with and without the noise
        inputs = torch.where(inputs == 0, noise, inputs)  # random tokens between the queries
    return inputs, labels


def copy_or_sort(
    problem: str, num_examples: int, vocab_size: int = 16, length: int = 16, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``x, SEP, f(x)`` with f the identity (copy) or sorting (sort); SEP = vocab_size - 1.

    Tokens of x are drawn from [0, vocab_size - 1); only f(x) is supervised.
    """
    if problem not in ("copy", "sort"):
        raise ValueError(f"unknown problem {problem!r}; expected copy or sort")
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(vocab_size - 1, (num_examples, length), generator=g)
    target = x if problem == "copy" else x.sort(dim=1).values
    sep = torch.full((num_examples, 1), vocab_size - 1)
    seq = torch.cat([x, sep, target], dim=1)  # (n, 2L + 1)
    labels = seq.clone()
    labels[:, : length + 1] = IGNORE  # nothing to predict before the separator
    return seq[:, :-1], labels[:, 1:]


class SyntheticDataModule(InMemoryDataModule):
    """MQAR, copy or sort, with disjoint seeds for the training and validation sets.

    Args:
        problem: mqar, copy or sort.
        vocab_size: token ids (MQAR: keys and values split it in halves; copy/sort: the
            last id is the separator).
        block_size: tokens per example (copy/sort: 2 * length + 1 - 1 inputs).
        num_kv_pairs: MQAR pairs per example.
        power_a: MQAR's power law of the query gaps (Zoology's 0.01).
        random_non_queries: MQAR's positions between the queries hold random tokens
            (else 0, Zoology's Figure 2 setting).
        train_examples, val_examples: set sizes.
        batch_size, num_workers: loaders.
        seed: the training set uses ``seed``, validation ``seed + 1``.
    """

    def __init__(
        self,
        problem: str = "mqar",
        vocab_size: int = 256,
        block_size: int = 64,
        num_kv_pairs: int = 8,
        train_examples: int = 20_000,
        val_examples: int = 1_000,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
        power_a: float = 0.01,
        random_non_queries: bool = True,
    ) -> None:
        super().__init__()
        at_least(1, block_size=block_size, train_examples=train_examples, batch_size=batch_size)
        at_least(1, val_examples=val_examples)
        at_least(0, num_workers=num_workers)
        if problem not in PROBLEMS:
            raise ValueError(
                f"unknown synthetic problem {problem!r}; valid ones are: {', '.join(PROBLEMS)}"
            )
        if problem != "mqar" and block_size % 2:
            raise ValueError(f"{problem} needs an even block_size (x, SEP, f(x)), got {block_size}")
        if problem == "mqar":  # what mqar() would refuse, said before any example is drawn
            check_mqar_sizes(vocab_size, block_size, num_kv_pairs)
        self.problem, self.vocab_size, self.block_size = problem, vocab_size, block_size
        self.num_kv_pairs, self.power_a = num_kv_pairs, power_a
        self.random_non_queries = random_non_queries
        self.train_examples, self.val_examples = train_examples, val_examples
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def generate(self, num_examples: int, seed: int) -> TensorDataset:
        if self.problem == "mqar":
            inputs, labels = mqar(
                num_examples,
                self.vocab_size,
                self.block_size,
                self.num_kv_pairs,
                self.power_a,
                seed=seed,
                random_non_queries=self.random_non_queries,
            )
        else:
            length = self.block_size // 2
            inputs, labels = copy_or_sort(self.problem, num_examples, self.vocab_size, length, seed)
        return TensorDataset(inputs, labels)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set = self.generate(self.train_examples, self.seed)
            self.val_set = self.generate(self.val_examples, self.seed + 1)

    def model_keys(self) -> set[str]:
        return {"vocab_size", "block_size"}

    def model_kwargs(self) -> dict[str, int]:
        return {"vocab_size": self.vocab_size, "block_size": self.block_size}
