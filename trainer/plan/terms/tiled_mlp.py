"""The tiled MLP (``memory.tiled_mlp``): its backward recomputes one tile of the MLP at a time,
so the largest temporary of a block's backward may be a tile's rather than the gradient of the
largest tensor the block saves.

What it holds while it runs its largest tile (``trainer.memory.tiled_mlp.TiledMLPFunction
.backward``): the tile's recomputed intermediates and the gradient of the largest of them, the
gradient of the MLP's whole input, filled tile by tile (per sample), and the MLP's parameter
gradients summed over the tiles (fixed). The probe measures it on one tile of the MLP's input
(``trainer.plan.probe``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MlpTile:
    """A tiled MLP's backward at its largest tile, as ``fixed + per_sample * batch`` (0 each
    without tiling)."""

    per_sample_bytes: int = 0
    fixed_bytes: int = 0

    def held_bytes(self, batch: int) -> int:
        return self.fixed_bytes + self.per_sample_bytes * batch
