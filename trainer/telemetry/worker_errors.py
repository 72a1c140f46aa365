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
from typing import Any

from monitoring.run_files import ERRORS_DIR, PREVIOUS_ERRORS_DIR
from trainer.errors import error_kind, first_line, is_user_error

log = logging.getLogger("memtrain")
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
    _write(run_dir, f"rank-{rank}.json", {"kind": error_kind(err),
                                         "message": first_line(err, ""),
                                         "user_error": is_user_error(err)})


def record_worker_exit(run_dir: Path, rank: int, how: str) -> None:
    """In the launcher: a worker that ended without an error of its own (``how``: "exited with
    code -9 (signal SIGKILL)"), for the next attempt's restart line
    (``trainer.telemetry.restarts``)."""
    _write(run_dir, f"rank-{rank}.json", {"kind": "", "message": how, "user_error": False,
                                         "exited": True})


CONTROLLER_FILE = "controller.json"  # errors/controller.json: Ray Train's controller failed


def record_controller_error(run_dir: Path, message: str) -> None:
    """In the driver: Ray Train's controller failed (the run is started again), for the next
    attempt's restart line (``trainer.telemetry.restarts``)."""
    _write(run_dir, CONTROLLER_FILE, {"kind": "", "message": message, "user_error": False})


def _write(run_dir: Path, name: str, record: dict[str, Any]) -> None:
    """``record`` as ``run_dir/errors/name``; best effort (a full disk loses it, not the run)."""
    try:
        path = run_dir / ERRORS_DIR / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    except OSError:
        log.debug("could not record %s in %s", name, run_dir, exc_info=True)


def error_records(run_dir: Path, directory: str = ERRORS_DIR) -> list[tuple[float, int, dict]]:
    """(time written, rank, record) of every rank's record in ``run_dir/directory``, by rank;
    unreadable ones left out."""
    found = []
    for path in (run_dir / directory).glob("rank-*.json"):
        number = path.stem.removeprefix("rank-")
        if not number.isdigit():
            continue
        try:
            found.append((path.stat().st_mtime, int(number), json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda entry: entry[1])


def is_peer_echo(record: dict[str, Any]) -> bool:
    """Whether a recorded error is a lost peer's echo (``PEER_LOST``), not a cause."""
    return any(mark in record.get("kind", "") or mark in record.get("message", "")
               for mark in PEER_LOST)


def as_worker_error(rank: int, record: dict[str, Any]) -> WorkerError:
    return WorkerError(rank, record["kind"], record["message"], record["user_error"])


def recorded_worker_error(run_dir: Path, rank: int | None = None,
                          directory: str = ERRORS_DIR) -> WorkerError | None:
    """The error a failed worker recorded: ``rank``'s where it is that rank's own (the rank
    seen failing first), else the last failure's. Ray Train restarts a group after a failure,
    so earlier attempts' errors may stay in the directory: the last failure is the files
    written within ``FAILURE_SECONDS`` of the newest, and of those the lowest rank's own error
    (not a lost peer's echo, ``is_peer_echo``), else the lowest rank's. A rank seen first whose
    record is an echo only lost its peer first: the cause is another rank's."""
    records = error_records(run_dir, directory)
    if rank is not None:
        mine = _last_failure([entry for entry in records if entry[1] == rank])
        if mine is not None and not is_peer_echo(mine[1]):
            return as_worker_error(*mine)
    chosen = _last_failure(records)
    return as_worker_error(*chosen) if chosen is not None else None


def _last_failure(records: list[tuple[float, int, dict]]) -> tuple[int, dict] | None:
    """(rank, record) of the last failure among ``records`` (``recorded_worker_error``)."""
    if not records:
        return None
    newest = max(mtime for mtime, _, _ in records)
    last = [(r, record) for mtime, r, record in records if mtime >= newest - FAILURE_SECONDS]
    own = [(r, record) for r, record in last if not is_peer_echo(record)]
    return (own or last)[0]


def clear_worker_errors(run_dir: Path) -> None:
    """Before a launch: the previous launch's errors move to ``errors-previous`` (one launch
    kept), where the next attempt reads why its predecessor ended
    (``trainer.telemetry.restarts``)."""
    previous = run_dir / PREVIOUS_ERRORS_DIR
    shutil.rmtree(previous, ignore_errors=True)
    if (run_dir / ERRORS_DIR).is_dir():
        (run_dir / ERRORS_DIR).rename(previous)
