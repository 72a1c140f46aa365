"""FSDP (``parallel.strategy: fsdp``): what it holds whole beside one rank's shards while it
runs, by its settings (``trainer.parallel.fsdp.FsdpSettings``), and what CPU offload moves to
the host.

Calibrated on CPU with gloo (2 ranks: fp32, bf16 autocast, bf16 parameters, kept after
forward, offload; ``tests/distributed/test_fsdp.py``), not yet measured on CUDA. Under FSDP
the end of backward is planned from what it holds there, not from the first block's
activations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.parallel.fsdp import FsdpSettings
from trainer.plan.profile import ActivationProfile
from trainer.plan.static import ParameterBytes, StaticBytes
from trainer.plan.terms.optimizer import step_temporaries


@dataclass(frozen=True)
class FsdpHeld:
    """What FSDP holds whole on one rank (0 each without FSDP): ``gathered`` throughout forward
    and backward, ``backward_grads`` while a block's backward runs, ``kept`` from a block's
    forward to its backward."""

    gathered: int = 0
    backward_grads: int = 0
    kept: int = 0

    @property
    def forward(self) -> int:
        """In the forward pass (and the plain loss's backward)."""
        return self.gathered + self.kept

    @property
    def backward(self) -> int:
        """While the last block's backward runs."""
        return self.gathered + self.kept + self.backward_grads

    @property
    def backward_end(self) -> int:
        """While the first block's backward runs: every block's kept copy is freed by then."""
        return self.gathered + self.backward_grads


def fsdp_in_flight(static: StaticBytes, parameters: ParameterBytes) -> FsdpHeld:
    """What FSDP holds whole beside one rank's shards (``trainer.parallel.fsdp``), nothing
    without FSDP:

    - the root's parameters, gathered for the whole step (it is not resharded after forward),
      in the parameter dtype; without mixed precision its own shard is part of the gather;
    - two blocks' parameters all-gathered (the one running and the one prefetched), in the
      parameter dtype, and under CPU offload their shards copied to the device first;
    - in backward, a block's unsharded gradients (parameter dtype) and the reduce-scatter's
      input they are copied into (reduction dtype), the next block's not yet begun;
    - ``reshard_after_forward`` false: every block's gathered parameters from its forward to its
      backward; a group of N: every block's parameters sharded N ways, as long."""
    if not static.sharded:
        return FsdpHeld()
    fsdp = static.fsdp or FsdpSettings()
    param_share, reduce_share = fsdp.param_share, fsdp.reduce_share
    root, block, world = (parameters.outside_blocks_param_bytes, parameters.block_param_bytes,
                          static.world_size)
    root_gathered = int(root * param_share)
    if param_share == 1.0 and not static.offloaded:
        root_gathered -= root // world
    blocks = 2 * int(block * param_share)
    if static.offloaded:
        blocks += 2 * -(-block // world)
    grads = int(block * param_share) + int(block * reduce_share)
    all_blocks = int(max(static.full_param_bytes - root, 0) * param_share)
    reshard = fsdp.reshard_after_forward
    if reshard is True:
        kept = 0
    elif reshard is False:  # the two gathered blocks are among those kept whole
        kept = max(0, all_blocks - int(2 * block * param_share))
    else:  # a group's copies, apart from the gathered blocks
        kept = all_blocks // reshard
    return FsdpHeld(root_gathered + blocks, grads, kept)


def under_fsdp(static: StaticBytes, profile: ActivationProfile
               ) -> tuple[StaticBytes, ActivationProfile]:
    """The row's FSDP settings at its precision (bf16 parameters need bf16: an fp32 row keeps
    fp32 ones), and its profile without autocast's weight copies where bf16 parameters replace
    autocast (the gathered bf16 blocks are in ``fsdp_in_flight``); both as they are without
    FSDP."""
    if static.fsdp is not None and profile.precision != "bf16":
        static = dataclasses.replace(static, fsdp=dataclasses.replace(
            static.fsdp, param_dtype="fp32", reduce_dtype="fp32"))
    if static.fsdp is not None and static.fsdp.param_dtype == "bf16":
        profile = dataclasses.replace(profile, fixed_bytes=0,
                                      recompute=profile.recompute.without_autocast_copies())
    return static, profile


def fsdp_host_bytes(static: StaticBytes) -> int:
    """FSDP's CPU offload: the shards, their gradients and AdamW's state (and its step's
    temporaries) in host memory; 0 without it."""
    return static.total + step_temporaries(static) if static.offloaded else 0
