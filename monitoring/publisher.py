"""Publishing on a timer: gauges that outlive Ray's export cycle, peaks that are never lost.

Ray's metrics agent drops a gauge that was not refreshed for two export intervals (Ray 2.60:
``2 x metrics_report_interval_ms``, 20 s by default), and Prometheus marks a series stale when a
scrape lacks it. Publishing only on log steps would let every gauge vanish between slow log
steps (big models, evaluation and checkpoint pauses) and reset the alerts' ``for:`` timers. So a
worker's values are published by one thread (``Publisher``) every ``interval`` seconds, and at
once when a log step pokes it; that thread is the sink's only writer of gauges and counters.

Peaks (``PeakTracker``): the CUDA allocator's peak is read and reset only here. The published
peak is the highest value seen in the last ``window`` seconds, sliding: a one-step spike stays in
every export and every scrape for ``window`` seconds, so with ``window`` at least the export
interval plus the scrape interval no scrape misses it, and ``max_over_time`` over a range is the
true peak of that range (to within one ``interval`` at its start).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

log = logging.getLogger("memtrain")


class PeakTracker:
    """The running peak of a resettable high-water mark (the allocator's), kept three ways:
    over a sliding ``window`` of seconds (published), since the last ``take()`` (a log step's
    interval), and over the whole run."""

    def __init__(self, read_peak: Callable[[], float], reset_peak: Callable[[], None],
                 window_seconds: float, clock: Callable[[], float] = time.monotonic):
        self._read, self._reset, self._clock = read_peak, reset_peak, clock
        self.window_seconds = window_seconds
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, float]] = deque()
        self._since_take = 0.0
        self.run_peak = 0.0

    def sample(self) -> float:
        """Fold the peak since the last sample in (and reset it); the window's peak."""
        with self._lock:
            now = self._clock()
            # Between the read and the reset a new high could be made and lost; both are a
            # few microseconds apart, far shorter than any step that allocates.
            peak = self._read()
            self._reset()
            self.run_peak = max(self.run_peak, peak)
            self._since_take = max(self._since_take, peak)
            self._recent.append((now, peak))
            while self._recent[0][0] < now - self.window_seconds:
                self._recent.popleft()
            return max(value for _, value in self._recent)

    def take(self) -> float:
        """The peak since the previous ``take()``, then start a new interval."""
        self.sample()
        with self._lock:
            peak, self._since_take = self._since_take, 0.0
        return peak

    def overall(self) -> float:
        """The peak over everything sampled so far, now included."""
        self.sample()
        return self.run_peak


class Publisher:
    """Every ``interval`` seconds, and when poked, ``sink.set(read())`` from one daemon thread.

    ``close(final)`` stops the thread and publishes ``read()`` updated with ``final`` from the
    caller's thread, so the last values (the run's final totals) are in the sink when it returns.
    A failing ``read`` or ``set`` is logged once and does not stop training.
    """

    def __init__(self, sink: object, read: Callable[[], Mapping[str, float]],
                 interval_seconds: float):
        self._sink, self._read, self.interval_seconds = sink, read, interval_seconds
        self._wake = threading.Event()
        self._stopping = False
        self._failed = False
        self._lock = threading.Lock()  # one publish at a time: counters publish deltas
        self._thread = threading.Thread(target=self._run, name="memtrain-metrics", daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def poke(self) -> None:
        self._wake.set()

    def close(self, final: Mapping[str, float] | None = None) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.publish(final)

    def publish(self, overrides: Mapping[str, float] | None = None) -> None:
        with self._lock:
            try:
                values = {**self._read(), **(overrides or {})}
                self._sink.set(values)  # type: ignore[attr-defined]
            except Exception:
                if not self._failed:
                    log.exception("publishing metrics failed (logged once; training goes on)")
                self._failed = True

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.interval_seconds)
            self._wake.clear()
            if not self._stopping:
                self.publish()
