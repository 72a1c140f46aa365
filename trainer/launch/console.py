"""What a Ray run prints on the driver's console: memtrain's lines and Ray's warnings, without
the workers' and the controller's tracebacks.

A worker that fails, or one whose peer died, prints its traceback to its stderr, and Ray Train's
controller logs each failure with one; Ray forwards all of it to the driver. A run that recovers
from faults would scroll pages of them (``Connection closed by peer``, ``ActorDiedError``), where
memtrain says what happened in one line of its own (``restarted after ...``:
``trainer.telemetry.restarts``; a run that stops: its one error line). So the driver drops every
traceback block from the forwarded output: the ``Traceback (most recent call last):`` line, its
indented frames, the exception's lines up to the next line that is not part of it, and the
"During handling ..." chains between. Ray's own log files keep everything, and
``memtrain --debug train`` prints it all.
"""

from __future__ import annotations

from typing import Any

TRACEBACK = "Traceback (most recent call last):"
CHAINS = ("During handling of the above exception, another exception occurred:",
          "The above exception was the direct cause of the following exception:")


class TracebackFilter:
    """Drops traceback blocks from Ray's forwarded worker output, per worker process (a block
    may span several batches)."""

    def __init__(self) -> None:
        self._inside: dict[Any, str] = {}  # pid -> "frames" | "exception"

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        pid = batch.get("pid")
        kept = []
        for line in batch.get("lines", []):
            if self.drops(pid, line):
                continue
            kept.append(line)
        return {**batch, "lines": kept}

    def drops(self, pid: Any, line: str) -> bool:
        state = self._inside.get(pid)
        text = line.strip()
        if text == TRACEBACK or text in CHAINS:
            self._inside[pid] = "frames"
            return True
        if state is None:
            return False
        if not text:  # a blank line ends a block (chains restart it)
            return True
        if line.startswith((" ", "\t")):  # frames, code, an exception's indented details
            return True
        if state == "frames":  # the first unindented line: the exception itself
            self._inside[pid] = "exception"
            return True
        # After the exception: the next unindented line is the worker's own output again.
        del self._inside[pid]
        return False
