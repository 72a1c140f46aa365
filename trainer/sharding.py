"""Sharded data parallelism with FSDP2 (``fully_shard``), built so no rank holds the whole model.

``parallel.strategy: fsdp`` shards every block of ``model.blocks``, the modules a model names
in ``fsdp_units`` and ``fsdp_loss_unit`` (a Hugging Face model's untied input embedding and
output layer), and then the root module, so
parameters, gradients and optimizer state are split across ranks (each holds 1/world of them) and
a block's parameters are all-gathered only while it runs. Its checkpoints are DCP files
(``trainer.checkpoint``), which reshard on load: one worker is not wrapped (nothing to shard) but
reads and writes the same files without a process group, so a run moves between 1 and N workers
either way.

``build_sharded`` builds the model on the meta device, applies the memory transforms, shards it,
allocates each rank's shards and fills them: with the values a seeded host build would have made
(``trainer.meta_init``: the same weights as DDP's build, at any world size), or, for an ``hf:``
directory with safetensors, with each rank's rows read from the files (``trainer.hf``). A model
that cannot be built on meta is built whole on the host, with one line saying so.

``FsdpSettings`` (``parallel.fsdp``): the parameter and reduction dtypes (``MixedPrecisionPolicy``:
bf16 parameters replace autocast under FSDP), ``reshard_after_forward`` and CPU offload
(``CPUOffloadPolicy``: pinned host memory where the device is a GPU, plain host memory on a CPU
run, where host and device are the same memory).

Gradient accumulation uses ``set_requires_gradient_sync(False)`` on all but the last micro-batch,
FSDP's counterpart of DDP's ``no_sync()``: one reduce-scatter per optimizer step.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from trainer.config import Config
    from trainer.memory.precision import PrecisionPolicy

# FSDP is imported where it is used: it brings in DTensor (about 1.5 s of CPU per process), which
# every DDP worker, CLI call and Ray worker would otherwise pay for nothing.

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class FsdpSettings:
    """``parallel.fsdp`` with its ``auto`` resolved (a plain dataclass: gpu-check and the benches
    build without pydantic)."""

    param_dtype: str = "fp32"  # fp32 | bf16
    reduce_dtype: str = "fp32"  # fp32 | bf16
    reshard_after_forward: bool | int = True
    offload: str = "none"  # none | cpu
    weight_dtype: str = "fp32"  # the shards' own dtype (``model.dtype``): fp32 | bf16

    @classmethod
    def of(cls, cfg: Config, precision: str, world_size: int) -> FsdpSettings:
        """``cfg``'s ``parallel.fsdp`` on ``world_size`` ranks, ``auto`` resolved by the run's
        ``precision``; raises ValueError where the reshard group does not divide the world."""
        fsdp = cfg.parallel.fsdp
        # An "auto" the planner has not resolved yet (it plans the defaults until it has).
        group = True if fsdp.reshard_after_forward == "auto" else fsdp.reshard_after_forward
        if not isinstance(group, bool) and world_size % group:
            raise ValueError(f"parallel.fsdp.reshard_after_forward {group} must divide the "
                             f"world size ({world_size} workers)")
        offload = "none" if fsdp.offload == "auto" else fsdp.offload
        return cls(cfg.fsdp_param_dtype(precision), cfg.fsdp_reduce_dtype(), group, offload,
                   cfg.model.dtype)

    @property
    def param_share(self) -> float:
        """Bytes of a gathered parameter per byte of its shard (0.5 for bf16 from fp32)."""
        return _DTYPES[self.param_dtype].itemsize / _DTYPES[self.weight_dtype].itemsize

    @property
    def reduce_share(self) -> float:
        """Bytes of a reduce-scattered gradient per byte of a weight."""
        return _DTYPES[self.reduce_dtype].itemsize / _DTYPES[self.weight_dtype].itemsize

    def step_policy(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        """``policy`` as a step runs under these settings: with bf16 parameters
        MixedPrecisionPolicy casts them for compute, and autocast has nothing to do."""
        if self.param_dtype == "fp32":
            return policy
        return dataclasses.replace(policy, autocast_dtype=None)

    @property
    def mixed_precision(self) -> bool:
        return self.param_dtype != self.weight_dtype or self.reduce_dtype != self.weight_dtype

    def describe(self) -> str:
        return (f"shards {self.weight_dtype}, parameters {self.param_dtype}, gradients "
                f"reduced in {self.reduce_dtype}, "
                f"reshard_after_forward {self.reshard_after_forward}, offload {self.offload}")


def _fsdp_kwargs(settings: FsdpSettings, device: torch.device) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    kwargs: dict = {"offload_policy": OffloadPolicy()}
    if settings.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=_DTYPES[settings.param_dtype],
                                                   reduce_dtype=_DTYPES[settings.reduce_dtype])
    if settings.offload == "cpu":
        # Pinned pages speed copies to a GPU; on a CPU run there is nothing to copy to.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return kwargs


def shard_model(model: nn.Module, settings: FsdpSettings = FsdpSettings(),
                device: torch.device | None = None) -> nn.Module:
    """``fully_shard`` each block of ``model.blocks``, each module of ``model.fsdp_units`` and
    ``model.fsdp_loss_unit`` where the model names them, then the root; returns the model. The
    root keeps its parameters gathered after forward (backward needs them first)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"parallel.strategy 'fsdp' needs the model to expose its blocks as "
                         f"`model.blocks` (an nn.ModuleList); {type(model).__name__} does not")
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    kwargs = _fsdp_kwargs(settings, device or torch.device("cpu"))
    for block in blocks:
        fully_shard(block, reshard_after_forward=settings.reshard_after_forward, **kwargs)
    # A unit of its own runs its all-gather only in its forward and backward (the input
    # embedding: at the step's start and end), where the root holds what it has gathered for
    # the whole step, since backward needs it first.
    for unit in getattr(model, "fsdp_units", ()):
        fully_shard(unit, **kwargs)
    loss_unit = getattr(model, "fsdp_loss_unit", None)
    if loss_unit is not None:  # kept gathered from the loss to its backward, which comes next
        fully_shard(loss_unit, reshard_after_forward=False, **kwargs)
        register_fsdp_forward_method(loss_unit, "summed_loss")
    fully_shard(model, reshard_after_forward=False, **kwargs)
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


def shard_rows(rows: int, rank: int, world_size: int) -> slice:
    """The rows of a tensor of ``rows`` rows FSDP2 gives ``rank``: ``torch.chunk``'s split of
    dim 0 (ranks past the last chunk hold none)."""
    per_rank = -(-rows // world_size)
    start = min(rank * per_rank, rows)
    return slice(start, min(start + per_rank, rows))


def fill_local(target: torch.Tensor, read: Callable[[slice | None], torch.Tensor],
               shape: torch.Size) -> None:
    """Copy this rank's part of a whole tensor of ``shape`` into ``target``: its rows of a
    sharded parameter, all of anything else. ``read(rows)`` gives those rows of the whole
    tensor (``None``: all of it)."""
    with torch.no_grad():
        if not hasattr(target, "to_local"):
            target.copy_(read(None))
            return
        import torch.distributed as dist

        local = target.to_local()
        if local.numel():
            rows = shard_rows(shape[0] if len(shape) else 0, dist.get_rank(),
                              dist.get_world_size())
            local.copy_(read(rows))
