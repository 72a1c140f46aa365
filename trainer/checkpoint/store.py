"""A run directory on object storage: ``run.dir: s3://bucket/prefix`` (any pyarrow URI).

The object store is the run directory: ``<run.dir>/<run.name>/`` holds the checkpoints, the
resolved ``config.yaml``, the metrics logs and ``summary.json``, so a run resumes from any machine
that can reach the bucket. The workers write into a local working copy (``run.work_dir``,
``<work_dir>/<run.name>``) and publish from it:

- checkpoints as ``trainer.checkpoint.files`` publishes them (under the local launcher rank 0
uploads
  each one once complete locally, ``meta.json`` last; under Ray, Ray Train writes and restores
  them in the store itself, ``storage_filesystem``, in the same layout);
- the logs (``config.yaml``, ``metrics/``, ``summary.json``, ``errors/``) with each checkpoint
  and when training ends, finished or failed (under Ray, from each node's copy). OOM reports,
  memory snapshots (``memory/``) and profiler traces (``profile/``) stay in the working copy:
  they can be large, and the logs are uploaded whole each time. Every name comes from
  ``monitoring.run_files``.

Resuming reads the store, not the working copy: its latest complete checkpoint is downloaded
unless the copy already holds it, and a working copy without metrics logs gets the store's, so
they continue rather than restart. Endpoints and credentials come from the usual environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), as for datasets. ``RemoteRun`` is the store's
file operations; what a checkpoint is lives in ``trainer.checkpoint.files``.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pyarrow import fs as pafs

from monitoring.host import cache_dir
from monitoring.run_files import (
    ATTEMPTS,
    CONFIG,
    ERRORS_DIR,
    METRICS_DIR,
    PROGRESS,
    SUMMARY,
    TENSORBOARD_DIR,
    TRACKING_FILE,
)

LOG_ENTRIES = (CONFIG, SUMMARY, METRICS_DIR, ERRORS_DIR, ATTEMPTS, PROGRESS,
               TRACKING_FILE, TENSORBOARD_DIR)  # the last two: the experiment trackers'


# The AWS SDK retries a failed request (throttling, 5xx, a dropped connection) with backoff, up
# to this many attempts in all: the one place transient errors are retried (pyarrow builds its
# S3 filesystem with no retry strategy unless told).
S3_ATTEMPTS = 5
UPLOAD_THREADS = 8  # files of one checkpoint in flight at once (FSDP: one or more per rank)


def default_work_dir(uri: str) -> Path:
    """``<cache>/runs/<scheme>/<bucket>/<prefix>`` (``monitoring.host.cache_dir``, by default
    ``~/.cache/memtrain``): one working copy per remote run directory, so two buckets' runs of
    one name never share it."""
    return cache_dir() / "runs" / uri.replace("://", "/", 1).rstrip("/")


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for ``uri``. S3 keys in this process's environment are written into
    it, so that a worker that receives it (Ray's workers, as Ray Train's own
    ``storage_filesystem``) reaches the store with them whatever its own environment; without
    keys here (node or pod roles), every process resolves its own credentials."""
    env = os.environ
    if not (uri.startswith("s3://") and env.get("AWS_ACCESS_KEY_ID")):
        return pafs.FileSystem.from_uri(uri)
    scheme, _, host = env.get("AWS_ENDPOINT_URL", "").partition("://")
    options: dict[str, Any] = {
        "access_key": env["AWS_ACCESS_KEY_ID"], "secret_key": env.get("AWS_SECRET_ACCESS_KEY"),
        "session_token": env.get("AWS_SESSION_TOKEN"),
        "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")}
    if host:
        options.update(endpoint_override=host, scheme=scheme)
    options = {k: v for k, v in options.items() if v}
    return (pafs.S3FileSystem(**options, retry_strategy=pafs.AwsStandardS3RetryStrategy(
        max_attempts=S3_ATTEMPTS)), uri.removeprefix("s3://"))


