"""Memory strategies as small transforms in native torch, chosen by ``MemoryConfig``.

- Precision: ``autocast`` to bf16 or fp16 (or nothing for fp32); fp16 adds a ``GradScaler``.
  ``auto`` (``resolve_precision``) picks what the device runs fast: bf16 on GPUs that have it,
  else fp16; on CPUs bf16 only where it is native (AVX512_BF16 or AMX), else fp32.
- Activation checkpointing: wrap every (``full``) or every k-th (``selective``) block of
  ``model.blocks`` in torch's non-reentrant checkpoint wrapper, which preserves RNG state so
  dropout is replayed identically; parameter names and state_dict keys are unchanged.
- Loss chunking: the output projection and cross-entropy in chunks of tokens, gradients computed
  on the fly (``trainer.loss``), so the ``(B, T, V)`` logits and their fp32 copies never exist.
- bf16 norm inputs: every ``nn.LayerNorm`` becomes a ``Bf16InputLayerNorm`` (a subclass with
  the same parameters and state_dict keys) that keeps only a bf16 copy of its input for backward.
- Allocator: ``expandable_segments:True`` through the environment, before CUDA initialises.

The checkpointing wrappers are torch's own; the norm transform changes each LayerNorm's class to
the subclass, so ``print(model)`` shows it. ``trainer.build.build_model`` applies them all, in
one order.
"""

from __future__ import annotations

import contextlib
import os
import resource
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.compat import checkpoint_wrapper_api, cpu_bf16_support, cpu_capability

