"""Opening, checking and reading the shards of one column of a dataset.

Local shards are memory-mapped: opening one maps it and checks its schema and row count against
the manifest without reading its data; rows are paged in when a batch is gathered from them.
Remote shards (``s3://`` and other pyarrow filesystems) are checked by size and schema when
opened and read with buffered reads, only the record batches a range needs.

Every shard is checked when the loader starts, identically on every rank, so all ranks agree on
which shards are usable before any collective runs. A bad shard is an error naming it, or with
``on_bad_shard="skip"``, logged, counted and left out of the epoch plan.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from datapipe.manifest import (
    ColumnSpec,
    DatasetError,
    Manifest,
    ShardInfo,
    read_manifest,
    remote_filesystem,
    sha256_file,
    shard_location,
)
from datapipe.paths import is_remote
from datapipe.split import Range
from datapipe.writer import arrow_type


def _load_libc() -> ctypes.CDLL | None:
    """libc's ``madvise`` and ``mincore`` through ctypes (which releases the GIL around them);
    None where either is missing (then windows are not advised, only read)."""
    if not hasattr(mmap, "MADV_WILLNEED"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


_libc = _load_libc()


def _resident(page: int) -> bool:
    """Whether the page at ``page`` (page-aligned) is in the page cache (``mincore``)."""
    assert _libc is not None
    state = ctypes.c_ubyte()  # one per call, so calls from several threads never share it
    return _libc.mincore(page, 1, ctypes.byref(state)) == 0 and bool(state.value & 1)

log = logging.getLogger("memtrain.data")
OnBadShard = Literal["error", "skip"]


def check_schema(file: str, schema: pa.Schema, columns: list[ColumnSpec]) -> None:
    """The shard's columns are exactly the manifest's, each of its dtype and shape."""
    expected = {c.name: arrow_type(c) for c in columns}
    for name in expected:
        if name not in schema.names:
            raise DatasetError(f"shard {file}: has no column {name!r} (schema differs from the "
                               "manifest)")
    for name in schema.names:
        if name not in expected:
            raise DatasetError(f"shard {file}: has a column {name!r} that the manifest does not "
                               f"list (it lists {', '.join(expected)})")
    for name, wanted in expected.items():
        found = schema.field(name).type
        if found != wanted:
            raise DatasetError(f"shard {file}: column {name!r} is {found}, the manifest says "
                               f"{wanted}")


def verify_dataset(directory: str | Path,
                   progress: Callable[[int], None] | None = None) -> list[str]:
    """Check every shard as ``memtrain train`` will, and more: present, its size and SHA-256,
    its columns, dtypes and shapes, and its rows (from the file's record batches), local or
    remote (remote shards are streamed through). Shard paths are checked to stay inside the
    dataset before any is opened (DatasetError).

    Returns one line per problem, naming the shard (empty: the dataset trains). ``progress``
    is told each shard's bytes once it is checked.
    """
    root = str(directory).rstrip("/") if is_remote(directory) \
        else str(directory).removeprefix("file://")
    manifest = read_manifest(root)
    files = [shard_location(root, shard) for shard in manifest.shards]
    problems = []
    for shard, file in zip(manifest.shards, files, strict=True):
        try:
            _verify_shard(file, shard, manifest.columns)
        except DatasetError as err:
            problems.append(str(err))
        if progress is not None:
            progress(shard.num_bytes)
    return problems


def _verify_shard(file: str, shard: ShardInfo, columns: list[ColumnSpec]) -> None:
    if is_remote(file):
        filesystem, inner = remote_filesystem(file)
        info = filesystem.get_file_info(inner)
        size = info.size if info.type == pafs.FileType.File else None
    else:
        size = Path(file).stat().st_size if Path(file).is_file() else None
    if size is None:
        raise DatasetError(f"shard {file}: missing")
    if size != shard.num_bytes:
        raise DatasetError(f"shard {file}: {size} bytes, the manifest says {shard.num_bytes}")
    digest = sha256_file(file)
    if digest != shard.sha256:
        raise DatasetError(f"shard {file}: checksum {digest[:16]}... does not match the "
                           f"manifest's {shard.sha256[:16]}...")
    try:
        if is_remote(file):
            filesystem, inner = remote_filesystem(file)
            source = filesystem.open_input_file(inner)
        else:
            source = pa.memory_map(file)  # a local batch's rows are counted without reading it
        with source:
            reader = pa.ipc.open_file(source)
            schema = reader.schema
            rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    except (OSError, pa.ArrowInvalid) as err:
        raise DatasetError(f"shard {file}: cannot be read as Arrow IPC ({err})") from err
    check_schema(file, schema, columns)
    if rows != shard.num_rows:
        raise DatasetError(f"shard {file}: has {rows} rows, the manifest says "
                           f"{shard.num_rows}")


class ShardSource:
    """One column of a dataset: which shards are usable, and their rows as numpy arrays."""

    def __init__(self, path: str | Path, column: str, on_bad_shard: OnBadShard = "error"):
        if on_bad_shard not in ("error", "skip"):
            raise ValueError(f"on_bad_shard must be 'error' or 'skip', got {on_bad_shard!r}")
        self.remote = is_remote(path)
        self.root = str(path).rstrip("/") if self.remote else str(path).removeprefix("file://")
        self.manifest: Manifest = read_manifest(self.root)
        # Every path is checked to stay in the dataset before any shard is opened.
        self.files = [shard_location(self.root, shard) for shard in self.manifest.shards]
        self.spec = self.manifest.column(column)
        self.arrow_type = arrow_type(self.spec)
        self.skipped: list[str] = []  # one message per skipped shard
        # local: per shard, zero-copy views onto the memory map, one per record batch
        self._views: dict[int, list[np.ndarray]] = {}
        self.usable: list[int] = []
        for index in range(len(self.manifest.shards)):
            try:
                self._open(index)
            except DatasetError as err:
                if on_bad_shard == "error":
                    raise
                log.warning("skipping bad shard (on_bad_shard: skip): %s", err)
                self.skipped.append(str(err))
                continue
            self.usable.append(index)
        if not self.usable:
            raise DatasetError(f"{self.root}: every shard is bad ({len(self.skipped)} skipped); "
                               f"first: {self.skipped[0]}")

    @property
    def shard_rows(self) -> list[int]:
        """Rows of each usable shard, in manifest order."""
        return [self.manifest.shards[i].num_rows for i in self.usable]

    def file(self, index: int) -> str:
        return self.files[index]

    def _check_schema(self, file: str, schema: pa.Schema) -> None:
        check_schema(file, schema, self.manifest.columns)

    def _open(self, index: int) -> None:
        shard, file = self.manifest.shards[index], self.file(index)
        try:
            if self.remote:
                filesystem, inner = remote_filesystem(file)
                info = filesystem.get_file_info(inner)
                if info.type != pafs.FileType.File:
                    raise DatasetError(f"shard {file}: missing")
                if info.size != shard.num_bytes:
                    raise DatasetError(f"shard {file}: {info.size} bytes, the manifest says "
                                       f"{shard.num_bytes} (truncated or replaced)")
                with filesystem.open_input_file(inner) as source:
                    self._check_schema(file, pa.ipc.open_file(source).schema)
                return
            path = Path(file)
            if not path.exists():
                raise DatasetError(f"shard {file}: missing")
            # A stat is cheap and catches truncation before the file is mapped.
            if path.is_file() and (size := path.stat().st_size) != shard.num_bytes:
                raise DatasetError(f"shard {file}: {size} bytes, the manifest says "
                                   f"{shard.num_bytes} (truncated or replaced)")
            with open(file, "rb") as handle:  # the table's buffers keep the map alive
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            table = pa.ipc.open_file(pa.py_buffer(mapped)).read_all()  # maps, reads nothing
        except DatasetError:
            raise
        except (OSError, ValueError, pa.ArrowInvalid) as err:  # ValueError: mmap of 0 bytes
            raise DatasetError(f"shard {file}: cannot be read ({err})") from err
        self._check_schema(file, table.schema)
        if table.num_rows != shard.num_rows:
            raise DatasetError(f"shard {file}: has {table.num_rows} rows, the manifest says "
                               f"{shard.num_rows}")
        self._views[index] = [self._as_rows(chunk)
                              for chunk in table.column(self.spec.name).chunks]

    def _will_need(self, parts: list[np.ndarray]) -> None:
        """madvise(WILLNEED) over the bytes of ``parts`` unless they look cached already: the
        kernel reads them ahead. Over pages already cached the call still walks every page
        (160 us for a 16 MiB window here) and slowed the consumer's gathers by 15-20%
        (bench/loader.py), so the middle page of each part is checked first (``mincore``; not
        its ends, which opening the shard may have read with the record batches' metadata).
        That is a guess, and cheap on purpose: a system call costs about 3 us on a VM, and the
        kernel's own fault path reads whatever a wrong guess leaves out."""
        if _libc is None:
            return
        regions = []
        for part in parts:
            address = part.__array_interface__["data"][0]
            aligned = address - address % mmap.PAGESIZE
            regions.append((aligned, address - aligned + part.nbytes))
        if all(_resident(aligned + length // 2 // mmap.PAGESIZE * mmap.PAGESIZE)
               for aligned, length in regions):
            return
        for aligned, length in regions:
            _libc.madvise(aligned, length, mmap.MADV_WILLNEED)

    def _as_rows(self, chunk: pa.Array) -> np.ndarray:
        """A fixed-size-list chunk as ``(rows, *shape)``: a view of its values' buffer (of the
        memory map, for a local shard). Numeric values are viewed directly rather than through
        ``to_numpy``, whose first call imports pandas where it is installed (Ray installs it):
        0.3 s of CPU in every worker process, for a conversion numpy does by itself. Arrow's
        booleans are bits, not bytes: they go through ``to_numpy``, always a copy."""
        values = chunk.values  # all of the list array's values: ``chunk``'s offset not applied
        if chunk.null_count or values.null_count:
            raise pa.ArrowInvalid(f"column {self.spec.name!r} holds nulls")
        dtype, size = np.dtype(self.spec.dtype), chunk.type.list_size
        start, count = chunk.offset * size, len(chunk) * size  # in ``values``
        if dtype == np.bool_:
            flat = values.slice(start, count).to_numpy(zero_copy_only=False)
        else:
            flat = np.frombuffer(values.buffers()[1], dtype=dtype, count=count,
                                 offset=(values.offset + start) * dtype.itemsize)
        return flat.reshape((len(chunk), *self.spec.shape))

    def read(self, piece: Range, advise: bool = False) -> list[np.ndarray]:
        """Rows ``piece.start .. piece.stop - 1`` of a usable shard as ``(rows, *shape)`` arrays,
        one per record batch they span: views onto the memory map for local shards (with
        ``advise``, the kernel is asked to page them in now), fresh memory (buffered reads of
        those batches only) for remote ones."""
        if not self.remote:
            parts, first = [], 0
            for view in self._views[piece.shard]:
                last = first + len(view)
                if last > piece.start and first < piece.stop:
                    parts.append(view[max(piece.start, first) - first:
                                      min(piece.stop, last) - first])
                first = last
            if advise:
                self._will_need(parts)
            return parts
        file = self.file(piece.shard)
        parts = []
        try:
            filesystem, inner = remote_filesystem(file)
            with filesystem.open_input_file(inner) as source:
                reader = pa.ipc.open_file(source)
                # With the writer's fixed batch size, skip straight to the first batch needed.
                step = self.manifest.shards[piece.shard].batch_rows
                start = piece.start // step if step else 0
                first = start * step if step else 0
                for i in range(start, reader.num_record_batches):
                    if first >= piece.stop:
                        break
                    batch = reader.get_batch(i)  # buffered read of this batch only
                    last = first + batch.num_rows
                    if last > piece.start:
                        lo, hi = max(piece.start, first) - first, min(piece.stop, last) - first
                        column = batch.column(self.spec.name).slice(lo, hi - lo)
                        parts.append(self._as_rows(column))
                    first = last
        except (OSError, pa.ArrowInvalid) as err:
            raise DatasetError(f"shard {file}: cannot be read ({err})") from err
        found = sum(len(p) for p in parts)
        if found != piece.rows:
            raise DatasetError(f"shard {file}: rows {piece.start}..{piece.stop - 1} requested, "
                               f"{found} found (the manifest says "
                               f"{self.manifest.shards[piece.shard].num_rows} rows)")
        return parts
