"""Where benchmark reports go: ``<out>/<name>-<date>-<host>.<suffix>``, one naming for every
bench and for ``bench/run_all.py``, which reads them back."""

from __future__ import annotations

import datetime as dt
import json
import socket
from pathlib import Path
from typing import Any


def stamp() -> str:
    """``<date>-<host>``: today's local date and this machine's name."""
    return f"{dt.date.today().isoformat()}-{socket.gethostname()}"


def result_path(out: str | Path, name: str, suffix: str = ".json") -> Path:
    """The path of today's ``name`` report in ``out`` (created); ``name`` "" for the summary."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{name + '-' if name else ''}{stamp()}{suffix}"


def cpu_description() -> dict[str, Any]:
    """Which CPU a figure came from: model, the instruction sets that change torch's kernels,
    and how it runs bf16 (``trainer.compat.cpu_bf16_support``)."""
    from monitoring.host import cpu_info
    from trainer.compat import cpu_bf16_support, cpu_capability

    cpu = cpu_info()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": cpu.name, "family": cpu.family, "model_number": cpu.model,
            "flags": [f for f in wanted if f in cpu.flags],
            "aten_capability": cpu_capability(), "bf16": cpu_bf16_support()}


def describe_cpu(cpu: dict[str, Any]) -> str:
    """One line for a report: ``AMD EPYC (avx2; bf16 emulated)``."""
    return f"{cpu['model']} ({', '.join(cpu['flags']) or 'no AVX2'}; bf16 {cpu['bf16']})"


def write_json(out: str | Path, name: str, report: dict[str, Any],
               sort_keys: bool = False) -> Path:
    """Write ``report`` (with the CPU it ran on added as ``cpu``) as today's ``name`` report;
    a value JSON has no type for (a dtype, a path) is written as its ``str``."""
    report.setdefault("cpu", cpu_description())
    path = result_path(out, name)
    path.write_text(json.dumps(report, indent=2, sort_keys=sort_keys, default=str) + "\n")
    return path