class RemoteRun:
    """One run's directory on object storage, ``<run.dir>/<run.name>``."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self.fs, self.root = _filesystem(self.uri)
        self._local = pafs.LocalFileSystem()

    def check(self) -> None:
        """Reach the store now (bucket, endpoint, credentials), not at the first checkpoint;
        raises OSError naming what failed."""
        bucket = self.root.split("/", 1)[0]
        if self.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"bucket {bucket!r} does not exist or is not visible with "
                                    "these credentials")
        self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))

    def _path(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def upload_file(self, local: Path, relative: str) -> None:
        if isinstance(self.fs, pafs.LocalFileSystem):  # object stores have no directories
            self.fs.create_dir(self._path(relative).rsplit("/", 1)[0], recursive=True)
        with local.open("rb") as source, self.fs.open_output_stream(self._path(relative)) as out:
            shutil.copyfileobj(source, out, length=8 << 20)

    def read_text(self, relative: str) -> str:
        with self.fs.open_input_stream(self._path(relative)) as stream:
            return stream.read().decode()

    def upload_files(self, root: Path, files: list[Path], last: str | None = None) -> None:
        """``files``, each under its name relative to ``root``, ``UPLOAD_THREADS`` at a time;
        the file named ``last`` alone once every other one is whole on the store."""
        first = [path for path in files if path.name != last]
        with ThreadPoolExecutor(UPLOAD_THREADS) as pool:  # pyarrow's streams release the GIL
            for done in [pool.submit(self.upload_file, path, path.relative_to(root).as_posix())
                         for path in first]:
                done.result()  # the first error, raised
        for path in files:
            if path.name == last:
                self.upload_file(path, path.relative_to(root).as_posix())

    def file_sizes(self, relative: str) -> dict[str, int]:
        """Every file under the directory ``relative``: its path below it, its bytes (one
        listing of the store)."""
        base = self._path(relative)
        infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True,
                                                        allow_not_found=True))
        return {info.path[len(base) + 1:]: info.size for info in infos
                if info.type == pafs.FileType.File}

    def directories(self) -> list[str]:
        """The names of the directories directly under the run's root."""
        return [info.base_name
                for info in self.fs.get_file_info(pafs.FileSelector(self.root,
                                                                    allow_not_found=True))
                if info.type == pafs.FileType.Directory]

    def is_file(self, relative: str) -> bool:
        return self.fs.get_file_info(self._path(relative)).type == pafs.FileType.File

    def delete_dir(self, relative: str) -> None:
        self.fs.delete_dir(self._path(relative))

    def clear_errors(self) -> None:
        """A new attempt's failures are its own: the store forgets the last one's error lines."""
        self.fs.delete_dir_contents(self._path(ERRORS_DIR), missing_dir_ok=True)

    def download_dir(self, relative: str, local: Path) -> None:
        """The store's ``relative`` directory into ``local`` (replaced whole, never half)."""
        staging = local.with_name(f".download-{local.name}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        pafs.copy_files(self._path(relative), str(staging), source_filesystem=self.fs,
                        destination_filesystem=self._local)
        shutil.rmtree(local, ignore_errors=True)
        os.replace(staging, local)

    def fetch_logs(self, run_dir: Path) -> None:
        """A working copy without metrics logs (another machine, a cleared cache) continues the
        store's, and the same tracked run (MLflow's run id, TensorBoard's events)."""
        for directory in (METRICS_DIR, TENSORBOARD_DIR):
            if not (run_dir / directory).is_dir() and \
                    self.fs.get_file_info(self._path(directory)).type == pafs.FileType.Directory:
                self.download_dir(directory, run_dir / directory)
        for name in (TRACKING_FILE, ATTEMPTS, PROGRESS):  # the run's attempts continue too
            if not (run_dir / name).is_file() and self.is_file(name):
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / name).write_text(self.read_text(name))

    def upload_logs(self, run_dir: Path) -> None:
        for entry in LOG_ENTRIES:
            path = run_dir / entry
            if path.is_file():
                self.upload_file(path, entry)
            elif path.is_dir():
                self.upload_files(run_dir, sorted(p for p in path.rglob("*") if p.is_file()))
