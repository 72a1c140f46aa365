"""A CPU whose bf16 is emulated (``trainer.compat.cpu_bf16_support``): what its matrix
products allocate beyond fp32's, measured with real kernels on the model's first block, called
as the probe's forward called it (``BlockCall``). The probe (``trainer.plan.probe``) adds it to
the profile for CPU plans in bf16; it is alive at the step's peak wherever a block runs.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.compat import quiet_native_logs
from trainer.memory.precision import precision_policy

MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor argument by shape and dtype: a probe's may be fake, a stand-in is made real."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _spec(value: Any) -> Any:
    """An argument with its tensors (also inside tuples, lists and dicts) as ``_TensorSpec``."""
    if isinstance(value, torch.Tensor):
        return _TensorSpec(tuple(value.shape), value.dtype)
    if isinstance(value, tuple | list):
        return type(value)(_spec(item) for item in value)
    if isinstance(value, dict):
        return {name: _spec(item) for name, item in value.items()}
    return value


def _stand_in(value: Any) -> Any:
    """``_spec``'s inverse with zeros: shapes, not values, decide a kernel's workspace."""
    if isinstance(value, _TensorSpec):
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, tuple | list):
        return type(value)(_stand_in(item) for item in value)
    if isinstance(value, dict):
        return {name: _stand_in(item) for name, item in value.items()}
    return value


@dataclass(frozen=True)
class BlockCall:
    """How the probe called the first block at batch 1: one sample's input shape and the
    other arguments (a Hugging Face decoder layer takes its rotary position embeddings and
    position ids), their tensors as ``_TensorSpec``."""

    sample_shape: tuple[int, ...]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def record(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BlockCall:
        return cls(tuple(args[0].shape[1:]), _spec(args[1:]), _spec(kwargs))


def emulated_bf16_workspace(block: nn.Module, sample_shape: tuple[int, ...],
                            call: BlockCall | None = None) -> int:
    """Per sample: how much more workspace a block's matrix products take in bf16 than in fp32
    on this CPU, in a forward and backward of one and two samples (``sample_shape``: one
    sample's input to the block, e.g. ``(T, C)``; ``call``: the block's other arguments, as
    the probe passed them).

    Where the CPU has no bf16 instructions, its kernels emulate bf16 with fp32 arithmetic and
    may convert operands into buffers of their own while they run; those buffers are alive
    at the step's peak when a matrix product runs there. The fp32 kernels' own workspace
    (transposed copies) is left out: the planner's fp32 prediction already holds without it.
    """
    from torch.profiler import ProfilerActivity, profile

    from trainer.compat import cpu_op_workspace_bytes

    args, kwargs = ((), {}) if call is None else (_stand_in(call.args), _stand_in(call.kwargs))

    # bf16 weights (``model.dtype``) run in bf16 only: fp32's workspace is a float copy's
    weights_bf16 = any(p.dtype == torch.bfloat16 for p in block.parameters())
    fp32_block = copy.deepcopy(block).float() if weights_bf16 else block

    def workspace(precision: str, batch: int) -> int:
        run = block if precision == "bf16" else fp32_block
        dtype = torch.bfloat16 if run is block and weights_bf16 else torch.float32
        x_BTC = torch.randn(batch, *sample_shape, dtype=dtype, requires_grad=True)
        policy = precision_policy(precision, x_BTC.device, warn=False)
        with quiet_native_logs(), profile(activities=[ProfilerActivity.CPU],
                                          profile_memory=True) as prof:
            with policy.autocast(x_BTC.device):
                y_BTC = run(x_BTC, *args, **kwargs)
            if isinstance(y_BTC, tuple | list):  # a decoder layer that returns more
                y_BTC = y_BTC[0]
            y_BTC.float().sum().backward()
        run.zero_grad(set_to_none=True)
        return cpu_op_workspace_bytes(prof, MATMUL_OPS)

    excess = [max(0, workspace("bf16", batch) - workspace("fp32", batch)) for batch in (1, 2)]
    return max(0, excess[1] - excess[0], excess[0])  # at least what one sample needs

