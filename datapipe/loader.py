"""The streaming loader: one rank's batches of a dataset column, epoch after epoch.

What it reads and in which order is decided by ``datapipe.split`` (pure, property-tested): the
rank's share of the epoch as shard ranges, read in shuffle windows. This module does the work:

- **Reading ahead.** Windows are read ``read_ahead`` windows ahead. Remote shards
  (``s3://``...) are fetched on a thread pool, with buffered reads of only the record batches a
  window needs, so reading overlaps compute. Local shards are memory-mapped: a window is views
  onto the map, plus, when shuffled, a ``madvise(WILLNEED)`` for pages not yet cached, which
  starts the kernel's read-ahead and returns, so it is done on the caller's thread (a pool
  thread cost more in GIL handoffs than it saved). Unshuffled windows are read in file order,
  and the kernel reads ahead of sequential faults on its own; advising them cost the
  unshuffled loader a tenth of its speed (bench/loader.py). The whole dataset is never loaded:
  memory is at most ``read_ahead + 1`` remote windows.
- **Batches.** When a shuffled window opens, all its batches are planned (the window's
  permutation sorted batch by batch); the next batch is then gathered when asked for, with one
  ``np.take`` (a slice copy when unshuffled) per record batch it touches, straight into the
  batch's array: no per-sample Python. Arrow's fixed-size lists
  view as ``(rows, *shape)`` arrays with no copy, so that gather is the only copy of a row
  between the page cache and the batch. It runs on the caller's thread on purpose: handing
  each batch over from a gather thread cost more, in GIL handoffs, than the gather itself
  (measured in ``bench/loader.py``).
- **Device (CUDA).** Batches are gathered straight into pinned staging buffers, allocated once
  and reused; each is copied to the GPU with one ``non_blocking`` copy on a side stream,
  ``prefetch`` batches ahead, and the compute stream waits on that copy's event only.
  On CPU there is no staging: each batch is a fresh tensor.
- **Resumption.** The position is ``(epoch, batch_index)`` of the next batch the *consumer* gets
  (batches copied ahead do not count); ``state_dict``/``load_state_dict`` restore it, and
  because batch ``k`` is computable without reading batches ``0..k-1``, a resumed run reads
  exactly the batches an uninterrupted one would.
- **World size.** The state records world size, batch size and seed. Loading a state saved at
  another world size or batch size (an elastic resize, a lost node, ``--workers``) continues the
  epoch with the rows no rank has read yet, re-split for this world
  (``datapipe.split.resumed_ranges``): no row repeats, and fewer than one batch per rank is
  dropped for the rest of that epoch. A different seed, shuffle or shuffle window is refused.
"""

from __future__ import annotations

import bisect
import logging
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from datapipe.manifest import DatasetError
from datapipe.shards import OnBadShard, ShardSource
from datapipe.split import (
    Range,
    Segment,
    batch_positions,
    batches_per_rank,
    epoch_ranges,
    resumed_ranges,
    span_ranges,
    window_permutation,
    window_rows,
)

log = logging.getLogger("memtrain.data")
# The window of an unshuffled local loader. Opening a window costs about 60 us of Python run
# with caches cold from the copies: with 16 MiB windows, 2 us of each 40 us batch.
SEQUENTIAL_WINDOW_BYTES = 256 << 20


# Memory-mapped rows are read-only numpy views; torch warns when it wraps one, though the
# loader only ever reads from them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                        category=UserWarning)


