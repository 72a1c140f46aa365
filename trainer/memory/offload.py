"""Activation offload: what autograd saves for backward goes to host memory, and comes back when
backward needs it (``memory.activation_offload``).

``ActivationOffload`` is a pair of ``saved_tensors_hooks``. Its pack hook copies the storage of
each saved tensor (parameters excepted, and storages under ``min_bytes``: none by default) into
host memory, once however many views of it are saved, and returns where the view lies in the
copy, so autograd
holds the host copy and the device storage is freed once the forward drops it; its unpack hook
copies the view back. On CUDA, as torchtune's ``OffloadActivations``: the host buffers
are pinned, the copies to the host run on a side stream (the device tensor is kept, recorded on
that stream, until its copy is done), and at most ``max_in_flight`` copies are outstanding (the
oldest is waited for beyond that). Backward copies each view back when its node runs (no
prefetch of the next block's: a shortcut against torchtune, which overlaps those too). On CPU,
host and device are one memory: the same hooks copy within it, which exercises every path but
saves nothing (the log says so).

Where the hooks are on (``install``):
- ``checkpointed``: around each checkpoint-wrapped block's call, outside the checkpoint, so they
  see only what the checkpoint keeps (its inputs; the block's inner activations are recomputed);
- ``all``: around the model's whole forward, the loss included.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from trainer.compat import is_checkpoint_wrapper, is_fake
from trainer.tensors import storage_key

# Smaller saved storages stay on the device. 0: every one moves, so the host bytes grow exactly
# linearly with the batch, as the planner fits them (with a threshold, a tensor of a few hundred
# bytes a sample would cross it between the probe's batch and the run's).
MIN_OFFLOAD_BYTES = 0


class ActivationOffload:
    """The pack/unpack hooks of activation offload, for one model (the module docstring)."""

    def __init__(self, model: nn.Module, min_bytes: int = MIN_OFFLOAD_BYTES,
                 max_in_flight: int = 8):
        self.model, self.min_bytes, self.max_in_flight = model, min_bytes, max_in_flight
        self.bytes_this_forward = 0  # host bytes held for the current forward's backward
        self.tensors_this_forward = 0
        # storage -> (a weak reference to it, its host copy), within one forward
        self._copies: dict[int, tuple[Any, Any]] = {}
        self._param_storages: set[int] = set()
        self._in_flight: deque[Any] = deque()
        self._stream: Any = None
        self._hooks: Any = None
        self._depth = 0

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def enter(self) -> None:
        """A forward (or a wrapped block) begins: the hooks go on."""
        if self._depth == 0 and torch.is_grad_enabled():
            self._hooks = self.context()
            self._hooks.__enter__()
        self._depth += 1

    def exit(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            self._copies.clear()  # autograd holds the copies now; nothing else may

    def start_forward(self) -> None:
        """A new training forward: its counts start at zero; the parameters' storages (FSDP
        swaps them) are read again."""
        self.bytes_this_forward = self.tensors_this_forward = 0
        self._param_storages = {storage_key(p) for p in self.model.parameters()}

    def pack(self, tensor: torch.Tensor) -> Any:
        if self._stays(tensor):
            return tensor
        key = storage_key(tensor)
        seen = self._copies.get(key)
        # Each storage once, whatever views of it are saved. A storage freed since (its copy
        # let it go) may be followed by a new one at the same key: the weak reference tells.
        if seen is None or seen[0].expired():
            seen = (StorageWeakRef(tensor.untyped_storage()), self._to_host(tensor))
            self._copies[key] = seen
            self.bytes_this_forward += tensor.untyped_storage().nbytes()
            self.tensors_this_forward += 1
        host = seen[1]
        return (tensor.device, host, tensor.dtype, tensor.storage_offset(),
                tuple(tensor.shape), tensor.stride())

    def _stays(self, tensor: torch.Tensor) -> bool:
        """Parameters (and views of them: they stay on the device anyway), small tensors,
        sparse ones and fake ones (the planner's probe: counted, not copied) are not moved."""
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter) \
                or tensor.layout != torch.strided:
            return True
        if tensor.untyped_storage().nbytes() < self.min_bytes:
            return True
        if is_fake(tensor):
            self._count_fake(tensor)
            return True
        return storage_key(tensor) in self._param_storages

    def _count_fake(self, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
        if key not in self._copies:
            self._copies[key] = (None, tensor)  # kept to the forward's end, as the probe does
            self.bytes_this_forward += tensor.untyped_storage().nbytes()
            self.tensors_this_forward += 1

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, dtype, offset, shape, stride = packed
        view = torch.empty(0, dtype=dtype).set_(host, offset, shape, stride)
        if device.type == "cpu":
            return view
        self._wait_all()  # the copy to the host must be complete before it is read
        return view.to(device, non_blocking=True)

    def _to_host(self, tensor: torch.Tensor) -> torch.UntypedStorage:
        """A host copy of ``tensor``'s whole storage (pinned, on a side stream, on CUDA)."""
        storage = tensor.untyped_storage()
        if tensor.device.type != "cuda":
            return storage.clone()  # CPU: one memory; the copy exercises the path
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=tensor.device)
        host = torch.UntypedStorage(storage.nbytes(), device="cpu").pin_memory()
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            host.copy_(storage, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        tensor.record_stream(self._stream)  # not reused before the copy has read it
        self._in_flight.append(event)
        while len(self._in_flight) > self.max_in_flight:
            self._in_flight.popleft().synchronize()
        return host

    def _wait_all(self) -> None:
        while self._in_flight:
            self._in_flight.popleft().synchronize()


def install(model: nn.Module, mode: str) -> ActivationOffload | None:
    """Turn activation offload on for ``model`` (``none`` | ``checkpointed`` | ``all``); the
    hooks object, kept on the model as ``activation_offload``, or None."""
    if mode == "none":
        return None
    if mode not in ("checkpointed", "all"):
        raise ValueError(f"memory.activation_offload {mode!r} is not none|checkpointed|all")
    offload = ActivationOffload(model)
    if mode == "all":
        targets = [model]
    else:
        targets = [module for module in model.modules() if is_checkpoint_wrapper(module)]
        if not targets:  # nothing checkpointed, nothing to offload (the config refuses it;
            return None  # the planner's plain probes build without checkpointing)
    model.register_forward_pre_hook(lambda _m, _args: _start(offload))
    for module in targets:
        module.register_forward_pre_hook(lambda _m, _args: offload.enter())
        module.register_forward_hook(lambda _m, _args, _out: offload.exit())
    model.activation_offload = offload  # type: ignore[assignment]
    return offload


def _start(offload: ActivationOffload) -> None:
    """The model's forward begins (the root's pre-hook, before any block's)."""
    if offload._depth:  # the last forward raised (an OOM) before its hooks came off
        offload._depth = 1
        offload.exit()
    if torch.is_grad_enabled():
        offload.start_forward()


def offload_of(model: nn.Module) -> ActivationOffload | None:
    """The ``ActivationOffload`` installed on ``model``, or None."""
    offload = getattr(model, "activation_offload", None)
    return offload if isinstance(offload, ActivationOffload) else None
