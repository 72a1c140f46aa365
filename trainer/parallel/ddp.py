"""Data parallelism with torch's DDP: every rank holds the whole model and its optimizer state,
and gradients are all-reduced once per optimizer step.

The model is built whole on every rank alike (the same seed, the same weights) and wrapped
after the checkpoint's restore, since DDP broadcasts rank 0's weights as it wraps. With gradient
accumulation, every micro-batch but the last runs under ``no_sync()``. Where the ranks agree on
an out-of-memory step first (``memory.oom_recovery``), every micro-batch runs under
``no_sync()`` and the gradients are averaged after the agreement (``all_reduce_gradients``:
DDP's own reduction is inside backward, where a rank that ran out would leave the others
waiting). Under ``memory.optimizer_in_backward`` each bucket's parameters step in DDP's
communication hook, once the bucket is reduced (``step_in_comm_hook``).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.compat import ddp_ignore
from trainer.memory.optimizers import BackwardSteps, InBackward
from trainer.models.build import Placement
from trainer.parallel.mesh import Mesh
from trainer.parallel.strategy import DeferredReduction, Parallelism


def is_ddp(model: nn.Module) -> bool:
    return isinstance(model, DDP)


class DataParallel(Parallelism, DeferredReduction):
    """DDP over the mesh's data ranks (every rank: the sequence ranks' gradients are of other
    tokens of the same rows, and are summed with them)."""

    agrees_on_oom: ClassVar[bool] = True
    backward_hooks: ClassVar[InBackward] = InBackward(comm_hook=True)  # attached in ``wrap``
    steady_transients: ClassVar[bool] = True

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def placement(self) -> Placement:
        return Placement()  # whole on every rank, alike (the same seed, the same weights)

    def shard(self, model: nn.Module, device: torch.device) -> None:
        """Nothing: every rank holds the whole model; ``wrap`` wraps it after the restore."""

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        device = next(model.parameters()).device
        # An NF4 base (QLoRA) is built alike on every rank; DDP's broadcast of rank 0's values
        # would copy it through its dequantized values and quantize it again, changing it.
        ddp_ignore(model, [name for name, p in model.named_parameters()
                           if not p.requires_grad and hasattr(p, "get_original_weight")])
        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        backward_steps = BackwardSteps.of(optimizer)
        if backward_steps is not None:  # each parameter steps once its bucket is reduced
            step_in_comm_hook(wrapped, backward_steps)
        return wrapped

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model

    def reduction_held(self, model: nn.Module, held: bool) -> AbstractContextManager[Any]:
        if isinstance(model, DDP) and held:
            return model.no_sync()
        return contextlib.nullcontext()

    def reduce_gradients(self, model: nn.Module) -> None:
        all_reduce_gradients(list(model.parameters()), self.mesh.world_size)

    def total_norm(self, grad_norm: torch.Tensor) -> torch.Tensor:
        return grad_norm  # every rank holds every gradient, reduced

    def describe(self) -> str | None:
        return self.mesh.describe()


def all_reduce_gradients(params: list[torch.nn.Parameter], world_size: int,
                         bucket_bytes: int = 25 << 20) -> int:
    """Average gradients over ranks in flat buckets (DDP's default 25 MiB); returns buckets."""
    grads = [p.grad for p in params if p.grad is not None]
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for grad in grads:
        if size and size + grad.numel() * grad.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += grad.numel() * grad.element_size()
    for bucket in buckets:
        if not bucket:
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)  # SUM: gloo has no AVG
        flat.div_(world_size)
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    return sum(1 for b in buckets if b)


def step_in_comm_hook(model: DDP, steps: BackwardSteps) -> None:
    """Under ``memory.optimizer_in_backward``: step each parameter in DDP's communication hook,
    once its bucket is all-reduced, and have DDP leave the gradients unset (its own
    optimizer-in-backward mode, whose hook needs a CUDA stream; this one runs on gloo too)."""
    model.register_comm_hook(steps, _all_reduce_then_step)
    model.reducer._set_optimizer_in_backward()


def _all_reduce_then_step(steps, bucket):  # type: ignore[no-untyped-def]
    """DDP's communication hook under ``BackwardSteps``: the bucket's mean over ranks (as DDP's
    default hook computes it), then each of its parameters' steps. (Unannotated: DDP accepts
    only the real ``GradBucket`` class as the annotation, not a postponed one.)"""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    future = dist.all_reduce(buffer, async_op=True).get_future()

    def step(done: Any) -> torch.Tensor:
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            param.grad = grad
            steps.steppers[id(param)].step()
        return done.value()[0]

    return future.then(step)
