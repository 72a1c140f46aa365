"""Metrics overhead: the cost of recording the metrics contract against the step it describes.

Per optimizer step the loop observes one step time; every ``monitoring.publish_seconds`` a thread
publishes the whole contract (host, train and, on CUDA, allocator and NVML readings) to the sink.
This measures both with the standalone exporter's sink on the demo's model and reports
``observe / step time + publish / publish_seconds``: the share of the worker's time. Target:
<= 1%.

Experiment trackers (``monitoring.trackers``) cost rank 0 one call per log step: their rows
report ``log call / (log_every x step time)`` at the default ``train.log_every`` (10), for
TensorBoard and MLflow (its file store here, or ``--mlflow-uri`` for a server), each alone.
Run: ``make bench-metrics`` (writes ``bench/results/metrics-overhead-<date>-<host>.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import socket
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from bench.results import write_json
from monitoring.memory import gpu_uuid, worker_labels
from monitoring.publisher import Publisher
from monitoring.sinks import PrometheusSink
from monitoring.trackers import KINDS, open_trackers
from trainer.memory.precision import precision_policy, resolve_precision
from trainer.models.build import MemoryTransforms, build_model
from trainer.models.gpt import GPT, GPTConfig
from trainer.optim import build_optimizer
from trainer.step import train_step
from trainer.telemetry.run_metrics import device_values, peak_tracker


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tracker_log_seconds(kind: str, mlflow_uri: str | None, calls: int = 200) -> float:
    """The median time of one log step's call to tracker ``kind`` (what the loop waits for;
    MLflow's HTTP or file writes run on its asynchronous logging thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        trackers = open_trackers([kind], Path(tmp), "bench", mlflow_uri=mlflow_uri,
                                 params={"train.lr": "0.003"}, resumed_from=None)
        assert trackers, f"tracker {kind} did not start"
        step = iter(range(1, calls + 1))
        values = {"loss": 2.5, "grad_norm": 1.0, "lr": 3e-3, "tokens_per_second": 40000.0,
                  "data_wait_share": 0.01, "peak_memory_bytes": 5e8, "micro_batch_size": 8,
                  "oom_recoveries": 0}
        seconds = median_seconds(lambda: trackers.log_metrics(next(step), values), calls)
        trackers.finish([])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mlflow-uri", default=None,
                        help="an MLflow server to log to (default: a file store in a temp dir)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig(seq_len=256, n_layer=4, n_head=4, n_embd=128)  # the demo's model
    model = build_model(partial(GPT, cfg), MemoryTransforms("full"), device)
    policy = precision_policy(resolve_precision("auto", device).name, device)
    scaler = policy.grad_scaler(device)
    optimizer = build_optimizer(model, lr=1e-3)
    tokens = torch.randint(0, 256, (8, cfg.seq_len + 1), device=device)
    step = median_seconds(lambda: train_step(model, optimizer, scaler, [tokens, tokens], 1,
                                             policy, 1.0), args.steps)
    sink = PrometheusSink(worker_labels("bench", 0, 0, socket.gethostname(), device))
    uuid, peaks = gpu_uuid(device), peak_tracker(device, 60.0)
    totals = {"memtrain_train_tokens_total": 0.0}

    def read() -> dict[str, float]:
        totals["memtrain_train_tokens_total"] += 4096
        return {"memtrain_train_run_active": 1.0, "memtrain_train_loss": 2.5,
                "memtrain_train_grad_norm": 1.0, "memtrain_train_grad_scale": 1.0,
                "memtrain_train_micro_batch_size": 8, "memtrain_train_accumulation_steps": 2,
                **totals, **device_values(device, uuid, peaks, 0)}

    publisher = Publisher(sink, read, 5.0)  # not started: publish() timed in this thread
    publish_seconds = median_seconds(publisher.publish, 1000)
    observe_seconds = median_seconds(
        lambda: sink.observe("memtrain_train_step_seconds", 0.5), 10000)
    rows = {}
    for interval in (1, 5):
        share = observe_seconds / step + publish_seconds / interval
        rows[f"publish_every_{interval}s"] = {"overhead_seconds_per_step": share * step,
                                              "share_of_step": share}
    log_every = 10  # train.log_every's default
    trackers = {kind: tracker_log_seconds(kind, args.mlflow_uri) for kind in KINDS}
    for kind, seconds in trackers.items():
        share = seconds / (log_every * step)
        rows[f"tracker_{kind}"] = {"overhead_seconds_per_step": share * step,
                                   "share_of_step": share}
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "host": socket.gethostname(), "device": str(device), "torch": torch.__version__,
              "step_seconds": step, "publish_seconds": publish_seconds,
              "observe_seconds": observe_seconds, "tracker_log_seconds": trackers,
              "log_every": log_every, "rows": rows,
              "target_share": 0.01,
              "met": all(r["share_of_step"] <= 0.01 for r in rows.values())}
    write_json(args.out, "metrics-overhead", report, sort_keys=True)
    print(f"step {1000 * step:.1f} ms; publish {1e6 * publish_seconds:.0f} us; observe "
          f"{1e6 * observe_seconds:.1f} us")
    for name, row in rows.items():
        print(f"{name}: {1e6 * row['overhead_seconds_per_step']:.0f} us per step = "
              f"{100 * row['share_of_step']:.3f}% of step time (target <= 1%)")


if __name__ == "__main__":
    main()
