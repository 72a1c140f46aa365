"""Console logging for memtrain's processes: one setup, before anything logs.

``setup_logging(level)`` sends every record at ``level`` or above to stderr: INFO and DEBUG as
the message alone, WARNING and above prefixed by their level (``warning: ...``), so callers log
warnings with ``log.warning`` and never type the prefix. The CLI sets the level once
(``--log-level``, ``-q``, ``-v``, ``--debug``) and exports it as ``MEMTRAIN_LOG_LEVEL``, so the
worker processes it starts log at the same level.
"""

from __future__ import annotations

import logging
import os

LEVEL_ENV = "MEMTRAIN_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")


class _ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {message}"
        return message


def log_level(name: str | None = None) -> int:
    """The logging level named ``name`` (``debug|info|warning|error``), else the one in
    ``$MEMTRAIN_LOG_LEVEL``, else INFO. Raises ValueError naming a level it does not know."""
    name = (name or os.environ.get(LEVEL_ENV) or "info").lower()
    if name not in LEVELS:
        raise ValueError(f"log level {name!r} is not one of {', '.join(LEVELS)}")
    return getattr(logging, name.upper())


def setup_logging(level: str | None = None) -> None:
    """Route the root logger to stderr at ``level`` (``log_level``), replacing any handler."""
    handler = logging.StreamHandler()
    handler.setFormatter(_ConsoleFormatter("%(message)s"))
    logging.basicConfig(handlers=[handler], level=log_level(level), force=True)
