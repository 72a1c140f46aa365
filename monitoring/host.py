"""This machine as memtrain sees it: its CPU, read once from /proc/cpuinfo (model name, family
and model numbers: the name alone, "AMD EPYC", does not tell one generation from another; its
instruction-set flags), and where memtrain keeps its caches (``cache_dir``). The planner keys
its calibration on the CPU, the benches and reports name their machine with it; the planner's
calibrations and the working copies of remote runs share the cache root."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuInfo:
    name: str
    family: str = "?"
    model: str = "?"
    flags: frozenset[str] = frozenset()

    def describe(self) -> str:
        """``AMD EPYC (family 26, model 2)``."""
        return f"{self.name} (family {self.family}, model {self.model})"


@functools.cache
def cpu_info() -> CpuInfo:
    """The first processor's entry of /proc/cpuinfo; the platform's name elsewhere."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return CpuInfo(fields.get("model name") or platform.processor() or platform.machine(),
                   fields.get("cpu family", "?"), fields.get("model", "?"),
                   frozenset(fields.get("flags", "").split()))


def cache_dir() -> Path:
    """memtrain's cache root: ``$MEMTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/memtrain``, else
    ``~/.cache/memtrain``."""
    if os.environ.get("MEMTRAIN_CACHE_DIR"):
        return Path(os.environ["MEMTRAIN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "memtrain"
