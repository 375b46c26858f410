"""The gated recurrence: the engine the gated kernels run on (RetNet, GLA, Mamba2's decay,
DeltaNet, Gated DeltaNet, and a user's own ``GatedKernel``).

``recurrence`` holds the maths: the token-by-token recurrence in float64 (the reference),
and the chunked forms, where a chunk keeps its cumulative log-decay and the delta rule's
chunk is the WY / UT-transform form. ``kernel`` is the module every gated kernel is
(``GatedKernel``): it picks the recurrent or the chunked path, or fla's fused op
(``attention.fla_ops``) where ``attention.backend`` asks for it.
"""
