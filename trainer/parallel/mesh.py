"""The ranks as one mesh of named dimensions, which every way of splitting and the loader read.

A run's ``W`` ranks form the grid ``data x sequence``:

- ``data``: the data ranks. Each reads rows of its own, and the global batch divides over them
  (``data_ranks``). Under DDP they hold whole copies of the model (the mesh calls them
  ``replicate``); under FSDP they hold shards of it (``shard``). One mesh holds one of the two
  above 1: hybrid sharding (replicas of a sharded model) is not a way memtrain has.
- ``sequence`` (``parallel.sequence: N``): the ranks that share each row, each training a
  ``1 / N`` slice of its tokens (Ulysses attention, ``trainer.parallel.sequence``). A sequence
  group is ``N`` consecutive ranks: rank ``r`` is data rank ``r // N``, sequence rank ``r % N``.

FSDP shards over every rank (``shard x sequence`` flattened, as torchtitan shards over
``dp_shard x cp``) and gradients are reduced over every rank, with or without the sequence
split: the sequence ranks' gradients are of different tokens of the same rows, and their sum
is the rows' gradient.

Why the loss needs nothing more under the split: each rank divides its slice's summed loss by
its slice's trained targets where every target is trained, and by the global count over ``W``
where a mask or packing leaves some out (``trainer.step.step_tokens`` over ``local_rows``; a
slice may train none); the reduction averages over all ``W`` ranks, so the gradient is that of
the mean over the global batch, as at ``W / N`` ranks on whole rows. The all-to-alls' backward
carries each rank's gradient to the ranks that hold the heads it attended with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

# The mesh's dimensions, outermost first: a rank's coordinates are row-major over their sizes.
DIMS = ("replicate", "shard", "sequence")


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the mesh: the size of each named dimension, the rank, and the
    process group of each dimension above 1 that has its own collectives (``sequence``)."""

    replicate: int = 1
    shard: int = 1
    sequence: int = 1
    rank: int = 0
    groups: Mapping[str, dist.ProcessGroup] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, world_size: int, rank: int, sequence: int = 1, sharded: bool = False) -> Mesh:
        """The mesh of ``world_size`` ranks: data ranks that replicate the model (or, where
        ``sharded``, shard it) x ``sequence`` ranks per row. A collective where ``sequence``
        is above 1: every rank creates every sequence group, in the same order
        (``dist.new_group``'s contract). Raises ValueError where ``sequence`` does not divide
        ``world_size``."""
        if world_size % sequence:
            raise ValueError(f"parallel.workers {world_size} is not divisible by "
                             f"parallel.sequence {sequence}")
        data = world_size // sequence
        groups = {}
        if sequence > 1:
            every = [dist.new_group(list(range(first, first + sequence)))
                     for first in range(0, world_size, sequence)]
            groups["sequence"] = every[rank // sequence]
        return cls(replicate=1 if sharded else data, shard=data if sharded else 1,
                   sequence=sequence, rank=rank, groups=groups)

    @property
    def sizes(self) -> dict[str, int]:
        """Each dimension's size, by name, outermost first."""
        return {dim: getattr(self, dim) for dim in DIMS}

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.sequence

    @property
    def data_ranks(self) -> int:
        """The ranks that read rows of their own: the global batch divides over them."""
        return self.replicate * self.shard

    @property
    def data_rank(self) -> int:
        """Which of the ``data_ranks`` this rank is: the rows it reads."""
        return self.rank // self.sequence

    @property
    def sequence_rank(self) -> int:
        """Which slice of each row's tokens this rank trains."""
        return self.rank % self.sequence

    @property
    def records_rows(self) -> bool:
        """Whether this rank records its data rank's rows (``data.record_rows``): the first of
        its sequence group, so that each row is recorded once."""
        return self.sequence_rank == 0

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of this rank's ``dim`` (``sequence``): the ranks it meets there."""
        if dim not in self.groups:
            raise KeyError(f"the mesh has no {dim!r} group (sizes {self.sizes})")
        return self.groups[dim]

    def describe(self) -> str | None:
        """The mesh's line in the run's log, where it splits rows (None otherwise)."""
        if self.sequence == 1:
            return None
        return (f"sequence parallel {self.sequence}: each row's tokens split over "
                f"{self.sequence} ranks (Ulysses attention), {self.data_ranks} data ranks")
