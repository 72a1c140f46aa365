"""The allocators: CUDA's caching allocator gets ``expandable_segments:True`` through the
environment, before CUDA initialises (fewer fragmented segments); on CPU, glibc's malloc keeps
freed memory for the next step (``keep_freed_host_memory``), except under FSDP, where it gives
large tensors back when freed (``return_freed_host_memory``); and the peak a run reaches."""

from __future__ import annotations

import ctypes
import os
import platform
import resource

import torch

ALLOCATOR_SETTING = "expandable_segments:True"
# glibc's mallopt parameters (malloc.h), and the variables with which a user sets them instead.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
# glibc's own initial mmap threshold; fixed, it no longer rises to 32 MiB as large chunks are freed
RETURNED_ABOVE_BYTES = 128 * 1024
_MALLOC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                     "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
_mode: str | None = None  # "kept" or "returned", once set for the process


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


def keep_freed_host_memory() -> bool:
    """On glibc, serve every host allocation from malloc's heap and keep freed memory there, so
    a training step's large tensors reuse the pages of the step before.

    By default glibc maps an allocation above its threshold (at most 32 MiB) on its own and
    unmaps it when freed, and returns a heap's free top to the system: the next step's tensor
    of that size is mapped afresh and its first write page-faults on every page. A CPU step
    allocates such tensors all the time (a 32k vocabulary's logits at micro-batch 4 are 33 MB in
    bf16). Measured on the 2-core AMD EPYC with bf16 (`python -m bench.plan`'s Llama 4x256,
    vocabulary 32,000, full checkpointing, 8 samples a step): 2,236 -> 4,152 tokens/s in bf16 at
    micro-batch 4, 1,420 -> 1,956 in fp32. The cost is resident memory: it stays at its
    high-water mark instead of falling between steps, and that mark is higher, since torch's
    aligned allocations reuse freed memory only once neighbouring chunks have coalesced (a
    64 + 12 MiB step: 360-620 MiB resident against 305 MiB, level from the third to the seventh
    step, no page faults after it, in 30 runs on the 2-core EPYC;
    ``tests/unit/test_allocator.py``). jemalloc and tcmalloc, which Intel's PyTorch guide
    preloads for the same reason, trade the same way.

    Left alone where the user set malloc's variables or preloads another allocator; a no-op
    elsewhere than glibc. Process-wide: the first call of either function decides; returns
    whether this one is in effect."""
    return _set_malloc("kept")


def return_freed_host_memory() -> bool:
    """On glibc, map every host allocation above 128 KiB on its own and unmap it when freed,
    at that fixed threshold, so resident memory falls back after each transient: FSDP's CPU
    workers take this instead of ``keep_freed_host_memory``.

    Under FSDP a step's transients are many and of changing sizes (each block's gathered
    parameters, its unsharded gradients, the reduce-scatter buffers gloo copies), and a heap
    that keeps them fragments and creeps; glibc's default, whose threshold rises past each freed
    chunk, keeps them too. What each costs, in memory and tokens/s: docs/memory.md ("Host memory
    of FSDP's CPU workers").

    Left alone where the user set malloc's variables or preloads another allocator; a no-op
    elsewhere than glibc. Process-wide: the first call of either function decides; returns
    whether this one is in effect."""
    return _set_malloc("returned")


def settle_host_memory(steady_transients: bool, lean: bool = False) -> bool:
    """glibc's heap on a CPU worker: freed memory kept for the next step where a step's large
    transients are the same every step (``keep_freed_host_memory``: they reuse the last step's
    pages), or returned where they change size through the step (FSDP's) or the run is
    ``lean`` (a LoRA model over a bf16 or NF4 base: its own bytes are few, and a kept heap holds
    every transient of its build and step beside them, as much again as an NF4 base). Returns
    whether the policy is in effect."""
    if steady_transients and not lean:
        return keep_freed_host_memory()
    return return_freed_host_memory()


def _set_malloc(mode: str) -> bool:
    global _mode
    if _mode is not None:
        return _mode == mode
    if any(name in os.environ for name in _MALLOC_VARIABLES) or \
            "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the symbols already in the process: its own glibc
    if mode == "kept":
        done = bool(libc.mallopt(_M_MMAP_MAX, 0)) and \
            bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    else:
        done = bool(libc.mallopt(_M_MMAP_THRESHOLD, RETURNED_ABOVE_BYTES))
    _mode = mode if done else None
    return done
