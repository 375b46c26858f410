"""Fully sharded data parallel as this project runs it (``Sharded``, ``trainer=fsdp``):
PyTorch's FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy``, every
block of the model sharded as a unit of its own and the model around them, parameters
gathered in bf16 for the forward and backward passes while gradients are reduced and the
optimizer steps in float32, and checkpoints written sharded (a folder, each process its
part) that any number of processes reads back. FSDP2 runs on CPU processes over gloo too,
which the tests do (``trainer=fsdp_cpu``, float32)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from transformers_lab.errors import must_be
from transformers_lab.nn import Block

# the dtypes of the parameters in the forward and backward passes; gradients are reduced,
# and the optimizer steps on its float32 copy, whatever this is
# (no fp16: without a loss scaler, which Lightning's strategy does not take, its gradients
# underflow)
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def one_process_refusal(world_size: int) -> str | None:
    """Why FSDP cannot run on ``world_size`` processes (None: it can)."""
    if world_size > 1:
        return None
    return (
        "trainer=fsdp shards the model over processes, and this run has 1: give "
        "trainer.devices=N with N >= 2 (trainer.num_nodes for more machines), or train on "
        "one device with trainer=gpu or trainer=cpu"
    )


class Sharded(ModelParallelStrategy):
    """FSDP2 over every process (no tensor parallelism), each ``Block`` a unit.

    Args:
        params: the dtype the parameters are gathered in for the passes: ``bf16`` (the
            field's: reductions and the optimizer's master weights stay float32) or
            ``fp32`` (what the CPU tests compare with plain training).
        reshard_after_forward: free each block's gathered parameters after its forward
            pass and gather them again for the backward (ZeRO-3); false keeps them
            (ZeRO-2: more memory, less communication).
        cpu_offload: keep the shards, gradients and optimizer state in CPU memory.
        options: more of ``ModelParallelStrategy``'s arguments.

    Checkpoints are folders: each process writes its part, and ``meta.pt`` the rest
    (``run.checkpoints.saved.is_sharded``), into a folder beside the target that the
    first process then renames into place: a process killed while it writes leaves the
    last complete checkpoint as it was (killed between the two renames, at
    ``<name>.old``, which a requeued job resumes from and the next save puts back).
    """

    def __init__(
        self,
        params: str = "bf16",
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        **options: Any,
    ) -> None:
        if params not in PARAM_DTYPES:
            raise ValueError(must_be("params", f"one of {', '.join(PARAM_DTYPES)}", params))
        switches = {"reshard_after_forward": reshard_after_forward, "cpu_offload": cpu_offload}
        for name, value in switches.items():
            if not isinstance(value, bool):
                raise ValueError(must_be(name, "true or false", value))
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            **options,
        )
        self.params = params
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload

    def setup_environment(self) -> None:
        # every process shards the data: one data-parallel group of all of them
        self._data_parallel_size = self.num_nodes * self.num_processes
        if (why := one_process_refusal(self._data_parallel_size)) is not None:
            raise ValueError(why)
        super().setup_environment()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        path = Path(self.broadcast(str(filepath)))
        staging, old = (path.with_name(f"{path.name}.{end}") for end in ("partial", "old"))
        if self.global_rank == 0:
            if old.is_dir() and not path.exists():  # a save killed between its renames
                old.rename(path)
            for leftover in (staging, old):  # of a save that was killed
                shutil.rmtree(leftover, ignore_errors=True)
        self.barrier()
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier()
        if self.global_rank == 0:
            if path.is_dir():
                path.rename(old)
            elif path.exists():  # a checkpoint file of another strategy
                path.unlink()
            staging.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier()

    def shard(self, model: nn.Module) -> None:
        """``fully_shard`` each block of ``model``, then the model (its embeddings, head and
        norms), over the data-parallel mesh; a model already sharded is left as it is."""
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )

        if isinstance(model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        options: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=PARAM_DTYPES[self.params], reduce_dtype=torch.float32
            ),
        }
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module, **options)
        fully_shard(model, **options)
