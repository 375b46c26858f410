"""Sequence mixers that are not attention: the layers a hybrid stack puts between its
attention layers (``model.hybrid``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from transformers_lab.errors import must_be
from transformers_lab.nn.parts import ShortConvolution


class BaseConv(nn.Module):
    """Zoology's BaseConv (Arora et al., 2023): ``y = conv(u) * W u + u``, with conv a
    depthwise causal convolution of width K (with a bias, no activation) over the d_model
    channels, and W a linear map. The gated convolution of the Based recipe: Zoology's
    Based model is ``Hybrid[BaseConv(kernel_size=3), Based]``, layers alternating.

    It takes a layer's calls as ``MultiHeadAttention`` does (``forward``, ``decode``,
    ``state_size``); ``n_head`` is accepted and unused. Decoding keeps the last K - 1
    inputs.
    """

    name = "base_conv"
    constant_state = True  # the last K - 1 inputs, whatever the context

    def __init__(
        self, d_model: int, n_head: int | None = None, kernel_size: int = 3, bias: bool = True
    ) -> None:
        super().__init__()
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
            raise ValueError(must_be("base_conv.kernel_size", "an integer >= 1", kernel_size))
        self.d_model = d_model
        self.projection = nn.Linear(d_model, d_model, bias=bias)
        self.conv = ShortConvolution(d_model, kernel_size, silu=False, bias=True)

    def forward(
        self,
        x: Tensor,
        context: Any = None,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        out, _ = self.mix(x, None, key_padding_mask)
        return out

    def mix(
        self, x: Tensor, past: Tensor | None, key_padding_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"expected x of shape (batch, tokens, d_model={self.d_model}), got {tuple(x.shape)}"
            )
        u = x if key_padding_mask is None else x.masked_fill(key_padding_mask[..., None], 0.0)
        conv, state = self.conv(u, past)
        return conv * self.projection(x) + x, state

    def decode(
        self, x: Tensor, state: Tensor | None = None, *, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.mix(x, state, key_padding_mask)

    def trim_state(self, state: Tensor | None, keep: int) -> Tensor | None:
        """The last K - 1 inputs are the whole state, whatever the context."""
        return state

    def state_size(self, n: int) -> int:
        """The last K - 1 inputs, whatever n."""
        return (self.conv.width - 1) * self.d_model
