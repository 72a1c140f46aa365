"""The benches' doubling-then-bisection search (``bench.search.largest_fitting``)."""

from __future__ import annotations

import pytest

from bench.search import largest_fitting


@pytest.mark.parametrize(("limit", "start", "step", "tried", "best"), [
    # doubled to the first miss, then bisected until within 1/16 of the largest that fitted
    (37, 4, 1, [4, 8, 16, 32, 64, 48, 40, 36, 38], 36),
    (4864, 2048, 256, [2048, 4096, 8192, 6144, 5120, 4608, 4864], 4864),
    (3, 4, 1, [4, 2, 3], 3),  # the first trial misses
])
def test_the_search_doubles_then_bisects(limit: int, start: int, step: int, tried: list[int],
                                         best: int) -> None:
    seen: list[int] = []

    def fits(size: int) -> bool:
        seen.append(size)
        return size <= limit

    largest_fitting(fits, start, step)
    assert seen == tried
    assert max(size for size in seen if size <= limit) == best
