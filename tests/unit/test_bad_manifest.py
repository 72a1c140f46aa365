"""The adversarial dataset catalogue: manifests and shards that must never get through.

Each case alters a dataset written by ``memtrain``'s own writer, then runs ``memtrain data
verify`` as a user would: one line naming the manifest or shard (and the field), exit 2. The
loader (what ``memtrain train`` reads with) must refuse the same datasets. For the path escapes,
an audit hook in the CLI's process records every file it opens: the file outside the dataset is
never among them, because the path check runs before any shard is opened.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from datapipe.manifest import MANIFEST_NAME, ColumnSpec, DatasetError, ShardInfo, shard_location
from datapipe.shards import ShardSource
from datapipe.writer import write_rows
from tests.conftest import REPO

SPEC = [ColumnSpec("x", "int32", (4,))]
OUTSIDE = "outside.arrow"  # a file beside the dataset, never to be opened through it


def dataset(path: Path, offset: int = 0) -> Path:
    rows = np.arange(4 * 40, dtype=np.int32).reshape(40, 4) + offset
    write_rows(path, SPEC, [{"x": rows}], rows_per_shard=10)  # 4 shards of 10 rows
    return path


def edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        change(manifest)
        (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    return apply


def shard_field(field: str, value: object, index: int = 1) -> Callable[[Path], None]:
    return edit(lambda m: m["shards"][index].__setitem__(field, value))


def column_field(field: str, value: object) -> Callable[[Path], None]:
    return edit(lambda m: m["columns"][0].__setitem__(field, value))


def rewrite_shard(table: pa.Table) -> Callable[[Path], None]:
    """Replace shard 1 and update its size and checksum: a consistent manifest of a shard that
    is wrong in itself."""
    def apply(path: Path) -> None:
        from datapipe.manifest import sha256_file

        file = path / "shard-00001.arrow"
        with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
            out.write_table(table)
        shard_field("num_bytes", file.stat().st_size)(path)
        shard_field("sha256", sha256_file(file))(path)
    return apply


def other_datasets_shard(path: Path) -> None:
    other = dataset(path.parent / "other", offset=1000)
    (path / "shard-00001.arrow").write_bytes((other / "shard-00001.arrow").read_bytes())


def zero_bytes(path: Path) -> None:
    (path / "shard-00001.arrow").write_bytes(b"")


def symlink_out(path: Path) -> None:
    (path / "shard-00001.arrow").unlink()
    (path / "shard-00001.arrow").symlink_to(path.parent / OUTSIDE)


def malformed(path: Path) -> None:
    (path / MANIFEST_NAME).write_text('{"format_version": 1, "columns": [')


_flat = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(40, np.int32)), 4)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "rows negative": (shard_field("num_rows", -1), r"shards\[1\]\.num_rows: -1 is out of range"),
    "rows 10^15": (shard_field("num_rows", 10**15), r"shards\[1\]\.num_rows: 1000000000000000 is "
                                                    r"out of range"),
    "rows off by one": (shard_field("num_rows", 11), r"shard-00001\.arrow: has 10 rows, the "
                                                     r"manifest says 11"),
    "rows a string": (shard_field("num_rows", "lots"), r"shards\[1\]\.num_rows: must be an "
                                                       r"integer, got 'lots'"),
    "bytes a float": (shard_field("num_bytes", 1.5), r"shards\[1\]\.num_bytes: must be an "
                                                     r"integer"),
    "unknown dtype": (column_field("dtype", "int33"), r"columns\[0\]\.dtype: 'int33' is not one "
                                                      r"of"),
    "shape zero": (column_field("shape", [0]), r"columns\[0\]\.shape: \[0\]: every size must"),
    "shape strings": (column_field("shape", ["4"]), r"columns\[0\]\.shape: \['4'\]: every size"),
    "malformed JSON": (malformed, r"manifest\.json: not valid JSON"),
    "format version 2": (edit(lambda m: m.__setitem__("format_version", 2)),
                         r"format_version 2 is not supported"),
    "unknown key": (edit(lambda m: m.__setitem__("shards_v2", [])),
                    r"shards_v2: unknown key"),
    "checksum not hex": (shard_field("sha256", "zz"), r"shards\[1\]\.sha256: 'zz' is not a hex"),
    "another dataset's shard": (other_datasets_shard, r"shard-00001\.arrow: checksum .* does not "
                                                      r"match"),
    "zero-byte shard": (zero_bytes, r"shard-00001\.arrow: 0 bytes, the manifest says"),
    "extra column": (rewrite_shard(pa.table({"x": _flat, "y": _flat})),
                     r"shard-00001\.arrow: has a column 'y' that the manifest does not list"),
    "escape: relative": (shard_field("path", f"../{OUTSIDE}"), r"shards\[1\]\.path: "
                                                              r"'\.\./outside\.arrow' must not "
                                                              r"contain '\.\.'"),
    "escape: absolute": (None, r"shards\[1\]\.path: '/.*outside\.arrow' must be a path "  # type: ignore[dict-item]
                               r"relative to the dataset"),
    "escape: symlink": (symlink_out, r"shard-00001\.arrow: resolves to .*outside\.arrow, outside "
                                     r"the dataset"),
}
ESCAPES = [name for name in CASES if name.startswith("escape")]
# The writer's own checksum/size agree on these, so only verify's extra checks see them.
VERIFY_ONLY = {"another dataset's shard"}


def broken(name: str, tmp_path: Path) -> Path:
    path = dataset(tmp_path / "ds")
    outside = tmp_path / OUTSIDE
    outside.write_bytes((path / "shard-00002.arrow").read_bytes())  # a valid shard, elsewhere
    change = CASES[name][0] or shard_field("path", str(outside))
    change(path)
    return path


# The CLI in a child process, with an audit hook that lists every file opened.
AUDITED = """
import sys
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
from trainer.cli import main
try:
    main(sys.argv[2:])
