"""Property tests of the pure epoch plan (datapipe/split.py): rank split, drop policy, shuffle
windows. Hypothesis explores shard layouts, world sizes 1 to 64 and batch sizes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datapipe.split import (
    batch_positions,
    batches_per_rank,
    dropped_window,
    epoch_ranges,
    span_ranges,
    window_rows,
)

pytestmark = pytest.mark.unit

shard_layouts = st.lists(st.integers(0, 400), min_size=1, max_size=30)
worlds = st.integers(1, 64)
batches = st.integers(1, 16)
seeds = st.integers(0, 2**31)
epochs = st.integers(0, 1000)


def rows_read(spans: list[list], shard_rows: list[int]) -> list[tuple[int, int]]:
    """Every (shard, row) read by any rank, in order."""
    return [(r.shard, row) for span in spans for r in span for row in range(r.start, r.stop)]


@settings(max_examples=300, deadline=None)
@given(shard_layouts, worlds, batches, seeds, epochs, st.booleans())
def test_every_rank_gets_the_same_rows_and_no_row_is_read_twice(
        shard_rows: list[int], world: int, batch: int, seed: int, epoch: int,
        shuffle: bool) -> None:
    spans = epoch_ranges(shard_rows, world, batch, seed, epoch, shuffle)
    assert len(spans) == world
    per_rank = batches_per_rank(sum(shard_rows), world, batch) * batch
    for span in spans:
        assert sum(r.rows for r in span) == per_rank  # equal batches: DDP never waits
        for r in span:
            assert 0 <= r.start < r.stop <= shard_rows[r.shard]
    read = rows_read(spans, shard_rows)
    assert len(read) == len(set(read))  # at most once per epoch
    dropped = sum(shard_rows) - len(read)
    assert 0 <= dropped < world * batch  # only the documented remainder
    assert dropped == dropped_window(sum(shard_rows), world, batch, seed, epoch)[1]


@settings(max_examples=200, deadline=None)
@given(shard_layouts, worlds, batches, seeds, epochs)
def test_an_epoch_holds_the_same_multiset_shuffled_or_not(
        shard_rows: list[int], world: int, batch: int, seed: int, epoch: int) -> None:
    plain = rows_read(epoch_ranges(shard_rows, world, batch, seed, epoch, False), shard_rows)
    shuffled = rows_read(epoch_ranges(shard_rows, world, batch, seed, epoch, True), shard_rows)
    assert Counter(plain) == Counter(shuffled)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=2, max_size=20), st.integers(1, 8),
       st.integers(1, 8), seeds)
def test_dropped_rows_move_between_epochs_so_none_is_always_dropped(
        shard_rows: list[int], world: int, batch: int, seed: int) -> None:
    total = sum(shard_rows)
    _, count = dropped_window(total, world, batch, seed, 0)
    if count == 0:
        return
    never_read = set.intersection(*[
        {(s, r) for s, n in enumerate(shard_rows) for r in range(n)}
        - set(rows_read(epoch_ranges(shard_rows, world, batch, seed, e, False), shard_rows))
        for e in range(40)])
    assert len(never_read) < count or count == total  # 40 epochs: windows moved


def test_shuffle_changes_the_order_between_epochs_and_seeds() -> None:
    layout = [100] * 12
    base = epoch_ranges(layout, 2, 4, seed=0, epoch=0, shuffle=True)
    assert base != epoch_ranges(layout, 2, 4, seed=0, epoch=1, shuffle=True)
    assert base != epoch_ranges(layout, 2, 4, seed=1, epoch=0, shuffle=True)
    assert base == epoch_ranges(layout, 2, 4, seed=0, epoch=0, shuffle=True)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), batches, st.integers(1, 300), seeds, epochs, st.integers(0, 63),
       st.booleans())
def test_batches_of_an_epoch_cover_the_span_once_within_their_windows(
        num_batches: int, batch: int, window: int, seed: int, epoch: int, rank: int,
        shuffle: bool) -> None:
    span = num_batches * batch
    size = window_rows(window, batch)
    assert size % batch == 0 and size >= batch
    seen = []
    for k in range(num_batches):
        positions = batch_positions(span, batch, window, k, seed, epoch, rank, shuffle)
        assert len(positions) == batch and list(positions) == sorted(positions)
        assert len({int(p) // size for p in positions}) == 1  # one window: bounded memory
        seen += positions.tolist()
    assert sorted(seen) == list(range(span))
    with pytest.raises(IndexError):
        batch_positions(span, batch, window, num_batches, seed, epoch, rank, shuffle)


def test_span_positions_map_to_shard_rows() -> None:
    from datapipe.split import Range

    ranges = [Range(3, 10, 15), Range(0, 0, 2), Range(7, 5, 8)]
    assert span_ranges(ranges, 0, 10) == ranges
    rows = [(r.shard, row) for r in span_ranges(ranges, 3, 9) for row in range(r.start, r.stop)]
    assert rows == [(3, 13), (3, 14), (0, 0), (0, 1), (7, 5), (7, 6)]
    assert span_ranges(ranges, 5, 7) == [Range(0, 0, 2)]
    assert span_ranges(ranges, 4, 4) == []


def _read_batches(spans: list[list], batch: int, window: int, seed: int, epoch: int,
                  shuffle: bool, upto: list[int] | None) -> list[tuple[int, int]]:
    """(shard, row) of every row each rank reads in its first ``upto[rank]`` batches (all of
    them when None), through the same functions the loader uses."""
    read = []
    for rank, ranges in enumerate(spans):
        span = sum(r.rows for r in ranges)
        count = span // batch if upto is None else upto[rank]
        for index in range(count):
            for position in batch_positions(span, batch, window, index, seed, epoch, rank,
                                            shuffle):
                [piece] = span_ranges(ranges, int(position), int(position) + 1)
                read.append((piece.shard, piece.start))
    return read


segment_sizes = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 5), st.floats(0, 1)),
                         min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 120), min_size=1, max_size=8), segment_sizes,
       st.tuples(st.integers(1, 6), st.integers(1, 5)), st.integers(1, 24), seeds, epochs,
       st.booleans())
def test_world_size_changes_within_an_epoch_read_every_row_at_most_once(
        shard_rows: list[int], sizes: list[tuple[int, int, float]], final: tuple[int, int],
        window: int, seed: int, epoch: int, shuffle: bool) -> None:
    """Any save world and batch size, any step, any number of changes, any resume size: the
    rows read before and after each change are distinct, and all the epoch's kept rows are read
    except fewer than one batch per new rank at each change."""
    from datapipe.split import Segment, resumed_ranges

    segments: list[Segment] = []
    read: list[tuple[int, int]] = []
    lost = 0  # rows dropped at the changes so far
    dropped = None
    for world, batch, fraction in [*sizes, (*final, 1.0)]:
        spans = resumed_ranges(shard_rows, segments, world, batch, seed, epoch, shuffle, window)
        available = sum(r.rows for span in spans for r in span)
        if dropped is None:  # the epoch's own drop window, chosen by its first size
            dropped = dropped_window(sum(shard_rows), world, batch, seed, epoch)[1]
        else:  # a change: what no rank read yet, less fewer than a batch per new rank
            left = sum(shard_rows) - dropped - lost - len(read)
            assert 0 <= left - available < world * batch
            lost += left - available
        per_rank = available // (world * batch)
        assert all(sum(r.rows for r in span) == per_rank * batch for span in spans)
        done = int(fraction * per_rank)
        read += _read_batches(spans, batch, window, seed, epoch, shuffle, [done] * world)
        segments.append(Segment(world, batch, done))
    counts = Counter(read)
    assert not [row for row, n in counts.items() if n > 1], "a row was read twice"
    assert len(read) + lost + dropped == sum(shard_rows)  # every other row was read
    assert all(0 <= row < shard_rows[shard] for shard, row in counts)


def test_a_change_after_the_last_batch_of_a_short_window_leaves_nothing() -> None:
    """The span ends inside its last window and every batch was read: nothing is left."""
    from datapipe.split import Segment, resumed_ranges

    assert resumed_ranges([1], [Segment(1, 1, 1)], 1, 1, 0, 0, True, 2) == [[]]


def test_a_change_keeps_the_rows_of_the_current_window_that_were_not_read() -> None:
    """2 ranks x batch 4 read 1 batch of a shuffled 8-row window, then 1 rank resumes: the 4
    unread rows of each window come first, in file order, then the later windows."""
    from datapipe.split import Segment, resumed_ranges

    shard_rows = [32]
    before = epoch_ranges(shard_rows, 2, 4, 7, 0, True)
    first = _read_batches(before, 4, 8, 7, 0, True, [1, 1])
    [after] = resumed_ranges(shard_rows, [Segment(2, 4, 1)], 1, 4, 7, 0, True, 8)
    rest = [(r.shard, row) for r in after for row in range(r.start, r.stop)]
    assert sorted(first + rest) == [(0, row) for row in range(32)]
    assert len(rest) == 24
