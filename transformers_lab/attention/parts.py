"""The switches of the parts of an attention layer around its kernel (the config side;
the modules are ``nn.parts``, and ``nn.attention.MultiHeadAttention`` builds them).

A layer is: projections -> (short convolution) -> (activation, L2 norm of q and k) ->
positions -> kernel -> (per-head norm, output gate) -> output projection. Each part in
brackets is a switch of the attention config (``conf/layer/parts.yaml``), off by default,
so a kernel runs bare unless asked; a preset switches on what its paper's layer uses::

    tlab-train experiment=mqar attention=fastmax_p2 attention.short_conv=4

The switches ride in the kernel's config beside the kernel's own options. Every kernel
class takes them (``AttentionKernel`` wraps its ``__init__``) and keeps them as
``kernel.parts``, untouched by its own code; the multi-head layer reads them there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")


@dataclass(frozen=True)
class LayerParts:
    """The switches of the parts around a kernel (all off: the bare kernel).

    Args:
        short_conv: K > 0: a depthwise causal convolution of width K over each channel of
            the projected q, k and v, then SiLU (fla's ShortConvolution); 0: none.
        qk_activation: an activation of q and k after the convolution (``silu``, ``relu``,
            ``elu``); None: none.
        qk_norm: divide each head's q and k by their L2 norms (before positions).
        output_norm: RMS-normalise each head's output, with a learned gain per channel.
        output_gate: multiply the output by swish(W_g x), a gate projected from the layer's
            input x (GLA, DeltaNet, RetNet).
    """

    short_conv: int = 0
    qk_activation: str | None = None
    qk_norm: bool = False
    output_norm: bool = False
    output_gate: bool = False

    def __post_init__(self) -> None:
        k = self.short_conv
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(
                f"attention.short_conv must be an integer >= 0 (the convolution's width; 0 "
                f"is off), got {k!r}"
            )
        if self.qk_activation is not None and self.qk_activation not in QK_ACTIVATIONS:
            raise ValueError(
                f"unknown attention.qk_activation {self.qk_activation!r}; valid ones are: "
                f"{', '.join(QK_ACTIVATIONS)} (or null for none)"
            )
        for name in ("qk_norm", "output_norm", "output_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"attention.{name} must be true or false, got {getattr(self, name)!r}"
                )

    def switched_on(self) -> list[str]:
        """The parts that are on, as ``key=value`` (the README's kernel table)."""
        default = LayerParts()
        return [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]


PART_KEYS = tuple(f.name for f in fields(LayerParts))
