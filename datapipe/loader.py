"""The streaming loader: one rank's batches of a dataset column, epoch after epoch.

What it reads and in which order is decided by ``datapipe.split`` (pure, property-tested): the
rank's share of the epoch as shard ranges, read in shuffle windows. This module does the work:

- **Reading.** Local shards are memory-mapped (``datapipe.shards``); remote shards are read
  with buffered reads of only the record batches needed. Windows are read ``read_ahead`` ahead
  on a thread pool, each into one array (a view when it lies in one record batch), which also
  pages local rows in before they are needed. The whole dataset is never loaded: memory is
  about ``(read_ahead + 1) x window`` rows plus ``prefetch`` batches.
- **Batches.** A background thread gathers each batch's rows into a tensor with one vectorized
  take (a slice copy when unshuffled; no per-sample Python) and queues up to ``prefetch``
  batches. Arrow's fixed-size lists view as ``(rows, *shape)`` numpy arrays with no copy.
- **Device (CUDA).** Batches are gathered straight into pinned staging buffers, allocated once
  and reused; each is copied to the GPU with one ``non_blocking`` copy on a side stream,
  ``device_prefetch`` batches ahead, and the compute stream waits on that copy's event only.
  On CPU there is no staging: each batch is a fresh tensor.
- **Resumption.** The position is ``(epoch, batch_index)`` of the next batch the *consumer* gets
  (prefetched batches do not count); ``state_dict``/``load_state_dict`` restore it, and because
  batch ``k`` is computable without reading batches ``0..k-1``, a resumed run reads exactly the
  batches an uninterrupted one would.
- **World size.** The state records world size, batch size and seed; loading a state saved with
  other values is refused (the rank spans would differ, so samples would repeat or be skipped).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datapipe.manifest import DatasetError
from datapipe.shards import OnBadShard, ShardSource
from datapipe.split import (
    Locator,
    Range,
    batch_positions,
    batches_per_rank,
    epoch_ranges,
    window_rows,
)

log = logging.getLogger("memtrain.data")
_DONE = object()


class _Window:
    """The rows of one shuffle window as one ``(rows, *shape)`` array.

    Built on a read-ahead thread: a window within one record batch is a view onto the memory
    map; one that spans several is copied into one array there (this pages the rows in ahead
    of use), so gathering a batch is a single vectorized take on the producer thread.
    """

    def __init__(self, pieces: list[np.ndarray], first: int):
        self.rows = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        self.first = first  # span position of the window's first row

    def gather(self, positions: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = row at span position positions[i]`` (``positions`` sorted)."""
        local = positions - self.first
        if local[-1] - local[0] == len(local) - 1:  # contiguous (no shuffle): a slice copy
            out[:] = self.rows[local[0]:local[-1] + 1]
        else:
            np.take(self.rows, local, axis=0, out=out, mode="clip")


