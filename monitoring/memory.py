"""Memory readers: pure functions from raw readings to the contract's metric names.

``read_cuda_allocator`` maps a ``torch.cuda.memory_stats()`` dict (tested on CPU with a dict
recorded on an H200, ``tests/fixtures/memory_stats_h200.json``); an empty dict, as on CPU or
before CUDA starts, gives an empty result: the family is absent, not zero. ``read_device_memory``
(NVML by GPU UUID) and ``read_host`` do the I/O for the device and host families.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

log = logging.getLogger("memtrain")

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


def gpu_uuid(device: torch.device) -> str:
    """The device's UUID as NVML and dcgm-exporter spell it (``GPU-...``); "" off CUDA.

    The UUID names the physical GPU whatever ``CUDA_VISIBLE_DEVICES`` renumbered, where the
    CUDA ordinal does not.
    """
    if device.type != "cuda":
        return ""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def read_device_memory(device: torch.device, uuid: str) -> dict[str, float]:
    """Device used and total bytes: NVML (nvidia-ml-py, a dependency) for the GPU named by
    ``uuid``, every process included; ``torch.cuda.mem_get_info`` where NVML cannot answer (no
    driver library, a MIG instance NVML does not resolve). {} off CUDA."""
    if device.type != "cuda":
        return {}
    nvml = _nvml()
    if nvml is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByUUID(uuid))
            return {"memtrain_gpu_device_used_bytes": float(info.used),
                    "memtrain_gpu_device_total_bytes": float(info.total)}
        except nvml.NVMLError as err:
            log.debug("NVML cannot read %s (%s); using torch.cuda.mem_get_info", uuid, err)
    return _mem_get_info(device)


@functools.cache
def _nvml() -> Any:
    """The initialised ``pynvml`` module, once per process; None where NVML cannot start."""
    try:
        import pynvml
    except ImportError:  # memtrain's dependencies not installed as pyproject says
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:  # includes NVMLError_LibraryNotFound: no driver library
        log.debug("NVML cannot start (%s); using torch.cuda.mem_get_info", err)
        return None
    return pynvml


def _mem_get_info(device: torch.device) -> dict[str, float]:
    free, total = torch.cuda.mem_get_info(device)
    return {"memtrain_gpu_device_used_bytes": float(total - free),
            "memtrain_gpu_device_total_bytes": float(total)}


def worker_labels(run: str, rank: int, local_rank: int, node: str,
                  device: torch.device) -> dict[str, str]:
    """The contract's labels for one worker (``monitoring.metrics.LABELS``)."""
    return {"run": run, "rank": str(rank), "local_rank": str(local_rank), "node": node,
            "device": str(device), "gpu_uuid": gpu_uuid(device),
            "hostname": socket.gethostname()}


def resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc/self/statm``, which counts pages: 4 KiB on
    x86, often 64 KiB on aarch64 servers, so the kernel's own page size multiplies)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """The most resident memory above the baseline at entry, sampled every millisecond on a
    thread while the block runs (a process's own high-water mark, ``ru_maxrss``, cannot be
    reset, and its baseline includes whatever came before)."""

    def __init__(self) -> None:
        self.peak = 0

    @contextlib.contextmanager
    def watch(self) -> Iterator[PeakResident]:
        baseline, stop = resident_bytes(), threading.Event()

        def sample() -> None:
            while not stop.is_set():
                self.peak = max(self.peak, resident_bytes() - baseline)
                stop.wait(0.001)

        sampler = threading.Thread(target=sample, name="peak-resident", daemon=True)
        sampler.start()
        try:
            yield self
        finally:
            stop.set()
            sampler.join()
            self.peak = max(self.peak, resident_bytes() - baseline)


def read_host(pinned_bytes: int) -> dict[str, float]:
    return {"memtrain_host_rss_bytes": float(resident_bytes()),
            "memtrain_host_pinned_bytes": float(pinned_bytes)}
