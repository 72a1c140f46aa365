from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from datapipe.corpus import build_stdlib_corpus, stdlib_source_files
from datapipe.manifest import MANIFEST_NAME, ColumnSpec, DatasetError, read_manifest
from datapipe.shards import ShardSource
from datapipe.split import Range
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
    [first] = ShardSource(tmp_path / "a/train", "tokens").read(Range(0, 0, 1))[0]
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


def test_verify_finds_checksum_size_and_missing_shard_problems(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    from datapipe.shards import verify_dataset

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


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int16", "float16", "int64", "float64"])
def test_a_shard_reads_back_the_rows_written_across_its_record_batches(
        tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are read as views of the shard's values (bits for bool, a copy): any range, within
    a record batch or across several, is the rows written, in their dtype and shape."""
    import datapipe.writer

    spec = [ColumnSpec("x", dtype, (2, 3))]
    monkeypatch.setattr(datapipe.writer, "BATCH_BYTES", 13 * 6 * np.dtype(dtype).itemsize)
    rows = (np.arange(40 * 6).reshape(40, 2, 3) % 7).astype(dtype)
    write_rows(tmp_path / "ds", spec, [{"x": rows}], 40)
    source = ShardSource(tmp_path / "ds", "x")
    assert [len(batch) for batch in source._views[0]] == [13, 13, 13, 1]
    for start, stop in ((0, 40), (5, 13), (11, 29), (39, 40)):
        parts = source.read(Range(0, start, stop))
        got = np.concatenate(parts)
        assert got.dtype == np.dtype(dtype) and got.shape == (stop - start, 2, 3)
        assert np.array_equal(got, rows[start:stop]), (start, stop)


def test_reading_a_shard_imports_neither_pandas_nor_pyarrows_compute(tmp_path: Path) -> None:
    """pyarrow's ``to_numpy`` imports pandas on its first call where it is installed (Ray
    installs it), and ``flatten`` pyarrow.compute: about 0.4 s of CPU in every worker process
    that reads data, for nothing numpy cannot do."""
    import subprocess
    import sys

    write_rows(tmp_path / "ds", [ColumnSpec("x", "uint16", (4,))],
               [{"x": np.arange(40, dtype=np.uint16).reshape(10, 4)}], 10)
    code = ("import sys\nfrom datapipe.shards import ShardSource\n"
            "from datapipe.split import Range\n"
            f"ShardSource({str(tmp_path / 'ds')!r}, 'x').read(Range(0, 2, 7))\n"
            "print(sorted({'pandas', 'pyarrow.compute'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
