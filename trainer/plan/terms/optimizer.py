"""AdamW's step: what it allocates beside its state, and the step's own moment of the peak.

torch's AdamW runs its multi-tensor (foreach) path on CUDA, whose temporaries are a moment's
size over every parameter; on CPU, and for torchao's low-bit states, it loops over the
parameters, and the largest parameter's step sets the temporaries.
"""

from __future__ import annotations

from trainer.plan.static import StaticBytes

# What one parameter's AdamW step allocates, in fp32 copies of that parameter: torch's loop on
# CPU, torchao's compiled step per state dtype (measured on CPU with the allocator's record:
# tests/unit/test_strategies.py).
STEP_TEMPORARIES_PER_PARAM = {"fp32": 3.0, "bf16": 0.0, "8bit": 2.0, "4bit": 6.5}


def step_temporaries(static: StaticBytes) -> int:
    """What AdamW's step allocates beside its state: a moment's size over every parameter for
    fp32 AdamW on CUDA (torch's multi-tensor path); else a loop over the parameters, whose
    largest sets it (``STEP_TEMPORARIES_PER_PARAM``)."""
    if static.optimizer_states == "fp32" and static.step_device == "cuda" \
            and not static.in_backward:
        return static.optimizer // 2
    return one_step_temporaries(static, static.largest_grad)


def one_step_temporaries(static: StaticBytes, grad_bytes: int) -> int:
    """What one parameter's AdamW step allocates, given its gradient's bytes: fp32 copies of
    it (``STEP_TEMPORARIES_PER_PARAM``), twice the gradient's bytes over bf16 weights."""
    return int(STEP_TEMPORARIES_PER_PARAM[static.optimizer_states] * grad_bytes
               * 4 // static.weight_itemsize)


def optimizer_step_bytes(static: StaticBytes) -> int:
    """The optimizer step's moment beside the parameters and AdamW's state: every gradient and
    the step's temporaries; 0 where the step is not on the device at the end (FSDP's CPU
    offload steps on the host; the step in backward has stepped every parameter already)."""
    if static.offloaded or static.in_backward:
        return 0
    return static.grads + step_temporaries(static)
