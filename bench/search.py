"""The search the "largest that fits" benches share: double until a trial does not fit, then
bisect."""

from __future__ import annotations

from collections.abc import Callable


def largest_fitting(fits: Callable[[int], bool], start: int, step: int = 1) -> None:
    """Call ``fits`` on ``start``, doubling until it returns False, then on midpoints (multiples
    of ``step``) until the bracket is within ``step`` or 1/16 of the largest that fitted. The
    caller keeps the trials ``fits`` ran and picks the largest that fitted."""
    low, high = 0, start
    while fits(high):
        low, high = high, high * 2
    while high - low > max(step, low // 16):
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
