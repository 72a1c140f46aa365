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
