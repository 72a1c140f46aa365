"""What the distributed tests count of a sharded model."""

from __future__ import annotations

from torch import nn

from trainer.tensors import local_tensor


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (its shards under FSDP, everything otherwise)."""
    return sum(local_tensor(p).numel() * local_tensor(p).element_size()
               for p in model.parameters())
