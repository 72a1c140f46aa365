"""`memtrain data write`: Parquet, JSON lines, text and numpy into memtrain datasets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datapipe.convert import write_dataset
from datapipe.loader import BatchLoader
from datapipe.manifest import DatasetError, read_manifest
from datapipe.shards import verify_dataset

pytestmark = pytest.mark.unit


def read_all(path: Path, column: str) -> np.ndarray:
    loader = BatchLoader(path, column, rank=0, world_size=1, batch_size=1, seed=0,
                         shuffle=False)
    rows = np.concatenate([next(loader).numpy() for _ in range(len(loader))])
    loader.close()
    return rows


def test_parquet_with_list_and_scalar_columns(tmp_path: Path) -> None:
    tokens = np.arange(300 * 9, dtype=np.int32).reshape(300, 9)
    table = pa.table({"tokens": pa.array(list(tokens)), "label": np.arange(300),
                      "text": ["ignored"] * 300})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=64)
    manifest = write_dataset([tmp_path / "in.parquet"], tmp_path / "ds",
                             columns=["tokens", "label"], shard_bytes=2000)
    assert [(c.name, c.dtype, c.shape) for c in manifest.columns] == [
        ("tokens", "int32", (9,)), ("label", "int64", ())]
    assert len(manifest.shards) == -(-300 // (2000 // (9 * 4 + 8)))
    np.testing.assert_array_equal(read_all(tmp_path / "ds", "tokens"), tokens)
    np.testing.assert_array_equal(read_all(tmp_path / "ds", "label"), np.arange(300))
    checked: list[int] = []  # what data verify's progress bar is told, shard by shard
    assert verify_dataset(tmp_path / "ds", checked.append) == []
    assert len(checked) == len(manifest.shards) and sum(checked) == manifest.num_bytes


def test_json_lines_with_nested_lists(tmp_path: Path) -> None:
    rows = [{"image": [[i, i + 1], [i + 2, i + 3]], "label": i % 3} for i in range(50)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = write_dataset([tmp_path / "in.jsonl"], tmp_path / "ds")
    assert {c.name: c.shape for c in manifest.columns} == {"image": (2, 2), "label": ()}
    image = read_all(tmp_path / "ds", "image")
    assert image.shape == (50, 2, 2) and image[7].tolist() == [[7, 8], [9, 10]]


def test_text_files_become_byte_token_rows_deterministically(tmp_path: Path) -> None:
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "b.txt").write_bytes(b"world " * 50)
    (tmp_path / "txt" / "a.txt").write_bytes(b"hello " * 50)
    a = write_dataset([tmp_path / "txt"], tmp_path / "a", seq_len=15, shard_bytes=64)
    b = write_dataset([tmp_path / "txt"], tmp_path / "b", seq_len=15, shard_bytes=64)
    assert a.to_json() == b.to_json()  # byte-identical shards (same checksums)
    rows = read_all(tmp_path / "a", "tokens")
    assert rows.shape == (600 // 16, 16) and rows.dtype == np.uint8
    assert bytes(rows[0]) == b"hello hello hell"  # sorted path order: a.txt first
    assert len(a.shards) == -(-len(rows) // 4)


def test_numpy_npz_gives_an_image_and_label_dataset(tmp_path: Path) -> None:
    images = np.random.default_rng(0).integers(0, 256, (70, 3, 4, 4), dtype=np.uint8)
    np.savez(tmp_path / "in.npz", image=images, label=np.arange(70, dtype=np.int64))
    manifest = write_dataset([tmp_path / "in.npz"], tmp_path / "ds", shard_bytes=1000)
    assert {c.name: (c.dtype, c.shape) for c in manifest.columns} == {
        "image": ("uint8", (3, 4, 4)), "label": ("int64", ())}
    np.testing.assert_array_equal(read_all(tmp_path / "ds", "image"), images)
    np.save(tmp_path / "x.npy", np.ones((10, 5), np.float32))
    manifest = write_dataset([tmp_path / "x.npy"], tmp_path / "npy", column="x")
    assert manifest.columns[0].shape == (5,) and manifest.num_rows == 10


@pytest.mark.parametrize("rows, message", [
    ([{"t": [1, 2]}, {"t": [1, 2, 3]}], "column 't' is ragged: row 1 has 3 values, row 0 has 2"),
    ([{"t": "text"}], "column 't' is string; memtrain datasets hold numbers"),
])
def test_columns_that_are_not_fixed_shape_numbers_are_named(
        tmp_path: Path, rows: list[dict], message: str) -> None:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=message.replace("(", r"\(")):
        write_dataset([tmp_path / "in.jsonl"], tmp_path / "ds")
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_an_existing_dataset_is_kept_unless_overwrite(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.ones((10, 5), np.float32))
    write_dataset([tmp_path / "x.npy"], tmp_path / "ds", column="x")
    with pytest.raises(DatasetError, match="already holds a dataset: pass --overwrite"):
        write_dataset([tmp_path / "x.npy"], tmp_path / "ds", column="x")
    np.save(tmp_path / "x.npy", np.zeros((20, 5), np.float32))
    write_dataset([tmp_path / "x.npy"], tmp_path / "ds", column="x", overwrite=True)
    assert read_manifest(tmp_path / "ds").num_rows == 20


def test_the_cli_writes_and_reports_errors_in_one_line(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.ones((10, 5), np.float32))
    cli = [sys.executable, "-m", "trainer.cli", "data", "write"]
    ok = subprocess.run([*cli, str(tmp_path / "x.npy"), "--out", str(tmp_path / "ds"),
                         "--column", "x", "--shard-size", "100B"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "10 rows (x float32[5]) in 2 shards" in " ".join(ok.stdout.split())  # 5 rows each
    bad = subprocess.run([*cli, str(tmp_path / "nope.npy"), "--out", str(tmp_path / "ds2")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"memtrain: error: input {tmp_path / 'nope.npy'} does not exist"
