"""One object per way of splitting the work over ranks: ``Parallelism`` (one process, and the
base of the others), ``DistributedDataParallel`` (``trainer.parallel.ddp``) and
``FullyShardedDataParallel`` (``trainer.parallel.fsdp``). Everything that differs between the
ways is asked of this object: how the model is built and made ready, wrapped after a restore
and unwrapped for a checkpoint or an export, whether a micro-batch's gradients are reduced,
whether the ranks can agree on an out-of-memory step before reducing, where the
optimizer-in-backward hooks attach, how precision is applied, what the worker's heap keeps, and
which rows a rank reads and which part of them it trains (``data_place``, ``local_rows``).
Nothing outside ``trainer.parallel`` and ``trainer.plan`` branches on the kind
(``tests/unit/test_boundaries.py`` greps for it). Lightning Fabric keeps one ``Strategy`` per
way the same way; sequence parallelism is here too (``trainer.parallel.mesh``), and tensor
parallelism would be.

The order in which a model is made ready is written once, in ``Parallelism.build``'s docstring,
and each way follows it; torchtitan comments its ``parallelize`` the same way.

Two things every way shares, and which therefore are not asked of it: the process group (one
default group for every way, NCCL with gloo beside it for CPU tensors on GPUs, started by the
launcher before the way is known: ``trainer.parallel.rendezvous``), and a checkpoint's format
(the same DCP files under every way, ``trainer.checkpoint.files``: the state-dict options depend
on the model, a LoRA model's base left out, not on the way), so a run moves between the ways and
between world sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from trainer.batches import Rows, TokenBatch
from trainer.memory.allocator import keep_freed_host_memory, return_freed_host_memory
from trainer.memory.optimizers import InBackward
from trainer.memory.precision import PrecisionPolicy
from trainer.models.build import MemoryTransforms, build_whole

if TYPE_CHECKING:
    from trainer.config import Config

Compile = Callable[[nn.Module], None]


@dataclass(frozen=True)
class DataPlace:
    """Which rows a rank reads: the loader's ``rank`` among ``world_size`` data ranks, and the
    ``sequence`` ranks that share each of those rows (each holding ``1 / sequence`` of its
    tokens), of which one, the ``first``, records the rows (``data.record_rows``)."""

    rank: int
    world_size: int
    sequence: int = 1
    first: bool = True


class Parallelism:
    """One process holding the whole model (and the base of the other ways)."""

    # The ranks can agree on an out-of-memory step before any gradient is reduced (so that the
    # step is retried at half the micro-batch on every rank: ``trainer.oom``).
    agrees_on_oom: ClassVar[bool] = True
    # Where ``memory.optimizer_in_backward``'s steps attach (``trainer.optim.build_optimizer``):
    # each parameter's post-accumulate-grad hook here.
    backward_hooks: ClassVar[InBackward] = InBackward()

    def build(self, cfg: Config, device: torch.device, compile_model: Compile) -> nn.Module:
        """``cfg``'s model made ready for this way of splitting, in this order:

        1. the model, its LoRA adapters on a frozen base and its weights' dtype
           (``trainer.models.build.model_factory``), with its weights: its own, or
           ``train.init_from: hf:DIR``'s over the seeded build's (read on a resume too, then
           replaced by the checkpoint's);
        2. the memory transforms (activation checkpointing, the chunked loss, bf16 norm
           inputs, activation offload: ``apply_transforms``), which wrap the blocks;
        3. under ``parallel.sequence``, attention split over the sequence group
           (``trainer.parallel.mesh``: it wraps ``compile_model``, so the split is compiled);
           then ``compile_model`` (torch.compile where asked), block by block, after checkpointing's
           wrappers, so that the recomputation is compiled too, and before any sharding, so
           that FSDP wraps compiled blocks;
        4. the split: FSDP shards here, on the meta device, and then fills each rank's shards
           (no rank holds the whole model); DDP wraps in ``wrap``, after the checkpoint's
           restore, since it broadcasts rank 0's weights as it wraps.

        Here: 1 and 2 on every rank alike (the same seed, the same weights), then 3."""
        model = build_whole(cfg.model, cfg.train.init_from, MemoryTransforms.of(cfg.memory),
                            device, seed=cfg.run.seed)
        compile_model(model)
        return model

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """The model as it steps, once its checkpoint is restored."""
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model as built (what a checkpoint and an export read), from ``wrap``'s."""
        return model

    def data_place(self, rank: int, world_size: int) -> DataPlace:
        """Which rows ``rank`` of ``world_size`` reads: its own, here."""
        return DataPlace(rank, world_size)

    def local_rows(self, batch: TokenBatch) -> Rows:
        """What this rank trains of a micro-batch's rows: all of them, here."""
        return batch

    def defers_reduction(self, agreement: Any) -> bool:
        """Whether the step's gradients are reduced only after ``agreement``'s check (an
        ``OOMAgreement`` over several ranks, or None), so that a rank that ran out of memory
        leaves no peer waiting inside a reduction."""
        return False

    def gradient_sync(self, model: nn.Module, is_last: bool,
                      agreeing: bool) -> AbstractContextManager[Any]:
        """Around one micro-batch's forward and backward: whether its gradients are reduced
        (once a step: on the last micro-batch, unless the ranks are ``agreeing`` on an OOM
        first, ``defers_reduction``, which then reduces them after the check)."""
        return contextlib.nullcontext()

    def reduce_gradients(self, model: nn.Module) -> None:
        """Reduce the gradients a deferred step held back (``defers_reduction``)."""

    def total_norm(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over every rank, from ``clip_grad_norm_``'s result."""
        return grad_norm

    def step_policy(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        """How a step applies the run's precision: autocast (``policy``) here."""
        return policy

    def precision_route(self) -> str:
        """What the log adds to the precision's reason where this way applies it otherwise."""
        return ""

    def settle_host_memory(self, lean: bool = False) -> None:
        """glibc's heap on a CPU worker: freed memory kept for the next step (a step's large
        tensors reuse the last step's pages; ``trainer.memory.allocator``), or returned where
        the run is ``lean`` (a LoRA model over a bf16 or NF4 base: its own bytes are few, and a
        kept heap holds every transient of its build and step beside them, as much again as
        an NF4 base)."""
        if lean:
            return_freed_host_memory()
        else:
            keep_freed_host_memory()

    def describe(self) -> str | None:
        """This way's own line in the run's log, if it has settings of its own."""
        return None


