"""Restarts, as the run sees them: why the previous attempt ended, and what recovering cost.

An attempt is one start of the training loop in a run directory: the first, each restart Ray
Train makes after a failure (``parallel.max_failures``), and each launch with the same run name.
Rank 0 keeps two records in the run directory:

- ``attempts.jsonl``: one line per attempt, at its start: its number, the launch it belongs to,
  the step it resumed from, the nodes its ranks ran on, and, for a restart, the cause and what it
  cost;
- ``progress``: the attempt's last finished step and its time, rewritten in place after every
  step (one ``pwrite`` of a fixed-width line: no open, rename or fsync in the step loop; it
  survives a killed process, as the page cache does), and ``done`` at the end.

An attempt whose predecessor has no ``done`` is a restart. Its cause, in order: an error a
worker recorded since the previous attempt started (``run_dir/errors``, or ``errors-previous``
for the launch before: an OOM beyond recovery, a failed checkpoint write, a full disk; a rank's
failed collective after a peer died is that peer's echo, not a cause); a worker's end as the
local launcher saw it (``rank 1 exited with code -9 (signal SIGKILL)``); a node of the previous
attempt that is gone (``lost_nodes``); an elastic group resized by Ray Train (another world
size, the same launch); another launch (the driver, or the job, stopped before
the end and started again); else a worker process that ended without an error of its own
(killed by a signal or by the kernel's OOM killer).

The recovery costs the seconds from the previous attempt's last finished step to this attempt's
first, and the steps done again (those past the checkpoint resumed from).

Rank 0 logs one line per restart at its first step, for example ``restarted after node
127.0.0.2 was lost: resumed from step 20 (16.2 s, 4 steps redone)``, and publishes the run's
totals: ``memtrain_train_restarts_total`` by cause and ``memtrain_train_recovery_seconds_total``.
Both count the whole run, every attempt before this one included, so a new worker process on
another node continues the count rather than starting at 0.

Limits: the records live in the run directory's working copy. On object storage across machines
a node lost with rank 0 takes its ``progress`` with it; the next attempt then dates the failure
from its predecessor's start (``attempts.jsonl`` is uploaded with the logs).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monitoring.run_files import ATTEMPTS, ERRORS_DIR, PREVIOUS_ERRORS_DIR, PROGRESS
from trainer.telemetry.worker_errors import (
    CONTROLLER_FILE,
    as_worker_error,
    error_records,
    is_peer_echo,
)

log = logging.getLogger("memtrain")
_WIDTH = 160  # the progress line's fixed width, padded with spaces

# The causes a restart is counted under (the metric's ``cause`` label: a bounded set).
CAUSES = ("worker_error", "controller_error", "node_lost", "resize", "relaunch", "worker_exit")
# A rank whose peer died fails in its next collective with one of these: an effect, not a cause.


@dataclass(frozen=True)
class Restart:
    """What the attempt now starting recovered from."""

    attempt: int
    cause: str  # one of CAUSES
    detail: str  # for the line: "node 127.0.0.2 was lost", "rank 1: OSError: ..."
    failed_at: float  # the previous attempt's last finished step's time (else its start)
    last_step: int  # the previous attempt's last finished step
    resumed_from: int  # the step this attempt resumed from (0: from scratch)

    @property
    def steps_redone(self) -> int:
        return max(0, self.last_step - self.resumed_from)


@dataclass
class Restarts:
    """Rank 0's records of the attempts in ``run_dir`` (other ranks: nothing to do)."""

    run_dir: Path
    active: bool
    attempt: int = 1
    restart: Restart | None = None
    causes: Counter[str] = field(default_factory=Counter)  # the run's restarts so far
    recovery_seconds: float = 0.0  # the run's, this attempt's own once its first step is done
    _fd: int | None = None
    _reported: bool = False
    _warned: bool = False

    @classmethod
    def begin(cls, run_dir: Path, is_main: bool, launch_id: str, resumed_from: int | None,
              nodes: Iterable[str], lost_nodes: Callable[[list[str]], list[str]]) -> Restarts:
        """Read the previous attempt's records and start this one's (rank 0 only).

        ``nodes``: the addresses this attempt's ranks run on; ``lost_nodes(previous)``: which of
        the previous attempt's node addresses are gone now."""
        nodes = list(nodes)
        if not is_main:
            return cls(run_dir, active=False)
        attempts = _read_attempts(run_dir / ATTEMPTS)
        progress = _read_progress(run_dir / PROGRESS)
        previous = attempts[-1] if attempts else None
        recovery = cls(run_dir, active=True, attempt=len(attempts) + 1)
        for record in attempts:
            if record.get("cause"):
                recovery.causes[record["cause"]] += 1
                recovery.recovery_seconds += record.get("recovery_seconds", 0.0)
        if previous is not None and not (progress.get("attempt") == previous["attempt"]
                                         and progress.get("done")):
            ran = progress.get("attempt") == previous["attempt"]
            cause, detail = _cause(run_dir, previous, launch_id, lost_nodes, len(nodes))
            recovery.restart = Restart(
                recovery.attempt, cause, detail,
                failed_at=progress["time"] if ran else previous["start"],
                last_step=progress["step"] if ran else previous["resumed_from"],
                resumed_from=resumed_from or 0)
            recovery.causes[cause] += 1
        start: dict[str, Any] = {"attempt": recovery.attempt, "launch": launch_id,
                                  "start": time.time(), "resumed_from": resumed_from or 0,
                                  "nodes": sorted(set(nodes)), "world_size": len(nodes)}
        if recovery.restart is not None:
            start.update(cause=recovery.restart.cause, detail=recovery.restart.detail,
                          failed_at=recovery.restart.failed_at,
                          last_step=recovery.restart.last_step)
        recovery._append(start)
        try:
            recovery._fd = os.open(run_dir / PROGRESS, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as err:
            recovery._warn(err)
        return recovery

    def step_done(self, step: int) -> None:
        """After every optimizer step: the progress record, and at this attempt's first step,
        a restart's line and its cost."""
        if not self.active:
            return
        now = time.time()
        self._write_progress({"attempt": self.attempt, "step": step, "time": now})
        if self.restart is not None and not self._reported:
            self._reported = True
            seconds = max(0.0, now - self.restart.failed_at)
            self.recovery_seconds += seconds
            log.warning("restarted after %s: resumed from step %d (%.1f s, %d step%s redone)",
                        self.restart.detail, self.restart.resumed_from, seconds,
                        self.restart.steps_redone, "" if self.restart.steps_redone == 1 else "s")
            self._append({"attempt": self.attempt, "recovered": True,
                          "recovery_seconds": seconds, "steps_redone": self.restart.steps_redone})

    def finish(self, step: int) -> None:
        """The attempt ended at the run's last step: the next start is no restart."""
        if self.active:
            self._write_progress({"attempt": self.attempt, "step": step, "time": time.time(),
                                  "done": True})

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def metrics(self) -> dict[str, Any]:
        """The run's totals for the metrics contract (rank 0's; empty on the others)."""
        if not self.active:
            return {}
        return {"memtrain_train_restarts_total": dict(self.causes),
                "memtrain_train_recovery_seconds_total": self.recovery_seconds}

    def summary(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "restarts": dict(self.causes),
                "recovery_seconds": round(self.recovery_seconds, 3)}

    def _write_progress(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            return
        line = json.dumps(record, sort_keys=True).ljust(_WIDTH - 1) + "\n"
        try:
            os.pwrite(self._fd, line.encode(), 0)
        except OSError as err:
            self._warn(err)

    def _append(self, record: dict[str, Any]) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / ATTEMPTS, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError as err:
            self._warn(err)

    def _warn(self, err: OSError) -> None:
        """The records are the run's account of itself, not its state: a full or read-only
        disk costs one warning, not the run (the next write to the run directory that matters,
        a log line or a checkpoint, reports it)."""
        if not self._warned:
            self._warned = True
            log.warning("the restart records in %s cannot be written (%s); restarts "
                        "go uncounted until they can", self.run_dir, err.strerror or err)


def _read_attempts(path: Path) -> list[dict[str, Any]]:
    """The attempts' start records, each updated with its ``recovered`` line's figures."""
    attempts: list[dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return attempts
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill: the attempt's start is what matters
        if record.get("recovered") and attempts and attempts[-1]["attempt"] == record["attempt"]:
            attempts[-1].update(recovery_seconds=record["recovery_seconds"])
        elif "start" in record:
            attempts.append(record)
    return attempts


def _read_progress(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text().strip() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _cause(run_dir: Path, previous: dict[str, Any], launch_id: str,
           lost_nodes: Callable[[list[str]], list[str]], world_size: int) -> tuple[str, str]:
    recorded = _recorded(run_dir, since=previous["start"])
    if recorded.error is not None:
        return "worker_error", recorded.error
    controller = _controller_error(run_dir, since=previous["start"])
    if controller is not None:
        return "controller_error", f"Ray Train's controller failed: {controller}"
    if recorded.exit is not None:
        return "worker_exit", recorded.exit
    lost = lost_nodes(list(previous.get("nodes", [])))
    if lost:
        return "node_lost", f"node{'s' if len(lost) > 1 else ''} {', '.join(lost)} " \
                            f"{'were' if len(lost) > 1 else 'was'} lost"
    before = previous.get("world_size")
    if before and before != world_size and previous.get("launch") == launch_id:
        return "resize", f"the group was resized from {before} to {world_size} workers"
    if previous.get("launch") != launch_id:  # (a killed driver's workers may echo each other)
        return "relaunch", "the previous launch stopped before its last step"
    return "worker_exit", "a worker exited without an error of its own (a signal or the " \
                          "kernel's OOM killer)"


@dataclass
class _Recorded:
    error: str | None = None  # the lowest rank's own error, one line
    exit: str | None = None  # "rank 1 exited with code -9 (signal SIGKILL)", as the launcher saw
    echoed: bool = False  # a rank's collective failed because a peer died (look no further)


def _recorded(run_dir: Path, since: float) -> _Recorded:
    """What the ranks and the launcher recorded since ``since`` (the previous attempt's
    start), in this launch's ``errors`` or, where it has none, the launch before's."""
    found = _Recorded()
    for directory in (ERRORS_DIR, PREVIOUS_ERRORS_DIR):
        for mtime, rank, record in error_records(run_dir, directory):
            if mtime < since - 1.0:  # (file times may lag the clock a little)
                continue
            if record.get("exited"):
                found.exit = found.exit or f"rank {rank} {record['message']}"
            elif is_peer_echo(record):
                found.echoed = True
            elif found.error is None:
                found.error = str(as_worker_error(rank, record))
        if found.error or found.exit or found.echoed:
            break
    return found


def _controller_error(run_dir: Path, since: float) -> str | None:
    """The failure of Ray Train's controller the driver recorded since ``since`` (it started
    the run again), or None."""
    path = run_dir / ERRORS_DIR / CONTROLLER_FILE
    try:
        if path.stat().st_mtime < since - 1.0:
            return None
        return str(json.loads(path.read_text())["message"])
    except (OSError, ValueError, KeyError):
        return None