class _Window:
    """The rows of one shuffle window: one array per record batch it spans, views onto the
    memory map for local shards (so the batch gather is the only copy of a row). They stay
    numpy arrays between batches, so a window adds no tensors to what the leak guard counts."""

    def __init__(self, pieces: list[np.ndarray], first: int):
        self.pieces = pieces
        self.starts = [0]  # each piece's first window row, then the window's row count
        for piece in pieces:
            self.starts.append(self.starts[-1] + len(piece))
        self.first = first  # span position of the window's first row
        # Set by plan_shuffle when the loader opens a shuffled window.
        self.relative = np.empty((0, 0), dtype=np.int64)
        self.bounds: list[list[int]] = []

    def plan_shuffle(self, order: np.ndarray, batch_size: int) -> None:
        """Every batch of the window at once, from its permutation ``order`` (window-local
        rows): batch ``k`` is ``order[k*B:(k+1)*B]``, sorted so it reads in file order, as
        ``datapipe.split.batch_positions`` defines it. Kept as piece-relative rows and, per
        batch, where each piece's rows start: a batch's gather is then one ``np.take`` per
        piece and no other array work (the per-batch sorts and searches cost a third of a
        shuffled batch's time, bench/loader.py)."""
        rows = np.sort(order.reshape(-1, batch_size), axis=1)
        starts = np.asarray(self.starts)
        piece = np.searchsorted(starts, rows, side="right") - 1
        self.relative = rows - starts[piece]
        self.bounds = np.stack([(rows < start).sum(axis=1) for start in self.starts],
                               axis=1).tolist()

    def gather(self, batch: int, dst: np.ndarray) -> None:
        """``dst[i]`` = row ``i`` of the window's planned batch ``batch`` (``plan_shuffle``):
        one ``np.take`` per piece it touches, straight into its slice of ``dst``."""
        relative, bounds = self.relative[batch], self.bounds[batch]
        for index, array in enumerate(self.pieces):
            a, b = bounds[index], bounds[index + 1]
            if a < b:  # "clip": the rows are in range, and "raise" would buffer the output
                np.take(array, relative[a:b], axis=0, out=dst[a:b], mode="clip")

    def copy(self, batch: int, batch_size: int, dst: np.ndarray | None = None) -> np.ndarray:
        """The window's unshuffled batch ``batch``: its rows ``batch*B .. (batch+1)*B - 1``,
        into ``dst``, or without one into a new array made by one copy in numpy's C code.
        Found when asked for (a bisect over the window's few pieces): planning every batch
        when the window opened cost more, in cold caches, than the batches' own Python."""
        starts, first = self.starts, batch * batch_size
        index = bisect.bisect_right(starts, first) - 1
        row = first - starts[index]
        if first + batch_size <= starts[index + 1]:  # inside one piece: most batches
            view = self.pieces[index][row:row + batch_size]
            if dst is None:
                return view.copy()
            dst[...] = view
            return dst
        parts, filled = [], 0
        while filled < batch_size:
            array = self.pieces[index]
            count = min(batch_size - filled, len(array) - row)
            parts.append(array[row:row + count])
            filled, index, row = filled + count, index + 1, 0
        if dst is None:
            return np.concatenate(parts)
        np.concatenate(parts, out=dst)
        return dst


class _Resumed(NamedTuple):
    """An epoch that earlier world sizes began: what they read, and this rank's rest of it."""

    epoch: int
    segments: list[Segment]
    ranges: list[Range]  # manifest shard indices
    batches: int


