"""The bad-data catalogue: each case is an error naming the shard (or path), or with
``on_bad_shard: skip`` a shard left out, logged and counted, the rest still read."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from datapipe.loader import BatchLoader
from datapipe.manifest import MANIFEST_NAME, ColumnSpec, DatasetError
from datapipe.writer import write_rows

pytestmark = pytest.mark.unit
SPEC = [ColumnSpec("x", "int32", (4,))]


def dataset(path: Path) -> Path:
    rows = np.arange(4 * 40, dtype=np.int32).reshape(40, 4)
    write_rows(path, SPEC, [{"x": rows}], rows_per_shard=10)  # 4 shards of 10 rows
    return path


def truncate(path: Path) -> None:
    shard = path / "shard-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:60])


def other_schema(path: Path) -> None:
    flat = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(40, np.float32)), 4)
    table = pa.table({"x": flat})
    with pa.OSFile(str(path / "shard-00001.arrow"), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema) as out:
        out.write_table(table)
    # The manifest agrees on size and checksum: only the schema is wrong.
    from datapipe.manifest import sha256_file

    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["shards"][1].update(num_bytes=(path / "shard-00001.arrow").stat().st_size,
                                 sha256=sha256_file(path / "shard-00001.arrow"))
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


def wrong_rows(path: Path) -> None:
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["shards"][1]["num_rows"] = 12
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


def missing(path: Path) -> None:
    (path / "shard-00001.arrow").unlink()


def unreadable(path: Path) -> None:  # not a file at all (chmod does not stop root, as in CI)
    (path / "shard-00001.arrow").unlink()
    (path / "shard-00001.arrow").mkdir()


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (truncate, "shard-00001.arrow: 60 bytes, the manifest says"),
    "schema differs": (other_schema, "shard-00001.arrow: column 'x' is fixed_size_list<item: "
                                     "float>[4], the manifest says"),
    "row count": (wrong_rows, "shard-00001.arrow: has 10 rows, the manifest says 12"),
    "missing": (missing, "shard-00001.arrow: missing"),
    "unreadable": (unreadable, "shard-00001.arrow: cannot be read"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_shard_is_an_error_naming_it(case: str, tmp_path: Path) -> None:
    damage, message = CASES[case]
    path = dataset(tmp_path / "ds")
    damage(path)
    with pytest.raises(DatasetError, match=message.replace("[", r"\[").replace("]", r"\]")):
        BatchLoader(path, "x", rank=0, world_size=1, batch_size=5, seed=0)


@pytest.mark.parametrize("case", list(CASES))
def test_with_skip_the_bad_shard_is_left_out_logged_and_counted(
        case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    damage, message = CASES[case]
    path = dataset(tmp_path / "ds")
    damage(path)
    with caplog.at_level(logging.WARNING, logger="memtrain.data"):
        loaders = [BatchLoader(path, "x", rank=r, world_size=2, batch_size=5, seed=0,
                               on_bad_shard="skip") for r in range(2)]
    assert [loader.skipped_shards for loader in loaders] == [1, 1]  # every rank agrees
    assert "skipping bad shard" in caplog.text and "shard-00001.arrow" in caplog.text
    assert [len(loader) for loader in loaders] == [3, 3]  # 30 good rows, 2 ranks x 5
    rows = np.concatenate([next(loader).numpy() for loader in loaders for _ in range(3)])
    assert sorted(rows[:, 0] // 4) == [i for i in range(40) if not 10 <= i < 20]
    for loader in loaders:
        loader.close()


def test_an_empty_dataset_is_refused(tmp_path: Path) -> None:
    path = dataset(tmp_path / "ds")
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["shards"] = []
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="the dataset is empty"):
        BatchLoader(path, "x", rank=0, world_size=1, batch_size=5, seed=0)


def test_every_shard_bad_under_skip_is_still_an_error(tmp_path: Path) -> None:
    path = dataset(tmp_path / "ds")
    for shard in path.glob("shard-*.arrow"):
        shard.unlink()
    with pytest.raises(DatasetError, match="every shard is bad"):
        BatchLoader(path, "x", rank=0, world_size=1, batch_size=5, seed=0, on_bad_shard="skip")


def test_a_nonexistent_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=f"dataset path {tmp_path / 'nope'} does not exist"):
        BatchLoader(tmp_path / "nope", "x", rank=0, world_size=1, batch_size=5, seed=0)


def test_fewer_rows_than_one_batch_per_rank_is_named(tmp_path: Path) -> None:
    path = dataset(tmp_path / "ds")
    with pytest.raises(DatasetError, match="40 rows are fewer than one batch per rank"):
        BatchLoader(path, "x", rank=0, world_size=8, batch_size=6, seed=0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_a_file_without_read_permission_is_named(tmp_path: Path) -> None:
    path = dataset(tmp_path / "ds")
    (path / "shard-00001.arrow").chmod(0)
    with pytest.raises(DatasetError, match="shard-00001.arrow: cannot be read"):
        BatchLoader(path, "x", rank=0, world_size=1, batch_size=5, seed=0)


@pytest.mark.slow
def test_training_on_a_bad_shard_is_one_line_exit_2(tmp_path: Path, corpus_dir: Path) -> None:
    import shutil

    from tests.conftest import tiny_train_command

    bad = tmp_path / "train"
    shutil.copytree(corpus_dir / "train", bad)
    truncate(bad)
    out = subprocess.run(tiny_train_command(corpus_dir, tmp_path, f"data.path={bad}",
                                            "train.steps=2"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()[-1:]
    assert line.startswith("memtrain: error: shard ") and "shard-00001.arrow" in line
    assert "Traceback" not in out.stderr
