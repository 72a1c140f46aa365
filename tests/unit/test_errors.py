"""The one line a user reads for an exception."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.errors import error_kind, first_line, is_user_error
from trainer.models.registry import ModelError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("err, line", [
    (ValueError("bad value\ndetails"), "bad value"),
    (ValueError("\n  \n  second line is the first with text  \nmore"),
     "second line is the first with text"),
    (ValueError(""), "ValueError"),
    (OSError(), "OSError"),
    (KeyError("key"), "'key'"),
])
def test_the_first_line_of_any_message_even_an_empty_one(err: BaseException, line: str) -> None:
    assert first_line(err) == line


def test_an_empty_message_takes_the_default_when_given() -> None:
    assert first_line(RuntimeError("  "), "out of memory") == "out of memory"
    assert first_line(RuntimeError("real"), "out of memory") == "real"


def test_user_errors_and_their_kind() -> None:
    assert is_user_error(ValueError("x")) and is_user_error(FileNotFoundError("f"))
    assert not is_user_error(RuntimeError("x"))
    assert is_user_error(ModelError("model.name 'm:f': ValueError: x", 2))
    assert not is_user_error(ModelError("model.name 'm:f': RuntimeError: x", 1))
    assert error_kind(RuntimeError("x")) == "RuntimeError"
    assert error_kind(ModelError("m", 2)) == ""


def test_the_rank_seen_failing_first_gives_way_to_the_cause_when_it_only_lost_its_peer(
        tmp_path: Path) -> None:
    """The local launcher asks for the rank torch saw fail first: its own error where it has
    one, but a rank whose collective broke because rank 0 died reports rank 0's cause."""
    from trainer.telemetry.worker_errors import record_worker_error, recorded_worker_error

    record_worker_error(tmp_path, 0, OSError("checkpoint write failed at step 4"))
    record_worker_error(tmp_path, 1, RuntimeError("[pair.cc:553] Connection closed by peer"))
    assert str(recorded_worker_error(tmp_path, 1)) == \
        "rank 0: OSError: checkpoint write failed at step 4"
    record_worker_error(tmp_path, 1, ValueError("bad model"))  # a cause of its own
    assert str(recorded_worker_error(tmp_path, 1)) == "rank 1: ValueError: bad model"
    assert recorded_worker_error(tmp_path / "none", 1) is None
