"""What a run tells its user while it trains and after it ends.

- ``run_metrics``: one run's counters, its JSON-lines log, the summary and the metrics sink;
- ``diagnostics``: a leak guard, a profiler window, allocator summaries;
- ``restarts``: why the previous attempt ended and what recovering cost;
- ``worker_errors``: a failed worker's error as the user reads it, one line naming its rank.
"""
