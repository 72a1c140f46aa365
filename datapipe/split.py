"""Which rows each rank reads in an epoch, and in what order: pure functions of the shard sizes,
the world, the batch size, the seed and the epoch. No I/O, so they are property-tested.

The policy, in three steps:

1. **Drop.** With ``N`` rows, ``W`` ranks and batch size ``B``, every rank gets
   ``N // (W * B)`` batches. The ``D = N mod (W * B)`` rows left over (fewer than one batch per
   rank) are dropped for the epoch: a contiguous window of ``D`` rows in manifest order starting
   at an offset drawn from ``(seed, epoch)``, so a different window each epoch and no row is
   dropped every time. The dropped rows do not depend on ``shuffle``: an epoch holds the same
   multiset of rows shuffled or not. Nothing is ever padded or repeated.
2. **Shard order.** The remaining rows form pieces (whole shards, or a shard cut by the drop
   window). With ``shuffle`` the pieces are permuted by ``(seed, epoch)``. Their concatenation
   is cut into ``W`` equal, contiguous spans; rank ``r`` reads span ``r`` as a list of
   ``(shard, start, stop)`` ranges, so each rank reads about ``1/W`` of the data, sequentially.
3. **Window shuffle.** A rank's span is read in windows of ``window`` rows (a multiple of
   ``B``). With ``shuffle`` the rows of each window are permuted by
   ``(seed, epoch, rank, window index)``; batches are consecutive runs of ``B`` rows of the
   permuted window. Memory is bounded by one window, and batch ``k`` of an epoch is found
   without reading anything before it: exact resume is O(1).

**A change of world size (or batch size) within an epoch** (``resumed_ranges``): the epoch so
far is a list of segments, each ``world_size`` ranks having read their first ``batches`` batches
of ``batch_size``. The rows no rank has read are, per rank of the last segment and in rank
order, the rest of its current window (in file order) and then its later windows; they are cut
into equal spans of whole batches for the new world, and window-shuffled as above. The rows
that do not fill one more batch on every new rank (fewer than ``world_size * batch_size``) are
dropped for the rest of that epoch. So across any number of changes, every row of an epoch is
read at most once, and all are read except the epoch's drop window and those remainders. The
next epoch is planned for the new world from scratch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

_DROP_SALT = 0x5EED_D209  # keeps the drop offset's stream apart from the shard permutation's


class Range(NamedTuple):
    """Rows ``[start, stop)`` of shard ``shard`` (its index in the manifest)."""

    shard: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def batches_per_rank(num_rows: int, world_size: int, batch_size: int) -> int:
    """How many batches every rank gets per epoch (the same for all ranks)."""
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"world_size and batch_size must be >= 1, got {world_size}, {batch_size}")
    return num_rows // (world_size * batch_size)


def dropped_window(num_rows: int, world_size: int, batch_size: int, seed: int,
                   epoch: int) -> tuple[int, int]:
    """``(offset, count)``: the rows ``offset .. offset + count - 1`` (mod ``num_rows``, in
    manifest order) that no rank reads this epoch."""
    count = num_rows - batches_per_rank(num_rows, world_size, batch_size) * world_size * batch_size
    if count == 0:
        return 0, 0
    offset = int(np.random.default_rng([seed, epoch, _DROP_SALT]).integers(num_rows))
    return offset, count


def epoch_ranges(shard_rows: list[int], world_size: int, batch_size: int, seed: int,
                 epoch: int, shuffle: bool) -> list[list[Range]]:
    """Per rank, the shard ranges it reads this epoch, in reading order (step 1 and 2 above)."""
    num_rows = sum(shard_rows)
    per_rank = batches_per_rank(num_rows, world_size, batch_size) * batch_size
    offset, count = dropped_window(num_rows, world_size, batch_size, seed, epoch)
    dropped = [(offset, min(offset + count, num_rows))]
    if offset + count > num_rows:  # the window wraps around to the first rows
        dropped.append((0, offset + count - num_rows))

    pieces: list[Range] = []
    first = 0
    for shard, rows in enumerate(shard_rows):
        kept = [(first, first + rows)]
        for lo, hi in dropped:
            kept = [part for a, b in kept for part in ((a, min(b, lo)), (max(a, hi), b))
                    if part[1] > part[0]]
        pieces += [Range(shard, a - first, b - first) for a, b in kept]
        first += rows
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(len(pieces))
        pieces = [pieces[i] for i in order]

    return _cut(pieces, world_size, per_rank)


def _cut(pieces: list[Range], world_size: int, per_rank: int) -> list[list[Range]]:
    """``pieces`` in order, cut into ``world_size`` spans of ``per_rank`` rows (the rest unread)."""
    spans: list[list[Range]] = [[] for _ in range(world_size)]
    rank, room = 0, per_rank
    for piece in pieces:
        start = piece.start
        while start < piece.stop and rank < world_size:
            take = min(room, piece.stop - start)
            if take:
                spans[rank].append(Range(piece.shard, start, start + take))
            start += take
            room -= take
            if room == 0:
                rank, room = rank + 1, per_rank
    return spans


def window_rows(window: int, batch_size: int) -> int:
    """The shuffle window in rows: at least one batch, a whole number of batches."""
    return max(1, -(-window // batch_size)) * batch_size


def batch_positions(span_rows: int, batch_size: int, window: int, batch_index: int, seed: int,
                    epoch: int, rank: int, shuffle: bool) -> np.ndarray:
    """Positions within the rank's span (0 .. span_rows - 1) of batch ``batch_index``, sorted
    (step 3 above). Batches never straddle windows because windows hold whole batches."""
    size = window_rows(window, batch_size)
    first = batch_index * batch_size
    if first + batch_size > span_rows:
        raise IndexError(f"batch {batch_index} is past the epoch's {span_rows // batch_size}")
    index, within = divmod(first, size)
    start = index * size
    length = min(size, span_rows - start)
    if not shuffle:
        return np.arange(first, first + batch_size, dtype=np.int64)
    order = window_permutation(length, seed, epoch, rank, index)
    # A batch is a set of rows; sorted, its rows are read in file order, one run per piece.
    return np.sort(start + order[within:within + batch_size])


@functools.lru_cache(maxsize=4)  # a loader asks for the same window once per batch in it
def window_permutation(length: int, seed: int, epoch: int, rank: int, index: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, rank, index]).permutation(length).astype(np.int64)


def span_ranges(ranges: list[Range], first: int, last: int) -> list[Range]:
    """The shard ranges that hold positions ``first .. last - 1`` of a rank's span (whose
    reading order is ``ranges``), in order."""
    out, start = [], 0
    for piece in ranges:
        lo, hi = max(first, start), min(last, start + piece.rows)
        if lo < hi:
            out.append(Range(piece.shard, piece.start + lo - start, piece.start + hi - start))
        start += piece.rows
    return out


class Segment(NamedTuple):
    """Part of an epoch read at one size: ``world_size`` ranks each read their first
    ``batches`` batches of ``batch_size`` rows."""

    world_size: int
    batch_size: int
    batches: int


def unread_ranges(ranges: list[Range], batch_size: int, window: int, batches: int, seed: int,
                  epoch: int, rank: int, shuffle: bool) -> list[Range]:
    """The rows of a rank's span (``ranges``, in reading order) outside its first ``batches``
    batches: the rest of the current window in file order, then the windows after it."""
    span = sum(r.rows for r in ranges)
    first = batches * batch_size
    size = window_rows(window, batch_size)
    index, within = divmod(first, size)
    if not shuffle or within == 0:  # whole windows read: the rest is contiguous
        return span_ranges(ranges, first, span)
    start = index * size
    length = min(size, span - start)
    rest = np.sort(start + window_permutation(length, seed, epoch, rank, index)[within:])
    # Runs of consecutive positions, each one range (or a few where the span changes piece).
    breaks = np.flatnonzero(np.diff(rest) != 1) + 1
    runs = [(int(run[0]), int(run[-1]) + 1) for run in np.split(rest, breaks) if run.size]
    return ([piece for lo, hi in runs for piece in span_ranges(ranges, lo, hi)]
            + span_ranges(ranges, start + length, span))


def resumed_ranges(shard_rows: list[int], segments: list[Segment], world_size: int,
                   batch_size: int, seed: int, epoch: int, shuffle: bool,
                   window: int) -> list[list[Range]]:
    """Per rank of a ``world_size`` x ``batch_size`` world, the ranges it reads of the rest of
    ``epoch`` after ``segments`` (read in that order, at their own sizes), in reading order;
    see "A change of world size" above."""
    if not segments:
        return epoch_ranges(shard_rows, world_size, batch_size, seed, epoch, shuffle)
    spans = epoch_ranges(shard_rows, segments[0].world_size, segments[0].batch_size, seed,
                         epoch, shuffle)
    following = [*segments[1:], Segment(world_size, batch_size, 0)]
    for segment, after in zip(segments, following, strict=True):
        pieces = [piece for rank, ranges in enumerate(spans)
                  for piece in unread_ranges(ranges, segment.batch_size, window,
                                             segment.batches, seed, epoch, rank, shuffle)]
        rows = sum(piece.rows for piece in pieces)
        per_rank = rows // (after.world_size * after.batch_size) * after.batch_size
        spans = _cut(pieces, after.world_size, per_rank)
    return spans
