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
