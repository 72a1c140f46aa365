"""The small worker context the training loop talks to, instead of talking to Ray.

A context knows the worker's place (rank, local rank, world size, device, run directory) and does
two things: ``report`` metrics with an optional checkpoint directory, and hand back the latest
checkpoint to resume from. ``LocalContext`` (here) keeps checkpoints in the run directory;
``trainer.launch.ray.RayContext`` hands them to Ray Train. Collectives are plain
``torch.distributed`` calls, no-ops when no process group exists.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer.errors import first_line
from trainer.faults import maybe_fail_checkpoint

if TYPE_CHECKING:
    from trainer.runstore import RemoteRun

CHECKPOINT_PREFIX = "checkpoint-"
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


class CheckpointWriteError(OSError):
    """Storage refused a checkpoint; nothing was published."""


def checkpoint_dir_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


@dataclass
class WorkerContext(ABC):
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    run_dir: Path

    # Where metrics go (monitoring.sinks.PrometheusSink or the Ray sink); None: nowhere.
    # Set after construction by the launcher.
    metrics_sink: Any = field(default=None, kw_only=True)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, step: int) -> None:
        """Publish metrics and, from rank 0, a complete checkpoint directory. Every rank calls."""

    @abstractmethod
    def latest_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]:
        """A context manager yielding the latest complete checkpoint's directory, or None."""

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def checkpoint_step(name: str) -> int | None:
    """The step of a published checkpoint directory's name; None for any other name (staging
    and download directories never match)."""
    match = _CHECKPOINT_RE.match(name)
    return int(match.group(1)) if match else None


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Published checkpoints in ``run_dir``, oldest first."""
    if not run_dir.is_dir():
        return []
    return sorted((step, child) for child in run_dir.iterdir()
                  if (step := checkpoint_step(child.name)) is not None and child.is_dir())


@dataclass
class LocalContext(WorkerContext):
    """Checkpoints live in ``run_dir/checkpoint-<step>``; published by an atomic rename. With a
    run directory on object storage (``remote``, ``trainer.runstore``), ``run_dir`` is its local
    working copy: rank 0 uploads each checkpoint once published here, and the store's latest
    is what resumes."""

    keep_checkpoints: int = 3
    remote: RemoteRun | None = field(default=None, kw_only=True)

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, step: int) -> None:
        """Every rank's checkpoint files go into one staging directory; rank 0 publishes it.

        The barriers order the phases: clean staging, copy (each rank its own files: rank 0
        only under DDP, every rank's shards under FSDP), rename, prune.
        """
        final = self.run_dir / checkpoint_dir_name(step)
        staging = self.run_dir / f".staging-{checkpoint_dir_name(step)}"
        self.barrier()
        if self.is_main:
            shutil.rmtree(staging, ignore_errors=True)  # left by a crash mid-write
            staging.mkdir(parents=True)
        self.barrier()
        if checkpoint_dir is not None:
            try:
                shutil.copytree(checkpoint_dir, staging, dirs_exist_ok=True)
            except OSError as err:  # disk full, read-only storage: the run stops here
                shutil.rmtree(staging, ignore_errors=True)
                reason = getattr(err, "strerror", None) or first_line(err)
                raise CheckpointWriteError(
                    f"checkpoint of step {step} could not be written to {staging.parent} "
                    f"({reason}); the previous checkpoint stays the latest") from err
        maybe_fail_checkpoint(step)  # MEMTRAIN_FAULTS=checkpoint@STEP (tests)
        self.barrier()
        if self.is_main:
            if final.exists():  # a rerun reached the same step: replace it whole
                shutil.rmtree(final)
            os.replace(staging, final)
            for _, old in complete_checkpoints(self.run_dir)[: -self.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
            if self.remote is not None:
                self._upload(final, step)
        self.barrier()  # nobody reads "latest" before rank 0 has published it

    def _upload(self, final: Path, step: int) -> None:
        assert self.remote is not None
        try:
            self.remote.upload_checkpoint(final)
            self.remote.prune(self.keep_checkpoints)
            self.remote.upload_logs(self.run_dir)
        except OSError as err:  # the store's latest complete checkpoint stays the latest
            raise CheckpointWriteError(
                f"checkpoint of step {step} could not be uploaded to {self.remote.uri} "
                f"({first_line(err)}); the previous checkpoint stays the latest") from err

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[Path | None]:
        if self.remote is None:
            checkpoints = complete_checkpoints(self.run_dir)
            yield checkpoints[-1][1] if checkpoints else None
            return
        # The store decides: rank 0 brings its latest into the working copy, the others wait.
        latest = self.remote.fetch_latest(self.run_dir) if self.is_main else None
        self.barrier()
        if not self.is_main:
            published = self.remote.checkpoints()
            latest = self.run_dir / published[-1][1] if published else None
        yield latest
