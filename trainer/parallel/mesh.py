"""The data x sequence mesh of ``parallel.sequence: N``: the ranks form ``W / N`` sequence groups
of ``N`` consecutive ranks (rank ``r``: data rank ``r // N``, sequence rank ``r % N``). The ranks
of a group read the same rows and each trains its slice of every row's tokens (Ulysses
attention, ``trainer.parallel.sequence``); gradients are reduced over the whole world by DDP or
FSDP as without the split.

Why the loss needs nothing more: each rank divides its slice's summed loss by its slice's
trained targets where every target is trained, and by the global count over ``W`` where a mask
or packing leaves some out (``step_tokens`` over ``local_rows``; a slice may train none); the
reduction averages over all ``W`` ranks, so the gradient is that of the mean over the global
batch, as at ``W / N`` ranks on whole rows. The all-to-alls' backward carries each rank's
gradient to the ranks that hold the heads it attended with.

``SequenceDDP`` and ``SequenceFSDP`` are DDP and FSDP with the split added by
``SplitSequences``: the model's attention switched to the split between the memory transforms
and compile (``Parallelism.build``'s order), each micro-batch cut to the rank's slice, the step's
loss the group's, the loader placed by data rank. The ranks of a group wait for each other in
every attention layer: under DDP, in a step that recovers from an out-of-memory error, each of
those meetings agrees on one first (``trainer.parallel.sequence.GroupOOMWatch``), so a rank that
ran out stops its group where the group meets and the step is retried at half the micro-batch
as without the split; under FSDP, as without the split, an OOM over several ranks fails the
run.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.batches import Rows, TokenBatch
from trainer.parallel.ddp import DistributedDataParallel
from trainer.parallel.fsdp import FsdpSettings, FullyShardedDataParallel
from trainer.parallel.sequence import SequenceParallel, apply_sequence_parallel, row_slice
from trainer.parallel.strategy import Compile, DataPlace, Parallelism

if TYPE_CHECKING:
    from trainer.config import Config


@dataclass(frozen=True)
class SequenceMesh:
    """This rank's place in the data x sequence mesh, and its sequence group."""

    size: int  # N: ranks per sequence group
    rank: int  # within the group: which slice of every row this rank holds
    data_rank: int
    data_world: int
    group: dist.ProcessGroup

    @classmethod
    def of(cls, size: int) -> SequenceMesh:
        """The mesh of the default process group's ranks in groups of ``size``. A collective:
        every rank creates every group, in the same order (``dist.new_group``'s contract)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise ValueError(f"parallel.workers {world} is not divisible by parallel.sequence "
                             f"{size}")
        groups = [dist.new_group(list(range(first, first + size)))
                  for first in range(0, world, size)]
        return cls(size, rank % size, rank // size, world // size, groups[rank // size])


class SplitSequences(Parallelism):
    """The sequence split, added to a data-parallel way (``SequenceDDP``, ``SequenceFSDP``)."""

    mesh: SequenceMesh

    def build(self, cfg: Config, device: torch.device, compile_model: Compile) -> nn.Module:
        """The data-parallel way's build, with the attention split over the sequence group
        after the memory transforms and before compile (and so before sharding)."""
        def split_then_compile(model: nn.Module) -> None:
            apply_sequence_parallel(model, self.mesh.group)
            compile_model(model)

        return super().build(cfg, device, split_then_compile)

    def data_place(self, rank: int, world_size: int) -> DataPlace:
        mesh = self.mesh
        return DataPlace(mesh.data_rank, mesh.data_world, mesh.size, mesh.rank == 0)

    def local_rows(self, batch: TokenBatch) -> Rows:
        return row_slice(batch, self.mesh.rank, self.mesh.size)

    def gradient_sync(self, model: nn.Module, is_last: bool,
                      agreeing: bool) -> AbstractContextManager[Any]:
        # agreeing: the step agrees on an OOM, so the group's meetings agree on one too
        data_way = super().gradient_sync(model, is_last, agreeing)
        if not agreeing:
            return data_way
        sequence = self.unwrap(model).sequence  # apply_sequence_parallel's
        assert isinstance(sequence, SequenceParallel), "the model was not split"
        stack = contextlib.ExitStack()
        stack.enter_context(data_way)
        stack.enter_context(sequence.watch.watching())
        return stack

    def describe(self) -> str:
        mesh = self.mesh
        line = (f"sequence parallel {mesh.size}: each row's tokens split over {mesh.size} ranks "
                f"(Ulysses attention), {mesh.data_world} data ranks")
        data = super().describe()
        return line if data is None else f"{data}; {line}"


class SequenceDDP(SplitSequences, DistributedDataParallel):
    """DDP over every rank, each row split over the ranks of its sequence group."""

    def __init__(self, mesh: SequenceMesh, world_size: int):
        super().__init__(world_size)
        self.mesh = mesh


class SequenceFSDP(SplitSequences, FullyShardedDataParallel):
    """FSDP sharded over every rank, each row split over the ranks of its sequence group."""

    def __init__(self, mesh: SequenceMesh, settings: FsdpSettings):
        super().__init__(settings)
        self.mesh = mesh
