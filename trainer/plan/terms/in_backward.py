"""``memory.optimizer_in_backward``: each gradient is stepped and dropped as it completes, so
the gradients never all live at once.

At the end of backward (the first block's) the rank holds the gradients outside the blocks,
the first block's (a bucket's under DDP, a reduce-scatter's under FSDP, one parameter's in one
process) and one parameter's step; the very last step (a tied embedding's, whose gradient
completes last) runs alone, when the activations are gone.
"""

from __future__ import annotations

from trainer.plan.static import ParameterBytes, StaticBytes
from trainer.plan.terms.optimizer import one_step_temporaries, step_temporaries


def in_backward_held(static: StaticBytes, parameters: ParameterBytes, outside_grads: int
                     ) -> int:
    """The step in backward at the first block's backward: the gradients outside the blocks
    (a tied embedding's completes last), that block's (FSDP reduce-scatters a block's at once,
    DDP a bucket's; in one process only the parameter stepping now holds one), and the step of
    its largest parameter with its temporaries."""
    largest = parameters.largest_block_param_bytes // static.world_size
    block = parameters.block_param_bytes // static.world_size \
        if static.sharded or static.bucketed else largest
    return min(static.grads, outside_grads + block) + one_step_temporaries(static, largest)


def in_backward_bytes(static: StaticBytes) -> int:
    """The last step in backward: the largest gradient while its parameter steps, with that
    step's temporaries (the largest is an embedding, tied to the output layer: its gradient
    completes last, when the activations are gone)."""
    return static.largest_grad + step_temporaries(static)


def backward_end_grads(static: StaticBytes, parameters: ParameterBytes, outside_grads: int
                       ) -> int:
    """The gradients on the device at the end of backward: every one (0 under FSDP's CPU
    offload, which holds them on the host), or with the step in backward those of
    ``in_backward_held``."""
    if static.offloaded:
        return 0
    if static.in_backward:
        return in_backward_held(static, parameters, outside_grads)
    return static.grads


def last_step_bytes(static: StaticBytes) -> int:
    """The moment of the last step in backward (``in_backward_bytes``); 0 without the step in
    backward, or where it runs on the host (FSDP's CPU offload)."""
    if not static.in_backward or static.offloaded:
        return 0
    return in_backward_bytes(static)
