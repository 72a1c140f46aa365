"""Where metric values go: the standalone Prometheus exporter (``prometheus_client``).

A sink (``Sink``) takes values by contract name: ``set`` for gauges, ``set_total`` for counters
(given the running total; the sink adds the difference, so readers like the allocator's
``num_ooms`` can be passed as they are), ``observe`` for histograms. ``PrometheusSink`` keeps
its own registry and can serve it over HTTP on 127.0.0.1; its series carry the contract's labels
and the names Ray's endpoint would give (``ray_memtrain_...``). The Ray sink lives at the launch
edge (``trainer/launch/ray.py``), since only that imports ray.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from monitoring.metrics import LABELS, METRICS, STEP_SECONDS_BUCKETS, spec

LOOPBACK = "127.0.0.1"


class Sink(ABC):
    """Values by contract name; subclasses write one gauge, counter increment or observation.

    ``max_publish_seconds``: how often, at least, values must be republished for gauges to stay
    (None: they stay until replaced, as in the standalone exporter)."""

    max_publish_seconds: float | None = None

    def __init__(self, labels: Mapping[str, str]):
        missing = set(LABELS) - set(labels)
        if missing:
            raise ValueError(f"metric labels missing: {sorted(missing)}")
        self.labels = {k: str(labels[k]) for k in LABELS}
        self._totals: dict[tuple[Any, ...], float] = {}

    def set(self, values: Mapping[str, float | Mapping[str, float]]) -> None:
        """Gauges take the value; counters take a running total (see ``set_total``); a metric
        with an extra label takes {label value: running total}."""
        for name, value in values.items():
            if isinstance(value, Mapping):
                (label,) = spec(name).extra_labels
                for label_value, total in value.items():
                    self.set_total(name, total, {label: label_value})
            elif spec(name).kind == "counter":
                self.set_total(name, value)
            elif spec(name).kind == "gauge":
                self._set_gauge(name, value)
            else:
                raise TypeError(f"{name} is a histogram: use observe()")

    def set_total(self, name: str, total: float, extra: Mapping[str, str] | None = None) -> None:
        extra = dict(extra or {})
        if set(extra) != set(spec(name).extra_labels):
            raise ValueError(f"{name} takes the extra labels {spec(name).extra_labels}, "
                             f"not {sorted(extra)}")
        key = (name, *sorted(extra.items()))
        if key not in self._totals:
            self._start_counter(name, extra)
            self._totals[key] = 0.0
        delta = total - self._totals[key]
        if delta > 0:
            self._inc_counter(name, delta, extra)
            self._totals[key] = total

    def _start_counter(self, name: str,  # noqa: B027 - optional hook, no-op default
                       extra: Mapping[str, str]) -> None:
        """Make the counter's series exist at 0 where the transport can (Ray's cannot)."""

    def observe(self, name: str, value: float) -> None:
        if spec(name).kind != "histogram":
            raise TypeError(f"{name} is a {spec(name).kind}, not a histogram")
        self._observe(name, value)

    @abstractmethod
    def _set_gauge(self, name: str, value: float) -> None: ...

    @abstractmethod
    def _inc_counter(self, name: str, delta: float, extra: Mapping[str, str]) -> None: ...

    @abstractmethod
    def _observe(self, name: str, value: float) -> None: ...


class PrometheusSink(Sink):
    def __init__(self, labels: Mapping[str, str], registry: CollectorRegistry | None = None):
        super().__init__(labels)
        self.registry = registry or CollectorRegistry()
        self._metrics: dict[str, Gauge | Counter | Histogram] = {}
        for metric in METRICS:
            # prometheus_client appends _total to counters itself: give it the bare name.
            name = metric.exposed_name.removesuffix("_total")
            if metric.kind == "gauge":
                self._metrics[metric.name] = Gauge(name, metric.help, LABELS,
                                                   registry=self.registry)
            elif metric.kind == "counter":
                self._metrics[metric.name] = Counter(name, metric.help,
                                                     LABELS + metric.extra_labels,
                                                     registry=self.registry)
            else:
                self._metrics[metric.name] = Histogram(name, metric.help, LABELS,
                                                       buckets=STEP_SECONDS_BUCKETS,
                                                       registry=self.registry)

    def _set_gauge(self, name: str, value: float) -> None:
        self._metrics[name].labels(**self.labels).set(value)  # type: ignore[union-attr]

    def _inc_counter(self, name: str, delta: float, extra: Mapping[str, str]) -> None:
        self._metrics[name].labels(**self.labels, **extra).inc(delta)  # type: ignore[union-attr]

    def _start_counter(self, name: str, extra: Mapping[str, str]) -> None:
        self._metrics[name].labels(**self.labels, **extra)  # the series now exists, at 0

    def _observe(self, name: str, value: float) -> None:
        self._metrics[name].labels(**self.labels).observe(value)  # type: ignore[union-attr]

    def serve(self, port: int) -> int:
        """Serve this registry on 127.0.0.1:``port`` (0: any free port); returns the port."""
        try:
            server, _thread = start_http_server(port, addr=LOOPBACK, registry=self.registry)
        except OSError as err:
            raise ValueError(f"monitoring.port: cannot serve metrics on {LOOPBACK}:{port} "
                             f"({err.strerror or err})") from err
        return server.server_port
