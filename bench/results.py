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


def write_json(out: str | Path, name: str, report: dict[str, Any],
               sort_keys: bool = False) -> Path:
    path = result_path(out, name)
    path.write_text(json.dumps(report, indent=2, sort_keys=sort_keys) + "\n")
    return path
