from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from datapipe.corpus import build_stdlib_corpus, stdlib_source_files
from datapipe.loader import ArrowRows, BatchLoader, rank_indices
from datapipe.manifest import MANIFEST_NAME, ColumnSpec, DatasetError, read_manifest
from datapipe.writer import write_rows


def test_corpus_is_real_stdlib_source_and_deterministic(tmp_path: Path) -> None:
    a = build_stdlib_corpus(tmp_path / "a", seq_len=32, max_bytes=100_000, rows_per_shard=500)
    b = build_stdlib_corpus(tmp_path / "b", seq_len=32, max_bytes=100_000, rows_per_shard=500)
    assert [s.sha256 for s in a["train"].shards] == [s.sha256 for s in b["train"].shards]
    assert (tmp_path / "a/train" / MANIFEST_NAME).read_bytes() == \
        (tmp_path / "b/train" / MANIFEST_NAME).read_bytes()
    assert a["train"].num_rows == 100_000 // 33
    assert len(a["train"].shards) == -(-a["train"].num_rows // 500)
    # The rows are the standard library's bytes, in order.
    first = ArrowRows(tmp_path / "a/train", "tokens").gather(np.array([0]))[0]
    train_files = [f for i, f in enumerate(stdlib_source_files()) if i % 20]
    assert bytes(first) == train_files[0].read_bytes()[:33]


def test_manifest_is_published_last_and_readers_trust_only_it(tmp_path: Path) -> None:
    spec = [ColumnSpec("x", "int32", (4,))]
    with pytest.raises(DatasetError, match="missing"):
        read_manifest(tmp_path)  # exists, no manifest
    with pytest.raises(DatasetError, match="does not exist"):
        read_manifest(tmp_path / "nope")

    def blocks():
        yield {"x": np.zeros((10, 4), np.int32)}
        # While the writer is still going, no manifest exists: the dataset is not readable.
        assert not (tmp_path / "ds" / MANIFEST_NAME).exists()
        assert any((tmp_path / "ds").glob("shard-*.arrow"))
        yield {"x": np.ones((5, 4), np.int32)}

    manifest = write_rows(tmp_path / "ds", spec, blocks(), rows_per_shard=6)
    assert [s.num_rows for s in manifest.shards] == [6, 6, 3]
    assert json.loads((tmp_path / "ds" / MANIFEST_NAME).read_text())["format_version"] == 1


def test_wrong_dtype_or_shape_is_refused(tmp_path: Path) -> None:
    spec = [ColumnSpec("x", "int32", (4,))]
    with pytest.raises(DatasetError, match="expected int32"):
        write_rows(tmp_path / "ds", spec, [{"x": np.zeros((3, 4), np.int64)}], 10)


@pytest.mark.parametrize("num_rows", [1, 7, 64, 1000, 1003])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("batch_size", [1, 4, 5])
def test_rank_split_reads_each_row_at_most_once_with_equal_batches(
        num_rows: int, world_size: int, batch_size: int) -> None:
    parts = [rank_indices(num_rows, r, world_size, batch_size, seed=3, epoch=1)
             for r in range(world_size)]
    assert len({p.shape for p in parts}) == 1  # every rank: the same number of batches
    seen = np.concatenate([p.ravel() for p in parts])
    assert len(seen) == len(np.unique(seen))  # no row twice
    dropped = num_rows - len(seen)
    assert 0 <= dropped < world_size * batch_size  # only the documented remainder is dropped


def test_shuffle_changes_order_not_the_multiset() -> None:
    plain = rank_indices(100, 0, 1, 10, seed=0, epoch=0, shuffle=False).ravel()
    shuffled = rank_indices(100, 0, 1, 10, seed=0, epoch=0).ravel()
    other_epoch = rank_indices(100, 0, 1, 10, seed=0, epoch=1).ravel()
    assert sorted(shuffled) == sorted(plain) == list(range(100))
    assert list(shuffled) != list(plain) and list(shuffled) != list(other_epoch)


def test_gather_matches_arrow_and_spans_shards(corpus_dir: Path) -> None:
    rows = ArrowRows(corpus_dir / "train", "tokens")
    indices = np.array([0, 999, 1000, rows.num_rows - 1, 5])
    table = pa.concat_tables(
        pa.ipc.open_file(pa.memory_map(str(corpus_dir / "train" / s.path))).read_all()
        for s in rows.manifest.shards)
    expected = np.stack([np.array(table.column("tokens")[int(i)].as_py(), np.uint8)
                         for i in indices])
    np.testing.assert_array_equal(rows.gather(indices), expected)


def test_loader_resumes_exactly_mid_epoch_and_across_epochs(corpus_dir: Path) -> None:
    def loader() -> BatchLoader:
        return BatchLoader(corpus_dir / "train", "tokens", rank=1, world_size=2, batch_size=4,
                           seed=7)

    reference = loader()
    n = len(reference) + 5  # crosses an epoch boundary
    expected = [next(reference) for _ in range(n)]
    for cut in (0, 3, len(reference) - 1, len(reference) + 2):
        first = loader()
        seen = [next(first) for _ in range(cut)]
        resumed = loader()
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        seen += [next(resumed) for _ in range(n - cut)]
        for a, b in zip(seen, expected, strict=True):
            assert torch.equal(a, b)


def test_loader_refuses_a_state_from_another_world_size(corpus_dir: Path) -> None:
    state = BatchLoader(corpus_dir / "train", "tokens", rank=0, world_size=2, batch_size=4,
                        seed=0).state_dict()
    other = BatchLoader(corpus_dir / "train", "tokens", rank=0, world_size=1, batch_size=4,
                        seed=0)
    with pytest.raises(ValueError, match="world_size=2 but this run has world_size=1"):
        other.load_state_dict(state)


def test_shard_that_disagrees_with_manifest_is_named(tmp_path: Path) -> None:
    spec = [ColumnSpec("x", "int32", (4,))]
    write_rows(tmp_path / "ds", spec, [{"x": np.zeros((10, 4), np.int32)}], 6)
    shard = tmp_path / "ds" / "shard-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:50])  # truncated
    with pytest.raises(DatasetError, match="shard-00001.arrow: cannot be read"):
        ArrowRows(tmp_path / "ds", "x")


def test_verify_finds_checksum_size_and_missing_shard_problems(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    from datapipe.manifest import verify_dataset

    spec = [ColumnSpec("x", "int32", (4,))]
    write_rows(tmp_path / "ds", spec, [{"x": np.arange(120, dtype=np.int32).reshape(30, 4)}], 10)
    assert verify_dataset(tmp_path / "ds") == []
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "ds", bad)
    flipped = bytearray((bad / "shard-00000.arrow").read_bytes())
    flipped[-100] ^= 0xFF  # same size, different bytes
    (bad / "shard-00000.arrow").write_bytes(bytes(flipped))
    (bad / "shard-00001.arrow").write_bytes(b"short")
    (bad / "shard-00002.arrow").unlink()
    problems = verify_dataset(bad)
    assert len(problems) == 3
    assert "shard-00000.arrow: checksum" in problems[0]
    assert "shard-00001.arrow: 5 bytes" in problems[1]
    assert "shard-00002.arrow: missing" in problems[2]
    result = subprocess.run([sys.executable, "-m", "trainer.cli", "data", "verify", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"memtrain: error: {problems[0]} (3 bad of 3 shards)"]
