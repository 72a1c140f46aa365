"""A checkpoint's manifest (``meta.json``: every file's size and SHA-256) and the readers that
check it: a checkpoint missing a file, truncated or corrupted is never trusted, and the one
before it is used, with one line naming what is wrong."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import save_checkpoint
from trainer.checkpoint import store as runstore
from trainer.checkpoint.files import (
    CheckpointReadError,
    checkpoint_dir_name,
    complete_checkpoints,
    latest_whole,
    published_checkpoints,
    verified,
)
from trainer.checkpoint.integrity import local_problem
from trainer.checkpoint.publish import fetch_latest, stored_checkpoints, upload_checkpoint
from trainer.checkpoint.store import RemoteRun


def _checkpoint(run_dir: Path, step: int, shard: bytes = b"") -> Path:
    directory = run_dir / checkpoint_dir_name(step)
    if shard:  # a DCP shard of another rank's, as write_states's gathered manifest lists
        directory.mkdir(parents=True)
        (directory / "__1_0.distcp").write_bytes(shard)
    save_checkpoint(directory, {"step": step, "weights": torch.full((64,), float(step))})
    return directory


def test_the_manifest_lists_every_file_and_names_what_is_wrong(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, 2, shard=b"x" * 1000)
    manifest = json.loads((directory / "meta.json").read_text())
    assert set(manifest["files"]) == {"state.pt", "__1_0.distcp"}
    assert manifest["files"]["__1_0.distcp"]["size"] == 1000
    assert local_problem(directory, hashes=True) is None

    (directory / "__1_0.distcp").write_bytes(b"x" * 999 + b"y")  # same size, other bytes
    assert local_problem(directory, hashes=False) is None  # sizes alone cannot see it
    assert local_problem(directory, hashes=True) == ("__1_0.distcp's bytes differ from the "
                                                     "SHA-256 meta.json lists")
    (directory / "__1_0.distcp").write_bytes(b"x" * 10)
    assert local_problem(directory, hashes=False) == ("__1_0.distcp has 10 bytes where "
                                                      "meta.json lists 1,000")
    (directory / "__1_0.distcp").unlink()
    assert local_problem(directory, hashes=False) == "__1_0.distcp missing"
    (directory / "meta.json").write_text('{"step": 2, "fi')  # torn
    assert local_problem(directory, hashes=False) == "meta.json is unreadable"
    (directory / "meta.json").unlink()
    assert local_problem(directory, hashes=False) == "meta.json is missing"


def test_a_checkpoint_written_before_manifests_still_loads(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, 4)
    (directory / "meta.json").write_text('{"step": 4}')  # what meta.json held before
    assert verified(directory, hashes=True) == directory
    (directory / "state.pt").unlink()
    with pytest.raises(CheckpointReadError, match="is not whole: state.pt missing"):
        verified(directory, hashes=True)


def test_the_latest_whole_checkpoint_skips_newer_partial_ones_with_a_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    with (tmp_path / "checkpoint-00000006" / "state.pt").open("r+b") as f:
        f.seek(100)
        f.write(b"\xff")  # a flipped byte: same size
    (tmp_path / "checkpoint-00000004" / "state.pt").write_bytes(b"cut")
    assert [s for s, _ in published_checkpoints(tmp_path)] == [2, 4, 6]
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 6]  # sizes only
    with caplog.at_level(logging.WARNING, logger="memtrain"):
        assert latest_whole(published_checkpoints(tmp_path), hashes=True) == \
            tmp_path / "checkpoint-00000002"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "checkpoint-00000006 is not whole (state.pt's bytes" in lines[0]
    assert "checkpoint-00000004 is not whole (state.pt has 3 bytes" in lines[1]
    assert latest_whole(published_checkpoints(tmp_path), hashes=False) == \
        tmp_path / "checkpoint-00000006"


def test_uploads_run_in_parallel_with_the_manifest_last_and_the_store_falls_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run store on a local filesystem (pyarrow's, as for S3): the files of a checkpoint
    are in flight together and ``meta.json`` starts only once every other one is whole; a
    store checkpoint whose shard never landed is not listed, and the working copy takes the
    one before it."""
    local = tmp_path / "work"
    for step in (2, 4):
        _checkpoint(local, step, shard=bytes(range(256)) * 64)
        for rank in range(2, 6):
            (local / checkpoint_dir_name(step) / f"__{rank}_0.distcp").write_bytes(b"s" * 64)
    remote = RemoteRun(str(tmp_path / "store"))
    (tmp_path / "store").mkdir()

    in_flight, most, order = 0, 0, []
    lock = threading.Lock()
    upload = RemoteRun.upload_file

    def slow(self: RemoteRun, path: Path, relative: str) -> None:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        time.sleep(0.05)
        upload(self, path, relative)
        with lock:
            in_flight -= 1
            order.append(Path(relative).name)

    monkeypatch.setattr(RemoteRun, "upload_file", slow)
    upload_checkpoint(remote, local / "checkpoint-00000002", keep=3)
    assert most > 1, most
    assert order[-1] == "meta.json" and len(order) == 7
    monkeypatch.setattr(RemoteRun, "upload_file", upload)
    upload_checkpoint(remote, local / "checkpoint-00000004", keep=3)
    assert stored_checkpoints(remote) == [(2, "checkpoint-00000002"), (4, "checkpoint-00000004")]

    (tmp_path / "store" / "checkpoint-00000004" / "__1_0.distcp").unlink()  # never landed
    assert stored_checkpoints(remote) == [(2, "checkpoint-00000002")]
    copy = tmp_path / "machine-b"
    assert fetch_latest(remote, copy) == copy / "checkpoint-00000002"
    assert local_problem(copy / "checkpoint-00000002", hashes=True) is None


def test_the_store_is_built_with_the_sdks_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow builds its S3 filesystem without retries unless given a strategy."""
    seen = {}

    class Recording:
        def __init__(self, **options):
            seen.update(options)

    monkeypatch.setattr(runstore.pafs, "S3FileSystem", Recording)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    runstore._filesystem("s3://bucket/runs")
    strategy = seen["retry_strategy"]
    assert isinstance(strategy, runstore.pafs.AwsStandardS3RetryStrategy)
    assert strategy.max_attempts == runstore.S3_ATTEMPTS > 1
