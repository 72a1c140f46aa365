"""Activation checkpointing: wrap every (``full``) or every k-th (``selective``) block of
``model.blocks`` in torch's non-reentrant checkpoint wrapper, which recomputes the block's
activations in backward and preserves RNG state, so dropout is replayed identically; parameter
names and state_dict keys are unchanged."""

from __future__ import annotations

import warnings
from functools import partial

from torch import nn

from trainer.compat import checkpoint_wrapper_api


def checkpointed_block_indices(num_blocks: int, mode: str, every: int) -> list[int]:
    """Which blocks get activation checkpointing: none, all, or (``selective``) blocks 0,
    ``every``, 2 * ``every``, ...; a ValueError for an ``every`` below 1 or another mode."""
    if mode == "none":
        return []
    if mode == "full":
        return list(range(num_blocks))
    if mode == "selective":
        if every < 1:
            raise ValueError(f"memory.activation_checkpointing_every must be >= 1, got {every}")
        return list(range(0, num_blocks, every))
    raise ValueError(f"memory.activation_checkpointing {mode!r} is not none|full|selective")


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> list[int]:
    """Wrap the chosen blocks of ``model.blocks`` in place; returns their indices."""
    if mode == "none":
        return []
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        # The shipped configs turn checkpointing on; a user's own model without blocks still
        # trains with them, and is told what it would take.
        warnings.warn(f"memory.activation_checkpointing {mode!r} ignored: it needs the model to "
                      f"expose its repeated blocks as `model.blocks` (an nn.ModuleList); "
                      f"{type(model).__name__} does not", stacklevel=2)
        return []
    chosen = checkpointed_block_indices(len(blocks), mode, every)
    targets = {id(blocks[i]) for i in chosen}
    api = checkpoint_wrapper_api()
    api.apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(api.checkpoint_wrapper,
                                      checkpoint_impl=api.CheckpointImpl.NO_REENTRANT,
                                      preserve_rng_state=True),
        check_fn=lambda module: id(module) in targets,
    )
    return chosen
