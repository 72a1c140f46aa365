"""Asynchronous checkpoint saves (``train.checkpoint_async`` under the local launcher).

The step waits only for the staging: a host copy of the model's and optimizer's state (and of
the small rest: schedule, loader position, RNG), taken where the step left them. Writing the
DCP files and ``state.pt``, hashing them into the manifest, publishing (the rename) and
uploading to a run store then run on a thread of their own while training goes on, as
torchtitan's ``async_mode`` does. At most one save is in flight: the next checkpoint waits for
the previous one first. A save that fails raises in the step that waits for it; a crash in the
middle of one leaves its staging directory unpublished (or, on a store, its ``meta.json``
unwritten), so the previous checkpoint stays the latest.

The save's collectives (DCP's planning, the manifest's gather, the publishing barriers) run on
a gloo process group of its own, so that they never interleave with the step's on the default
group from the other thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only


def staged(tree: Any) -> Any:
    """A copy of every tensor in ``tree`` in host memory, nothing shared with the originals
    (which the next step changes in place). Tensor subclasses (DTensor, torchao's quantized
    optimizer states, which implement neither ``clone`` nor ``new_empty``) are copied through
    their inner tensors."""
    return tree_map_only(torch.Tensor, _staged_tensor, tree)


def _staged_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if is_traceable_wrapper_subclass(tensor):
        names, context = tensor.__tensor_flatten__()
        inner = {name: _staged_tensor(getattr(tensor, name)) for name in names}
        return type(tensor).__tensor_unflatten__(inner, context, tensor.size(),
                                                 tensor.stride())
    return tensor.detach().to("cpu", copy=True)


class AsyncSaves:
    """One checkpoint save at a time on a thread of its own (every rank creates one: the
    process group is a collective)."""

    def __init__(self) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def wait(self) -> None:
        """Until the save in flight, if any, is done; its error is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def start(self, save: Callable[[], None], done: Callable[[float], None]) -> None:
        """Run ``save`` on the save thread (after the one in flight), then ``done`` with its
        seconds."""
        self.wait()

        def run() -> None:
            began = time.perf_counter()
            try:
                save()
            except BaseException as err:  # noqa: BLE001 - raised in the waiting step
                self._error = err
                return
            done(time.perf_counter() - began)

        # A daemon: a process that fails while a save waits on a lost peer still exits.
        self._thread = threading.Thread(target=run, name="memtrain-checkpoint", daemon=True)
        self._thread.start()
