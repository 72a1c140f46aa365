"""Precision: ``autocast`` to bf16 or fp16 (or nothing for fp32); fp16 adds a ``GradScaler``.

``auto`` (``resolve_precision``) picks what the device runs fast: bf16 on GPUs that have it, else
fp16; on CPUs bf16 only where it is native (AVX512_BF16 or AMX,
``trainer.compat.cpu_bf16_support``), else fp32.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from trainer.compat import cpu_bf16_support, cpu_capability

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


def resolve_precision(requested: str, device: torch.device, fp16: bool = True
                      ) -> PrecisionChoice:
    """``memory.precision`` for ``device``: an explicit value as it is, ``auto`` resolved.

    ``auto``: on CUDA, bf16 where the device has it natively, else fp16 with a GradScaler
    where the way of splitting runs it (``fp16``; FSDP does not), else fp32. On CPU, bf16 only where
    the CPU has native bf16 (AVX512_BF16 or AMX): elsewhere autocast emulates it with fp32
    arithmetic and conversions, 2-9x slower than plain fp32 (``docs/benchmarks.md``), so fp32.
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
        if not fp16:
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