ALLOCATOR_SETTING = "expandable_segments:True"
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """How the forward pass runs: autocast dtype (None for fp32) and whether grads are scaled."""

    name: str
    autocast_dtype: torch.dtype | None
    use_grad_scaler: bool

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def grad_scaler(self, device: torch.device, init_scale: float = 2.0**16
                    ) -> torch.amp.GradScaler:
        """A GradScaler that is a no-op unless this policy is fp16."""
        return torch.amp.GradScaler(device.type, init_scale=init_scale,
                                    enabled=self.use_grad_scaler)


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run uses, why (one log line), and a warning where an explicit choice is
    slow on this device."""

    name: str
    reason: str
    warning: str | None = None


def resolve_precision(requested: str, device: torch.device, strategy: str = "ddp"
                      ) -> PrecisionChoice:
    """``memory.precision`` for ``device``: an explicit value as it is, ``auto`` resolved.

    ``auto``: on CUDA, bf16 where the device has it natively, else fp16 with a GradScaler (fp32
    under FSDP, which memtrain does not run with fp16). On CPU, bf16 only where the CPU has
    native bf16 (AVX512_BF16 or AMX): elsewhere autocast emulates it with fp32 arithmetic and
    conversions, 2-9x slower than plain fp32 (``docs/benchmarks.md``), so fp32.
    """
    if requested != "auto":
        warning = None
        if requested == "bf16" and device.type == "cpu" and cpu_bf16_support() != "native":
            warning = (f"memory.precision bf16 on this CPU ({cpu_capability()}, no AVX512_BF16 "
                       "or AMX) is emulated and slower than fp32; 'auto' would choose fp32")
        return PrecisionChoice(requested, "set in memory.precision", warning)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return PrecisionChoice("bf16", f"auto: {name} has native bf16")
        if strategy == "fsdp":
            return PrecisionChoice("fp32", f"auto: {name} has no native bf16, and FSDP does "
                                           "not run with fp16 here")
        return PrecisionChoice("fp16", f"auto: {name} has no native bf16; fp16 with a "
                                       "GradScaler")
    if device.type == "cpu":
        support = cpu_bf16_support()
        if support == "native":
            return PrecisionChoice("bf16", "auto: this CPU has native bf16 (AVX512_BF16/AMX)")
        return PrecisionChoice("fp32", f"auto: this CPU ({cpu_capability()}) has no native bf16 "
                                       "(AVX512_BF16/AMX), where bf16 autocast is emulated and "
                                       "slower than fp32")
    return PrecisionChoice("fp32", f"auto: no mixed precision for {device.type} devices")


def precision_policy(precision: str, device: torch.device, warn: bool = True
                     ) -> PrecisionPolicy:
    """The policy for a resolved ``precision`` on ``device``; raises ValueError where the device
    can't run it.

    ``warn=False`` silences the fp16-on-CPU warning (probes and benchmarks ask for it on purpose).
    """
    if precision not in _DTYPES:
        raise ValueError(f"memory.precision {precision!r} is not one of {sorted(_DTYPES)} "
                         "(resolve 'auto' first)")
    if (precision == "bf16" and device.type == "cuda"
            and not torch.cuda.is_bf16_supported(including_emulation=False)):
        raise ValueError(f"memory.precision 'bf16' is not supported natively on "
                         f"{torch.cuda.get_device_name(device)}; use 'fp16'")
    if warn and precision == "fp16" and device.type == "cpu":
        warnings.warn("memory.precision 'fp16' on CPU: autocast and GradScaler work but are "
                      "slow and rarely useful there; 'bf16' is the CPU choice", stacklevel=2)
    return PrecisionPolicy(precision, _DTYPES[precision], use_grad_scaler=precision == "fp16")


def checkpointed_block_indices(num_blocks: int, mode: str, every_k: int) -> list[int]:
    """Which blocks get activation checkpointing: none, all, or every k-th (0, k, 2k, ...)."""
    if mode == "none":
        return []
    if mode == "full":
        return list(range(num_blocks))
    if mode == "selective":
        if every_k < 1:
            raise ValueError(f"memory.checkpoint_every_k must be >= 1, got {every_k}")
        return list(range(0, num_blocks, every_k))
    raise ValueError(f"memory.activation_checkpointing {mode!r} is not none|full|selective")


def apply_activation_checkpointing(model: nn.Module, mode: str, every_k: int = 2) -> list[int]:
    """Wrap the chosen blocks of ``model.blocks`` in place; returns their indices."""
    if mode == "none":
        return []
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        # The shipped configs turn checkpointing on; a user's own model without blocks still
        # trains with them, and is told what it would take.
        warnings.warn(f"memory.activation_checkpointing {mode!r} ignored: it needs the model to "
                      f"expose its repeated blocks as `model.blocks` (an nn.ModuleList); "
                      f"{type(model).__name__} does not", stacklevel=2)
        return []
    chosen = checkpointed_block_indices(len(blocks), mode, every_k)
    targets = {id(blocks[i]) for i in chosen}
    api = checkpoint_wrapper_api()
    api.apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(api.checkpoint_wrapper,
                                      checkpoint_impl=api.CheckpointImpl.NO_REENTRANT,
                                      preserve_rng_state=True),
        check_fn=lambda module: id(module) in targets,
    )
    return chosen


AUTO_LOSS_CHUNK_TOKENS = 4096  # one chunk's fp32 logits: 0.77 GiB at GPT-2's vocabulary


def computes_own_loss(model: nn.Module) -> bool:
    """Whether ``model(idx, targets)`` returns its summed loss, so the loss can be chunked."""
    return hasattr(model, "loss_chunk_tokens")


def set_loss_chunking(model: nn.Module, chunk_tokens: int | str) -> int:
    """Compute the loss in chunks of ``chunk_tokens`` tokens (0: the plain loss; "auto": 4096
    for a model that computes its own loss, else the plain loss). Returns the chunk size set."""
    if chunk_tokens == "auto":
        chunk_tokens = AUTO_LOSS_CHUNK_TOKENS if computes_own_loss(model) else 0
    assert isinstance(chunk_tokens, int), chunk_tokens
    if chunk_tokens and not computes_own_loss(model):
        raise ValueError(f"memory.loss_chunk_tokens {chunk_tokens} needs a model that computes "
                         f"its own loss (`loss_chunk_tokens` attribute); {type(model).__name__} "
                         "does not; set it to 0")
    if computes_own_loss(model):
        setattr(model, "loss_chunk_tokens", chunk_tokens)  # noqa: B010 - any model class
    return chunk_tokens


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


def configure_allocator_env() -> str:
    """Ask for expandable segments unless the user set the allocator; call before CUDA starts.

    Both variable names are set because torch versions differ in which one they read.
    Returns the effective setting.
    """
    setting = (os.environ.get("PYTORCH_ALLOC_CONF")
               or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ALLOCATOR_SETTING)
    os.environ.setdefault("PYTORCH_ALLOC_CONF", setting)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", setting)
    return setting


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: CUDA allocator peak on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
