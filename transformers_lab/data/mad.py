"""The six synthetic tasks of MAD (Poli et al., 2024, "Mechanistic Design and Scaling of
Hybrid Architectures"; athms/mad-lab ``mad/data/instances.py``), generated from a seed.

Each generator returns ``(inputs, labels)`` of shape (n, length) in this framework's
next-token form: ``labels[:, t]`` is what the model must say at position ``t`` having read
``inputs[:, : t + 1]``, and -100 where nothing is asked. The token layouts, the reserved
ids and the supervised positions follow MAD's generators (multi-query mode, as its
benchmark runs them):

- in-context recall: key-value pairs, keys re-used within a sequence with the same value;
  training supervises every next token (MAD trains on the shifted inputs), the test only
  the values of keys seen before and the final probe;
- noisy recall: the same with pairs replaced by two noise tokens at rate ``frac_noise``;
- fuzzy recall: keys and values are motifs of 1 to ``k_motif_size`` (``v_motif_size``)
  tokens, left-padded; the test presents keys at their full size;
- selective copying: ``num_tokens_to_copy`` tokens scattered among blanks, to be written
  out in order after the copy token;
- compression: random tokens and a compression token, every token reconstructed (MAD's
  encoder-bottleneck model: ``model.bottleneck=true``, which the data asks for);
- memorization: a fixed key-value map (seeded apart from the data) to be recalled after
  each key's insert token.

Every generator is deterministic under its ``seed``; the vectorised ones draw in chunks of
rows so that memory stays bounded (about ``CHUNK`` numbers in the widest tensor).
"""

from __future__ import annotations

import inspect
import random
from typing import Any

import torch
from torch import Generator, Tensor
from torch.utils.data import TensorDataset

from transformers_lab.data.base import IGNORE, InMemoryDataModule
from transformers_lab.errors import at_least

MAD_PROBLEMS = (
    "in_context_recall",
    "noisy_recall",
    "fuzzy_recall",
    "selective_copying",
    "compression",
    "memorization",
)
CHUNK = 2**24  # numbers the largest tensor of a chunk of rows may hold


