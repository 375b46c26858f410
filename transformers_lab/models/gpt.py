"""GPT: a decoder-only transformer for language modelling (Radford et al.; nanoGPT-shaped)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from transformers_lab.models.common import (
    Hybrid,
    block_stack,
    check_sizes,
    final_norm,
    flops_per_token,
    sample_next,
)
from transformers_lab.nn import (
    KernelFactory,
    PositionalEncoding,
    TokenEmbedding,
    checkpoint_blocks,
)
from transformers_lab.nn.layers import sinusoidal_table


class GPT(nn.Module):
    """Token and position embeddings, a stack of causal Blocks, a final norm and an LM head
    tied to the token embedding.

    Args:
        vocab_size: number of token ids.
        block_size: the longest context, the size of the positions table.
        n_layer, n_head, d_model: depth, heads and width.
        mlp_ratio: MLP hidden width over d_model.
        dropout: on the embeddings and the residual branches (attention dropout is the
            kernel's own ``dropout`` option).
        bias: biases in the linear layers and LayerNorms.
        act: MLP activation.
        norm_first: pre-norm blocks (GPT-2) or post-norm.
        pos_encoding: learned (GPT-2), sinusoidal, fourier, rope, alibi or none.
        rope_theta: the base of RoPE's frequencies (``pos_encoding=rope``).
        tie_weights: share the LM head with the token embedding.
        attention: kernel factory (``${attention}`` in the configs) or kernel name.
        hybrid: each layer's attention, where they differ (``models.common.layer_choices``):
            a pattern that repeats over the layers (``[base_conv, based]``), or {layer:
            choice}; ``"attention"`` stands for ``attention``. None: ``attention`` in every
            layer.
        bottleneck: MAD's encoder-bottleneck for its compression task (Poli et al., 2024):
            the blocks read the sequence, the last position's state is all that is kept,
            and a small decoder (``Bottleneck``) reads every token back from it. The
            compression data sets this (None: as the data asks, else False); such a
            model does not generate.
        activation_checkpointing: recompute each block's activations in the backward
            pass rather than keep them (``nn.checkpoint_blocks``): less memory, the same
            gradients, about a third more compute.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        bias: bool = True,
        act: str = "gelu",
        norm_first: bool = True,
        pos_encoding: str = "learned",
        rope_theta: float = 10000.0,
        tie_weights: bool = True,
        attention: KernelFactory | str = "softmax",
        bottleneck: bool | None = False,
        hybrid: Hybrid = None,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        check_sizes(dropout, n_layer=n_layer, n_head=n_head, d_model=d_model)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.tok = TokenEmbedding(vocab_size, d_model)
        # fixed positions as large as the token embeddings (N(0, 0.02), _init_weights):
        # sines and cosines times 0.02 * sqrt(2) have a root mean square of 0.02
        self.pos = PositionalEncoding(pos_encoding, d_model, block_size, math.sqrt(2) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = block_stack(
            n_layer,
            d_model,
            n_head,
            attention,
            hybrid=hybrid,
            mlp_ratio=mlp_ratio,
            act=act,
            dropout=dropout,
            bias=bias,
            norm_first=norm_first,
            rope_theta=rope_theta if pos_encoding == "rope" else None,
            alibi=pos_encoding == "alibi",
            who="the GPT",
            causal=True,
            context=block_size,
        )
        self.norm = final_norm(d_model, bias, norm_first)
        self.bottleneck = Bottleneck(d_model, block_size, bias) if bottleneck else None
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 n_layer), one per sub-layer
        for name, param in self.named_parameters():
            if name.endswith(("mixer.out_proj.weight", "mlp.proj.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        if tie_weights:
            self.lm_head.weight = self.tok.weight
        checkpoint_blocks(self, activation_checkpointing)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """N(0, 0.02) for linear and embedding weights, zero biases (GPT-2)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position table, as nanoGPT counts."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(p.numel() for p in self.pos.parameters())
        return n

    def flops_per_token(self, n: int | None = None) -> float:
        """Training FLOPs a token (forward and backward) in windows of ``n`` tokens (default:
        ``block_size``): ``models.common.flops_per_token``; a run's MFU divides its rate of
        these by the hardware's peak (``run.callbacks.throughput``)."""
        return flops_per_token(self, self.blocks, self.block_size if n is None else n)

    def state_size(self, n: int | None = None) -> int:
        """Numbers the decoding cache holds per sequence after ``n`` tokens (default:
        ``block_size``), all layers and heads: a KV cache grows with n, a linear kernel's
        state does not. Zoology and Based plot recall against it."""
        n = self.block_size if n is None else n
        return sum(block.mixer.state_size(n) for block in self.blocks)

    def embed(self, idx: Tensor, offset: int = 0) -> Tensor:
        """Token + position embeddings of ids (B, T) starting at position ``offset``."""
        if idx.dim() != 2:
            raise ValueError(f"expected token ids of shape (batch, tokens), got {tuple(idx.shape)}")
        return self.drop(self.pos(self.tok(idx), offset))  # (B, T, d_model)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits (B, T, vocab) of the next token at every position of idx (B, T)."""
        return self.logits(self.features(idx))

    def features(self, idx: Tensor) -> Tensor:
        """The final normalised hidden states (B, T, d_model) of idx (B, T)."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, causal=True)
        x = self.norm(x)
        return x if self.bottleneck is None else self.bottleneck(x[:, -1], x.shape[1])

    def logits(self, h: Tensor) -> Tensor:
        """Next-token logits (..., vocab) of hidden states (..., d_model): a task that
        scores a few positions (MQAR's answers) projects only those."""
        return self.lm_head(h)

    def refuse_bottleneck(self) -> None:
        if self.bottleneck is not None:
            raise RuntimeError(
                "this GPT has a bottleneck (bottleneck=True, MAD's compression data): it "
                "reconstructs its input and does not generate"
            )

    def forward_cached(
        self, idx: Tensor, cache: list[Any] | None = None, offset: int = 0
    ) -> tuple[Tensor, list[Any]]:
        """Logits of new tokens idx (B, T) at positions ``offset..``, given the cache of the
        tokens before them (None at the start); returns the logits and the new cache.

        The cache is, per layer, the kernel's decoding state: keys and values for the
        softmax family, the recurrent state for fastmax.
        """
        self.refuse_bottleneck()
        x = self.embed(idx, offset)
        cache = cache or [None] * len(self.blocks)
        new_cache = []
        for block, state in zip(self.blocks, cache, strict=True):
            x, state = block.decode(x, state)
            new_cache.append(state)
        return self.lm_head(self.norm(x)), new_cache

    def reach(self, length: int) -> str | None:
        """Why these weights cannot read ``length`` tokens in one pass, the model rebuilt at
        ``block_size=length`` (evaluation at other lengths), or None where they can: a
        learned table has no vector past its ``block_size``, and a kernel that weighs
        positions up to its own max_len (cosFormer) ends there. A formula (sinusoidal,
        fourier), RoPE, ALiBi and no positions go on."""
        if self.pos.kind == "learned" and length > self.block_size:
            return (
                f"its learned positions end at block_size={self.block_size}; evaluate at "
                f"lengths up to {self.block_size}, or train with model.pos_encoding=rope "
                "(alibi, none) to go past it"
            )
        for i, block in enumerate(self.blocks):
            kernel = getattr(block.mixer, "kernel", None)
            longest = getattr(kernel, "max_len", None)
            if longest is not None and length > longest:
                return (
                    f"layer {i}'s {kernel.name} weighs positions up to its "
                    f"attention.max_len={longest}; evaluate at lengths up to {longest}"
                )
        return None

    def decode_limit(self) -> str | None:
        """Why this model cannot decode past ``block_size`` on its decoding state, or None
        where it can: positions from a table (learned, sinusoidal) end there, a kernel that
        weighs positions up to its own max_len (cosFormer) ends at that, and a layer whose
        growing state cannot be cut (a kernel's or mixer's own) cannot slide."""
        if self.pos.bounded:
            return f"its {self.pos.kind} positions end at block_size={self.block_size}"
        for i, block in enumerate(self.blocks):
            mixer = block.mixer
            kernel = getattr(mixer, "kernel", None)
            if getattr(kernel, "max_len", None) is not None:
                return f"layer {i}'s {kernel.name} weighs positions up to its max_len"
            if not hasattr(mixer, "trim_state") or not getattr(kernel, "trimmable", True):
                name = getattr(kernel, "name", type(mixer).__name__)
                return f"layer {i}'s {name} keeps a decoding state that cannot slide"
        return None

    def slide(self, cache: list[Any], keep: int) -> list[Any]:
        """Each layer's decoding state holding at most its last ``keep`` tokens: a constant
        state as it is, a KV cache cut (``Block.trim_state``). A state that cannot be cut
        is refused (``decode_limit`` says which), never dropped."""
        cut = [
            block.trim_state(state, keep) for block, state in zip(self.blocks, cache, strict=True)
        ]
        if any(new is None and old is not None for new, old in zip(cut, cache, strict=True)):
            raise ValueError(f"this model cannot decode past block_size: {self.decode_limit()}")
        return cut

    @torch.no_grad()
    def stream(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Iterator[Tensor]:
        """Sample ``max_new_tokens`` tokens after idx (B, T), yielding each step's ids (B,)
        as soon as they are drawn (``temperature=0``: greedy).

        With ``use_cache`` each new token costs one cached step; without it the whole
        context is recomputed every step. Past ``block_size``, a model whose positions go
        on (none, RoPE, ALiBi, Fourier) decodes on its state (``decode_limit``): a
        constant state (linear and gated kernels, the sliding window, short convolutions)
        carries on, and a KV cache keeps its last ``block_size - 1`` keys, so that each
        token sees ``block_size`` tokens at every layer (the sliding window of that size)
        and each step costs the same. Otherwise the context slides by re-encoding its last
        ``block_size`` tokens once the window moves (``tlab-sample`` says so).
        """
        self.refuse_bottleneck()
        sample = functools.partial(
            sample_next, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        if max_new_tokens <= 0:
            return
        decoder = Decoder(self, use_cache)
        logits = decoder.feed(idx)
        for step in range(max_new_tokens):
            next_id = sample(logits[:, -1])  # (B,)
            yield next_id
            if step < max_new_tokens - 1:
                logits = decoder.feed(next_id[:, None])

    def forward_on_state(
        self, idx: Tensor, cache: list[Any] | None = None, offset: int = 0
    ) -> tuple[Tensor, list[Any]]:
        """``forward_cached`` past ``block_size`` too, for a model whose ``decode_limit``
        is None: constant states read idx (B, T) at once; a model with a growing state (a
        KV cache) reads what fits in its first window at once and the rest a token at a
        time, its caches cut to the last ``block_size - 1`` tokens before each (``slide``):
        every token sees ``block_size`` tokens at every layer."""
        if not self.states_grow():
            return self.forward_cached(idx, cache, offset)
        window, start, steps = self.block_size, 0, []
        if offset < window:  # within the first window: at once
            start = min(idx.shape[1], window - offset)
            logits, cache = self.forward_cached(idx[:, :start], cache, offset)
            steps.append(logits)
        for t in range(start, idx.shape[1]):
            cache = self.slide(cache, window - 1)
            logits, cache = self.forward_cached(idx[:, t : t + 1], cache, offset + t)
            steps.append(logits)
        return torch.cat(steps, dim=1), cache

    def states_grow(self) -> bool:
        """Whether a layer's decoding state grows with the context (a KV cache)."""
        for block in self.blocks:
            part = getattr(block.mixer, "kernel", block.mixer)
            if not getattr(part, "constant_state", False):
                return True
        return False

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """idx (B, T) extended by ``max_new_tokens`` sampled tokens: (B, T + max_new_tokens).
        The sampling is ``stream``'s, with the same arguments."""
        tokens = self.stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache, generator)
        return torch.cat([idx, *(next_id[:, None] for next_id in tokens)], dim=1)


class Decoder:
    """A GPT's decoding of a batch of sequences, as ``GPT.stream`` goes: ``feed(ids)``
    reads the next tokens (B, n) and returns the logits (B, n, vocab) after each (after
    the last ``block_size`` of them when the context is re-encoded). The exported model's
    ``generate`` (``transformers_lab.hf``) steps through the same object, so both decode
    alike.

    - On the decoding state (``use_cache`` and ``decode_limit()`` is None): the state
      carries on past ``block_size`` (``forward_on_state``).
    - A model that cannot slide its state (positions from a table, a kernel's own
      max_len): steps on its cache while the context fits in ``block_size``, then
      re-encodes the last ``block_size`` tokens at each step.
    - Without ``use_cache``: the last ``block_size`` tokens are read whole at each step.
    """

    def __init__(self, model: GPT, use_cache: bool = True) -> None:
        model.refuse_bottleneck()
        self.model, self.use_cache = model, use_cache
        self.on_state = use_cache and model.decode_limit() is None
        self.cache: list[Any] | None = None
        self.read = 0  # tokens fed so far
        self.cached = 0  # tokens the cache holds (off the decoding state)
        self.seen: Tensor | None = None  # the last block_size tokens fed (off the state)

    def feed(self, ids: Tensor) -> Tensor:
        model, n = self.model, ids.shape[1]
        if self.on_state:
            logits, self.cache = model.forward_on_state(ids, self.cache, offset=self.read)
            self.read += n
            return logits
        self.read += n
        seen = ids if self.seen is None else torch.cat([self.seen, ids], dim=1)
        context = self.seen = seen[:, -model.block_size :]  # all that is read again
        if not self.use_cache:
            return model(context)[:, -n:]
        if self.cache is not None and self.cached + n <= model.block_size:
            logits, self.cache = model.forward_cached(ids, self.cache, offset=self.cached)
            self.cached += n
            return logits
        logits, self.cache = model.forward_cached(context)  # the start, or the window slid
        self.cached = context.shape[1]
        return logits[:, -n:]


class Bottleneck(nn.Module):
    """MAD's compression decoder (``mad/model/auto_encoder.py``): the encoded sequence's
    last state plus a fixed sinusoidal embedding of each position, through a two-layer
    MLP without residuals (norm, linear, GELU, twice) and a final norm: one state per
    position to reconstruct, for the LM head to score."""

    def __init__(self, d_model: int, block_size: int, bias: bool = True) -> None:
        super().__init__()
        self.register_buffer("positions", sinusoidal_table(block_size, d_model), persistent=False)
        self.mlp = nn.Sequential(
            nn.LayerNorm(d_model, bias=bias),
            nn.Linear(d_model, d_model, bias=bias),
            nn.GELU(),
            nn.LayerNorm(d_model, bias=bias),
            nn.Linear(d_model, d_model, bias=bias),
            nn.GELU(),
            nn.LayerNorm(d_model, bias=bias),
        )

    def forward(self, h: Tensor, length: int) -> Tensor:
        """States (B, length, d_model) to read ``length`` tokens back from h (B, d_model)."""
        if length > len(self.positions):
            raise ValueError(
                f"the bottleneck decodes at most block_size={len(self.positions)} tokens, "
                f"got {length}"
            )
        return self.mlp(h[:, None, :] + self.positions[:length])
