"""Sharded data parallelism with FSDP2 (``fully_shard``), built so no rank holds the whole model:
``ShardedDataParallel``, the ``Parallelism`` of ``parallel.strategy: fsdp`` over several
ranks.

FSDP shards every block of ``model.blocks``, the modules a model names as ``input_unit`` and
``loss_unit`` (a Hugging Face model's untied input embedding and output layer), and then
the root module, so parameters, gradients and optimizer state are split across ranks (each
holds 1/world of them) and a block's parameters are all-gathered only while it runs. Its
checkpoints are DCP files (``trainer.checkpoint.files``), which reshard on load: one worker is
not wrapped (nothing to shard) but reads and writes the same files without a process group, so
a run moves between 1 and N workers either way.

Its build (``Parallelism.build``; ``build_sharded`` without compile) makes the model on the
meta device, applies the memory transforms, shards it, allocates each rank's shards and fills
them: with the values a seeded host build would have made
(``trainer.models.meta_init``: the same weights as DDP's build, at any world size), or, for an
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
import functools
import logging
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from trainer.memory.optimizers import InBackward
from trainer.models.build import (
    MemoryTransforms,
    ModelFactory,
    OnMeta,
    Placement,
    apply_transforms,
    model_factory,
)
from trainer.models.hf import SafetensorsRows
from trainer.parallel.mesh import Mesh
from trainer.parallel.strategy import AppliesPrecision, Parallelism
from trainer.parallel.vocab_loss import (
    LOOKUP_ROUND_TOKENS,
    split_lookup,
    split_summed_loss,
    splits_the_vocabulary,
)

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

    def placement(self, world_size: int) -> Placement:
        """Where the model is made under these settings over ``world_size`` ranks: on meta,
        sharded, an NF4 base split into ``world_size`` parts, the shards on the host under CPU
        offload."""
        return Placement(shards=True, parts=world_size, on_host=self.offload == "cpu")

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
    """``fully_shard`` each block of ``model.blocks``, ``model.input_unit`` and
    ``model.loss_unit`` where the model names them, then the root; returns the model. The
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
    # the whole step, since backward needs it first. A frozen embedding or output layer is
    # never gathered: its lookup and the loss are split by vocabulary over the ranks
    # (trainer.parallel.vocab_loss).
    # Such a unit is sharded without FSDP's mixed precision, which it never gathers for (and
    # whose gradient accumulation would read the gathered parameter): it casts its own rows.
    offloaded = settings.offload == "cpu"
    world = dist.get_world_size() if dist.is_initialized() else 1
    param_dtype = _DTYPES[settings.param_dtype] if settings.mixed_precision else None
    unmixed = {key: value for key, value in kwargs.items() if key != "mp_policy"}
    input_unit = getattr(model, "input_unit", None)
    if input_unit is not None:
        split = splits_the_vocabulary(input_unit, world, offloaded, LOOKUP_ROUND_TOKENS)
        fully_shard(input_unit, **(unmixed if split else kwargs))
        if split:
            lookup = functools.partial(split_lookup, input_unit, param_dtype)
            setattr(model, "input_lookup", lookup)  # noqa: B010 - any model class
        else:
            input_unit.register_forward_pre_hook(_gather_before_forward, prepend=True)
    loss_unit = getattr(model, "loss_unit", None)
    if loss_unit is not None:
        split = splits_the_vocabulary(loss_unit, world, offloaded,
                                      getattr(model, "loss_chunk_tokens", 0))
        fully_shard(loss_unit, reshard_after_forward=False, **(unmixed if split else kwargs))
        if split:
            loss_unit.summed_loss = functools.partial(split_summed_loss, loss_unit, param_dtype)
        else:  # gathered for the loss and kept to its backward, which comes next
            register_fsdp_forward_method(loss_unit, "summed_loss")
            _gather_before(loss_unit, "summed_loss")
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if input_unit is not None and not any(p.requires_grad for p in input_unit.parameters()):
        # In backward FSDP gathers the unit that ran before the first block (the embedding)
        # while the first block's gradients are computed; a frozen unit (LoRA's base) has no
        # backward of its own and is never used, so that all-gather would only be held. A
        # block "prefetching" itself, already gathered, does nothing and turns that off.
        first: Any = blocks[0]
        first.set_modules_to_backward_prefetch([first])
    return model