def chunked(n: int, seed: int, make, width: int) -> tuple[Tensor, Tensor]:
    """``make(rows, generator)`` over chunks of rows whose widest tensor (``width``
    numbers a row) holds at most about CHUNK numbers, concatenated."""
    g = torch.Generator().manual_seed(seed)
    rows = max(1, CHUNK // max(1, width))
    parts = [make(min(rows, n - i), g) for i in range(0, n, rows)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def in_context_recall(
    num_examples: int,
    vocab_size: int = 16,
    seq_len: int = 128,
    training: bool = True,
    seed: int = 0,
    frac_noise: float = 0.0,
    noise_vocab_size: int = 0,
) -> tuple[Tensor, Tensor]:
    """MAD's (noisy) in-context recall, multi-query: ``seq_len // 2`` slots of (key, value),
    the last one a probe of a key already shown; ``seq_len - 1`` input tokens.

    With ``n = vocab_size - noise_vocab_size``, keys are ``[0, n // 2)``, values
    ``[n // 2, n)`` and noise tokens the last ``noise_vocab_size`` ids, as in MAD. A key
    keeps its value within a sequence. With ``frac_noise`` each slot but one (and the
    probe) is two noise tokens instead."""
    check(seq_len % 2 == 0 and seq_len >= 4, f"seq_len must be even and >= 4, got {seq_len}")
    check(0 <= frac_noise < 1, f"frac_noise must be in [0, 1), got {frac_noise}")
    check(noise_vocab_size >= 0, f"noise_vocab_size must be >= 0, got {noise_vocab_size}")
    check(
        frac_noise == 0 or noise_vocab_size > 0,
        f"frac_noise={frac_noise} needs noise tokens: set noise_vocab_size > 0",
    )
    ns = vocab_size - noise_vocab_size
    check(ns >= 2, f"vocab_size={vocab_size} leaves no keys and values after "
          f"noise_vocab_size={noise_vocab_size}")  # fmt: skip
    K, S = ns // 2, seq_len // 2  # keys, slots (the last is the probe)

    def make(n: int, g: Generator) -> tuple[Tensor, Tensor]:
        keys = torch.randint(K, (n, S - 1), generator=g)
        table = torch.randint(K, ns, (n, K), generator=g)  # each key's value
        values = table.gather(1, keys)
        noise = torch.rand(n, S - 1, generator=g) < frac_noise
        kept = torch.randint(S - 1, (n,), generator=g)  # one slot is always a pair
        noise[torch.arange(n), kept] = False
        noise_tokens = torch.randint(ns, max(ns + noise_vocab_size, ns + 1), (n, S - 1, 2),
                                     generator=g)  # fmt: skip
        # the slot where each key first appears (noise slots count as key K: none)
        slot = torch.arange(S - 1).expand(n, -1)
        first = torch.full((n, K + 1), S, dtype=torch.long)
        first.scatter_reduce_(1, keys.masked_fill(noise, K), slot, "amin")
        seen_before = (first.gather(1, keys) < slot) & ~noise
        shown = first[:, :K] < S  # keys that appear, one drawn uniformly as the probe
        probe = torch.rand(n, K, generator=g).masked_fill(~shown, -1.0).argmax(1)
        seq = torch.empty(n, 2 * S, dtype=torch.long)
        seq[:, 0:-2:2] = torch.where(noise, noise_tokens[..., 0], keys)
        seq[:, 1:-2:2] = torch.where(noise, noise_tokens[..., 1], values)
        seq[:, -2], seq[:, -1] = probe, table.gather(1, probe[:, None])[:, 0]
        if training:
            return seq[:, :-1], seq[:, 1:]
        targets = torch.full_like(seq, IGNORE)
        targets[:, 1:-2:2] = values.masked_fill(~seen_before, IGNORE)
        targets[:, -1] = seq[:, -1]
        return seq[:, :-1], targets[:, 1:]

    return chunked(num_examples, seed, make, width=max(K, 2 * S))


def noisy_recall(
    num_examples: int,
    vocab_size: int = 32,
    seq_len: int = 128,
    training: bool = True,
    seed: int = 0,
    frac_noise: float = 0.2,
    noise_vocab_size: int = 16,
) -> tuple[Tensor, Tensor]:
    """In-context recall with noise, at MAD's defaults (vocab 32 of which 16 are noise)."""
    return in_context_recall(
        num_examples, vocab_size, seq_len, training, seed, frac_noise, noise_vocab_size
    )


def fuzzy_recall(
    num_examples: int,
    vocab_size: int = 16,
    seq_len: int = 128,
    training: bool = True,
    seed: int = 0,
    k_motif_size: int = 3,
    v_motif_size: int = 3,
) -> tuple[Tensor, Tensor]:
    """MAD's fuzzy in-context recall, multi-query: keys of 1..k and values of 1..v distinct
    tokens (keys at the full k in the test), a probe pair placed at a random point and
    repeated at the end, left-padded with the pad token ``vocab_size - 1``; ``seq_len``
    input tokens. With ``n = vocab_size - 1``, keys are ``[0, n // 2)`` and values
    ``[n // 2, n)``, as in MAD."""
    ns = vocab_size - 1
    K = ns // 2
    check(
        min(k_motif_size, v_motif_size) >= 1,
        f"motif sizes must be >= 1, got k_motif_size={k_motif_size}, v_motif_size={v_motif_size}",
    )
    check(
        max(k_motif_size, v_motif_size) <= K,
        f"vocab_size={vocab_size} is too small for motifs of {k_motif_size} keys and "
        f"{v_motif_size} values of distinct tokens: need (vocab_size - 1) // 2 >= "
        f"{max(k_motif_size, v_motif_size)}",
    )
    pad, largest = vocab_size - 1, k_motif_size + v_motif_size
    check(seq_len > 2 * largest, f"seq_len={seq_len} is too short for motifs of {largest}: "
          f"need seq_len > {2 * largest}")  # fmt: skip
    rng = random.Random(seed)
    key_sizes = list(range(1, k_motif_size + 1)) if training else [k_motif_size]
    value_sizes = list(range(1, v_motif_size + 1))

    def motif(low: int, high: int, size: int) -> tuple[int, ...]:
        return tuple(rng.sample(range(low, high), size))

    rows_in, rows_out = [], []
    for _ in range(num_examples):
        k_probe = motif(0, K, rng.choice(key_sizes))
        v_probe = motif(K, ns, rng.choice(value_sizes))
        probe_len = len(k_probe) + len(v_probe)
        probe_at = rng.randrange(seq_len - 2 * probe_len)
        value_of: dict[tuple[int, ...], tuple[int, ...]] = {}
        inputs: list[int] = []
        targets: list[int] = []
        while len(inputs) < seq_len - probe_len - largest:
            if len(inputs) >= probe_at and k_probe not in value_of:
                key, value, asked = k_probe, v_probe, False
            else:
                key = motif(0, K, rng.choice(key_sizes))
                asked = key in value_of
                if key == k_probe:
                    value = v_probe
                else:
                    value = value_of.get(key) or motif(K, ns, rng.choice(value_sizes))
            value_of[key] = value
            inputs += [*key, *value]
            targets += [IGNORE] * len(key) + (list(value) if asked else [IGNORE] * len(value))
        inputs += [*k_probe, *v_probe]
        targets += [IGNORE] * len(k_probe) + list(v_probe)
        n_pad = seq_len + 1 - len(inputs)
        inputs, targets = [pad] * n_pad + inputs, [IGNORE] * n_pad + targets
        rows_in.append(inputs[:-1])
        rows_out.append(inputs[1:] if training else targets[1:])
    return torch.tensor(rows_in, dtype=torch.long), torch.tensor(rows_out, dtype=torch.long)


def selective_copying(
    num_examples: int,
    vocab_size: int = 16,
    seq_len: int = 256,
    training: bool = True,
    seed: int = 0,
    num_tokens_to_copy: int = 16,
) -> tuple[Tensor, Tensor]:
    """MAD's selective copying: ``num_tokens_to_copy`` tokens of ``[0, vocab_size - 2)``
    with blanks (``vocab_size - 2``) inserted before them at random, the copy token
    (``vocab_size - 1``), then blanks at which the tokens are to be written in order."""
    ntc = num_tokens_to_copy
    blanks = seq_len - 2 * ntc - 1
    check(ntc >= 1, f"num_tokens_to_copy must be >= 1, got {ntc}")
    check(blanks >= 0, f"seq_len={seq_len} is too short to copy {ntc} tokens: "
          f"need seq_len >= 2 * num_tokens_to_copy + 1 = {2 * ntc + 1}")  # fmt: skip
    check(vocab_size >= 3, f"vocab_size={vocab_size} leaves no data tokens (2 are reserved)")
    blank, copy = vocab_size - 2, vocab_size - 1

    def make(n: int, g: Generator) -> tuple[Tensor, Tensor]:
        data = torch.randint(vocab_size - 2, (n, ntc), generator=g)
        # each blank goes before one of the data tokens (MAD: np.insert at randint(0, ntc))
        before = torch.randint(ntc, (n, blanks), generator=g)
        counts = torch.zeros(n, ntc, dtype=torch.long).scatter_add_(
            1, before, torch.ones_like(before)
        )
        where = counts.cumsum(1) + torch.arange(ntc)  # the data tokens' positions
        seq = torch.full((n, seq_len), blank, dtype=torch.long)
        seq.scatter_(1, where, data)
        seq[:, seq_len - ntc - 1] = copy
        targets = torch.full_like(seq, IGNORE)
        targets[:, seq_len - ntc :] = data
        return seq, targets

    return chunked(num_examples, seed, make, width=max(seq_len, blanks))


def compression(
    num_examples: int,
    vocab_size: int = 16,
    seq_len: int = 32,
    training: bool = True,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """MAD's compression: ``seq_len - 1`` random tokens of ``[0, vocab_size - 1)`` and the
    compression token ``vocab_size - 1``; every position is to be reconstructed."""
    check(vocab_size >= 2 and seq_len >= 2, f"compression needs vocab_size and seq_len >= 2, "
          f"got {vocab_size} and {seq_len}")  # fmt: skip

    def make(n: int, g: Generator) -> tuple[Tensor, Tensor]:
        seq = torch.randint(vocab_size - 1, (n, seq_len), generator=g)
        seq[:, -1] = vocab_size - 1
        return seq, seq.clone()

    return chunked(num_examples, seed, make, width=seq_len)


def memorization_map(vocab_size: int, seed: int = 12345) -> Tensor:
    """The fixed key -> value map: keys ``[0, (V - 1) // 2)`` to distinct values of
    ``[(V - 1) // 2, V - 1)``, shuffled by its own seed (MAD's ``kv_map_seed`` 12345), so
    the training and test sets share it whatever their seeds."""
    half = (vocab_size - 1) // 2
    g = torch.Generator().manual_seed(seed)
    return half + torch.randperm(vocab_size - 1 - half, generator=g)[:half]


def memorization(
    num_examples: int,
    vocab_size: int = 256,
    seq_len: int = 32,
    training: bool = True,
    seed: int = 0,
    map_seed: int = 12345,
) -> tuple[Tensor, Tensor]:
    """MAD's memorization: ``seq_len // 2`` pairs of (key, insert token ``vocab_size - 1``);
    at each insert token the model must say the key's value in the fixed map."""
    check(seq_len % 2 == 0, f"seq_len must be even (key, insert pairs), got {seq_len}")
    check(vocab_size >= 5, f"vocab_size={vocab_size} is too small for a key-value map")
    table = memorization_map(vocab_size, map_seed)

    def make(n: int, g: Generator) -> tuple[Tensor, Tensor]:
        keys = torch.randint(len(table), (n, seq_len // 2), generator=g)
        seq = torch.full((n, seq_len), vocab_size - 1, dtype=torch.long)
        seq[:, 0::2] = keys
        targets = torch.full_like(seq, IGNORE)
        targets[:, 1::2] = table[keys]
        return seq, targets

    return chunked(num_examples, seed, make, width=seq_len)


GENERATORS = {
    "in_context_recall": in_context_recall,
    "noisy_recall": noisy_recall,
    "fuzzy_recall": fuzzy_recall,
    "selective_copying": selective_copying,
    "compression": compression,
    "memorization": memorization,
}


SHARED = ("num_examples", "vocab_size", "seq_len", "training", "seed")
# the settings each problem takes beyond what they all take
OPTIONS = {
    name: [p for p in inspect.signature(fn).parameters if p not in SHARED]
    for name, fn in GENERATORS.items()
}


class MADDataModule(InMemoryDataModule):
    """One of MAD's six tasks at one setting; the training set follows MAD's training
    targets, the validation (and test) set its test targets.

    Args:
        problem: one of ``MAD_PROBLEMS``.
        vocab_size, block_size: MAD's ``vocab_size`` and ``seq_len`` (the recall tasks
            read ``seq_len - 1`` tokens after the shift, as in MAD).
        train_examples, val_examples: MAD's 12,800 and 1,280 by default (memorization
            trains on 256).
        batch_size, num_workers: loaders (MAD: batch 128).
        seed: the training set uses ``seed``, validation ``seed + 1``.
        frac_noise, noise_vocab_size: noisy recall's noise (in-context recall takes them too).
        k_motif_size, v_motif_size: fuzzy recall's longest keys and values.
        num_tokens_to_copy: selective copying.
        map_seed: memorization's fixed key-value map (MAD's 12345).
        repeat: passes over the training set in one epoch (memorization's 256 sequences
            make 2 steps an epoch; repeat 10 gives it MAD's 400 steps in 20 epochs).
        Problem options left null take MAD's defaults; one the problem does not take is
        refused.
    """

    def __init__(
        self,
        problem: str = "in_context_recall",
        vocab_size: int = 16,
        block_size: int = 128,
        train_examples: int = 12_800,
        val_examples: int = 1_280,
        batch_size: int = 128,
        num_workers: int = 0,
        seed: int = 0,
        frac_noise: float | None = None,
        noise_vocab_size: int | None = None,
        k_motif_size: int | None = None,
        v_motif_size: int | None = None,
        num_tokens_to_copy: int | None = None,
        map_seed: int | None = None,
        repeat: int = 1,
    ) -> None:
        super().__init__()
        at_least(1, block_size=block_size, train_examples=train_examples, batch_size=batch_size)
        at_least(1, val_examples=val_examples)
        at_least(0, num_workers=num_workers)
        if repeat < 1:
            raise ValueError(f"repeat must be >= 1 passes over the training set, got {repeat}")
        if problem not in GENERATORS:
            raise ValueError(
                f"unknown MAD problem {problem!r}; valid ones are: {', '.join(MAD_PROBLEMS)}"
            )
        given = {
            "frac_noise": frac_noise,
            "noise_vocab_size": noise_vocab_size,
            "k_motif_size": k_motif_size,
            "v_motif_size": v_motif_size,
            "num_tokens_to_copy": num_tokens_to_copy,
            "map_seed": map_seed,
        }
        given = {k: v for k, v in given.items() if v is not None}
        foreign = sorted(set(given) - set(OPTIONS[problem]))
        if foreign:
            takes = ", ".join(OPTIONS[problem]) or "no options"
            raise ValueError(
                f"MAD's {problem} takes no {', '.join(foreign)} (it takes: {takes}); "
                f"set {' and '.join(f'data.{k}=null' for k in foreign)}"
            )
        self.problem, self.options = problem, given
        self.vocab_size, self.block_size = vocab_size, block_size
        self.train_examples, self.val_examples = train_examples, val_examples
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.repeat = repeat
        # draw one example now: a setting the generator refuses is said before training
        inputs, _ = self.generate(1, seed, training=False)
        self.length = inputs.shape[1]
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def generate(self, num_examples: int, seed: int, training: bool) -> tuple[Tensor, Tensor]:
        make = GENERATORS[self.problem]
        return make(num_examples, self.vocab_size, self.block_size, training, seed, **self.options)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            inputs, labels = self.generate(self.train_examples, self.seed, True)
            self.train_set = TensorDataset(
                inputs.repeat(self.repeat, 1), labels.repeat(self.repeat, 1)
            )
            self.val_set = TensorDataset(*self.generate(self.val_examples, self.seed + 1, False))

    def model_keys(self) -> set[str]:
        return {"vocab_size", "block_size"} | (
            {"bottleneck"} if self.problem == "compression" else set()
        )

    def model_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"vocab_size": self.vocab_size, "block_size": self.length}
        if self.problem == "compression":  # MAD's encoder-bottleneck model
            kwargs["bottleneck"] = True
        return kwargs
