"""The streaming loader on real Arrow shards: every sample once per epoch across ranks, exact
resume at any point, the staged (pinned on CUDA) transfer path, record batches and ranges."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from datapipe import writer
from datapipe.loader import BatchLoader
from datapipe.manifest import ColumnSpec
from datapipe.shards import ShardSource
from datapipe.split import Range, dropped_window
from datapipe.writer import write_rows

pytestmark = pytest.mark.unit


def id_dataset(path: Path, rows_per_shard: list[int]) -> Path:
    """Rows ``[i, -i]`` (int64): a batch says exactly which rows it holds."""
    blocks, first = [], 0
    for n in rows_per_shard:
        ids = np.arange(first, first + n, dtype=np.int64)
        blocks.append({"x": np.stack([ids, -ids], axis=1)})
        first += n
    spec = [ColumnSpec("x", "int64", (2,))]
    write_rows(path, spec, blocks, rows_per_shard=max(rows_per_shard))
    return path


def ids(batch: torch.Tensor) -> list[int]:
    assert torch.equal(batch[:, 1], -batch[:, 0])  # rows are whole, never torn
    return batch[:, 0].tolist()


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Shards of one size each (the writer cuts at max rows), last one short: 7 x 97 + 50 rows.
    return id_dataset(tmp_path_factory.mktemp("ids") / "ds", [97] * 7 + [50])


@pytest.mark.parametrize("world, batch", [(1, 1), (2, 8), (3, 5), (8, 4)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_an_epoch_reads_every_kept_row_once_and_ranks_get_equal_batches(
        uneven: Path, world: int, batch: int, shuffle: bool) -> None:
    loaders = [BatchLoader(uneven, "x", rank=r, world_size=world, batch_size=batch, seed=5,
                           shuffle=shuffle, shuffle_window=64) for r in range(world)]
    assert len({len(loader) for loader in loaders}) == 1
    seen = [i for loader in loaders for _ in range(len(loader)) for i in ids(next(loader))]
    total = loaders[0].num_rows
    assert len(seen) == len(set(seen)) == total - dropped_window(total, world, batch, 5, 0)[1]
    for loader in loaders:
        assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batch_index"] == 0
        loader.close()


def test_shuffling_changes_the_order_not_the_epoch(uneven: Path) -> None:
    def epoch(shuffle: bool, which: int) -> list[int]:
        loader = BatchLoader(uneven, "x", rank=0, world_size=1, batch_size=4, seed=1,
                             shuffle=shuffle, shuffle_window=100)
        loader.load_state_dict({**loader.state_dict(), "epoch": which})
        out = [i for _ in range(len(loader)) for i in ids(next(loader))]
        loader.close()
        return out

    plain, shuffled, other = epoch(False, 0), epoch(True, 0), epoch(True, 1)
    assert sorted(plain) == sorted(shuffled) and plain != shuffled and shuffled != other
    assert plain == sorted(plain)  # unshuffled: manifest order


@pytest.mark.parametrize("world", [1, 3])
def test_batches_are_the_documented_window_shuffle(uneven: Path, world: int) -> None:
    """Each batch holds exactly the rows ``datapipe.split.batch_positions`` names (the loader
    plans a window's batches at once), in file order, and windows that straddle shards give
    batches mixing rows of several shards."""
    rank = world - 1
    loader = BatchLoader(uneven, "x", rank=rank, world_size=world, batch_size=8, seed=3,
                         shuffle=True, shuffle_window=64)
    shard_first = np.cumsum([0] + loader.source.shard_rows)
    mixed = 0
    for epoch in range(2):
        span = [int(shard_first[r.shard]) + row for r in loader.ranges(epoch)
                for row in range(r.start, r.stop)]
        for k in range(len(loader)):
            got = ids(next(loader))
            assert got == [span[p] for p in loader.positions(epoch, k)]
            mixed += len({int(np.searchsorted(shard_first, i, side="right")) for i in got}) > 1
    assert mixed > 0
    loader.close()


@pytest.mark.parametrize("staging", ["direct", "staged"])
def test_resume_at_random_points_gives_the_uninterrupted_sequence(
        uneven: Path, staging: str) -> None:
    def loader() -> BatchLoader:
        return BatchLoader(uneven, "x", rank=1, world_size=2, batch_size=6, seed=11,
                           shuffle_window=40, staging=staging)

    reference = loader()
    total = 2 * len(reference) + 3  # crosses two epoch boundaries
    expected = [ids(next(reference)) for _ in range(total)]
    reference.close()
    rng = random.Random(0)
    for cut in [0, len(reference), *rng.sample(range(1, total), 6)]:
        first = loader()
        seen = [ids(next(first)) for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
        first.close()
        resumed = loader()
        resumed.load_state_dict(state)
        seen += [ids(next(resumed)) for _ in range(total - cut)]
        resumed.close()
        assert seen == expected, f"resumed after {cut} batches"


def _read_from(dataset: Path, state: dict | None, world: int, batch: int, count: int | None,
               shuffle: bool) -> tuple[list[int], dict]:
    """Loaders of ``world`` ranks resume from ``state`` (None: the start) and each reads
    ``count`` batches (None: to the end of the epoch); the ids read and rank 0's state after."""
    loaders = [BatchLoader(dataset, "x", rank=r, world_size=world, batch_size=batch, seed=9,
                           shuffle=shuffle, shuffle_window=40) for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    epoch = loaders[0].state_dict()["epoch"]
    read = []
    for loader in loaders:
        todo = loader.batches_in(epoch) - loader.batch_index if count is None else count
        read += [i for _ in range(todo) for i in ids(next(loader))]
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states)  # rank 0's checkpoint serves every rank
    for loader in loaders:
        loader.close()
    return read, states[0]


@pytest.mark.parametrize("sizes", [[(4, 6), (2, 6)], [(2, 6), (1, 6)], [(1, 6), (2, 6)],
                                   [(4, 5), (2, 6), (3, 4)]])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_resize_mid_epoch_reads_every_remaining_row_once(
        uneven: Path, sizes: list[tuple[int, int]], shuffle: bool) -> None:
    """4 -> 2, 2 -> 1 and 1 -> 2 workers (and 4 -> 2 -> 3 with batch sizes changing): the
    rows read before and after each change are distinct, fewer than one batch per new rank is
    dropped at each change, and the next epoch is whole at the new size."""
    total = sum(ShardSource(uneven, "x").shard_rows)
    state, read = None, []
    for world, batch in sizes[:-1]:
        got, state = _read_from(uneven, state, world, batch, 3, shuffle)
        read += got
    world, batch = sizes[-1]
    rest, after = _read_from(uneven, state, world, batch, None, shuffle)
    read += rest
    assert len(read) == len(set(read)), "a row was read twice across the resize"
    first_drop = dropped_window(total, *sizes[0], 9, 0)[1]
    remainders = sum(w * b for w, b in sizes[1:])  # each change drops fewer than this
    assert total - first_drop - remainders < len(read) <= total - first_drop
    assert after["epoch"] == 1 and after["batch_index"] == 0 and after["segments"] == []
    next_epoch, _ = _read_from(uneven, after, world, batch, None, shuffle)
    assert len(set(next_epoch)) == len(next_epoch) == total - dropped_window(
        total, world, batch, 9, 1)[1]


def test_a_resized_epoch_resumes_exactly_within_itself(uneven: Path) -> None:
    """A state saved inside an epoch that was resized carries its segments: resuming at the
    same size again gives exactly the batches an uninterrupted resized epoch gives."""
    _, state = _read_from(uneven, None, 4, 6, 3, True)
    whole, _ = _read_from(uneven, state, 2, 6, None, True)
    part, middle = _read_from(uneven, state, 2, 6, 2, True)
    assert middle["segments"] == [[4, 6, 3]] and middle["batch_index"] == 2
    rest, _ = _read_from(uneven, middle, 2, 6, None, True)
    assert sorted(part + rest) == sorted(whole)


@pytest.mark.parametrize("key, value", [("seed", 1), ("shuffle", False),
                                        ("shuffle_window", 64)])
def test_a_state_with_another_order_is_refused(uneven: Path, key: str, value: object) -> None:
    """What decides which rows were read must match: seed, shuffle and the shuffle window."""
    state = BatchLoader(uneven, "x", rank=0, world_size=2, batch_size=4, seed=0,
                        shuffle_window=32).state_dict()
    other = BatchLoader(uneven, "x", rank=0, world_size=1, batch_size=4,
                        **{"seed": 0, "shuffle": True, "shuffle_window": 32, key: value})
    with pytest.raises(ValueError, match=f"{key}={state[key]} but this run has {key}={value}"):
        other.load_state_dict(state)


def test_the_staged_path_reuses_buffers_allocated_once(uneven: Path) -> None:
    """The CUDA branch's ring logic (slots, copy events, prefetch depth) with CPU stand-ins."""
    direct = BatchLoader(uneven, "x", rank=0, world_size=1, batch_size=8, seed=2)
    staged = BatchLoader(uneven, "x", rank=0, world_size=1, batch_size=8, seed=2,
                         staging="staged", prefetch=2)
    transfer = staged._transfer
    assert transfer is not None and direct._transfer is None
    buffers = [slot.host.data_ptr() for slot in transfer.slots]
    assert len(buffers) == 2 + 2  # copies ahead, the one handed out, one being filled
    for _ in range(3 * len(direct)):
        assert torch.equal(next(direct), next(staged))
    assert [slot.host.data_ptr() for slot in transfer.slots] == buffers  # never reallocated
    assert transfer.copies == 3 * len(direct) + 2  # one copy per batch, 2 copied ahead
    assert staged.pinned_bytes == 0 and direct.pinned_bytes == 0  # CPU: nothing pinned
    direct.close()
    staged.close()


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("staging", ["direct", "staged"])
def test_ranges_across_record_batches_are_views_onto_the_memory_map(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool, staging: str) -> None:
    monkeypatch.setattr(writer, "BATCH_BYTES", 16 * 10)  # 10 rows of 16 bytes per batch
    path = id_dataset(tmp_path / "ds", [35, 35])
    reader = pa.ipc.open_file(pa.memory_map(str(path / "shard-00000.arrow")))
    assert reader.num_record_batches == 4
    source = ShardSource(path, "x")
    parts = source.read(Range(0, 7, 33))
    assert [len(p) for p in parts] == [3, 10, 10, 3]
    assert all(not p.flags.owndata for p in parts)  # zero-copy
    assert np.concatenate(parts)[:, 0].tolist() == list(range(7, 33))
    # Batches of 7 from record batches of 10: most batches are copied from two of them.
    loader = BatchLoader(path, "x", rank=0, world_size=1, batch_size=7, seed=0,
                         shuffle=shuffle, shuffle_window=21, staging=staging)
    seen = [i for _ in range(len(loader)) for i in ids(next(loader))]
    assert sorted(seen) == list(range(70))
    assert (seen == sorted(seen)) is not shuffle
    loader.close()


def test_vision_shaped_columns_load_as_tensors(tmp_path: Path) -> None:
    images = np.random.default_rng(0).integers(0, 255, (40, 3, 8, 8), dtype=np.uint8)
    labels = np.arange(40, dtype=np.int64)
    write_rows(tmp_path / "img", [ColumnSpec("image", "uint8", (3, 8, 8)),
                                  ColumnSpec("label", "int64", ())],
               [{"image": images, "label": labels}], rows_per_shard=16)
    loader = BatchLoader(tmp_path / "img", "image", rank=0, world_size=1, batch_size=5,
                         seed=0, shuffle=False)
    batch = next(loader)
    assert batch.shape == (5, 3, 8, 8) and batch.dtype == torch.uint8
    np.testing.assert_array_equal(batch.numpy(), images[:5])
    labels_loader = BatchLoader(tmp_path / "img", "label", rank=0, world_size=1, batch_size=5,
                                seed=0, shuffle=False)
    assert next(labels_loader).tolist() == [0, 1, 2, 3, 4]
    loader.close()
    labels_loader.close()


def test_reading_ahead_is_bounded_and_crosses_epochs(uneven: Path) -> None:
    loader = BatchLoader(uneven, "x", rank=0, world_size=1, batch_size=4, seed=0,
                         shuffle_window=200, read_ahead=3)
    windows_per_epoch = -(-len(loader) * 4 // 200)
    for _ in range(3 * len(loader)):
        next(loader)
        reader = loader._reader
        assert reader is not None and len(reader.pending) <= 3  # memory: bounded windows
    assert windows_per_epoch == 4 and reader.next_epoch == 3  # already reading epoch 3
    loader.close()


def _evict(dataset: Path) -> bool:
    """Drop the shards' pages from the page cache (clean pages that no process maps); whether
    the kernel did, checked on a fresh map of the first shard's middle page."""
    import mmap
    import os

    from datapipe import shards

    for file in dataset.glob("*.arrow"):
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    with open(dataset / "shard-00000.arrow", "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapped, dtype=np.uint8)
    address = view.__array_interface__["data"][0]
    middle = address + len(mapped) // 2 // mmap.PAGESIZE * mmap.PAGESIZE
    cached = shards._resident(middle)
    del view
    mapped.close()
    return not cached


def test_only_a_shuffled_window_outside_the_page_cache_is_advised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shuffled window reads its rows in random order, so the kernel is asked to read it
    ahead (``madvise(WILLNEED)``) when it is not cached, and not asked when it is (the advice
    walks every page); an unshuffled loader's sequential faults get the kernel's own read-ahead
    and are never advised. The real page cache and libc, with the calls recorded."""
    from datapipe import shards

    if shards._libc is None:
        pytest.skip("this platform has no madvise/mincore: windows are read without advice")
    # Two shards of 32 MiB, one record batch each, rows of one page: opening a shard reads
    # its metadata at both ends, and the kernel reads around those faults (up to read_ahead_kb,
    # 8 MiB on this project's VM), which never reaches a 16 MiB window's middle page.
    monkeypatch.setattr(writer, "BATCH_BYTES", 64 << 20)
    page_rows = np.zeros((8192, 4096), dtype=np.uint8)
    path = tmp_path / "ds"
    write_rows(path, [ColumnSpec("x", "uint8", (4096,))], [{"x": page_rows}] * 2,
               rows_per_shard=8192)
    advised: list[int] = []

    class Recorded:
        def __init__(self, libc: object):
            self.libc = libc

        def mincore(self, *args: object) -> int:
            return self.libc.mincore(*args)  # type: ignore[attr-defined]

        def madvise(self, address: int, length: int, advice: int) -> int:
            advised.append(length)
            return self.libc.madvise(address, length, advice)  # type: ignore[attr-defined]

    monkeypatch.setattr(shards, "_libc", Recorded(shards._libc))

    def first_batches(shuffle: bool) -> list[int]:
        advised.clear()
        loader = BatchLoader(path, "x", rank=0, world_size=1, batch_size=256, seed=0,
                             shuffle=shuffle, shuffle_window=4096, read_ahead=2)
        next(loader)
        loader.close()
        return list(advised)

    if not _evict(path):
        pytest.skip("the kernel kept the shards cached after POSIX_FADV_DONTNEED")
    assert first_batches(shuffle=False) == []
    if not _evict(path):
        pytest.skip("the kernel kept the shards cached after POSIX_FADV_DONTNEED")
    # Two windows read (the current one and one ahead), 16 MiB each from their first page.
    advice = first_batches(shuffle=True)
    assert len(advice) == 2 and all(16 << 20 <= n < (16 << 20) + 4096 for n in advice), advice
    loader = BatchLoader(path, "x", rank=0, world_size=1, batch_size=256, seed=0,
                         shuffle_window=4096)
    for _ in range(len(loader)):  # every page cached
        next(loader)
    loader.close()
    assert first_batches(shuffle=True) == []


def test_a_remote_range_reads_only_the_record_batches_it_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The object store is stood in for by the local disk behind a URI scheme, with a file
    object that counts the bytes pyarrow reads (the S3 path itself: tests/e2e/test_s3.py)."""
    from pyarrow import fs

    from datapipe import manifest, shards

    monkeypatch.setattr(writer, "BATCH_BYTES", 16 * 100)  # 100 rows per record batch
    path = id_dataset(tmp_path / "ds", [1000])
    assert manifest.read_manifest(path).shards[0].batch_rows == 100
    read = {"bytes": 0}

    class Counting(fs.LocalFileSystem):
        def open_input_file(self, p: str):  # type: ignore[override]
            inner = super().open_input_file(p)

            class File:
                closed = False

                def __getattr__(self, name: str):
                    method = getattr(inner, name)
                    if not name.startswith("read"):
                        return method

                    def counted(*args, **kwargs):
                        data = method(*args, **kwargs)
                        read["bytes"] += len(data) if hasattr(data, "__len__") else data
                        return data
                    return counted

            return pa.PythonFile(File(), mode="r")

    def local(uri: str):
        return Counting(), uri.removeprefix("store://")

    monkeypatch.setattr(manifest, "remote_filesystem", local)
    monkeypatch.setattr(shards, "remote_filesystem", local)
    source = ShardSource(f"store://{path}", "x")
    assert source.remote
    parts = source.read(Range(0, 850, 950))
    assert np.concatenate(parts)[:, 0].tolist() == list(range(850, 950))
    # Two record batches of 1,600 bytes (rows 800-899 and 900-999) plus the footer; reading
    # from the first batch would take about 10 x 1,600.
    assert read["bytes"] < 5 * 1600
