"""bf16 norm inputs: under bf16 autocast every ``nn.LayerNorm`` becomes a
``Bf16InputLayerNorm`` (a subclass with the same parameters and state_dict keys, so
``print(model)`` shows it) that keeps only a bf16 copy of its input for backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def bf16_norm_inputs(model: nn.Module, enabled: bool = True) -> int:
    """Under bf16 autocast, make every ``nn.LayerNorm`` save a bf16 copy of its input.

    Autocast runs LayerNorm in fp32, so it saves its input, the fp32 residual stream, for
    backward: with the matmuls' inputs in bf16 that is the largest fp32 share of the saved
    activations. Here the forward is unchanged (fp32, from the fp32 input) but only a bf16
    copy of the input is kept; backward recomputes the norm in fp32 from that copy (one extra
    pass over a memory-bound op) and takes its gradients in fp32. Outside bf16 autocast nothing
    changes. Returns how many norms were changed.
    """
    if not enabled:
        return 0
    norms = [m for m in model.modules() if type(m) is nn.LayerNorm]
    for norm in norms:
        norm.__class__ = Bf16InputLayerNorm
    return len(norms)


class Bf16InputLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that, under bf16 autocast with grad, saves a bf16 copy of its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if not (torch.is_autocast_enabled(device_type)
                and torch.get_autocast_dtype(device_type) == torch.bfloat16
                and x.dtype == torch.float32 and torch.is_grad_enabled()):
            return super().forward(x)
        return _LayerNormSavingBf16.apply(x, self.weight, self.bias, self.normalized_shape,
                                          self.eps)


class _LayerNormSavingBf16(torch.autograd.Function):
    """``F.layer_norm`` in fp32 that keeps its input for backward in bf16."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, shape: tuple[int, ...], eps: float) -> torch.Tensor:
        ctx.save_for_backward(x.to(torch.bfloat16), weight, bias)
        ctx.shape, ctx.eps = shape, eps
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, shape, weight, bias, eps)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_bf16, weight, bias = ctx.saved_tensors
        inputs = [x_bf16.float().requires_grad_()]
        inputs += [t.detach().requires_grad_() for t in (weight, bias) if t is not None]
        with torch.enable_grad(), torch.autocast(grad_y.device.type, enabled=False):
            x = inputs[0]
            w = inputs[1] if weight is not None else None
            b = inputs[-1] if bias is not None else None
            y = F.layer_norm(x, ctx.shape, w, b, ctx.eps)
            grads = list(torch.autograd.grad(y, inputs, grad_y.float()))
        grad_x = grads.pop(0)
        grad_w = grads.pop(0) if weight is not None else None
        grad_b = grads.pop(0) if bias is not None else None
        return grad_x, grad_w, grad_b, None, None
