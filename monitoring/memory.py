"""Memory readers: pure functions from raw readings to the contract's metric names.

``read_cuda_allocator`` maps a ``torch.cuda.memory_stats()`` dict (tested on CPU with a dict
recorded on an H200, ``tests/fixtures/memory_stats_h200.json``); an empty dict, as on CPU or
before CUDA starts, gives an empty result: the family is absent, not zero. ``read_nvml`` and
``read_host`` do the I/O for the device and host families.
"""

from __future__ import annotations

from collections.abc import Mapping

# Contract name -> key in torch.cuda.memory_stats().
CUDA_ALLOCATOR_KEYS = {
    "memtrain_gpu_memory_allocated_bytes": "allocated_bytes.all.current",
    "memtrain_gpu_memory_reserved_bytes": "reserved_bytes.all.current",
    "memtrain_gpu_memory_active_bytes": "active_bytes.all.current",
    "memtrain_gpu_memory_peak_allocated_bytes": "allocated_bytes.all.peak",
    "memtrain_gpu_memory_inactive_split_bytes": "inactive_split_bytes.all.current",
    "memtrain_gpu_alloc_retries_total": "num_alloc_retries",
    "memtrain_gpu_ooms_total": "num_ooms",
}


def read_cuda_allocator(stats: Mapping[str, int | float]) -> dict[str, float]:
    """The allocator family from a ``torch.cuda.memory_stats()`` dict; {} when it is empty."""
    if not stats:
        return {}
    return {name: float(stats.get(key, 0)) for name, key in CUDA_ALLOCATOR_KEYS.items()}


def read_nvml(device_index: int) -> dict[str, float]:
    """Device used and total bytes through NVML (nvidia-ml-py); {} where it is not present."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(device_index))
    except pynvml.NVMLError:
        return {}
    return {"memtrain_gpu_device_used_bytes": float(info.used),
            "memtrain_gpu_device_total_bytes": float(info.total)}


def resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def read_host(pinned_bytes: int) -> dict[str, float]:
    return {"memtrain_host_rss_bytes": float(resident_bytes()),
            "memtrain_host_pinned_bytes": float(pinned_bytes)}