finally:
    open(sys.argv[1], "w").write("\\n".join(map(str, opened)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_verify_refuses_in_one_line_with_exit_2(name: str, tmp_path: Path) -> None:
    path = broken(name, tmp_path)
    log = tmp_path / "opened.txt"
    out = subprocess.run([sys.executable, "-c", AUDITED, str(log), "data", "verify", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("memtrain: error: ")
    import re

    assert re.search(CASES[name][1], line), line
    if name in ESCAPES:
        opened = log.read_text().splitlines()
        assert not [p for p in opened if p.endswith(OUTSIDE)], "opened outside the dataset"
        assert not [p for p in opened if p.endswith(".arrow")], "a shard opened before the check"


@pytest.mark.parametrize("name", [n for n in CASES if n not in VERIFY_ONLY])
def test_the_loader_refuses_the_same_datasets(name: str, tmp_path: Path) -> None:
    path = broken(name, tmp_path)
    with pytest.raises(DatasetError, match=CASES[name][1]):
        ShardSource(path, "x")


def test_an_extra_column_is_a_counted_skip_under_skip(tmp_path: Path) -> None:
    path = broken("extra column", tmp_path)
    source = ShardSource(path, "x", on_bad_shard="skip")
    assert source.usable == [0, 2, 3] and len(source.skipped) == 1


@pytest.mark.parametrize("key", ["../ds2/shard.arrow", "/bucket/other.arrow", "a//b.arrow",
                                 "s3://other-bucket/shard.arrow"])
def test_a_remote_key_stays_under_the_dataset_prefix(key: str) -> None:
    """For object stores the check is on the key itself, before any request is made."""
    shard = ShardInfo(key, 10, 100, "0" * 64)
    with pytest.raises(DatasetError, match="must"):
        shard_location("s3://bucket/datasets/ds", shard)
    assert shard_location("s3://bucket/datasets/ds", ShardInfo("sub/shard.arrow", 10, 100,
                                                                 "0" * 64)) \
        == "s3://bucket/datasets/ds/sub/shard.arrow"


def test_the_audit_hook_sees_verify_open_shards(tmp_path: Path) -> None:
    """The escape cases' proof is only as good as the hook: on an intact dataset it must see
    every shard opened (verify reads each one's checksum through Python's ``open``)."""
    path = dataset(tmp_path / "ds")
    log = tmp_path / "opened.txt"
    out = subprocess.run([sys.executable, "-c", AUDITED, str(log), "data", "verify", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    opened = {Path(p).name for p in log.read_text().splitlines() if p.endswith(".arrow")}
    assert opened == {f"shard-{i:05d}.arrow" for i in range(4)}
