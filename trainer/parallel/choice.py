"""Which way of splitting the work a run takes (``parallelism_for``), or an already built model
was given (``parallelism_of``), whether it runs fp16 (``runs_fp16``), and whether the model
splits over the ranks as asked (``check_splits``, before any worker starts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from trainer.parallel.ddp import DataParallel, is_ddp
from trainer.parallel.fsdp import FsdpSettings, ShardedDataParallel, check_splits, is_sharded
from trainer.parallel.mesh import Mesh
from trainer.parallel.strategy import OneProcess, Parallelism

if TYPE_CHECKING:
    from trainer.config import Config

__all__ = ["check_splits", "parallelism_for", "parallelism_of", "runs_fp16"]


def runs_fp16(cfg: Config) -> bool:
    """Whether ``cfg``'s way of splitting runs fp16 (``memory.precision: auto`` otherwise takes
    fp32 on a GPU without native bf16): FSDP does not, at any world size (the config refuses
    fp16 with it), so a run moves between one worker and several under one precision."""
    return cfg.parallel.strategy != "fsdp"


def parallelism_for(cfg: Config, world_size: int, precision: str) -> Parallelism:
    """The way ``cfg`` splits the work over ``world_size`` ranks at the run's resolved
    ``precision``: FSDP where asked over several ranks, DDP over several ranks otherwise, and
    one process alone (one FSDP worker has nothing to shard, and reads and writes the same
    checkpoints); its mesh splits each row over ``parallel.sequence`` ranks (the groups created
    here: every rank calls)."""
    if world_size == 1:
        return OneProcess()
    sharded = cfg.parallel.strategy == "fsdp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = Mesh.of(world_size, rank, cfg.parallel.sequence, sharded)
    if sharded:
        return ShardedDataParallel(mesh, FsdpSettings.of(cfg, precision, world_size))
    return DataParallel(mesh)


def parallelism_of(model: nn.Module) -> Parallelism:
    """The way an already built ``model`` is split, from how it is wrapped: for a step run
    outside the loop (the planner's measurements, the benches), which holds no ``Parallelism``
    of its own."""
    if is_ddp(model):
        return DataParallel(Mesh.of(dist.get_world_size(), dist.get_rank()))
    if is_sharded(model):
        return ShardedDataParallel(Mesh.of(dist.get_world_size(), dist.get_rank(), sharded=True),
                                   None)
    return OneProcess()
