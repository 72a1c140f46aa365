"""A block's backward: what it holds beside the activations it saved.

The gradient flowing into it (the residual stream's, and under autocast its low-precision copy,
which the block's last matrix product takes) and its largest temporary: the gradient of the
largest tensor it saves or, where larger, a tiled MLP's tile (``trainer.plan.terms.tiled_mlp``).
At the end of backward, the first block's own saved activations (recomputed where it is
checkpointed) are held beside every other gradient.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.plan.terms.tiled_mlp import MlpTile


@dataclass(frozen=True)
class BlockBackward:
    """A block's backward, per sample as the probe measured it (0 each for a model without
    blocks)."""

    # The biggest single tensor a block saves (from a probe without checkpointing): its gradient
    # is the largest temporary of backward.
    largest_tensor_per_sample_bytes: int = 0
    # The gradient of a block's output, alive through its backward.
    output_grad_per_sample_bytes: int = 0
    # What the first block holds for its own backward at the end of backward (recomputed where
    # it is checkpointed), when every other gradient exists already.
    first_block_per_sample_bytes: int = 0
    mlp_tile: MlpTile = dataclasses.field(default_factory=MlpTile)

    def held_bytes(self, batch: int) -> int:
        """The incoming gradient and the largest temporary of one block's backward."""
        largest = max(self.largest_tensor_per_sample_bytes * batch,
                      self.mlp_tile.held_bytes(batch))
        return largest + self.output_grad_per_sample_bytes * batch

    def first_block_bytes(self, batch: int) -> int:
        """The first block's saved activations, at the end of backward."""
        return self.first_block_per_sample_bytes * batch
