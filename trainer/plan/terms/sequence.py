"""Sequence parallelism (``parallel.sequence: N``): Ulysses' all-to-alls.

A rank is probed as the run splits it (``trainer.plan.probe``), the all-to-alls stood in for by
local reshuffles of the same shapes, which record what each takes in. While a block's backward
runs, one all-to-all's send and receive buffers are held beside it (its output takes the place
of a tensor the unsplit block holds); a step sends their bytes and their gradients', and a
checkpointed block's recomputation sends its forward's again (``trainer.plan.speed``).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.parallel.sequence import SequenceShapes
from trainer.plan.devices import DeviceSpeed
from trainer.plan.speed import all_to_all_seconds, all_to_all_sent_bytes


@dataclass(frozen=True)
class AllToAlls:
    """A split rank's all-to-alls, per sample (0 each where one rank holds whole rows)."""

    ranks: int = 1  # the ranks each row is split over
    # What one forward's all-to-alls take in (queries, keys, values and attention's output,
    # every layer), and the largest single all-to-all's input.
    per_sample_bytes: int = 0
    largest_per_sample_bytes: int = 0

    @classmethod
    def of(cls, split: SequenceShapes | None) -> AllToAlls:
        """What ``split``'s all-to-alls took in, one sample's (the probe's forward at batch 1,
        then at 2); none without a split."""
        if split is None:
            return cls()
        calls = split.moved_bytes[:len(split.moved_bytes) // 2]  # batch 1's
        moved = [size for call in calls for size in call]
        return cls(split.size, sum(moved), max(moved, default=0))

    def held_bytes(self, batch: int) -> int:
        """One all-to-all's send and receive buffers, while a block's backward runs."""
        return 2 * self.largest_per_sample_bytes * batch

    def sent_bytes(self, batch: int, accumulation_steps: int, recomputed: float) -> int:
        """What a rank sends in a step (``recomputed``: the share of the blocks recomputed)."""
        return accumulation_steps * all_to_all_sent_bytes(
            self.per_sample_bytes * batch, self.ranks, recomputed)

    def seconds(self, batch: int, accumulation_steps: int, speed: DeviceSpeed,
                recomputed: float) -> float:
        """What a step's all-to-alls take at ``speed``'s all-reduce bus rate."""
        return accumulation_steps * all_to_all_seconds(
            self.per_sample_bytes * batch, self.ranks, speed, recomputed)
