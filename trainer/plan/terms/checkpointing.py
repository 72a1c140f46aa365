"""Activation checkpointing (``memory.activation_checkpointing``): what recomputation adds.

A checkpointed block saves only its inputs in the forward pass (the probe's saved bytes hold
that already) and recomputes its activations in backward: while the last block's backward runs,
that block's recomputed activations (counted only when the last block is checkpointed: an
unchecked last block frees more than a recomputed one takes) and its autocast weight copies
again. Under autocast, the checkpointed blocks' low-precision weight copies are cached until
autocast exits at the end of the forward pass, without being saved for backward. The time it
costs is the recomputed share of the forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Recompute:
    """What checkpointing's recomputation costs, as measured by the probe against a probe
    without checkpointing (0 each without it)."""

    # Forward FLOPs recomputed in backward, as a share of forward+backward: the wrapped
    # blocks' share of the blocks, a third (a forward is about a third of the step's work).
    fraction: float = 0.0
    # What the recomputed last block saves again, per sample and fixed (its autocast weight
    # copies); 0 where the last block is not checkpointed.
    block_per_sample_bytes: int = 0
    block_fixed_bytes: int = 0
    # Autocast's low-precision weight copies of the checkpointed blocks, cached until the end of
    # the forward pass (0 without autocast).
    autocast_cache_bytes: int = 0

    @property
    def recomputed_share(self) -> float:
        """The share of the blocks checkpointing recomputes (a recomputed forward is a third of
        forward and backward: ``fraction``)."""
        return 3 * self.fraction

    def last_block_bytes(self, batch: int) -> int:
        """The recomputed last block's activations while its backward runs."""
        return self.block_fixed_bytes + self.block_per_sample_bytes * batch

    def without_autocast_copies(self) -> Recompute:
        """The same recomputation where no autocast weight copies are made (FSDP's bf16
        parameters replace autocast)."""
        return dataclasses.replace(self, autocast_cache_bytes=0, block_fixed_bytes=0)
