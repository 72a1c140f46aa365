"""memtrain's monitoring: metric definitions, memory readers, sinks, dashboards and alert rules.

- ``metrics``: the contract, the single source of metric names, kinds, labels, units and help;
- ``memory``: memory readers, pure functions from raw readings to the contract's names;
- ``host``: this machine's CPU as memtrain sees it;
- ``publisher``: publishing on a timer (gauges that outlive an export cycle, peaks never lost);
- ``sinks``: where metric values go (the standalone Prometheus exporter);
- ``dashboards``: Grafana dashboards as code;
- ``trackers``: experiment trackers (MLflow, TensorBoard);
- ``report``: a run report as a PNG from the per-rank metrics logs;
- ``run_files``: the names inside a run directory, for every writer and reader;
- ``units``: byte sizes as people write and read them.

Never imports ``trainer``.
"""
