"""The global batch's arithmetic, in one place: how it divides over ranks and micro-batches.

A run keeps its global batch exactly: ``global = micro x accumulation x world``. The config's
checks (``TrainConfig.accumulation_steps``), ``auto``'s candidates (``trainer.plan``) and
``memtrain plan`` all divide it here, so one rule and one message hold everywhere. Plain
integers, no torch and no config: the config imports it (``memtrain submit`` runs without
torch), and gpu-check and the benches use it without pydantic.
"""

from __future__ import annotations


def per_rank_batch(global_batch_size: int, world_size: int) -> int:
    """Samples each rank trains per optimizer step; ValueError naming both where the global
    batch does not divide over the ranks."""
    per_rank, remainder = divmod(global_batch_size, world_size)
    if remainder:
        raise ValueError(f"train.global_batch_size ({global_batch_size}) must be a multiple of "
                         f"the workers ({world_size})")
    return per_rank


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per optimizer step on each rank; ValueError naming the world sizes that
    keep this global batch where ``micro x world`` does not divide it."""
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        fits = [w for w in range(1, global_batch_size // micro_batch_size + 1)
                if global_batch_size % (micro_batch_size * w) == 0]
        raise ValueError(
            f"train.global_batch_size ({global_batch_size}) must be a multiple of "
            f"train.micro_batch_size x workers ({micro_batch_size} x {world_size}); workers "
            f"that keep this global batch: {', '.join(map(str, fits))}")
    return global_batch_size // per_step


def micro_batch_candidates(per_rank: int) -> list[int]:
    """The micro-batches that keep a rank's batch whole: its divisors, largest first."""
    return sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True)
