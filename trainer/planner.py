"""Predict training memory before a run: static bytes by dtype and sharding, activations by probe.

Static bytes are counted from the model: parameters, gradients (same dtype as the parameters) and
AdamW's two fp32 moments, each divided by the world size under FSDP. Activation bytes are measured,
not guessed: a probe forward pass on CPU (the model at full width and sequence length, one and two
samples) counts every tensor autograd saves for backward through ``saved_tensors_hooks``,
deduplicated by storage, excluding parameters, and adds the inputs that activation checkpointing
keeps alive for recomputation. Two probe sizes separate the per-sample bytes from the fixed ones
(autocast's low-precision weight copies).

The predicted step peak is ``static + saved(micro_batch) + transient``, where the transient is
what backward holds on top of the saved tensors: the gradient of the largest saved tensor (taken
as twice its size) plus, with activation checkpointing, one block's recomputed activations
(measured as the difference to a probe without checkpointing). The planner does not model the
CUDA allocator's rounding and caching; ``make gpu-check`` measures how far the prediction is from
the real peak.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from trainer.loss import summed_loss
from trainer.memory import apply_activation_checkpointing, precision_policy, set_loss_chunking

ADAMW_STATE_BYTES_PER_PARAM = 8  # exp_avg and exp_avg_sq in fp32


@dataclass(frozen=True)
class StaticBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class ActivationProfile:
    """Saved-for-backward bytes of one forward: ``fixed + per_sample * batch``."""

    precision: str
    activation_checkpointing: str
    per_sample_bytes: int
    fixed_bytes: int
    largest_tensor_per_sample_bytes: int  # the biggest single saved tensor, per sample
    recompute_fraction: float  # forward FLOPs recomputed in backward, as a share of the forward
    # What one checkpointed block saves while backward recomputes it, per sample (0 without AC).
    recompute_block_per_sample_bytes: int = 0

    def saved_bytes(self, batch: int) -> int:
        return self.fixed_bytes + self.per_sample_bytes * batch


@dataclass(frozen=True)
class PlanRow:
    precision: str
    activation_checkpointing: str
    micro_batch_size: int
    accumulation_steps: int
    static_bytes: int
    activation_bytes: int
    transient_bytes: int
    predicted_peak_bytes: int
    recompute_cost: float  # extra step time from recomputation, as a share of forward+backward

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def static_bytes(model: nn.Module, parallel: str = "ddp", world_size: int = 1) -> StaticBytes:
    """Bytes of parameters, gradients and AdamW state held by one rank."""
    unique = {id(p): p for p in model.parameters()}.values()  # tied weights count once
    param_bytes = sum(p.numel() * p.element_size() for p in unique)
    numel = sum(p.numel() for p in unique if p.requires_grad)
    grad_bytes = sum(p.numel() * p.element_size() for p in unique if p.requires_grad)
    optimizer_bytes = numel * ADAMW_STATE_BYTES_PER_PARAM
    if parallel == "fsdp":
        return StaticBytes(*(-(-b // world_size) for b in (param_bytes, grad_bytes,
                                                            optimizer_bytes)))
    if parallel != "ddp":
        raise ValueError(f"parallel {parallel!r} is not ddp|fsdp")
    return StaticBytes(param_bytes, grad_bytes, optimizer_bytes)


@contextlib.contextmanager
def count_saved_tensors(model: nn.Module) -> Iterator[dict[str, int]]:
    """Count bytes autograd saves inside the block (deduplicated by storage, no parameters)."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    counts = {"bytes": 0, "largest": 0}

    def record(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in param_storages or ptr in seen or ptr == 0:
            return
        seen.add(ptr)
        counts["bytes"] += storage.nbytes()
        counts["largest"] = max(counts["largest"], storage.nbytes())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        record(tensor)
        return tensor

    # Non-reentrant checkpointing saves nothing through hooks: the wrapped block's inputs are
    # what it keeps alive, so count those from a forward pre-hook on each wrapped block.
    def record_inputs(_module: nn.Module, args: tuple[object, ...]) -> None:
        for arg in args:
            if isinstance(arg, torch.Tensor):
                record(arg)

    handles = [module.register_forward_pre_hook(record_inputs) for module in model.modules()
               if type(module).__name__ == "CheckpointWrapper"]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield counts
    finally:
        for handle in handles:
            handle.remove()


def measure_saved_bytes(model: nn.Module, tokens_BT: torch.Tensor, precision: str
                        ) -> tuple[int, int]:
    """(saved bytes, largest saved tensor bytes) of one training forward on ``tokens_BT``."""
    device = tokens_BT.device
    policy = precision_policy(precision, device) if precision != "fp16" or device.type != "cpu" \
        else _quiet_fp16_policy(device)
    with count_saved_tensors(model) as counts:
        loss = summed_loss(model, tokens_BT, policy)  # the loop's own forward
    del loss
    return counts["bytes"], counts["largest"]


def _quiet_fp16_policy(device: torch.device):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return precision_policy("fp16", device)


def profile_activations(build: Callable[[], nn.Module], seq_len: int, vocab_size: int,
                        precision: str, activation_checkpointing: str, every_k: int = 2,
                        device: torch.device | None = None, loss_chunk_tokens: int = 0
                        ) -> ActivationProfile:
    """Probe a freshly built model at batch 1 and 2 and fit ``fixed + per_sample * batch``."""
    device = device or torch.device("cpu")
    torch.manual_seed(0)
    model = build().to(device)
    chosen = apply_activation_checkpointing(model, activation_checkpointing, every_k)
    set_loss_chunking(model, loss_chunk_tokens)
    num_blocks = len(getattr(model, "blocks", []))
    model.train()
    measured = {}
    for batch in (1, 2):
        tokens_BT = torch.randint(0, vocab_size, (batch, seq_len + 1), device=device)
        measured[batch] = measure_saved_bytes(model, tokens_BT, precision)
    per_sample = measured[2][0] - measured[1][0]
    fixed = max(0, measured[1][0] - per_sample)
    recompute_block = 0
    if chosen:
        plain = profile_activations(build, seq_len, vocab_size, precision, "none", every_k,
                                    device, loss_chunk_tokens)
        recompute_block = (plain.per_sample_bytes - per_sample) // len(chosen)
    # Recomputation repeats the forward of the wrapped blocks: their share of the forward FLOPs
    # is about their share of the blocks, and a forward is about a third of forward+backward.
    recompute = (len(chosen) / num_blocks) / 3 if num_blocks else 0.0
    return ActivationProfile(precision, activation_checkpointing, per_sample, fixed,
                             measured[2][1] - measured[1][1] or measured[1][1], recompute,
                             recompute_block)


def plan_row(static: StaticBytes, profile: ActivationProfile, micro_batch_size: int,
             accumulation_steps: int) -> PlanRow:
    activations = profile.saved_bytes(micro_batch_size)
    transient = (2 * profile.largest_tensor_per_sample_bytes
                 + profile.recompute_block_per_sample_bytes) * micro_batch_size
    return PlanRow(profile.precision, profile.activation_checkpointing, micro_batch_size,
                   accumulation_steps, static.total, activations, transient,
                   static.total + activations + transient, profile.recompute_fraction)


def feasible_plans(static: StaticBytes, profiles: list[ActivationProfile],
                   global_batch_size: int, world_size: int, device_memory_bytes: int,
                   headroom: float = 0.9) -> list[PlanRow]:
    """Every (precision, checkpointing, micro-batch) that keeps the global batch and fits.

    Micro-batches are the divisors of the per-rank batch; for each profile only the largest
    micro-batch that fits ``headroom`` of the device is kept (the fastest choice for it).
    Rows are sorted by recompute cost, then by predicted peak.
    """
    per_rank, remainder = divmod(global_batch_size, world_size)
    if remainder:
        raise ValueError(f"global batch {global_batch_size} is not divisible by world size "
                         f"{world_size}")
    budget = int(device_memory_bytes * headroom)
    rows = []
    for profile in profiles:
        for micro in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0),
                            reverse=True):
            row = plan_row(static, profile, micro, per_rank // micro)
            if row.predicted_peak_bytes <= budget:
                rows.append(row)
                break
    return sorted(rows, key=lambda r: (r.recompute_cost, r.predicted_peak_bytes))
