"""An NF4 base (QLoRA, ``model.lora.base_dtype: nf4``): its matmuls run on a dequantized copy of
the weight (``trainer.memory.nf4.Nf4Linear``), held while the largest NF4 layer runs, in
forward, in backward and in recomputation alike.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from trainer.memory.nf4 import Nf4Linear, to_nf4


def nf4_dequantized_bytes(weights: int) -> int:
    """What an NF4 layer of ``weights`` weights holds while its matmul runs on its dequantized
    weight: the allocator's record of one token's forward and backward through two real NF4
    layers of a few slices (``fixed + per weight``), drawn to ``weights``; 0 for none."""
    if not weights:
        return 0
    fixed, per_weight = _dequantize_cost()
    return int(fixed + per_weight * weights)


@functools.cache
def _dequantize_cost() -> tuple[float, float]:
    from trainer.telemetry.diagnostics import cpu_peak_bytes

    measured = []
    for rows in (2048, 4096):  # 8 and 16 slices of 2**18 weights
        layer = nn.Linear(256, rows, bias=False)
        layer.weight = nn.Parameter(to_nf4(torch.zeros(rows, 256)), requires_grad=False)
        layer.__class__ = Nf4Linear
        x = torch.zeros(1, 256, requires_grad=True)

        def step(layer: nn.Module = layer, x: torch.Tensor = x) -> None:
            with torch.autocast("cpu", torch.bfloat16):  # as an NF4 base runs
                out = layer(x)
            out.float().sum().backward()

        measured.append((rows * 256, cpu_peak_bytes(step)))
    (n1, b1), (n2, b2) = measured
    per_weight = (b2 - b1) / (n2 - n1)
    return b1 - per_weight * n1, per_weight
