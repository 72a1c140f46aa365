"""A minimal, correct loader over a memtrain dataset: rank split, seeded shuffle, exact resume.

Each epoch draws one permutation of all rows from ``(seed, epoch)``. The first
``batches_per_epoch * world_size * batch_size`` positions of it are dealt round-robin to the ranks,
so every rank gets the same number of batches (DDP never waits on a rank that ran dry) and each
row is read at most once per epoch across ranks. The remainder (fewer than
``world_size * batch_size`` rows) is dropped for that epoch; the next epoch's permutation differs,
so no row is dropped every time. Shards are memory-mapped and only the rows of a batch are
gathered, with one vectorized copy per shard touched.

On CUDA, batches are staged in pinned host buffers allocated once and copied to the device with
``non_blocking=True``; on CPU the pinned path is skipped. Position is ``(epoch, batch_index)``,
which ``state_dict`` returns and ``load_state_dict`` restores, so a resumed run sees the same
sequence of batches as an uninterrupted one.

This holds an index permutation of the whole dataset in memory (8 bytes a row): fine for the demo
and for millions of rows; the streaming loader of issue #3 replaces it for larger data.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from datapipe.manifest import DatasetError, Manifest, is_remote, read_manifest, remote_filesystem
from datapipe.writer import arrow_type


def batches_per_epoch(num_rows: int, world_size: int, batch_size: int) -> int:
    """How many batches each rank gets per epoch (the same for every rank)."""
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"world_size and batch_size must be >= 1, got {world_size}, {batch_size}")
    return num_rows // (world_size * batch_size)


def rank_indices(num_rows: int, rank: int, world_size: int, batch_size: int, seed: int,
                 epoch: int, shuffle: bool = True) -> np.ndarray:
    """The row indices rank ``rank`` reads in ``epoch``, shape ``(batches, batch_size)``. Pure."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    num_batches = batches_per_epoch(num_rows, world_size, batch_size)
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    else:
        order = np.arange(num_rows)
    used = order[: num_batches * world_size * batch_size]
    return used[rank::world_size].reshape(num_batches, batch_size)


class ArrowRows:
    """Random access to one fixed-shape column of a dataset through memory-mapped shards."""

    def __init__(self, path: str | Path, column: str):
        self.path = path if is_remote(path) else Path(str(path).removeprefix("file://"))
        self.manifest: Manifest = read_manifest(self.path)
        self.spec = self.manifest.column(column)
        self._offsets = np.cumsum([0] + [s.num_rows for s in self.manifest.shards])
        self._arrays = [self._open_shard(i) for i in range(len(self.manifest.shards))]

    @property
    def num_rows(self) -> int:
        return int(self._offsets[-1])

    def _open_shard(self, index: int) -> np.ndarray:
        shard = self.manifest.shards[index]
        file = f"{str(self.path).rstrip('/')}/{shard.path}"
        try:
            if is_remote(file):  # buffered read of the whole shard from the object store
                filesystem, inner = remote_filesystem(file)
                with filesystem.open_input_file(inner) as source:
                    table = pa.ipc.open_file(source).read_all()
            else:  # memory-mapped: pages are read as rows are gathered
                table = pa.ipc.open_file(pa.memory_map(file, "r")).read_all()
        except (OSError, pa.ArrowInvalid) as err:
            raise DatasetError(f"shard {file}: cannot be read ({err})") from err
        if self.spec.name not in table.column_names:
            raise DatasetError(f"shard {file}: has no column {self.spec.name!r}")
        column = table.column(self.spec.name)
        if column.type != arrow_type(self.spec):
            raise DatasetError(f"shard {file}: column {self.spec.name!r} is {column.type}, "
                               f"the manifest says {arrow_type(self.spec)}")
        if table.num_rows != shard.num_rows:
            raise DatasetError(f"shard {file}: has {table.num_rows} rows, "
                               f"the manifest says {shard.num_rows}")
        chunk = column.combine_chunks()
        # Zero-copy view onto the memory map: (rows, *shape) in the column's dtype.
        values = chunk.values.to_numpy(zero_copy_only=True)
        return values.reshape((shard.num_rows, *self.spec.shape))

    def gather(self, indices: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Copy rows ``indices`` into ``out`` (allocated if None), one fancy-index per shard."""
        if out is None:
            out = np.empty((len(indices), *self.spec.shape), dtype=self.spec.dtype)
        shard_ids = np.searchsorted(self._offsets, indices, side="right") - 1
        for shard_id in np.unique(shard_ids):
            mask = shard_ids == shard_id
            out[mask] = self._arrays[shard_id][indices[mask] - self._offsets[shard_id]]
        return out


class BatchLoader:
    """Endless iterator of ``(batch_size, *shape)`` tensors for one rank, epoch after epoch."""

    def __init__(self, path: str | Path, column: str, *, rank: int, world_size: int,
                 batch_size: int, seed: int, shuffle: bool = True,
                 device: torch.device | None = None, num_staging_buffers: int = 2):
        self.rows = ArrowRows(path, column)
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.seed, self.shuffle = seed, shuffle
        self.device = device or torch.device("cpu")
        self.num_batches = batches_per_epoch(self.rows.num_rows, world_size, batch_size)
        if self.num_batches == 0:
            raise DatasetError(
                f"{self.rows.path}: {self.rows.num_rows} rows are fewer than one batch per rank "
                f"(world_size {world_size} x batch_size {batch_size})")
        self.epoch = 0
        self.batch_index = 0  # next batch to yield within self.epoch
        self._epoch_indices: np.ndarray | None = None
        self._pinned = self.device.type == "cuda"
        shape = (batch_size, *self.rows.spec.shape)
        dtype = torch.from_numpy(np.empty(0, dtype=self.rows.spec.dtype)).dtype
        # Staging buffers are allocated once; on CUDA they are pinned and an event per buffer
        # keeps the next gather from overwriting a buffer whose async copy is still in flight.
        self._staging = [torch.empty(shape, dtype=dtype, pin_memory=True)
                         for _ in range(num_staging_buffers if self._pinned else 0)]
        self._events: list[Any] = [None] * num_staging_buffers
        self._next_buffer = 0

    def __len__(self) -> int:
        return self.num_batches

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held by the staging buffers (0 on CPU)."""
        return sum(t.numel() * t.element_size() for t in self._staging)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed,
                "world_size": self.world_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "world_size", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state was saved with {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}; resuming would repeat or skip samples")
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
        self._epoch_indices = None

    def rewind(self) -> None:
        """Go back to the first batch of epoch 0 (evaluation reads the same batches each time)."""
        self.epoch, self.batch_index, self._epoch_indices = 0, 0, None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self.batch_index >= self.num_batches:
            self.epoch, self.batch_index, self._epoch_indices = self.epoch + 1, 0, None
        if self._epoch_indices is None:
            self._epoch_indices = rank_indices(self.rows.num_rows, self.rank, self.world_size,
                                               self.batch_size, self.seed, self.epoch,
                                               self.shuffle)
        indices = self._epoch_indices[self.batch_index]
        self.batch_index += 1
        return self._to_device(indices)

    def _to_device(self, indices: np.ndarray) -> torch.Tensor:
        if not self._pinned:  # CPU: the gather is the only copy
            return torch.from_numpy(self.rows.gather(indices)).to(self.device)
        slot = self._next_buffer
        self._next_buffer = (slot + 1) % len(self._staging)
        staging = self._staging[slot]
        if self._events[slot] is not None:
            self._events[slot].synchronize()  # the copy that last read this buffer is done
        self.rows.gather(indices, out=staging.numpy())
        batch = staging.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[slot] = event
        return batch

