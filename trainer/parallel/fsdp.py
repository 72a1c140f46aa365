"""Sharded data parallelism with FSDP2 (``fully_shard``), built so no rank holds the whole model:
``FullyShardedDataParallel``, the ``Parallelism`` of ``parallel.strategy: fsdp`` over several
ranks.

FSDP shards every block of ``model.blocks``, the modules a model names in ``fsdp_units`` and
``fsdp_loss_unit`` (a Hugging Face model's untied input embedding and output layer), and then
the root module, so parameters, gradients and optimizer state are split across ranks (each
holds 1/world of them) and a block's parameters are all-gathered only while it runs. Its
checkpoints are DCP files (``trainer.checkpoint.files``), which reshard on load: one worker is
not wrapped (nothing to shard) but reads and writes the same files without a process group, so
a run moves between 1 and N workers either way.

``build_sharded`` builds the model on the meta device, applies the memory transforms, shards it,
allocates each rank's shards and fills them: with the values a seeded host build would have made
(``trainer.parallel.meta_init``: the same weights as DDP's build, at any world size), or, for an
``hf:`` directory with safetensors, with each rank's rows read from the files
(``trainer.models.hf``). A model that cannot be built on meta is built whole on the host, with one
line saying so.

``FsdpSettings`` (``parallel.fsdp``): the parameter and reduction dtypes (``MixedPrecisionPolicy``:
bf16 parameters replace autocast under FSDP), ``reshard_after_forward`` and CPU offload
(``CPUOffloadPolicy``: pinned host memory where the device is a GPU, plain host memory on a CPU
run, where host and device are the same memory).

Gradient accumulation uses ``set_requires_gradient_sync(False)`` on all but the last micro-batch,
FSDP's counterpart of DDP's ``no_sync()``: one reduce-scatter per optimizer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from trainer.errors import first_line
from trainer.memory.allocator import return_freed_host_memory
from trainer.memory.optimizers import InBackward
from trainer.models.build import (
    Bf16Weights,
    MemoryTransforms,
    ModelFactory,
    apply_transforms,
    build_model,
    model_factory,
)
from trainer.models.hf import PREFIX as HF_PREFIX
from trainer.models.hf import SafetensorsRows, initialise_on_meta, weights_of
from trainer.models.weights import fill_from_file, fill_owner, owners
from trainer.parallel import meta_init
from trainer.parallel.strategy import Compile, Parallelism

if TYPE_CHECKING:
    from trainer.config import Config
    from trainer.memory.precision import PrecisionPolicy

# FSDP is imported where it is used: it brings in DTensor (about 1.5 s of CPU per process), which
# every DDP worker, CLI call and Ray worker would otherwise pay for nothing.

log = logging.getLogger(__name__)
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


def _meta_build(factory: ModelFactory, hf_init: bool) -> tuple[nn.Module, meta_init.MetaRecording]:
    """The model on meta with its record; ValueError naming a tensor whose values the record
    cannot make again (the replay would leave it uninitialised memory)."""
    with initialise_on_meta() if hf_init else contextlib.nullcontext():
        model, recording = meta_init.record(factory)
    unmade = meta_init.unrecorded(recording, dict(meta_init.module_tensors(model)))
    if unmade:
        raise ValueError(f"{', '.join(unmade[:3])}: made without a tensor operation the meta "
                         "device records (torch.from_numpy, load_state_dict(assign=True))")
    return model, recording


def build_sharded(factory: ModelFactory, transforms: MemoryTransforms, device: torch.device,
                  seed: int | None, settings: FsdpSettings, *, model_name: str = "",
                  before_shard: Callable[[nn.Module], None] = lambda model: None,
                  weights: SafetensorsRows | None = None) -> nn.Module:
    """The FSDP model, built so that no rank holds it whole (the module docstring of
    ``trainer.parallel.fsdp``): on meta, transformed, ``before_shard`` (torch.compile), sharded,
    then each rank's shards allocated and filled with the seeded host build's values, or with
    ``weights``' rows where the directory has them (``factory`` then builds without them). A model
    that cannot be built on meta is built whole on the host and sharded, with one warning naming the
    reason."""
    cast = isinstance(factory, Bf16Weights)
    try:
        model, recording = _meta_build(factory.factory if isinstance(factory, Bf16Weights)
                                       else factory, hf_init=":" in model_name)
    except Exception as err:  # the factory needed real values (an .item(), a data branch);
        # an error of the model's own is raised again by the host build below.
        log.warning("model.name %r cannot be built on the meta device (%s); building it whole "
                    "on the host, then sharding", model_name, first_line(err, type(err).__name__))
        model, recording = build_model(factory, MemoryTransforms(), device, seed), None
    tensors = owners(model)  # by the storages the record made (fp32 ones where ``cast``)
    hf_model = getattr(model, "hf", None)  # its files' names are matched as transformers does
    if cast and recording is not None:
        _bf16_parameters(model)  # its shards are allocated in bf16
    apply_transforms(model, transforms)
    before_shard(model)
    shard_model(model, settings, device)
    if recording is None:
        fill_from_file(tensors, weights, hf_model)
        return model
    host = torch.device("cpu")
    model.to_empty(device=host if settings.offload == "cpu" else device)
    from_file = fill_from_file(tensors, weights, hf_model)

    def take(key: int, real: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for owner in tensors[key]:
            fill_owner(owner, real(owner.meta))

    meta_init.replay(recording, set(tensors) - from_file, seed, take)
    if settings.offload == "cpu" and device != host:  # the buffers stay with the compute
        for module in model.modules():
            module._buffers.update({k: b.to(device) for k, b in module._buffers.items()
                                    if b is not None})
    return model


def _bf16_parameters(model: nn.Module) -> None:
    """New bf16 parameters in place of a meta model's floating ones (tied ones stay tied).
    New objects, not ``.data``: the record's operations hold the old ones, and the replay finds
    each by its storage."""
    swapped: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_floating_point():
                continue
            if id(param) not in swapped:
                swapped[id(param)] = nn.Parameter(param.detach().to(torch.bfloat16),
                                                  requires_grad=param.requires_grad)
            module._parameters[name] = swapped[id(param)]


class FullyShardedDataParallel(Parallelism):
    """FSDP2 with ``settings`` (None: a model sharded elsewhere, only stepped here)."""

    # A reduce-scatter runs inside backward and cannot wait for the ranks to agree: an OOM
    # is recovered per rank where nothing was reduced yet (``trainer.oom``).
    agrees_on_oom: ClassVar[bool] = False
    # post-accumulate hooks on the shards, the norm's squares summed over the ranks
    in_backward: ClassVar[InBackward] = InBackward(norm_over_ranks=True)

    def __init__(self, settings: FsdpSettings | None):
        self.settings = settings or FsdpSettings()

    def build(self, cfg: Config, device: torch.device, compile_model: Compile) -> nn.Module:
        """``Parallelism.build``'s order on the meta device: 1 and 2 there (no rank holds the
        whole model), 3, then 4: sharded, each rank's shards allocated and filled with the
        seeded build's values or its rows of the safetensors (``build_sharded``)."""
        init_hf = cfg.train.init_from \
            if (cfg.train.init_from or "").startswith(HF_PREFIX) else None
        return build_sharded(model_factory(cfg.model, load_weights=False),
                             MemoryTransforms.of(cfg.memory), device, cfg.run.seed,
                             self.settings, model_name=cfg.model.name,
                             before_shard=compile_model,
                             weights=weights_of(init_hf or cfg.model.name))

    def micro_batch(self, model: nn.Module, is_last: bool,
                    deferred: bool) -> AbstractContextManager[Any]:
        # FSDP's counterpart of no_sync(): one reduce-scatter per optimizer step
        if is_sharded(model):
            model.set_requires_gradient_sync(is_last)  # type: ignore[operator]
        return contextlib.nullcontext()

    def total_norm(self, grad_norm: torch.Tensor) -> torch.Tensor:
        full_tensor = getattr(grad_norm, "full_tensor", None)  # a DTensor over the shards
        return full_tensor() if full_tensor is not None else grad_norm

    def step_policy(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        return self.settings.step_policy(policy)

    def precision_route(self) -> str:
        if self.settings.param_dtype == "fp32":
            return ""
        return "; bf16 parameters through FSDP's MixedPrecisionPolicy, autocast off"

    def settle_host_memory(self) -> None:
        # FSDP's transients change size through the step; a heap that kept them would fragment
        return_freed_host_memory()

    def describe(self) -> str:
        return f"FSDP: {self.settings.describe()}"
