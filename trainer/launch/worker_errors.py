"""A failed worker's error, as the user reads it: one line, the rank and the worker's own error.

Each failing worker records its error in ``run_dir/errors/rank-<r>.json`` (best effort: a run
directory on another node leaves the launcher's fallback, the process's exit or Ray's own
exception); the launcher reads the lowest rank's and raises it as a ``WorkerError``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from trainer.errors import error_kind, first_line, is_user_error

log = logging.getLogger("memtrain")
ERRORS_DIR = "errors"  # run_dir/errors/rank-<r>.json: a failed worker's own error, one line
PREVIOUS_ERRORS_DIR = "errors-previous"  # the launch before
# A failing group's ranks record their errors within seconds of each other (Ray Train stops the
# rest once one failed); a restarted group's next failure comes after a restart, which takes
# longer.
FAILURE_SECONDS = 5.0
# A rank whose peer died fails in its next collective with one of these: an effect, not a cause.
# (Ray Train tears the group's process group down once a worker died: a rank still running then
# fails in its next collective without one.)
PEER_LOST = ("DistBackendError", "Connection closed by peer", "Connection reset by peer",
             "Broken pipe", "ActorUnavailableError", "ActorDiedError",
             "Default process group has not been initialized")


class WorkerError(RuntimeError):
    """A worker failed: the message is one line, the rank and the worker's own error. Exit 2
    when the worker's error is one a user fixes (config, data, checkpoint: a ValueError), else
    1, as for the same error in the driver."""

    one_line = True

    def __init__(self, rank: int, kind: str, message: str, user_error: bool):
        # kind "": the worker's message was written for the user and names what failed itself
        super().__init__(f"rank {rank}: " + ": ".join(part for part in (kind, message) if part))
        self.rank, self.kind = rank, kind
        self.exit_code = 2 if user_error else 1


def record_worker_error(run_dir: Path, rank: int, err: BaseException) -> None:
    """In a failing worker: keep its error where the launcher finds it (best effort: a run
    directory the driver cannot see, on another node, just leaves the launcher's fallback)."""
    record = {"kind": error_kind(err), "message": first_line(err, ""),
              "user_error": is_user_error(err)}
    try:
        path = run_dir / ERRORS_DIR / f"rank-{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    except OSError:
        log.debug("could not record rank %d's error in %s", rank, run_dir, exc_info=True)


def record_worker_exit(run_dir: Path, rank: int, how: str) -> None:
    """In the launcher: a worker that ended without an error of its own (``how``: "exited with
    code -9 (signal SIGKILL)"), for the next attempt's restart line (``trainer.recovery``)."""
    try:
        path = run_dir / ERRORS_DIR / f"rank-{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kind": "", "message": how, "user_error": False,
                                    "exited": True}))
    except OSError:
        log.debug("could not record rank %d's exit in %s", rank, run_dir, exc_info=True)


CONTROLLER_FILE = "controller.json"  # errors/controller.json: Ray Train's controller failed


def record_controller_error(run_dir: Path, message: str) -> None:
    """In the driver: Ray Train's controller failed (the run is started again), for the next
    attempt's restart line (``trainer.recovery``)."""
    try:
        path = run_dir / ERRORS_DIR / CONTROLLER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kind": "", "message": message, "user_error": False}))
    except OSError:
        log.debug("could not record the controller's error in %s", run_dir, exc_info=True)


def recorded_worker_error(run_dir: Path, rank: int | None = None,
                          directory: str = ERRORS_DIR) -> WorkerError | None:
    """The error a failed worker recorded: ``rank``'s, or the last failure's. Ray Train restarts
    a group after a failure, so earlier attempts' errors may stay in the directory: the last
    failure is the files written within ``FAILURE_SECONDS`` of the newest, and of those the
    lowest rank's own error (not a lost peer's echo, ``PEER_LOST``), else the
    lowest rank's."""
    found = []  # (mtime, rank, record)
    for path in (run_dir / directory).glob("rank-*.json"):
        number = path.stem.removeprefix("rank-")
        if not number.isdigit() or (rank is not None and int(number) != rank):
            continue
        try:
            found.append((path.stat().st_mtime, int(number), json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    if not found:
        return None
    newest = max(mtime for mtime, _, _ in found)
    last = sorted((r, record) for mtime, r, record in found if mtime >= newest - FAILURE_SECONDS)
    own = [(r, record) for r, record in last
           if not any(mark in record.get("message", "") or mark == record.get("kind")
                      for mark in PEER_LOST)]
    chosen, record = (own or last)[0]
    return WorkerError(chosen, record["kind"], record["message"], record["user_error"])


def clear_worker_errors(run_dir: Path) -> None:
    """Before a launch: the previous launch's errors move to ``errors-previous`` (one launch
    kept), where the next attempt reads why its predecessor ended (``trainer.recovery``)."""
    previous = run_dir / PREVIOUS_ERRORS_DIR
    shutil.rmtree(previous, ignore_errors=True)
    if (run_dir / ERRORS_DIR).is_dir():
        (run_dir / ERRORS_DIR).rename(previous)
