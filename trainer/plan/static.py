"""What a model's parameters take on one rank, counted from the model without running it.

``StaticBytes``: the parameters, their gradients (same dtype as the parameters) and AdamW's
state, held through the whole step, each divided over the ranks under FSDP; and the settings
that decide how the optimizer's step holds them (its state's dtype, where it steps, the step in
backward). ``ParameterBytes``: where the parameters sit against the model's repeated blocks,
which the terms of FSDP, of the step in backward and of an NF4 base are planned from. Only
parameters that train have gradients and state (a LoRA model's adapters).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from trainer.memory.nf4 import is_nf4
from trainer.memory.optimizers import state_bytes, trainable
from trainer.parallel.fsdp import FsdpSettings
from trainer.tensors import tensor_bytes

ADAMW_STATE_BYTES_PER_PARAM = 8  # exp_avg and exp_avg_sq in fp32


@dataclass(frozen=True, kw_only=True)
class StaticBytes:
    params: int
    grads: int
    optimizer: int
    world_size: int = 1
    sharded: bool = False  # FSDP: the bytes above are one rank's shards
    # FSDP (``parallel.fsdp``, ``trainer.parallel.fsdp.FsdpSettings``): how it shards.
    fsdp: FsdpSettings | None = None
    full_param_bytes: int = 0  # the whole model's parameters, unsharded
    # memory.optimizer_in_backward: each gradient is stepped and dropped as it completes, so
    # only the largest one (``largest_grad``, with its step's temporaries) is held at a time.
    in_backward: bool = False
    largest_grad: int = 0
    optimizer_states: str = "fp32"  # memory.optimizer_states
    # Where the optimizer steps: torch's AdamW runs its multi-tensor path on CUDA, a loop over
    # the parameters on CPU (``trainer.plan.terms.optimizer.step_temporaries``).
    step_device: str = "cuda"
    # DDP on more than one rank: gradients are reduced in buckets, so the step in backward
    # holds a bucket's (about a block's) at once; one process steps each as it completes.
    bucketed: bool = False
    # Bytes of one trained weight: 2 under ``model.dtype: bf16``, whose step still computes in
    # fp32 (torchao): its temporaries are fp32 copies, twice the gradient's bytes.
    weight_itemsize: int = 4

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def offloaded(self) -> bool:
        """FSDP's CPU offload: the shards, gradients and AdamW state live in host memory."""
        return self.fsdp is not None and self.fsdp.offload == "cpu"

    @property
    def device_static(self) -> int:
        """Parameters and AdamW state held on the device through the step."""
        return 0 if self.offloaded else self.params + self.optimizer


@dataclass(frozen=True, kw_only=True)
class ParameterBytes:
    """Where the parameters sit against ``model.blocks`` (the whole model is outside the blocks
    for a model without them)."""

    outside_blocks_grad_bytes: int = 0  # gradients of the parameters outside the blocks
    outside_blocks_param_bytes: int = 0  # what FSDP gathers for the whole step (the root)
    block_param_bytes: int = 0  # the largest block's: what FSDP gathers a block at a time
    largest_block_param_bytes: int = 0  # the largest trained parameter inside the blocks
    # An NF4 base (QLoRA): the weights of its largest NF4 layer, whose matmul holds them
    # dequantized (``trainer.plan.terms.nf4``); 0 without one.
    largest_nf4_weights: int = 0


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The tensors' bytes, an NF4 base by its codes and scales."""
    return sum(tensor_bytes(t) for t in tensors)


def static_bytes(model: nn.Module, parallel: str = "ddp", world_size: int = 1,
                 fsdp: FsdpSettings | None = None, states: str = "fp32",
                 in_backward: bool = False, step_device: str = "cuda") -> StaticBytes:
    """Bytes of parameters, gradients and AdamW state held by one rank (under FSDP, with
    ``fsdp``'s settings: the defaults where None). Only parameters that train have gradients
    and state (a LoRA model's adapters); ``states``: the moments' dtype
    (``memory.optimizer_states``, counted tensor by tensor as torchao keeps them);
    ``in_backward``: ``memory.optimizer_in_backward``; ``step_device``: where AdamW steps
    (``trainer.plan.terms.optimizer.step_temporaries``)."""
    unique = list({id(p): p for p in model.parameters()}.values())  # tied weights count once
    trained = trainable(model)
    param_bytes = nbytes(unique)
    grad_bytes = nbytes(trained)
    sharded = parallel == "fsdp"
    if states == "fp32":  # the same bytes for every tensor: the shards' total, split evenly
        optimizer_bytes = -(-sum(p.numel() for p in trained) * ADAMW_STATE_BYTES_PER_PARAM
                            // (world_size if sharded else 1))
    else:  # torchao quantizes a shard by its own size
        optimizer_bytes = state_bytes(trained, states, shards=world_size if sharded else 1)
    largest = max((nbytes([p]) for p in trained), default=0)
    itemsize = max((p.element_size() for p in trained), default=4)
    if sharded:
        params, grads = (-(-b // world_size) for b in (param_bytes, grad_bytes))
        return StaticBytes(params=params, grads=grads, optimizer=optimizer_bytes,
                           world_size=world_size, sharded=True, fsdp=fsdp or FsdpSettings(),
                           full_param_bytes=param_bytes, in_backward=in_backward,
                           largest_grad=-(-largest // world_size), optimizer_states=states,
                           step_device=step_device, weight_itemsize=itemsize)
    if parallel != "ddp":
        raise ValueError(f"parallel {parallel!r} is not ddp|fsdp")
    return StaticBytes(params=param_bytes, grads=grad_bytes, optimizer=optimizer_bytes,
                       in_backward=in_backward, largest_grad=largest, optimizer_states=states,
                       step_device=step_device, bucketed=world_size > 1,
                       weight_itemsize=itemsize)


def parameter_bytes(model: nn.Module) -> ParameterBytes:
    """Where ``model``'s parameters sit against its blocks (``model.blocks``, where it has
    them; tied weights count once)."""
    blocks = getattr(model, "blocks", nn.ModuleList())
    in_blocks = {id(p) for p in blocks.parameters()}
    outside = [p for p in {id(p): p for p in model.parameters()}.values()
               if id(p) not in in_blocks]
    return ParameterBytes(
        outside_blocks_grad_bytes=nbytes(p for p in outside if p.requires_grad),
        outside_blocks_param_bytes=nbytes(outside),
        block_param_bytes=max((nbytes(block.parameters()) for block in blocks), default=0),
        largest_block_param_bytes=max(
            (nbytes([p]) for p in blocks.parameters() if p.requires_grad), default=0),
        largest_nf4_weights=max((p.numel() for p in blocks.parameters() if is_nf4(p)),
                                default=0))