class BatchLoader:
    """Endless iterator of ``(batch_size, *shape)`` tensors for one rank."""

    def __init__(self, path: str | Path, column: str, *, rank: int, world_size: int,
                 batch_size: int, seed: int, shuffle: bool = True,
                 device: torch.device | None = None, shuffle_window: int = 8192,
                 prefetch: int = 2, read_ahead: int = 2,
                 on_bad_shard: OnBadShard = "error", staging: str | None = None):
        self._reader: _Reader | None = None
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.source = ShardSource(path, column, on_bad_shard)
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.seed, self.shuffle = seed, shuffle
        self.device = device or torch.device("cpu")
        self.shuffle_window = shuffle_window  # as asked: a resize re-plans it per batch size
        self.window = window_rows(shuffle_window, batch_size)
        if not shuffle and not self.source.remote:
            # Unshuffled local windows are views of the map read in file order: their size
            # changes neither the order nor the memory held, only how often one is opened.
            row_bytes = int(np.prod(self.source.spec.shape)) * np.dtype(
                self.source.spec.dtype).itemsize
            self.window = window_rows(max(shuffle_window, SEQUENTIAL_WINDOW_BYTES // row_bytes),
                                      batch_size)
        self._window_batches = self.window // batch_size
        self.read_ahead = max(1, read_ahead)
        self.num_rows = sum(self.source.shard_rows)
        self.num_batches = batches_per_rank(self.num_rows, world_size, batch_size)
        if self.num_batches == 0:
            raise DatasetError(
                f"{self.source.root}: {self.num_rows} rows are fewer than one batch per rank "
                f"(world_size {world_size} x batch_size {batch_size})")
        self.shape = (batch_size, *self.source.spec.shape)
        self.dtype = np.dtype(self.source.spec.dtype)
        self.epoch = 0
        # Set when a state saved at another size resumes mid-epoch (only that epoch differs).
        self._resumed: _Resumed | None = None
        self.resized_from: int | None = None  # the world size of a state loaded at another
        self.batch_index = 0  # of the next batch handed to the consumer
        self._cursor = (0, 0)  # (epoch, batch_index) of the next batch to gather
        self._current: tuple[int, int, _Window] | None = None  # (epoch, window index, window)
        # "pinned" on CUDA; tests force "staged" on CPU to run the same ring logic unpinned.
        mode = staging or ("pinned" if self.device.type == "cuda" else "direct")
        self._transfer = (_StagedTransfer(self, pin=mode == "pinned", depth=prefetch)
                          if mode in ("pinned", "staged") else None)

    # ---- what the trainer uses --------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_batches

    @property
    def skipped_shards(self) -> int:
        return len(self.source.skipped)

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held by the staging buffers (0 on CPU)."""
        return self._transfer.pinned_bytes if self._transfer is not None else 0

    def state_dict(self) -> dict[str, Any]:
        resumed = self._resumed_in(self.epoch)
        segments = resumed.segments if resumed is not None else []
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed,
                "shuffle": self.shuffle, "shuffle_window": self.shuffle_window,
                "world_size": self.world_size, "batch_size": self.batch_size,
                "segments": [list(segment) for segment in segments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "shuffle", "shuffle_window"):  # what decides which rows were read
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state was saved with {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}; resuming would repeat or skip samples")
        epoch, batch_index = int(state["epoch"]), int(state["batch_index"])
        segments = [Segment(*map(int, segment)) for segment in state.get("segments", [])]
        saved_world = int(state["world_size"])
        self.resized_from = saved_world if saved_world != self.world_size else None
        if (saved_world, state["batch_size"]) != (self.world_size, self.batch_size):
            # Another size read this epoch so far: the rest of it is re-split for this one.
            segments.append(Segment(saved_world, int(state["batch_size"]), batch_index))
            batch_index = 0
        self._restart(epoch, batch_index)
        self._resumed = None
        if segments:
            spans = resumed_ranges(self.source.shard_rows, segments, self.world_size,
                                   self.batch_size, self.seed, epoch, self.shuffle,
                                   self.shuffle_window)
            ranges = self._manifest_ranges(spans[self.rank])
            self._resumed = _Resumed(epoch, segments, ranges,
                                     sum(r.rows for r in ranges) // self.batch_size)
            if self._resumed.batches == 0:  # less than a batch per rank was left
                self._restart(epoch + 1, 0)

    def rewind(self) -> None:
        """Go back to the first batch of epoch 0 (evaluation reads the same batches each time)."""
        self._restart(0, 0)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the read-ahead threads (idempotent)."""
        reader = getattr(self, "_reader", None)  # absent when __init__ raised early
        if reader is not None:
            reader.close()
            self._reader = None
        self._current = None

    def __del__(self) -> None:
        self.close()

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self._transfer is not None:
            batch = self._transfer.next()
        else:  # a numpy array: numpy allocates a batch faster than torch.empty
            batch = torch.from_numpy(self._gather(None))
        self.batch_index += 1
        if self.batch_index == self.batches_in(self.epoch):
            self.epoch, self.batch_index = self.epoch + 1, 0
        return batch

    # ---- planning (pure, cheap) -------------------------------------------------------------
    def _resumed_in(self, epoch: int) -> _Resumed | None:
        return self._resumed if self._resumed is not None and self._resumed.epoch == epoch \
            else None

    def batches_in(self, epoch: int) -> int:
        """This rank's batches in ``epoch``: fewer in an epoch resumed at another world size."""
        if self._resumed is None:  # asked twice per batch: the common case first
            return self.num_batches
        resumed = self._resumed_in(epoch)
        return resumed.batches if resumed is not None else self.num_batches

    def ranges(self, epoch: int) -> list[Range]:
        """This rank's shard ranges in ``epoch`` (manifest shard indices)."""
        resumed = self._resumed_in(epoch)
        if resumed is not None:
            return resumed.ranges
        spans = epoch_ranges(self.source.shard_rows, self.world_size, self.batch_size, self.seed,
                             epoch, self.shuffle)
        return self._manifest_ranges(spans[self.rank])

    def _manifest_ranges(self, ranges: list[Range]) -> list[Range]:
        """Ranges over the usable shards, renumbered as manifest shard indices."""
        usable = self.source.usable
        return [Range(usable[r.shard], r.start, r.stop) for r in ranges]

    def positions(self, epoch: int, batch_index: int) -> np.ndarray:
        return batch_positions(self.batches_in(epoch) * self.batch_size, self.batch_size,
                               self.window, batch_index, self.seed, epoch, self.rank,
                               self.shuffle)

    def _gather(self, out: np.ndarray | None) -> np.ndarray:
        """Gather the batch at the cursor into ``out`` (None: a new array) and advance the
        cursor. Everything a batch needs beyond its copy was planned when its window opened."""
        epoch, batch_index = self._cursor
        index, within = divmod(batch_index, self._window_batches)
        current = self._current
        if current is None or current[1] != index or current[0] != epoch:
            current = self._current = (epoch, index, self._open_window(epoch, index))
        if self.shuffle:
            if out is None:
                out = np.empty(self.shape, dtype=self.dtype)
            current[2].gather(within, out)
        else:
            out = current[2].copy(within, self.batch_size, out)
        batch_index += 1
        self._cursor = ((epoch + 1, 0) if batch_index == self.batches_in(epoch)
                        else (epoch, batch_index))
        return out

    def _open_window(self, epoch: int, index: int) -> _Window:
        if self._reader is None:
            self._reader = _Reader(self, epoch, index)
        window = self._reader.window(epoch, index)
        if self.shuffle:
            span = self.batches_in(epoch) * self.batch_size
            window.plan_shuffle(window_permutation(min(self.window, span - window.first),
                                                   self.seed, epoch, self.rank, index),
                                self.batch_size)
        return window

    def _restart(self, epoch: int, batch_index: int) -> None:
        self.close()
        if self._transfer is not None:
            self._transfer.reset()
        self.epoch, self.batch_index = epoch, batch_index
        self._cursor = (epoch, batch_index)


class _Reader:
    """Windows in order from ``(epoch, window)`` on, across epochs, read ``read_ahead`` ahead
    (on a thread pool for remote shards, inline for local ones)."""

    def __init__(self, loader: BatchLoader, epoch: int, window: int):
        self.loader = loader
        # Local shards: a window's "read" is views onto the memory map (plus a WILLNEED advice
        # when shuffled, which starts the kernel's read-ahead and returns); done inline,
        # ``read_ahead`` windows early. A pool thread there cost the consumer more in GIL
        # handoffs than it saved (up to 20% of the unshuffled loader's speed,
        # bench/loader.py). Remote shards are fetched on the pool.
        self.pool: ThreadPoolExecutor | _Inline = (
            ThreadPoolExecutor(max_workers=loader.read_ahead, thread_name_prefix="memtrain-read")
            if loader.source.remote else _Inline())
        self.pending: deque[tuple[int, int, Future[_Window] | _Done]] = deque()
        self.next_epoch, self.next_window = epoch, window
        self._ranges: tuple[int, list[Range]] | None = None  # (epoch, this rank's ranges)

    def count(self, epoch: int) -> int:
        """Windows in ``epoch``."""
        loader = self.loader
        return -(-loader.batches_in(epoch) * loader.batch_size // loader.window)

    def _epoch_ranges(self, epoch: int) -> list[Range]:
        if self._ranges is None or self._ranges[0] != epoch:
            self._ranges = (epoch, self.loader.ranges(epoch))
        return self._ranges[1]

    def window(self, epoch: int, index: int) -> _Window:
        """Window ``index`` of ``epoch``: the next one in reading order."""
        while len(self.pending) < self.loader.read_ahead:
            ranges = self._epoch_ranges(self.next_epoch)
            self.pending.append((self.next_epoch, self.next_window, self.pool.submit(
                self._read, ranges, self.next_epoch, self.next_window)))
            self.next_window += 1
            if self.next_window == self.count(self.next_epoch):
                self.next_epoch, self.next_window = self.next_epoch + 1, 0
        got_epoch, got_index, future = self.pending.popleft()
        assert (got_epoch, got_index) == (epoch, index), "windows are read in order"
        return future.result()

    def _read(self, ranges: list[Range], epoch: int, index: int) -> _Window:
        loader = self.loader
        span = loader.batches_in(epoch) * loader.batch_size
        first, last = index * loader.window, min((index + 1) * loader.window, span)
        pieces = [part for piece in span_ranges(ranges, first, last)
                  for part in loader.source.read(piece, advise=loader.shuffle)]
        return _Window(pieces, first)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class _Inline:
    """The executor interface, run on the caller's thread (local shards)."""

    def submit(self, function: Any, *args: Any) -> _Done:
        try:
            return _Done(function(*args), None)
        except BaseException as err:  # raised again by result(), where the pool's would be
            return _Done(None, err)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class _Done(NamedTuple):
    """A finished ``Future``'s ``result()`` without its lock and condition (inline reads)."""

    value: Any
    error: BaseException | None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Slot:
    """One staging buffer and the event of the last copy that read it."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.host_array = host.numpy()  # the same memory, for the gather
        self.copied: Any = None

    def wait_copied(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None


class _StagedTransfer:
    """Staging buffers allocated once (pinned on CUDA) and reused in a ring; one
    ``non_blocking`` copy per batch on a side stream, ``depth`` batches ahead.

    With ``pin=False`` on a CPU device the same ring, slot and event logic runs with CPU
    stand-ins for the stream and events, which is how the tests exercise it without a GPU.
    """

    def __init__(self, loader: BatchLoader, pin: bool, depth: int):
        self.loader, self.pin, self.depth = loader, pin, max(1, depth)
        dtype = _torch_dtype(loader.dtype)
        self.slots = [_Slot(torch.empty(loader.shape, dtype=dtype, pin_memory=pin))
                      for _ in range(self.depth + 2)]
        self.cuda = loader.device.type == "cuda"
        self.stream = torch.cuda.Stream(loader.device) if self.cuda else None
        self.in_flight: deque[tuple[torch.Tensor, Any]] = deque()
        self.next_slot = 0
        self.copies = 0

    @property
    def pinned_bytes(self) -> int:
        if not self.pin:
            return 0
        return sum(s.host.numel() * s.host.element_size() for s in self.slots)

    def reset(self) -> None:
        self.in_flight.clear()
        for slot in self.slots:
            slot.wait_copied()

    def _issue(self) -> None:
        slot = self.slots[self.next_slot]
        self.next_slot = (self.next_slot + 1) % len(self.slots)
        slot.wait_copied()  # the copy that last read this buffer is done
        self.loader._gather(slot.host_array)
        event: Any
        if self.cuda:
            with torch.cuda.stream(self.stream):
                batch = slot.host.to(self.loader.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            batch, event = slot.host.clone(), _DoneEvent()
        slot.copied = event
        self.copies += 1
        self.in_flight.append((batch, event))

    def next(self) -> torch.Tensor:
        while len(self.in_flight) < self.depth + 1:  # this batch and `depth` ahead
            self._issue()
        batch, event = self.in_flight.popleft()
        if self.cuda:
            current = torch.cuda.current_stream(self.loader.device)
            current.wait_event(event)  # compute waits for this copy only
            batch.record_stream(current)  # the allocator must not reuse it early
        return batch


class _DoneEvent:
    """A copy that finished when it was issued (the CPU stand-in for a CUDA event)."""

    def synchronize(self) -> None:
        pass


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