# A unit of its own (the embedding, the output layer) is a vocabulary wide. Gathered in its
# forward, FSDP keeps the all-gather's buffer (a second copy of the unit) until the next unit's
# forward has gathered, to overlap that copy with the next all-gather: for the output layer
# that is through the whole loss. Gathered explicitly (``FSDPModule.unshard``) just before, the
# buffer is freed as soon as it is copied out; the forward then finds the unit gathered.
def _gather_before_forward(unit: Any, args: Any) -> None:
    unit.unshard()


def _gather_before(unit: Any, method: str) -> None:
    fsdp_method = getattr(unit, method)

    @functools.wraps(fsdp_method)
    def gathered_first(*args: Any, **kwargs: Any) -> Any:
        unit.unshard()
        return fsdp_method(*args, **kwargs)

    setattr(unit, method, gathered_first)


def is_sharded(model: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing was sharded
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def build_sharded(factory: ModelFactory, transforms: MemoryTransforms, device: torch.device,
                  seed: int | None, settings: FsdpSettings, *, model_name: str = "",
                  weights: SafetensorsRows | None = None) -> nn.Module:
    """The FSDP model of ``factory``, built so that no rank holds it whole, in
    ``Parallelism.build``'s order without the sequence split and compile: on meta
    (``OnMeta``), transformed, sharded (``shard_model``), then each rank's shards allocated and
    filled with the seeded host build's values or ``weights``' rows. An NF4 base is quantized
    shard by shard."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    started = OnMeta.placed(factory, device, seed, settings.placement(world),
                            model_name=model_name, weights=weights)
    apply_transforms(started.model, transforms)
    shard_model(started.model, settings, device)
    return started.finish()


class ShardedDataParallel(Parallelism, AppliesPrecision):
    """FSDP2 with ``settings`` over every rank of the mesh (None: a model sharded elsewhere,
    only stepped here)."""

    # A reduce-scatter runs inside backward and cannot wait for the ranks to agree: an OOM
    # over several ranks fails the run (``trainer.oom``); one FSDP worker recovers as one.
    agrees_on_oom: ClassVar[bool] = False
    # post-accumulate hooks on the shards, the norm's squares summed over the ranks
    backward_hooks: ClassVar[InBackward] = InBackward(norm_over_ranks=True)
    # FSDP's transients change size through the step; a heap that kept them would fragment
    steady_transients: ClassVar[bool] = False

    def __init__(self, mesh: Mesh, settings: FsdpSettings | None):
        self.mesh = mesh
        self.settings = settings or FsdpSettings()

    def placement(self) -> Placement:
        return self.settings.placement(self.mesh.world_size)

    def shard(self, model: nn.Module, device: torch.device) -> None:
        shard_model(model, self.settings, device)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        return model  # sharded as it was built

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def reduction_held(self, model: nn.Module, held: bool) -> AbstractContextManager[Any]:
        # FSDP's counterpart of no_sync(): one reduce-scatter per optimizer step
        if is_sharded(model):
            model.set_requires_gradient_sync(not held)  # type: ignore[operator]
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

    def describe(self) -> str:
        mesh = self.mesh.describe()
        line = f"FSDP: {self.settings.describe()}"
        return line if mesh is None else f"{line}; {mesh}"


def check_splits(cfg: Config) -> bool:
    """``cfg``'s model checked to split over FSDP's ranks as the run needs, before any worker
    starts: under an NF4 base, every layer one process quantizes must split into whole NF4
    blocks on every world size the run may take, else one line naming the layer (the model's
    shapes, on the meta device: nothing is allocated or read). Returns whether the split was
    checked (False: no NF4 base, or not FSDP, or not yet)."""
    lora, parallel = cfg.model.lora, cfg.parallel
    if lora is None or lora.base_dtype != "nf4" or parallel.strategy != "fsdp":
        return False
    from trainer.config import ConfigError
    from trainer.memory.nf4 import nf4_split_refusal

    bf16 = cfg.model.model_copy(update={"lora": lora.model_copy(update={"base_dtype": "bf16"})})
    with torch.device("meta"):
        model = model_factory(bf16, load_weights=False)()
    low, high = parallel.worker_range
    for world in range(max(low, 2), high + 1):
        refusal = nf4_split_refusal(model, world)
        if refusal is not None:
            raise ConfigError(refusal)
    return True
