"""Sharded data parallelism with FSDP2 (``fully_shard``).

``parallel.strategy: fsdp`` shards every block of ``model.blocks`` and then the root module, so
parameters, gradients and optimizer state are split across ranks (each holds 1/world of them) and
a block's parameters are all-gathered only while it runs. Its checkpoints are DCP files
(``trainer.checkpoint``), which reshard on load: one worker is not wrapped (nothing to shard) but
reads and writes the same files without a process group, so a run moves between 1 and N workers
either way.

Gradient accumulation uses ``set_requires_gradient_sync(False)`` on all but the last micro-batch,
FSDP's counterpart of DDP's ``no_sync()``: one reduce-scatter per optimizer step.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

# FSDP is imported where it is used: it brings in DTensor (about 1.5 s of CPU per process), which
# every DDP worker, CLI call and Ray worker would otherwise pay for nothing.


def shard_model(model: nn.Module) -> nn.Module:
    """``fully_shard`` each block of ``model.blocks``, then the root; returns the model."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"parallel.strategy 'fsdp' needs the model to expose its blocks as "
                         f"`model.blocks` (an nn.ModuleList); {type(model).__name__} does not")
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def is_sharded(model: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing was sharded
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of an FSDP DTensor, else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (its shards under FSDP, everything otherwise)."""
    return sum(local_tensor(p).numel() * local_tensor(p).element_size()
               for p in model.parameters())