class BatchLoader:
    """Endless iterator of ``(batch_size, *shape)`` tensors for one rank."""

    def __init__(self, path: str | Path, column: str, *, rank: int, world_size: int,
                 batch_size: int, seed: int, shuffle: bool = True,
                 device: torch.device | None = None, shuffle_window: int = 8192,
                 prefetch: int = 4, read_ahead: int = 2, device_prefetch: int = 2,
                 on_bad_shard: OnBadShard = "error", staging: str | None = None):
        self._producer: _Producer | None = None
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.source = ShardSource(path, column, on_bad_shard)
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.seed, self.shuffle = seed, shuffle
        self.device = device or torch.device("cpu")
        self.window = window_rows(shuffle_window, batch_size)
        self.prefetch, self.read_ahead = max(1, prefetch), max(1, read_ahead)
        self.num_rows = sum(self.source.shard_rows)
        self.num_batches = batches_per_rank(self.num_rows, world_size, batch_size)
        if self.num_batches == 0:
            raise DatasetError(
                f"{self.source.root}: {self.num_rows} rows are fewer than one batch per rank "
                f"(world_size {world_size} x batch_size {batch_size})")
        self.shape = (batch_size, *self.source.spec.shape)
        self.dtype = np.dtype(self.source.spec.dtype)
        self.epoch = 0
        self.batch_index = 0  # of the next batch handed to the consumer
        # "pinned" on CUDA; tests force "staged" on CPU to run the same ring logic unpinned.
        mode = staging or ("pinned" if self.device.type == "cuda" else "direct")
        self._transfer = (_StagedTransfer(self, pin=mode == "pinned", slots=self.prefetch
                                          + device_prefetch + 2, depth=device_prefetch)
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

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed,
                "world_size": self.world_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "world_size", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state was saved with {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}; resuming would repeat or skip samples")
        self._restart(int(state["epoch"]), int(state["batch_index"]))

    def rewind(self) -> None:
        """Go back to the first batch of epoch 0 (evaluation reads the same batches each time)."""
        self._restart(0, 0)

    def close(self) -> None:
        producer = getattr(self, "_producer", None)  # absent when __init__ raised early
        if producer is not None:
            producer.stop()
            self._producer = None

    def __del__(self) -> None:
        self.close()

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self._producer is None:
            self._producer = _Producer(self, self.epoch, self.batch_index)
        batch = (self._transfer.next(self._producer) if self._transfer is not None
                 else self._producer.get())
        self.batch_index += 1
        if self.batch_index == self.num_batches:
            self.epoch, self.batch_index = self.epoch + 1, 0
        return batch

    # ---- planning (pure, cheap) -------------------------------------------------------------
    def ranges(self, epoch: int) -> list[Range]:
        """This rank's shard ranges in ``epoch`` (manifest shard indices)."""
        spans = epoch_ranges(self.source.shard_rows, self.world_size, self.batch_size, self.seed,
                             epoch, self.shuffle)
        usable = self.source.usable
        return [Range(usable[r.shard], r.start, r.stop) for r in spans[self.rank]]

    def positions(self, epoch: int, batch_index: int) -> np.ndarray:
        return batch_positions(self.num_batches * self.batch_size, self.batch_size, self.window,
                               batch_index, self.seed, epoch, self.rank, self.shuffle)

    def _restart(self, epoch: int, batch_index: int) -> None:
        self.close()
        if self._transfer is not None:
            self._transfer.reset()
        self.epoch, self.batch_index = epoch, batch_index


class _Producer:
    """The background thread: reads windows (``read_ahead`` ahead on a pool) and gathers
    batches into a bounded queue, in order, from ``(epoch, batch_index)`` on."""

    def __init__(self, loader: BatchLoader, epoch: int, batch_index: int):
        self.loader = loader
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=loader.prefetch)
        self.free_buffers: queue.Queue[Any] | None = None  # set by _StagedTransfer
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=loader.read_ahead,
                                        thread_name_prefix="memtrain-read")
        self._start = (epoch, batch_index)
        self._thread = threading.Thread(target=self._run, name="memtrain-loader", daemon=True)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def get(self) -> Any:
        self.start()
        item = self.queue.get()
        if isinstance(item, BaseException):
            self.stop()
            raise item
        return item

    def stop(self) -> None:
        self._stop.set()
        while True:  # unblock a put() waiting for room
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if self._started:
            self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _windows(self, epoch: int, first_window: int) -> Iterator[_Window]:
        """The epoch's windows from ``first_window`` on, read ``read_ahead`` ahead."""
        loader = self.loader
        locator = Locator(tuple(loader.ranges(epoch)))
        span = loader.num_batches * loader.batch_size
        count = -(-span // loader.window)
        pending: deque[Future[_Window]] = deque()
        next_window = first_window
        while next_window < count or pending:
            while next_window < count and len(pending) < loader.read_ahead:
                pending.append(self._pool.submit(self._read_window, locator, next_window, span))
                next_window += 1
            yield pending.popleft().result()

    def _read_window(self, locator: Locator, index: int, span: int) -> _Window:
        loader = self.loader
        first, last = index * loader.window, min((index + 1) * loader.window, span)
        starts = locator.starts
        pieces = []
        for i, piece in enumerate(locator.ranges):
            lo, hi = max(first, starts[i]), min(last, starts[i + 1])
            if lo < hi:
                offset = piece.start - starts[i]
                pieces += loader.source.read(Range(piece.shard, lo + offset, hi + offset))
        return _Window(pieces, first)

    def _run(self) -> None:
        loader = self.loader
        epoch, batch_index = self._start
        per_window = loader.window // loader.batch_size
        try:
            while not self._stop.is_set():
                for window in self._windows(epoch, batch_index // per_window):
                    stop_at = min(loader.num_batches,
                                  (window.first + loader.window) // loader.batch_size)
                    while batch_index < stop_at:
                        out = self._buffer()
                        if out is None:
                            return
                        tensor, array = out
                        window.gather(loader.positions(epoch, batch_index), array)
                        if not self._put(tensor):
                            return
                        batch_index += 1
                    if self._stop.is_set():
                        return
                epoch, batch_index = epoch + 1, 0
        except BaseException as err:  # handed to the consumer, which raises it
            self._put(err)

    def _buffer(self) -> tuple[Any, np.ndarray] | None:
        """Where the next batch goes: a fresh tensor, or a free staging slot."""
        if self.free_buffers is None:
            tensor = torch.empty(self.loader.shape, dtype=_torch_dtype(self.loader.dtype))
            return tensor, tensor.numpy()
        while not self._stop.is_set():
            try:
                slot = self.free_buffers.get(timeout=0.1)
            except queue.Empty:
                continue
            slot.wait_copied()  # the last copy out of this buffer is done
            return slot, slot.host.numpy()
        return None


class _Slot:
    """One staging buffer and the event of the last copy that read it."""

    def __init__(self, host: torch.Tensor):
        self.host = host
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

    def __init__(self, loader: BatchLoader, pin: bool, slots: int, depth: int):
        self.loader, self.pin, self.depth = loader, pin, max(1, depth)
        dtype = _torch_dtype(loader.dtype)
        self.slots = [_Slot(torch.empty(loader.shape, dtype=dtype, pin_memory=pin))
                      for _ in range(slots)]
        self.cuda = loader.device.type == "cuda"
        self.stream = torch.cuda.Stream(loader.device) if self.cuda else None
        self.in_flight: deque[tuple[torch.Tensor, Any]] = deque()
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

    def _attach(self, producer: _Producer) -> None:
        if producer.free_buffers is None:
            producer.free_buffers = queue.Queue()
            for slot in self.slots:
                producer.free_buffers.put(slot)

    def _issue(self, producer: _Producer) -> None:
        slot: _Slot = producer.get()
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
        producer.free_buffers.put(slot)  # type: ignore[union-attr]
        self.in_flight.append((batch, event))

    def next(self, producer: _Producer) -> torch.Tensor:
        self._attach(producer)
        producer.start()
        while len(self.in_flight) < self.depth + 1:  # this batch and `depth` ahead
            self._issue(producer)
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
