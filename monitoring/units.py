"""Byte sizes as people write and read them: ``80GiB`` in a config or an option, ``1.5 GiB`` in
a log line or a table."""

from __future__ import annotations

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str, what: str = "size") -> int:
    """``80GiB``, ``141GB``, ``512MiB`` or a plain number of bytes; raises ValueError naming
    ``what`` (the option or field) and the value."""
    cleaned = text.strip().upper().replace(" ", "")
    number = cleaned.rstrip("KMGTIB")
    unit = cleaned[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ValueError(f"{what} {text!r} is not a size like 80GiB, 141GB or 512MiB")
    return int(value * _UNITS[unit])


def format_bytes(num_bytes: float) -> str:
    """``512 B``, ``1.5 KiB``, ..., up to GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"
