"""Write fixed-shape numeric rows as a sharded Arrow IPC dataset.

Each column is stored as an Arrow ``fixed_size_list`` of its dtype, flattened row-major, so a
reader can view a record batch as one contiguous ``(rows, *shape)`` numpy array without copying.
Shards are cut at a target number of rows and hold record batches of about ``BATCH_BYTES`` each
(a remote reader fetches only the batches a range needs); each is written under a temporary
name and renamed into place;
the manifest is published last (see ``datapipe.manifest``). Output is deterministic: the same rows
give byte-identical shards and manifest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa

from datapipe.manifest import (
    ColumnSpec,
    DatasetError,
    Manifest,
    ShardInfo,
    sha256_file,
    write_manifest,
)

ProgressFn = Callable[[int], None]  # called with the number of rows just written
# Target size of one record batch inside a shard: large enough that a batch gather touches few
# (one np.take each), small enough for ranged reads from object stores.
BATCH_BYTES = 8 << 20


def arrow_type(spec: ColumnSpec) -> pa.DataType:
    size = math.prod(spec.shape)
    return pa.list_(pa.from_numpy_dtype(np.dtype(spec.dtype)), size)


def arrow_schema(columns: list[ColumnSpec]) -> pa.Schema:
    return pa.schema([pa.field(c.name, arrow_type(c), nullable=False) for c in columns])


def _to_arrow(array: np.ndarray, spec: ColumnSpec) -> pa.Array:
    if array.dtype != np.dtype(spec.dtype) or array.shape[1:] != spec.shape:
        raise DatasetError(
            f"column {spec.name!r}: got {array.dtype}{list(array.shape[1:])}, "
            f"expected {spec.dtype}{list(spec.shape)}"
        )
    flat = pa.array(np.ascontiguousarray(array).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, math.prod(spec.shape))


class DatasetWriter:
    """Accumulates rows and writes shards of ``rows_per_shard`` rows into ``directory``.

    Call ``close()`` after the last ``write``: only then is the manifest published.
    """

    def __init__(self, directory: str | Path, columns: list[ColumnSpec], rows_per_shard: int,
                 metadata: Mapping[str, str] | None = None, progress: ProgressFn | None = None):
        if rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
        self.directory = Path(directory)
        self.columns = columns
        self.schema = arrow_schema(columns)
        self.rows_per_shard = rows_per_shard
        self.metadata = dict(metadata or {})
        self.progress = progress
        self._pending: list[dict[str, np.ndarray]] = []
        self._pending_rows = 0
        self._shards: list[ShardInfo] = []
        self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, rows: Mapping[str, np.ndarray]) -> None:
        """Append a block of rows: one array of shape ``(n, *column.shape)`` per column."""
        lengths = {len(rows[c.name]) for c in self.columns}
        if len(lengths) != 1:
            raise DatasetError(f"columns have different row counts: {sorted(lengths)}")
        self._pending.append({c.name: rows[c.name] for c in self.columns})
        self._pending_rows += lengths.pop()
        while self._pending_rows >= self.rows_per_shard:
            self._flush(self.rows_per_shard)

    def close(self) -> Manifest:
        if self._pending_rows:
            self._flush(self._pending_rows)
        if not self._shards:
            raise DatasetError(f"{self.directory}: no rows were written; refusing an empty dataset")
        manifest = Manifest(columns=self.columns, shards=self._shards, metadata=self.metadata)
        write_manifest(self.directory, manifest)
        return manifest

    def _flush(self, num_rows: int) -> None:
        merged = {c.name: np.concatenate([p[c.name] for p in self._pending]) for c in self.columns}
        take = {name: array[:num_rows] for name, array in merged.items()}
        rest = {name: array[num_rows:] for name, array in merged.items()}
        self._pending = [rest] if len(next(iter(rest.values()))) else []
        self._pending_rows -= num_rows

        row_bytes = sum(math.prod(c.shape) * np.dtype(c.dtype).itemsize for c in self.columns)
        batch_rows = max(1, BATCH_BYTES // max(1, row_bytes))
        name = f"shard-{len(self._shards):05d}.arrow"
        final = self.directory / name
        tmp = self.directory / f".{name}.tmp-{os.getpid()}"
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, self.schema) as writer:
            for first in range(0, num_rows, batch_rows):
                writer.write_batch(pa.record_batch(
                    [_to_arrow(take[c.name][first:first + batch_rows], c) for c in self.columns],
                    schema=self.schema))
        os.replace(tmp, final)
        self._shards.append(ShardInfo(name, num_rows, final.stat().st_size, sha256_file(final),
                                      batch_rows))
        if self.progress is not None:
            self.progress(num_rows)


def write_rows(directory: str | Path, columns: list[ColumnSpec],
               blocks: Iterable[Mapping[str, np.ndarray]], rows_per_shard: int,
               metadata: Mapping[str, str] | None = None,
               progress: ProgressFn | None = None) -> Manifest:
    """Write every block of rows into a new dataset at ``directory`` and return its manifest."""
    writer = DatasetWriter(directory, columns, rows_per_shard, metadata, progress)
    for block in blocks:
        writer.write(block)
    return writer.close()
