"""The small worker context the training loop talks to, instead of talking to Ray.

A context knows the worker's place (rank, local rank, world size, device, run directory) and does
two things: ``report`` metrics with an optional checkpoint directory, and hand back the latest
checkpoint to resume from. ``LocalContext`` (here) publishes checkpoints in the run directory
(and its run store) with ``trainer.checkpoint.publish``;
``trainer.launch.ray.RayContext`` hands them to Ray Train. Collectives are plain
``torch.distributed`` calls, no-ops when no process group exists.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint.files import latest_whole, published_checkpoints
from trainer.checkpoint.publish import fetch_latest, publish_checkpoint, upload_checkpoint
from trainer.checkpoint.store import RemoteRun


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
    # The launch this worker belongs to (an id the launcher draws): a start under another
    # launch than the previous attempt's is a relaunch (trainer.telemetry.restarts).
    launch_id: str = field(default="", kw_only=True)
    # How many checkpoints are kept (``run.keep_checkpoints``), and whether a checkpoint's
    # bytes are checked against their hashes before it is read (``run.checkpoint_verify``).
    keep_checkpoints: int = field(default=3, kw_only=True)
    verify_hashes: bool = field(default=True, kw_only=True)
    # ``train.checkpoint_async``: where the context saves in the background (the local one:
    # the whole save on a thread, trainer.checkpoint.async_save) or uploads in the background
    # (Ray's).
    checkpoint_async: bool = field(default=False, kw_only=True)

    @property
    def takes_checkpoint_files(self) -> bool:
        """Whether ``report`` keeps the checkpoint directory it is handed (and deletes it once
        done with it), rather than copying it before returning."""
        return False

    @property
    def saves_in_background(self) -> bool:
        """Whether the whole save runs on a thread of its own
        (``trainer.checkpoint.async_save``)."""
        return False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, step: int,
               group: Any = None) -> None:
        """Publish metrics and, from every rank's part, a complete checkpoint. Every rank
        calls. ``group``: the process group of its collectives (None: the default one; an
        asynchronous save publishes on a group of its own, from its own thread)."""

    @abstractmethod
    def latest_checkpoint(self) -> contextlib.AbstractContextManager[Path | None]:
        """A context manager yielding the latest complete checkpoint's directory, or None."""

    def barrier(self, group: Any = None) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=group)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a collective: every rank calls)."""
        if not (dist.is_available() and dist.is_initialized()):
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def node_address(self) -> str:
        """The address of the node this worker runs on."""
        return "127.0.0.1"

    def node_addresses(self) -> list[str]:
        """Every rank's node address (a collective: every rank calls)."""
        mine = self.node_address()
        if not (dist.is_available() and dist.is_initialized()):
            return [mine]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        return [str(address) for address in gathered]

    def lost_nodes(self, addresses: list[str]) -> list[str]:
        """Which of ``addresses`` (nodes an earlier attempt ran on) are gone: none, for
        workers that all run on this machine."""
        return []


@dataclass
class LocalContext(WorkerContext):
    """Checkpoints live in ``run_dir/checkpoint-<step>`` (``trainer.checkpoint.files``). With a run
    directory on object storage (``remote``, ``trainer.checkpoint.store``), ``run_dir`` is its local
    working copy: rank 0 uploads each checkpoint once published here, and the store's latest
    is what resumes."""

    remote: RemoteRun | None = field(default=None, kw_only=True)

    @property
    def saves_in_background(self) -> bool:
        return self.checkpoint_async

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, step: int,
               group: Any = None) -> None:
        final = publish_checkpoint(self.run_dir, step, checkpoint_dir, self.rank,
                                   lambda: self.barrier(group), self.keep_checkpoints)
        if self.is_main and self.remote is not None:
            upload_checkpoint(self.remote, final, self.keep_checkpoints)
        self.barrier(group)  # nobody reads "latest" before rank 0 has published it

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[Path | None]:
        # Rank 0 decides (the run directory's latest whole checkpoint, or the store's, brought
        # into the working copy); the others take its choice.
        latest = None
        if self.is_main:
            latest = (latest_whole(published_checkpoints(self.run_dir), self.verify_hashes)
                      if self.remote is None else
                      fetch_latest(self.remote, self.run_dir, self.verify_hashes))
        yield self.broadcast(latest)
