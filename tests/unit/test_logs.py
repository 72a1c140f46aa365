"""The console's log: one setup for every command and worker, levels by flag, warnings
labelled by the formatter (callers never type the prefix)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from tests.unit.test_cli import DEMO, memtrain_here
from trainer.logs import LEVEL_ENV, log_level, setup_logging


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_levels_are_named_or_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    assert log_level() == logging.INFO
    assert log_level("WARNING") == logging.WARNING
    monkeypatch.setenv(LEVEL_ENV, "debug")  # what a worker started by the CLI reads
    assert log_level() == logging.DEBUG
    with pytest.raises(ValueError, match="log level 'loud' is not one of debug, info"):
        log_level("loud")


def test_warnings_carry_their_level_and_info_lines_do_not(
        root_logger: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("info")
    log = logging.getLogger("memtrain")
    log.debug("not shown")
    log.info("auto: precision fp32")
    log.warning("tracker mlflow dropped")
    assert capsys.readouterr().err.splitlines() == ["auto: precision fp32",
                                                    "warning: tracker mlflow dropped"]


def test_quiet_keeps_warnings_only_and_a_bad_level_is_one_line(
        root_logger: logging.Logger, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    result = memtrain_here(capsys, "-q", "plan", "-c", DEMO, "--device-memory", "lots")
    assert result.returncode == 2
    assert os.environ.pop(LEVEL_ENV) == "warning"  # exported for the workers it starts
    result = memtrain_here(capsys, "--log-level", "loud", "plan", "-c", DEMO)
    assert result.returncode == 2
    assert result.stderr.strip() == ("memtrain: error: Invalid value for --log-level: log "
                                     "level 'loud' is not one of debug, info, warning, error")
