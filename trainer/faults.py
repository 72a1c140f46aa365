"""Fault injection for tests, through one environment variable: ``MEMTRAIN_FAULTS``.

A comma-separated list of ``KIND@STEP`` or ``KIND@STEP:RANK`` (rank 0 when left out), steps
1-based optimizer steps:
- ``oom@3:1``: rank 1 raises ``torch.OutOfMemoryError`` halfway through step 3's micro-batches,
  on the step's first attempt only (OOM recovery then retries it): ``oom_armed`` around an
  attempt, ``maybe_oom`` before each micro-batch;
- ``checkpoint@4[:RANK]``: the checkpoint of step 4 fails after its files are written, before
  it is published: rank 0 (or ``RANK``) raises, the other ranks then lose it as a peer; once per
  run directory, so a restarted run gets past it;
- ``savekill@4``: rank 0 SIGKILLs itself in step 4's checkpoint, its files written and not yet
  published (once per run directory);
- ``kill@5:1``: rank 1 SIGKILLs itself at the end of step 5, once per run directory (a marker
  file in the run directory keeps a restarted worker from doing it again);
- ``stall@3``: rank 0 sleeps ``STALL_SECONDS`` at the end of step 3, as a long evaluation, a
  slow checkpoint or a stuck peer would hold it (the other ranks wait in the next collective);
  once per run directory, as ``kill``;
- ``hold@3``: rank 0 waits at the end of step 3 until the file ``.faults-release`` appears in
  the run directory (at most ``HOLD_SECONDS``): a test holds the run where it is while it
  changes the cluster around it; once per run directory.

Both launchers carry the variable to their workers (the local one hands each worker the
launcher's environment; the Ray launcher passes it in the loop config, since Ray's workers start
before a test could set it). Unset, every check is a dictionary lookup. Production code has no
other test hooks: no function takes a parameter for tests.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ENV = "MEMTRAIN_FAULTS"
KINDS = ("oom", "checkpoint", "savekill", "kill", "stall", "hold")
# Three times the gauge expiry of the tests' Ray cluster (two 1 s export intervals).
STALL_SECONDS = 6.0
HOLD_SECONDS = 180.0
RELEASE_FILE = ".faults-release"
log = logging.getLogger("memtrain")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}"


def parse_faults(text: str) -> tuple[Fault, ...]:
    """``"oom@3:1,kill@5"`` -> faults; raises ValueError naming the bad item."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, at, where = item.partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not at or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV} item {item!r} is not KIND@STEP[:RANK] with KIND one of "
                             f"{', '.join(KINDS)}")
        faults.append(Fault(kind, int(step), int(rank or 0)))
    return tuple(faults)


def active() -> tuple[Fault, ...]:
    return parse_faults(os.environ.get(ENV, ""))


def wanted(kind: str, step: int, rank: int) -> bool:
    """Whether ``MEMTRAIN_FAULTS`` asks for a ``kind`` fault at ``step`` on ``rank``."""
    return Fault(kind, step, rank) in active()


_OOM_ARMED: contextvars.ContextVar[bool] = contextvars.ContextVar("memtrain_oom_armed",
                                                                  default=False)


@contextlib.contextmanager
def oom_armed(step: int, rank: int, first_attempt: bool) -> Iterator[None]:
    """Around one attempt of a step: arm ``maybe_oom`` where ``oom@STEP:RANK`` asks for this
    step and rank and the attempt is the step's first."""
    token = _OOM_ARMED.set(first_attempt and wanted("oom", step, rank))
    try:
        yield
    finally:
        _OOM_ARMED.reset(token)


def maybe_oom(index: int, count: int) -> None:
    """Before micro-batch ``index`` of ``count``: raise the armed OOM at the middle one."""
    if _OOM_ARMED.get() and index == count // 2:
        import torch  # only where an OOM is injected: this module needs no torch otherwise

        raise torch.OutOfMemoryError(f"out of memory (injected by {ENV})")


def maybe_fail_checkpoint(run_dir: Path, step: int, rank: int) -> None:
    """``checkpoint@STEP[:RANK]``: fail this step's checkpoint write on that rank (rank 0 when
    left out), once per run directory; ``savekill@STEP:RANK``: SIGKILL the rank there instead,
    its files written and not published (a crash in the middle of a save, asynchronous or
    not), once per run directory."""
    if any(f.kind == "checkpoint" and f.step == step for f in active()) and \
            _first_time(run_dir, Fault("checkpoint", step, rank)):
        raise OSError(f"checkpoint write failed at step {step} (injected by {ENV})")
    if _first_time(run_dir, Fault("savekill", step, rank)):
        log.warning("rank %d: killed by %s while saving step %d", rank, ENV, step)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_stall(run_dir: Path, step: int, rank: int) -> None:
    """``stall@STEP:RANK``: hold this rank at the end of the step for ``STALL_SECONDS``, once
    per run directory."""
    if _first_time(run_dir, Fault("stall", step, rank)):
        log.warning("rank %d: stalled %.0f s by %s at the end of step %d", rank, STALL_SECONDS,
                    ENV, step)
        time.sleep(STALL_SECONDS)


def maybe_hold(run_dir: Path, step: int, rank: int) -> None:
    """``hold@STEP:RANK``: wait at the end of the step until ``RELEASE_FILE`` is in the run
    directory (at most ``HOLD_SECONDS``), once per run directory."""
    if not _first_time(run_dir, Fault("hold", step, rank)):
        return
    log.warning("rank %d: held by %s at the end of step %d", rank, ENV, step)
    deadline = time.monotonic() + HOLD_SECONDS
    while not (run_dir / RELEASE_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def _first_time(run_dir: Path, fault: Fault) -> bool:
    """Whether ``fault`` is asked for and has not fired in ``run_dir`` yet (then it has)."""
    if fault not in active():
        return False
    marker = run_dir / ".faults-fired" / str(fault).replace(":", "-")
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return True


def at_step_end(run_dir: Path, step: int, rank: int) -> None:
    """The faults that fire at the end of a step: ``stall``, ``hold``, then ``kill``."""
    maybe_stall(run_dir, step, rank)
    maybe_hold(run_dir, step, rank)
    maybe_kill(run_dir, step, rank)


def maybe_kill(run_dir: Path, step: int, rank: int) -> None:
    """``kill@STEP:RANK``: SIGKILL this process at the end of the step, once per run dir."""
    fault = Fault("kill", step, rank)
    if not _first_time(run_dir, fault):
        return
    # Ray's controller registers a reported checkpoint when it next polls the workers; wait for
    # that, so the kill lands after the checkpoint is known, as a real preemption would.
    time.sleep(3)
    log.warning("rank %d: killed by %s=%s at the end of step %d", rank, ENV, fault, step)
    os.kill(os.getpid(), signal.SIGKILL)
