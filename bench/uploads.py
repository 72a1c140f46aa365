"""A checkpoint of 8 FSDP ranks uploaded to an S3-compatible store through a slow network:
one file at a time against memtrain's parallel upload (``trainer.checkpoint.store.UPLOAD_THREADS``).

The store is moto's S3 server on 127.0.0.1, behind the chaos campaign's fault proxy
(``tests/chaos/proxy.py``) holding every chunk ``--delay`` seconds each way, as a store across a
long link would. The checkpoint is what 8 ranks write: a DCP shard file per rank of
``--shard-mib`` MiB, DCP's ``.metadata``, ``state.pt`` and the manifest, published by
``trainer.checkpoint.files.upload_checkpoint`` (``meta.json`` last). Best of ``--repeats``.
Run: ``make bench-uploads`` (writes ``bench/results/uploads-<date>-<host>.json``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.results import describe_cpu, write_json
from tests.chaos.proxy import FaultProxy
from tests.conftest import running_s3_server
from trainer.checkpoint import store as runstore
from trainer.checkpoint.files import checkpoint_dir_name
from trainer.checkpoint.integrity import describe, write_manifest
from trainer.checkpoint.publish import stored_checkpoints, upload_checkpoint

BUCKET = "memtrain-bench"


def eight_rank_checkpoint(root: Path, shard_mib: float) -> Path:
    directory = root / checkpoint_dir_name(8)
    directory.mkdir(parents=True)
    for rank in range(8):
        (directory / f"__{rank}_0.distcp").write_bytes(os.urandom(int(shard_mib * 2**20)))
    (directory / ".metadata").write_bytes(os.urandom(64 << 10))
    torch.save({"step": 8, "dcp": True}, directory / "state.pt")
    write_manifest(directory, 8, describe(directory))
    return directory


def timed_upload(uri: str, checkpoint: Path, threads: int) -> float:
    runstore.UPLOAD_THREADS = threads
    remote = runstore.RemoteRun(uri)
    started = time.perf_counter()
    upload_checkpoint(remote, checkpoint, keep=3)
    seconds = time.perf_counter() - started
    assert stored_checkpoints(remote)[-1][1] == checkpoint.name  # whole on the store
    remote.delete_dir(checkpoint.name)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--shard-mib", type=float, default=8.0)
    parser.add_argument("--delay", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    parallel_threads = runstore.UPLOAD_THREADS
    seconds: dict[str, float] = {}
    with pytest.MonkeyPatch.context() as patch, running_s3_server(patch, BUCKET), \
            tempfile.TemporaryDirectory(prefix="memtrain-bench-upload-") as tmp:
        endpoint = os.environ["AWS_ENDPOINT_URL"]
        proxy = FaultProxy(int(endpoint.rsplit(":", 1)[1]))
        patch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        proxy.set("slow", delay=args.delay)
        checkpoint = eight_rank_checkpoint(Path(tmp) / "work", args.shard_mib)
        uri = f"s3://{BUCKET}/runs/bench"
        for _ in range(args.repeats):
            for name, threads in (("serial", 1), ("parallel", parallel_threads)):
                took = timed_upload(uri, checkpoint, threads)
                seconds[name] = min(seconds.get(name, took), took)
        proxy.close()
    report: dict[str, Any] = {
        "shard_mib": args.shard_mib, "ranks": 8, "delay_s_per_chunk": args.delay,
        "threads": parallel_threads, "seconds": seconds,
        "speedup": seconds["serial"] / seconds["parallel"]}
    path = write_json(args.out, "uploads", report)
    print(describe_cpu(report["cpu"]))
    print(f"8 ranks x {args.shard_mib:g} MiB through a proxy holding each chunk {args.delay} s: "
          f"serial {seconds['serial']:.2f} s, parallel ({parallel_threads} threads) "
          f"{seconds['parallel']:.2f} s, {report['speedup']:.1f}x")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
