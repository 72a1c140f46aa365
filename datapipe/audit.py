"""``data.record_rows``: which rows each rank trained, step by step, so a run can be audited
against the dataset (every row once per epoch, across restarts and resizes).

A row's fingerprint is the same whether computed from a batch the loop trained on or from the
row read back from its shard, so the audit needs nothing but the dataset and these logs.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np


def row_fingerprint(row: Any) -> str:
    """A row's fingerprint in ``data.record_rows``' log: 8 bytes of blake2b, in hex, over its
    token ids as little-endian int64 (whatever the dataset's integer type): computed the same
    from a batch the loop trained on or from a row read from the dataset."""
    data = np.asarray(row, dtype="<i8")
    return hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()


class RowRecord:
    """``data.record_rows``: one JSON line per step, ``{"step", "rows": [fingerprint, ...],
    "world_size", "time"}``, the rows in the order this rank trained them. A step redone after a
    restart is recorded again, by the ranks of the group that redid it: a step's rows are those
    of the last group to train it (its latest lines, at that group's world size)."""

    def __init__(self, path: Path, world_size: int):
        """Append to ``path`` (the run directory's ``metrics/rows-rank-<r>.jsonl``,
        ``monitoring.run_files.rank_rows``)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self.world_size = world_size

    def record(self, step: int, micro_batches: list[Any]) -> None:
        rows = [row_fingerprint(row) for batch in micro_batches
                for row in np.asarray(batch.cpu().numpy(), dtype="<i8")]  # one copy a batch
        self._file.write(json.dumps({"step": step, "rows": rows, "world_size": self.world_size,
                                     "time": time.time()}) + "\n")

    def close(self) -> None:
        self._file.close()
