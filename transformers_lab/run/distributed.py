"""Fully sharded data parallel as this project runs it (``fsdp``, ``trainer=fsdp``): every
block of the model wrapped and sharded on its own, parameters gathered in bf16 for the
forward and backward passes, gradients reduced and the optimizer run in float32, and
checkpoints written sharded, each process its own part, read back onto any number of
processes."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy

from transformers_lab.errors import must_be
from transformers_lab.nn import Block

# the dtypes of FSDP's parameters in the forward and backward passes (``param_dtype``);
# gradients are reduced, and the optimizer steps, in float32 whatever this is
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
SHARDINGS = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "hybrid": "HYBRID_SHARD"}
STATE_DICTS = ("sharded", "full")


def fsdp(
    params: str = "bf16",
    sharding: str = "full",
    state_dict: str = "sharded",
    cpu_offload: bool = False,
    **options: Any,
) -> FSDPStrategy:
    """Lightning's FSDP strategy with each ``Block`` its own unit.

    Args:
        params: the dtype parameters are gathered in for the passes: ``bf16`` (the field's:
            reductions and the optimizer's master weights stay float32), ``fp16``, or
            ``fp32`` (none: what the CPU tests compare with plain training).
        sharding: ``full`` (parameters, gradients and optimizer state sharded: ZeRO-3),
            ``grad_op`` (gradients and optimizer state: ZeRO-2) or ``hybrid`` (full
            within a node, replicated across nodes: HSDP).
        state_dict: ``sharded`` (each process writes its part of a checkpoint folder,
            which any number of processes reads back) or ``full`` (one file, gathered on
            the first process: what tlab-eval and tlab-export read as they are).
        cpu_offload: keep the sharded parameters in CPU memory between their uses.
        options: more of ``FSDPStrategy``'s arguments.
    """
    if params not in PARAM_DTYPES:
        raise ValueError(must_be("params", f"one of {', '.join(PARAM_DTYPES)}", params))
    if sharding not in SHARDINGS:
        raise ValueError(must_be("sharding", f"one of {', '.join(SHARDINGS)}", sharding))
    if state_dict not in STATE_DICTS:
        raise ValueError(must_be("state_dict", f"one of {', '.join(STATE_DICTS)}", state_dict))
    mixed = None
    if PARAM_DTYPES[params] is not None:
        from torch.distributed.fsdp import MixedPrecision

        mixed = MixedPrecision(
            param_dtype=PARAM_DTYPES[params],
            reduce_dtype=torch.float32,
            buffer_dtype=torch.float32,
        )
    return FSDPStrategy(
        auto_wrap_policy={Block},
        mixed_precision=mixed,
        sharding_strategy=SHARDINGS[sharding],
        state_dict_type=state_dict,
        cpu_offload=cpu_offload,
        **options,
    )
