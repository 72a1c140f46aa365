"""The CUDA caching allocator: ``expandable_segments:True`` through the environment, before CUDA
initialises (fewer fragmented segments), and the peak a run reaches."""

from __future__ import annotations

import os
import resource

import torch

ALLOCATOR_SETTING = "expandable_segments:True"


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
