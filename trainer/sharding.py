"""Sharded data parallelism with FSDP2 (``fully_shard``) and sharded checkpoints (DCP).

``parallel.strategy: fsdp`` shards every block of ``model.blocks`` and then the root module, so
parameters, gradients and optimizer state are split across ranks (each holds 1/world of them) and
a block's parameters are all-gathered only while it runs. Checkpoints are written with
``torch.distributed.checkpoint``: every rank writes its own shard files and rank 0 the metadata,
into the same checkpoint directory, and loading reshards to the current world, whatever the
world that wrote them. One worker is not wrapped (nothing to shard) but reads and writes the same
DCP files without a process group, so a run moves between 1 and N workers either way.

Gradient accumulation uses ``set_requires_gradient_sync(False)`` on all but the last micro-batch,
FSDP's counterpart of DDP's ``no_sync()``: one reduce-scatter per optimizer step.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

# FSDP and DCP are imported where they are used: they bring in DTensor (about 1.5 s of CPU per
# process), which every DDP worker, CLI call and Ray worker would otherwise pay for nothing.


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


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """One worker, in-process, has no process group: DCP then reads and writes alone, and warns
    on every call that it assumed so (even when told). That is this case's intent: silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def save_sharded(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its model and optimizer shards into ``directory`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_state, "optimizer": optimizer_state},
                 checkpoint_id=str(directory))


def load_sharded(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer state written by ``save_sharded`` at any world size (a
    collective): each rank reads the parts of the files that its shards cover."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.load({"model": model_state, "optimizer": optimizer_state},
                 checkpoint_id=str(directory))  # loads into the dicts in place
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict=optimizer_state)
