"""Training from an S3-compatible object store: a real moto server on 127.0.0.1.

The dataset is uploaded to a bucket and the trainer reads it through pyarrow's S3 filesystem
(``s3://bucket/prefix``; endpoint and credentials from the usual AWS environment variables).
The same run from the local copy gives the same losses, step for step.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pyarrow import fs

from tests.conftest import logged_losses, running_s3_server, tiny_config
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run

pytestmark = pytest.mark.e2e
BUCKET = "memtrain-data"


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch):
    """moto's S3 server on 127.0.0.1, a bucket, and the environment that points pyarrow at it."""
    with running_s3_server(monkeypatch, BUCKET) as admin:
        yield admin


def test_training_from_s3_matches_training_from_local_disk(s3_server, corpus_dir: Path,
                                                           tmp_path: Path) -> None:
    for split in ("train", "val"):
        fs.copy_files(str(corpus_dir / split), f"{BUCKET}/stdlib/{split}",
                      source_filesystem=fs.LocalFileSystem(), destination_filesystem=s3_server)
    common = ("parallel.launcher=local", "parallel.workers=1", "train.steps=6",
              "train.log_every=1", "train.eval_every=3")
    local_cfg, local_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common,
                                                   "run.name=local"))
    launch_local(local_cfg, local_dir)
    s3_cfg, s3_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, *common, "run.name=s3",
        f"data.path=s3://{BUCKET}/stdlib/train", f"data.val_path=s3://{BUCKET}/stdlib/val"))
    assert s3_cfg.data.path == f"s3://{BUCKET}/stdlib/train"  # not mangled into a local path
    summary = launch_local(s3_cfg, s3_dir)
    assert logged_losses(s3_dir) == logged_losses(local_dir)
    assert summary["eval_loss"] is not None


def test_a_missing_s3_prefix_is_a_clear_error(s3_server, tmp_path: Path, corpus_dir: Path
                                              ) -> None:
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=f"data.path: s3://{BUCKET}/nothing/manifest.json is "
                                          "missing"):
        prepare_run(tiny_config(corpus_dir, tmp_path, f"data.path=s3://{BUCKET}/nothing"))



def test_the_remote_loader_reads_the_local_batches_and_names_a_vanished_shard(
        s3_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from datapipe import writer
    from datapipe.loader import BatchLoader
    from datapipe.manifest import DatasetError
    from tests.unit.test_loader import id_dataset

    monkeypatch.setattr(writer, "BATCH_BYTES", 16 * 25)  # 4 record batches per shard
    local = id_dataset(tmp_path / "ids", [100, 100, 100])
    fs.copy_files(str(local), f"{BUCKET}/ids", source_filesystem=fs.LocalFileSystem(),
                  destination_filesystem=s3_server)

    def batches(path: str, count: int) -> list[torch.Tensor]:
        loader = BatchLoader(path, "x", rank=1, world_size=2, batch_size=6, seed=4,
                             shuffle_window=30, read_ahead=3)
        out = [next(loader) for _ in range(count)]
        loader.close()
        return out

    remote, near = batches(f"s3://{BUCKET}/ids", 60), batches(str(local), 60)
    assert all(torch.equal(a, b) for a, b in zip(remote, near, strict=True))

    loader = BatchLoader(f"s3://{BUCKET}/ids", "x", rank=0, world_size=1, batch_size=6, seed=4,
                         shuffle=False, prefetch=1, read_ahead=1)
    next(loader)
    s3_server.delete_file(f"{BUCKET}/ids/shard-00002.arrow")  # gone while training
    with pytest.raises(DatasetError, match="shard-00002.arrow: cannot be read"):
        for _ in range(len(loader)):
            next(loader)
    loader.close()


def test_verify_reads_remote_shards_and_names_a_corrupted_one(s3_server, tmp_path: Path,
                                                               corpus_dir: Path) -> None:
    fs.copy_files(str(corpus_dir / "val"), f"{BUCKET}/check",
                  source_filesystem=fs.LocalFileSystem(), destination_filesystem=s3_server)
    cli = [sys.executable, "-m", "trainer.cli", "data", "verify", f"s3://{BUCKET}/check"]
    ok = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "shards verified" in ok.stdout, ok.stderr
    shard = f"{BUCKET}/check/shard-00000.arrow"
    with s3_server.open_input_stream(shard) as stream:
        data = bytearray(stream.read())
    data[-200] ^= 0xFF  # same size, one byte flipped
    with s3_server.open_output_stream(shard) as sink:
        sink.write(bytes(data))
    bad = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert f"shard s3://{shard}: checksum" in bad.stderr


def _store_files(s3: fs.S3FileSystem, prefix: str) -> set[str]:
    found = s3.get_file_info(fs.FileSelector(prefix, recursive=True))
    return {f.path.removeprefix(prefix + "/") for f in found if f.type == fs.FileType.File}


def test_a_run_directory_on_s3_resumes_on_another_machine_from_its_fsdp_checkpoint(
        s3_server, corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """``run.dir=s3://...``: FSDP on 2 workers stops after its step-4 checkpoint (DCP shards,
    uploaded with ``meta.json`` last). On the store, step 4's shard of rank 1 is then missing
    while its ``meta.json`` is there: what Ray Train's unordered upload leaves when the driver
    dies mid-upload. The same run started from another working copy (another machine: nothing
    local) skips step 4 with one line, resumes from step 2, and ends with the losses of an
    uninterrupted local run, its metrics log continued, its summary in the store, nothing
    written in the current directory."""
    monkeypatch.chdir(tmp_path)
    common = ("parallel.launcher=local", "parallel.strategy=fsdp", "memory.precision=fp32",
              "train.steps=8", "train.checkpoint_every=2", "train.log_every=1",
              "train.eval_every=0")
    remote = (f"run.dir=s3://{BUCKET}/runs", "run.name=remote")
    cfg, first_copy = prepare_run(tiny_config(corpus_dir, tmp_path, *common, *remote,
                                              f"run.work_dir={tmp_path / 'machine-a'}"))
    assert first_copy == tmp_path / "machine-a" / "remote"
    assert launch_local(cfg, first_copy, until_step=4)["final_step"] == 4
    stored = _store_files(s3_server, f"{BUCKET}/runs/remote")
    assert {"checkpoint-00000004/meta.json", "checkpoint-00000004/state.pt",
            "checkpoint-00000004/__0_0.distcp", "checkpoint-00000004/__1_0.distcp",
            "config.yaml", "metrics/rank-0.jsonl"} <= stored, stored
    s3_server.delete_file(f"{BUCKET}/runs/remote/checkpoint-00000004/__1_0.distcp")

    cfg, second_copy = prepare_run(tiny_config(corpus_dir, tmp_path, *common, *remote,
                                               f"run.work_dir={tmp_path / 'machine-b'}"))
    from trainer.checkpoint.publish import fetch_latest
    from trainer.checkpoint.store import RemoteRun

    with caplog.at_level(logging.WARNING, logger="memtrain"):  # what rank 0 does on resume
        chosen = fetch_latest(RemoteRun(f"s3://{BUCKET}/runs/remote"), tmp_path / "probe")
    assert chosen == tmp_path / "probe" / "checkpoint-00000002"
    [skipped] = [r.getMessage() for r in caplog.records]
    assert "checkpoint-00000004 is not whole (__1_0.distcp missing)" in skipped, skipped
    summary = launch_local(cfg, second_copy)
    assert (summary["resumed_from_step"], summary["final_step"]) == (2, 8)
    assert {"checkpoint-00000008/meta.json", "summary.json"} <= _store_files(
        s3_server, f"{BUCKET}/runs/remote")
    with s3_server.open_input_stream(f"{BUCKET}/runs/remote/metrics/rank-0.jsonl") as stream:
        stored_log = [json.loads(line) for line in stream.read().decode().splitlines()]
    losses = {r["step"]: r["loss"] for r in stored_log if "loss" in r}  # the last of each step
    assert sorted(losses) == list(range(1, 9))

    local_cfg, local_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common,
                                                   "run.name=uninterrupted"))
    launch_local(local_cfg, local_dir)
    assert [losses[step] for step in range(1, 9)] == logged_losses(local_dir)
    assert not any(p.name.startswith("s3") for p in tmp_path.iterdir())


