"""The contract every way of splitting the work over ranks answers: ``Parallelism``, with
``OneProcess`` (here), ``DataParallel`` (``trainer.parallel.ddp``) and ``ShardedDataParallel``
(``trainer.parallel.fsdp``). Everything that differs between the ways is asked of this object:
where a model's tensors are made and how it is sharded, wrapped after a restore and unwrapped
for a checkpoint or an export, whether a micro-batch's gradients are reduced, whether the ranks
can agree on an out-of-memory step before reducing, where the optimizer-in-backward hooks
attach, and the gradient norm over the ranks. Nothing outside ``trainer.parallel`` and
``trainer.plan`` branches on the kind (``tests/unit/test_boundaries.py`` greps for it).

What every way must answer is abstract, so a way that leaves one out cannot be made; what only
some ways do is a capability of its own, asked with ``isinstance`` (as Lightning Fabric's
``_BackwardSyncControl`` and ``_Sharded``): ``DeferredReduction`` (DDP: gradients reduced after
the ranks agree on an OOM) and ``AppliesPrecision`` (FSDP: its own mixed precision in place of
autocast). The ranks' layout is the way's ``mesh`` (``trainer.parallel.mesh``): the sequence
split is a dimension of it, not a way of its own, so the ways stay one class each.

The order in which a model is made ready is ``Parallelism.build``: one line per stage, so that
reordering is moving a line (torchtitan's ``parallelize`` reads the same way).

Two things every way shares, and which therefore are not asked of it: the process group (one
default group for every way, NCCL with gloo beside it for CPU tensors on GPUs, started by the
launcher before the way is known: ``trainer.parallel.rendezvous``), and a checkpoint's format
(the same DCP files under every way, ``trainer.checkpoint.files``), so a run moves between the
ways and between world sizes.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from trainer.batches import Rows, TokenBatch
from trainer.memory.optimizers import InBackward
from trainer.memory.precision import PrecisionPolicy
from trainer.models.build import MemoryTransforms, Placement, apply_transforms, start_model
from trainer.parallel.mesh import Mesh
from trainer.parallel.sequence import SequenceParallel, apply_sequence_parallel, row_slice

if TYPE_CHECKING:
    from trainer.config import Config

Compile = Callable[[nn.Module], None]

# What every concrete way states as a class attribute (``__init_subclass__`` holds it).
_STATED = ("agrees_on_oom", "backward_hooks", "steady_transients")


class Parallelism(ABC):
    """A way of splitting the work over the ranks of ``mesh``."""

    mesh: Mesh
    # The ranks can agree on an out-of-memory step before any gradient is reduced (so that the
    # step is retried at half the micro-batch on every rank: ``trainer.oom``).
    agrees_on_oom: ClassVar[bool]
    # Where ``memory.optimizer_in_backward``'s steps attach (``trainer.optim.build_optimizer``).
    backward_hooks: ClassVar[InBackward]
    # A step's large transients are the same every step, so a CPU worker's heap keeps freed
    # memory for the next one (``trainer.memory.allocator.settle_host_memory``).
    steady_transients: ClassVar[bool]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # (ABCMeta sets __abstractmethods__ only after this runs: found here as it does)
        abstract = any(getattr(getattr(cls, name, None), "__isabstractmethod__", False)
                       for name in dir(cls))
        unstated = [name for name in _STATED if not hasattr(cls, name)]
        if unstated and not abstract:
            raise TypeError(f"{cls.__name__} does not state {', '.join(unstated)}")

    def build(self, cfg: Config, device: torch.device, compile_model: Compile) -> nn.Module:
        """``cfg``'s model made ready for this way, in the one order every way follows."""
        # 1. the model, its LoRA adapters on a frozen base and its weights' dtype, with its
        #    weights (its own, or train.init_from: hf:DIR's): whole, or on the meta device
        #    where the way shards it (no rank holds it whole) or the base is bf16 or NF4
        started = start_model(cfg.model, cfg.train.init_from, device, cfg.run.seed,
                              self.placement())
        model = started.model
        # 2. the memory transforms: tiled MLP, activation checkpointing, the chunked loss, bf16
        #    norm inputs, activation offload (they wrap the blocks)
        apply_transforms(model, MemoryTransforms.of(cfg.memory))
        # 3. attention split over the mesh's sequence ranks, before compile so it is compiled
        self.split_sequences(model)
        # 4. torch.compile where asked, block by block: after checkpointing's wrappers (the
        #    recomputation is compiled too), before the shard (FSDP wraps compiled blocks)
        compile_model(model)
        # 5. the shard (FSDP, on meta); DDP wraps in ``wrap``, after the checkpoint's restore,
        #    since it broadcasts rank 0's weights as it wraps
        self.shard(model, device)
        # 6. what the meta device only described, allocated and filled: each rank's shards,
        #    with the seeded build's values or its rows of the safetensors
        return started.finish()

    def split_sequences(self, model: nn.Module) -> None:
        """Under ``parallel.sequence``, ``model``'s attention split over the sequence group."""
        if self.mesh.sequence > 1:
            apply_sequence_parallel(model, self.mesh.group("sequence"))

    def local_rows(self, batch: TokenBatch) -> Rows:
        """What this rank trains of a micro-batch's rows: its slice of every row's tokens."""
        if self.mesh.sequence == 1:
            return batch
        return row_slice(batch, self.mesh.sequence_rank, self.mesh.sequence)

    def gradient_sync(self, model: nn.Module, is_last: bool,
                      agreeing: bool) -> AbstractContextManager[Any]:
        """Around one micro-batch's forward and backward: its gradients held on the rank
        (every micro-batch but the last, and every one where the ranks are ``agreeing`` on an
        OOM first: ``defers_reduction``) or reduced; where the rows are split, the sequence
        group's meetings agree on an OOM too while the step does."""
        held = self.reduction_held(model, held=agreeing or not is_last)
        if not (agreeing and self.mesh.sequence > 1):
            return held
        sequence = self.unwrap(model).sequence  # apply_sequence_parallel's
        assert isinstance(sequence, SequenceParallel), "the model was not split"
        stack = contextlib.ExitStack()
        stack.enter_context(held)
        stack.enter_context(sequence.watch.watching())
        return stack

    def defers_reduction(self, agreement: Any) -> bool:
        """Whether the step's gradients are reduced only after ``agreement``'s check (an
        ``OOMAgreement`` over several ranks, or None), so that a rank that ran out of memory
        leaves no peer waiting inside a reduction: a ``DeferredReduction`` way's."""
        return isinstance(self, DeferredReduction) and agreement is not None \
            and agreement.distributed

    @abstractmethod
    def placement(self) -> Placement:
        """Where the model's tensors are made (``build``'s first stage)."""

    @abstractmethod
    def shard(self, model: nn.Module, device: torch.device) -> None:
        """``model``, on meta, sharded over the ranks where the way shards (``build``)."""

    @abstractmethod
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """The model as it steps, once its checkpoint is restored."""

    @abstractmethod
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model as built (what a checkpoint and an export read), from ``wrap``'s."""

    @abstractmethod
    def reduction_held(self, model: nn.Module, held: bool) -> AbstractContextManager[Any]:
        """Around a micro-batch: its gradients kept on the rank where ``held``, else reduced
        over the ranks in its backward."""

    @abstractmethod
    def total_norm(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over every rank, from ``clip_grad_norm_``'s result."""

    @abstractmethod
    def describe(self) -> str | None:
        """This way's own line in the run's log, if it has settings of its own."""


class DeferredReduction(ABC):
    """A way whose gradients can be reduced after the backward pass, once the ranks agree
    that no one ran out of memory (``Parallelism.defers_reduction``)."""

    @abstractmethod
    def reduce_gradients(self, model: nn.Module) -> None:
        """Reduce the gradients a deferred step held back."""


class AppliesPrecision(ABC):
    """A way that applies the run's precision itself, in place of autocast."""

    @abstractmethod
    def step_policy(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        """How a step applies ``policy`` under this way."""

    @abstractmethod
    def precision_route(self) -> str:
        """What the log adds to the precision's reason."""


def step_policy(parallel: Parallelism, policy: PrecisionPolicy) -> PrecisionPolicy:
    """How a step under ``parallel`` applies the run's precision: autocast (``policy``), unless
    the way applies it itself."""
    return parallel.step_policy(policy) if isinstance(parallel, AppliesPrecision) else policy


def precision_route(parallel: Parallelism) -> str:
    return parallel.precision_route() if isinstance(parallel, AppliesPrecision) else ""


class OneProcess(Parallelism):
    """One process holding the whole model."""

    agrees_on_oom: ClassVar[bool] = True  # alone: nothing to agree with, nothing to wait for
    backward_hooks: ClassVar[InBackward] = InBackward()  # each parameter's post-accumulate hook
    steady_transients: ClassVar[bool] = True

    def __init__(self, mesh: Mesh | None = None):
        self.mesh = mesh or Mesh()

    def placement(self) -> Placement:
        return Placement()

    def shard(self, model: nn.Module, device: torch.device) -> None:
        """Nothing: one process holds the whole model."""

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def reduction_held(self, model: nn.Module, held: bool) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()  # nothing to reduce

    def total_norm(self, grad_norm: torch.Tensor) -> torch.Tensor:
        return grad_norm

    def describe(self) -> str | None:
        return None
