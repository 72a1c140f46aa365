"""How memtrain turns an exception into the one line a user reads.

Every error a user sees is one line (``trainer.cli``): the first line of the exception's message,
or its type where the message is empty. An error the user fixes (a config, a dataset, a
checkpoint, their model's entry point) exits 2; any other failure exits 1.
"""

from __future__ import annotations


def first_line(err: BaseException, default: str | None = None) -> str:
    """The first non-blank line of ``err``'s message, stripped; ``default`` (else the error's
    type name) when the message is empty or blank."""
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()
    return default if default is not None else type(err).__name__


def is_user_error(err: BaseException) -> bool:
    """An error the user fixes (config, data, checkpoint, their model's entry point): exit 2.
    An error that carries its own ``exit_code`` says so itself."""
    return isinstance(err, ValueError | FileNotFoundError) or getattr(err, "exit_code", 1) == 2


def error_kind(err: BaseException) -> str:
    """How a one-line error names its type: not at all for an error whose message was written
    for the user (``one_line``, e.g. ``trainer.models.registry.ModelError``)."""
    return "" if getattr(err, "one_line", False) else type(err).__name__


class NonFiniteError(RuntimeError):
    """Training produced non-finite numbers that it cannot step over."""
