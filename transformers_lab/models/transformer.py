"""The encoder-decoder Transformer of Vaswani et al. (2017), for translation."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from transformers_lab.attention import Memory
from transformers_lab.errors import check_beam
from transformers_lab.models.common import block_stack, check_sizes, final_norm, reorder_cache
from transformers_lab.nn import KernelFactory, PositionalEncoding, TokenEmbedding, checkpoint_blocks


class Transformer(nn.Module):
    """Encoder over the source, decoder over the target with cross-attention to the source.

    Args:
        src_vocab_size, tgt_vocab_size: token ids of each side.
        d_model, n_head: width and heads (512 and 8 in the paper's base model).
        n_encoder_layers, n_decoder_layers: depths (6 and 6 in the paper).
        mlp_ratio: MLP hidden width over d_model (2048 / 512 = 4 in the paper).
        dropout: on the embeddings and residual branches (0.1 in the paper).
        act: MLP activation (relu in the paper).
        bias: biases in the linear layers and LayerNorms.
        norm_first: pre-norm; False (the default) is the paper's post-norm.
        block_size: the longest source or target sequence, BOS and EOS included: the
            context, and the positions table.
        pos_encoding: sinusoidal (the paper), learned, fourier, alibi, rope (in the encoder's
            and the decoder's self-attention) or none.
        rope_theta: the base of RoPE's frequencies (``pos_encoding=rope``).
        share_embeddings: one embedding table for source and target (same vocabulary).
        tie_output: the output projection shares the target embedding.
        pad_id, bos_id, eos_id: special token ids; source tokens equal to pad_id are
            masked out of every attention.
        attention: kernel of the encoder and decoder self-attention.
        cross_attention: kernel of the decoder's cross-attention; None means ``attention``.
        activation_checkpointing: recompute each block's activations in the backward
            pass, as in GPT.
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        d_model: int = 512,
        n_head: int = 8,
        n_encoder_layers: int = 6,
        n_decoder_layers: int = 6,
        mlp_ratio: float = 4.0,
        dropout: float = 0.1,
        act: str = "relu",
        bias: bool = True,
        norm_first: bool = False,
        block_size: int = 256,
        pos_encoding: str = "sinusoidal",
        rope_theta: float = 10000.0,
        share_embeddings: bool = False,
        tie_output: bool = True,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        attention: KernelFactory | str = "softmax",
        cross_attention: KernelFactory | str | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        check_sizes(
            dropout, n_encoder_layers=n_encoder_layers,
            n_decoder_layers=n_decoder_layers, n_head=n_head, d_model=d_model,
        )  # fmt: skip
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(
                "share_embeddings needs one vocabulary, but src_vocab_size="
                f"{src_vocab_size} and tgt_vocab_size={tgt_vocab_size}"
            )
        self.d_model = d_model
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.src_tok = TokenEmbedding(src_vocab_size, d_model)
        self.tgt_tok = self.src_tok if share_embeddings else TokenEmbedding(tgt_vocab_size, d_model)
        # fixed positions as large as the scaled token embeddings: Xavier's std
        # sqrt(2 / (vocab + d_model)) times sqrt(d_model) (embed); sines and cosines have a
        # root mean square of 1/sqrt(2)
        token_rms = math.sqrt(2 / (src_vocab_size + d_model)) * math.sqrt(d_model)
        self.pos = PositionalEncoding(pos_encoding, d_model, block_size, math.sqrt(2) * token_rms)
        self.drop = nn.Dropout(dropout)
        options = {
            "mlp_ratio": mlp_ratio,
            "act": act,
            "dropout": dropout,
            "bias": bias,
            "norm_first": norm_first,
            "rope_theta": rope_theta if pos_encoding == "rope" else None,
            "alibi": pos_encoding == "alibi",
        }
        self.encoder = block_stack(
            n_encoder_layers, d_model, n_head, attention, who="the Transformer's encoder",
            causal=False, context=block_size, **options,
        )  # fmt: skip
        self.decoder = block_stack(
            n_decoder_layers, d_model, n_head, attention, cross_attention or attention,
            who="the Transformer's decoder", causal=True, context=block_size,
            cross_key="attention" if cross_attention is None else "cross_attention", **options,
        )  # fmt: skip
        self.encoder_norm = final_norm(d_model, bias, norm_first)
        self.decoder_norm = final_norm(d_model, bias, norm_first)
        self.out = nn.Linear(d_model, tgt_vocab_size, bias=False)
        # Xavier init of the projections and embeddings, as in the reference implementation;
        # the kernels keep their own initialisation (cosine temperatures, additive biases)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.xavier_uniform_(module.weight)
        if tie_output:
            self.out.weight = self.tgt_tok.weight
        checkpoint_blocks(self, activation_checkpointing)

    def embed(self, tokens: Tensor, table: nn.Embedding, offset: int = 0) -> Tensor:
        """Embeddings scaled by sqrt(d_model), plus positions, for ids (B, T)."""
        if tokens.dim() != 2:
            raise ValueError(f"expected token ids (batch, tokens), got shape {tuple(tokens.shape)}")
        return self.drop(self.pos(table(tokens) * math.sqrt(self.d_model), offset))

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """Source ids (B, S) -> memory (B, S, d_model) and its padding mask (B, S)."""
        src_pad = src == self.pad_id
        x = self.embed(src, self.src_tok)
        for block in self.encoder:
            x = block(x, key_padding_mask=src_pad)
        return self.encoder_norm(x), src_pad

    def decode(self, tgt: Tensor, memory: Tensor, src_pad: Tensor) -> Tensor:
        """Teacher-forced decoder: target ids (B, T) -> next-token logits (B, T, vocab)."""
        x = self.embed(tgt, self.tgt_tok)
        for block in self.decoder:
            x = block(x, causal=True, memory=memory, memory_padding_mask=src_pad)
        return self.out(self.decoder_norm(x))

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Logits (B, T, vocab) of the next target token, given src (B, S) and tgt (B, T)
        (the target shifted right, starting with BOS)."""
        memory, src_pad = self.encode(src)
        return self.decode(tgt, memory, src_pad)

    def decode_step(
        self, tokens: Tensor, cache: list[Any], memory: list[Memory], offset: int
    ) -> tuple[Tensor, list[Any]]:
        """Logits (B, vocab) of the token after ``tokens`` (B, 1) at position ``offset``,
        using each layer's self-attention cache and prepared memory of the source."""
        x = self.embed(tokens, self.tgt_tok, offset)
        new_cache = []
        for block, state, layer_memory in zip(self.decoder, cache, memory, strict=True):
            x, state = block.decode(x, state, memory=layer_memory)
            new_cache.append(state)
        return self.out(self.decoder_norm(x))[:, -1], new_cache

    def _start(
        self, src: Tensor, copies: int, max_new_tokens: int | None
    ) -> tuple[list[Memory], int]:
        """Encode once and prepare each decoder layer's memory, repeated ``copies`` times;
        and the number of decoding steps (``max_new_tokens``, at most the positions table)."""
        memory, src_pad = self.encode(src)
        memory = memory.repeat_interleave(copies, dim=0)
        src_pad = src_pad.repeat_interleave(copies, dim=0)
        prepared = [block.cross.project_context(memory, src_pad) for block in self.decoder]
        table = self.pos.block_size
        return prepared, table if max_new_tokens is None else min(max_new_tokens, table)

    def _never_emit(self, logits: Tensor) -> Tensor:
        """Logits with PAD and BOS ruled out: they are never real output tokens."""
        logits = logits.clone()
        logits[:, [self.pad_id, self.bos_id]] = float("-inf")
        return logits

    @torch.no_grad()
    def translate(
        self,
        src: Tensor,
        max_new_tokens: int | None = None,
        beam_size: int = 1,
        length_penalty: float = 0.6,
    ) -> Tensor:
        """Target ids (B, T) for source ids (B, S), without BOS; after EOS, pad_id.

        ``beam_size=1`` is greedy decoding. Beam search keeps the ``beam_size`` best
        partial translations by summed log-probability and returns, per source, the
        finished one with the best score / lp, where lp = ((5 + length) / 6) ** alpha
        (Wu et al., 2016) and alpha = ``length_penalty``. Both decode with caches.
        """
        if beam_size == 1:
            return self.greedy(src, max_new_tokens)
        return self.beam_search(src, beam_size, max_new_tokens, length_penalty)

    @torch.no_grad()
    def greedy(self, src: Tensor, max_new_tokens: int | None = None) -> Tensor:
        """Greedy decoding with caches; see ``translate``."""
        memory, steps = self._start(src, 1, max_new_tokens)
        ys = torch.full((src.shape[0], 1), self.bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        cache: list[Any] = [None] * len(self.decoder)
        for t in range(steps):
            logits, cache = self.decode_step(ys[:, -1:], cache, memory, t)
            next_id = self._never_emit(logits).argmax(dim=-1).masked_fill(done, self.pad_id)
            ys = torch.cat([ys, next_id[:, None]], dim=1)
            done |= next_id == self.eos_id
            if done.all():
                break
        return ys[:, 1:]

    @torch.no_grad()
    def beam_search(
        self,
        src: Tensor,
        beam_size: int,
        max_new_tokens: int | None = None,
        length_penalty: float = 0.6,
    ) -> Tensor:
        """Beam search with caches; see ``translate``."""
        check_beam(beam_size)
        b, k, alpha, device = src.shape[0], beam_size, length_penalty, src.device
        memory, steps = self._start(src, k, max_new_tokens)
        scores = torch.full((b, k), float("-inf"), device=device)
        scores[:, 0] = 0.0  # one live beam per source at the start
        ys = torch.full((b * k, 1), self.bos_id, dtype=torch.long, device=device)
        done = torch.zeros(b * k, dtype=torch.bool, device=device)
        lengths = torch.zeros(b * k, device=device)
        cache: list[Any] = [None] * len(self.decoder)
        for t in range(steps):
            logits, cache = self.decode_step(ys[:, -1:], cache, memory, t)
            logp = self._never_emit(logits.float()).log_softmax(dim=-1)  # (B * K, V)
            # a finished beam only continues with padding, at no cost
            logp[done] = float("-inf")
            logp[done, self.pad_id] = 0.0
            vocab = logp.shape[-1]
            candidates = (scores.view(-1, 1) + logp).view(b, k * vocab)
            scores, flat = candidates.topk(k, dim=-1)  # (B, K)
            rows = (torch.arange(b, device=device)[:, None] * k + flat // vocab).view(-1)
            next_id = (flat % vocab).view(-1)
            ys = torch.cat([ys[rows], next_id[:, None]], dim=1)
            lengths = lengths[rows] + (~done[rows]).float()
            done = done[rows] | (next_id == self.eos_id)
            cache = reorder_cache(cache, rows)
            if done.all():
                break
        penalty = ((5.0 + lengths.view(b, k)) / 6.0) ** alpha
        best = (scores / penalty).argmax(dim=-1)
        return ys.view(b, k, -1)[torch.arange(b, device=device), best, 1:]
