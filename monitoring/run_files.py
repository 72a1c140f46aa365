"""The names inside a run directory (``runs/<run-name>/`` or ``s3://.../<run-name>/``), one
place for every writer and reader: the trainer, the launchers, the run store, the reports and
the trackers. Here, in monitoring, because monitoring (the report, the trackers) reads and
writes run directories too and never imports the trainer; datapipe's row record is handed its
path by the loop.

::

    config.yaml                  the resolved config (prepare_run)
    summary.json                 the run's summary (rank 0, at the end)
    checkpoint-<step>/           checkpoints (trainer.checkpoint.files)
    metrics/rank-<r>.jsonl       each rank's step metrics (trainer.telemetry.run_metrics)
    metrics/rows-rank-<r>.jsonl  the rows each rank trained (data.record_rows)
    errors/rank-<r>.json         a failed worker's error, one line (trainer.telemetry.worker_errors)
    errors-previous/             the launch before's
    attempts.jsonl, progress     the run's starts and its last step (trainer.telemetry.restarts)
    profile/rank-<r>.trace.json  profiler traces (memory.profile_steps)
    memory/                      OOM reports, memory snapshots and summaries
    report.png                   memtrain report
    tensorboard/, tracking.json  the experiment trackers
"""

CONFIG = "config.yaml"
SUMMARY = "summary.json"
CHECKPOINT_PREFIX = "checkpoint-"
METRICS_DIR = "metrics"
ERRORS_DIR = "errors"
PREVIOUS_ERRORS_DIR = "errors-previous"
ATTEMPTS = "attempts.jsonl"
PROGRESS = "progress"
PROFILE_DIR = "profile"
MEMORY_DIR = "memory"
REPORT = "report.png"
TENSORBOARD_DIR = "tensorboard"
TRACKING_FILE = "tracking.json"  # the MLflow run to reopen on resume


def rank_metrics(rank: int) -> str:
    """``metrics/rank-<r>.jsonl``, relative to the run directory."""
    return f"{METRICS_DIR}/rank-{rank}.jsonl"


def rank_rows(rank: int) -> str:
    """``metrics/rows-rank-<r>.jsonl``, relative to the run directory."""
    return f"{METRICS_DIR}/rows-rank-{rank}.jsonl"
