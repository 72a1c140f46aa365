"""Where a checkpoint's files go once each rank has written its part: the parts each rank
writes first, in this machine's temporary directory (``rank_parts_prefix``, cleared of a killed
attempt's by ``clear_rank_parts``); the checkpoint published in the run directory by an atomic
rename (``publish_checkpoint``); uploaded to a run store on object storage with ``meta.json``
last (``upload_checkpoint``), and the store's latest whole one fetched back
(``stored_checkpoints``, ``fetch_latest``). Ray Train publishes through ``ray.train.report``
instead (``trainer.launch.ray``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from trainer.checkpoint.files import (
    META_FILE,
    CheckpointWriteError,
    checkpoint_dir_name,
    checkpoint_step,
    published_checkpoints,
)
from trainer.checkpoint.integrity import local_problem, parse, size_problem
from trainer.checkpoint.store import RemoteRun
from trainer.errors import first_line
from trainer.faults import maybe_fail_checkpoint

log = logging.getLogger("memtrain")


def rank_parts_prefix(run_dir: Path) -> str:
    """How the directories start, in the system's temporary directory, where this run's ranks
    write their parts of a checkpoint before the context publishes them
    (``run_dir/checkpoint-<step>``) or Ray Train uploads them: named after the run directory,
    so that the part a worker killed mid-save leaves behind is found by the run's next start
    (``clear_rank_parts``)."""
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return f"memtrain-ckpt-{key}-"


def clear_rank_parts(run_dir: Path) -> None:
    """Remove the parts killed workers of this run left in this machine's temporary directory:
    directories of this user only, never a link."""
    for path in Path(tempfile.gettempdir()).glob(rank_parts_prefix(run_dir) + "*"):
        try:
            found = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def publish_checkpoint(run_dir: Path, step: int, files: Path | None, rank: int,
                       barrier: Callable[[], None], keep: int) -> Path:
    """Publish one step's checkpoint in ``run_dir`` from every rank's ``files`` (its
    ``write_states`` directory, or None); every rank calls. Returns the checkpoint.

    The barriers order the phases: clean staging, copy (each rank its own DCP files, rank 0
    ``state.pt`` too), rename (atomic: a checkpoint is there whole or
    not at all), prune to the ``keep`` newest.
    """
    final = run_dir / checkpoint_dir_name(step)
    staging = run_dir / f".staging-{checkpoint_dir_name(step)}"
    is_main = rank == 0
    barrier()
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash mid-write
        staging.mkdir(parents=True)
    barrier()
    if files is not None:
        try:
            shutil.copytree(files, staging, dirs_exist_ok=True)
        except OSError as err:  # disk full, read-only storage: the run stops here
            shutil.rmtree(staging, ignore_errors=True)
            reason = getattr(err, "strerror", None) or first_line(err)
            raise CheckpointWriteError(
                f"checkpoint of step {step} could not be written to {staging.parent} "
                f"({reason}); the previous checkpoint stays the latest") from err
    maybe_fail_checkpoint(run_dir, step, rank)  # MEMTRAIN_FAULTS=checkpoint@STEP (faults.py)
    barrier()
    if is_main:
        if final.exists():  # a rerun reached the same step: replace it whole
            shutil.rmtree(final)
        os.replace(staging, final)
        for _, old in published_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def upload_checkpoint(remote: RemoteRun, checkpoint: Path, keep: int) -> None:
    """A checkpoint published in the working copy, to the run store: every file under its
    name, ``meta.json`` last (complete from then); then the store keeps its ``keep`` newest, and
    gets the run's logs as they are at this checkpoint."""
    step = checkpoint_step(checkpoint.name)
    try:
        if checkpoint.name in remote.directories():  # a rerun's, or a partial upload's
            remote.delete_dir(checkpoint.name)
        files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
        remote.upload_files(checkpoint.parent, files, last=META_FILE)
        stored = _stored(remote)
        whole = [name for _step, name, problem in stored if problem is None]
        for _step, name, problem in stored:  # the older whole ones beyond keep, partial ones
            if name != checkpoint.name and (problem is not None or name in whole[:-keep]):
                remote.delete_dir(name)
        remote.upload_logs(checkpoint.parent)
    except OSError as err:  # the store's latest complete checkpoint stays the latest
        raise CheckpointWriteError(
            f"checkpoint of step {step} could not be uploaded to {remote.uri} "
            f"({first_line(err)}); the previous checkpoint stays the latest") from err


def _stored(remote: RemoteRun) -> list[tuple[int, str, str | None]]:
    """(step, name, what is missing or None) of every checkpoint directory in the store,
    oldest first: one listing of each, no bytes read but its manifest's."""
    found = []
    for name in remote.directories():
        if (step := checkpoint_step(name)) is None:
            continue
        sizes = remote.file_sizes(name)
        manifest = parse(remote.read_text(f"{name}/{META_FILE}")) if META_FILE in sizes else None
        found.append((step, name, size_problem(manifest, sizes)))
    return sorted(found)


def stored_checkpoints(remote: RemoteRun) -> list[tuple[int, str]]:
    """(step, name) of the checkpoints in the run store that hold every file their manifest
    lists, at its size; oldest first."""
    return [(step, name) for step, name, problem in _stored(remote) if problem is None]


def fetch_latest(remote: RemoteRun, run_dir: Path, hashes: bool = True) -> Path | None:
    """The store's latest whole checkpoint in the working copy ``run_dir`` (downloaded unless
    the copy holds it whole); None when the store has none. Each newer one that is not whole,
    on the store or once downloaded, is skipped with one line."""
    for _, name, problem in reversed(_stored(remote)):
        local = run_dir / name
        if problem is None and local_problem(local, hashes) is not None:
            remote.download_dir(name, local)
            problem = local_problem(local, hashes)
        if problem is None:
            return local
        log.warning("checkpoint %s/%s is not whole (%s): skipped, the one before it is used",
                    remote.uri, name, problem)
    return None