def test_an_unreachable_run_store_is_one_line_before_training(s3_server, corpus_dir: Path,
                                                              tmp_path: Path) -> None:
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"^run.dir 's3://no-such-bucket/runs': .*") as err:
        prepare_run(tiny_config(corpus_dir, tmp_path, "run.dir=s3://no-such-bucket/runs",
                                "parallel.launcher=local"))
    assert "\n" not in str(err.value)


def test_a_nodes_workers_read_one_download_of_a_remote_checkpoint(s3_server, tmp_path: Path
                                                                   ) -> None:
    """Ray's own per-node sharing downloads again when a worker comes late, over the files
    another is reading (ray-project/ray#48726). Two workers of one node (threads, a barrier as
    their process group's): the second comes late and reads slowly; the one download is
    complete for both, replaces a killed attempt's leftovers, and goes once both have read."""
    import ray.train

    from trainer.launch.ray import node_copy

    source = tmp_path / "checkpoint-00000006"
    source.mkdir()
    (source / "state.pt").write_bytes(bytes(range(256)) * 32768)  # 8 MiB
    (source / "meta.json").write_text('{"step": 6}')
    fs.copy_files(str(source), f"{BUCKET}/runs/a/{source.name}",
                  source_filesystem=fs.LocalFileSystem(), destination_filesystem=s3_server)
    directory = tmp_path / "copy" / ".restore" / f"node-{source.name}"
    directory.mkdir(parents=True)
    (directory / "state.pt").write_bytes(b"truncated")  # an earlier attempt, killed mid-copy
    (directory / "left-over").write_text("")

    downloads = []

    class Counted(ray.train.Checkpoint):
        def to_directory(self, path=None):
            downloads.append(path)
            return super().to_directory(path)

    checkpoint = Counted(f"{BUCKET}/runs/a/{source.name}", filesystem=s3_server)
    barrier = threading.Barrier(2, timeout=60)
    seen: dict[int, dict[str, bytes]] = {}
    errors: list[BaseException] = []

    def worker(local_rank: int) -> None:
        try:
            if local_rank == 1:
                time.sleep(0.5)  # comes after the download has finished
            with node_copy(checkpoint, directory, local_rank == 0, barrier.wait) as copy:
                if local_rank == 1:
                    time.sleep(0.5)  # still reading when the other has finished
                seen[local_rank] = {p.name: p.read_bytes() for p in sorted(copy.iterdir())}
        except BaseException as err:  # noqa: BLE001 - reported by the test thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    expected = {p.name: p.read_bytes() for p in sorted(source.iterdir())}
    assert seen == {0: expected, 1: expected}
    assert downloads == [str(directory)]
    assert not directory.exists()
