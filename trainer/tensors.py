"""What a tensor is underneath, for code that must not care how the work is split: the storage
it views (``storage_key``), the bytes it holds (``tensor_bytes``: a quantized subclass by its
parts), this rank's part of it (``local_tensor``: an FSDP shard's local tensor, else the tensor),
and which rows of a whole tensor a rank holds under FSDP2's split (``shard_rows``, ``fill_local``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def storage_key(tensor: torch.Tensor) -> int:
    """Which storage a tensor views (the same for its views, ``.data`` and a Parameter of it):
    the storage's C++ object, not its data pointer, which meta and fake tensors do not have."""
    return tensor.untyped_storage()._cdata


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s bytes: a tensor subclass that stores other
    tensors (torchao's NF4 weights: 4-bit codes and their scales) by its parts, else itself."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or hasattr(tensor, "to_local"):  # a DTensor: ``local_tensor``'s
        return [tensor]
    return [part for name in flatten()[0] for part in plain_tensors(getattr(tensor, name))]


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` holds (a quantized subclass by its parts: ``plain_tensors``)."""
    return sum(t.numel() * t.element_size() for t in plain_tensors(tensor))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of an FSDP DTensor, else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def shard_rows(rows: int, rank: int, world_size: int) -> slice:
    """The rows of a tensor of ``rows`` rows FSDP2 gives ``rank``: ``torch.chunk``'s split of
    dim 0 (ranks past the last chunk hold none)."""
    per_rank = -(-rows // world_size)
    start = min(rank * per_rank, rows)
    return slice(start, min(start + per_rank, rows))


def fill_local(target: torch.Tensor, read: Callable[[slice | None], torch.Tensor],
               shape: torch.Size) -> None:
    """Copy this rank's part of a whole tensor of ``shape`` into ``target``: its rows of a
    sharded parameter, all of anything else. ``read(rows)`` gives those rows of the whole
    tensor (``None``: all of it)."""
    with torch.no_grad():
        if not hasattr(target, "to_local"):
            target.copy_(read(None))
            return
        import torch.distributed as dist

        local = target.to_local()
        if local.numel():
            rows = shard_rows(shape[0] if len(shape) else 0, dist.get_rank(),
                              dist.get_world_size())
            local.copy_(read(rows))
