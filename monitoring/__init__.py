"""memtrain's monitoring: metric definitions, memory readers, sinks, dashboards and alert rules.

Never imports ``trainer``. ``metrics.py`` is the contract (names, kinds, labels); ``sinks.py``
exports it (Ray or the standalone Prometheus exporter); ``dashboards.py`` generates Grafana JSON.
"""
