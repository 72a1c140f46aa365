"""The global batch's arithmetic, in one place: how it divides over ranks and micro-batches.

A run keeps its global batch exactly: ``global = micro x accumulation x world``. The config's
checks (``TrainConfig.accumulation_steps``), ``auto``'s candidates (``trainer.plan``) and
``memtrain plan`` all divide it here, so one rule and one message hold everywhere. Plain
integers, no torch and no config: the config imports it (``memtrain submit`` runs without
torch), and gpu-check and the benches use it without pydantic.
"""

from __future__ import annotations


def _ranks(sequence: int) -> str:
    """What the global batch divides over: the workers, or under ``parallel.sequence`` the data
    ranks (the sequence groups, whose ranks read the same rows)."""
    return "workers" if sequence == 1 else f"data ranks (workers / parallel.sequence {sequence})"


def per_rank_batch(global_batch_size: int, data_ranks: int, sequence: int = 1) -> int:
    """Samples each rank trains per optimizer step; ValueError naming both where the global
    batch does not divide over the ranks. ``data_ranks``: the workers, or the workers over
    ``sequence`` (``parallel.sequence``, the ranks of a sequence group)."""
    per_rank, remainder = divmod(global_batch_size, data_ranks)
    if remainder:
        raise ValueError(f"train.global_batch_size ({global_batch_size}) must be a multiple of "
                         f"the {_ranks(sequence)} ({data_ranks})")
    return per_rank


def accumulation_steps(global_batch_size: int, micro_batch_size: int, data_ranks: int,
                       sequence: int = 1) -> int:
    """Micro-batches per optimizer step on each rank; ValueError naming the worker counts that
    keep this global batch where ``micro x data ranks`` does not divide it. ``data_ranks``: the
    ranks, the workers over ``sequence`` (``parallel.sequence``): the counts named are
    multiples of it."""
    per_step = micro_batch_size * data_ranks
    if global_batch_size % per_step:
        fits = [sequence * ranks for ranks in range(1, global_batch_size // micro_batch_size + 1)
                if global_batch_size % (micro_batch_size * ranks) == 0]
        keep = (f"workers that keep this global batch: {', '.join(map(str, fits))}" if fits else
                f"no number of workers keeps it: train.micro_batch_size ({micro_batch_size}) "
                "does not divide it")
        raise ValueError(
            f"train.global_batch_size ({global_batch_size}) must be a multiple of "
            f"train.micro_batch_size x {_ranks(sequence)} ({micro_batch_size} x {data_ranks}); "
            f"{keep}")
    return global_batch_size // per_step


def micro_batch_candidates(per_rank: int) -> list[int]:
    """The micro-batches that keep a rank's batch whole: its divisors, largest first."""
    return sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True)
