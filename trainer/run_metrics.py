"""``RunMetrics``: one run's counters, its JSON-lines log, the summary and the metrics sink.

This is the only trainer code that knows metric names; they come from the contract in
``monitoring/metrics.py``. Per rank it appends to ``run_dir/metrics/rank-<rank>.jsonl`` (across
resumes): a record per log step and per evaluation. Where the context has a metrics sink, a
``monitoring.publisher.Publisher`` thread publishes every value every
``monitoring.publish_seconds`` (and at once on log steps): this run's running totals, the last
log step's gauges, host memory and, on CUDA, the allocator's and the device's figures, so gauges
never lapse between slow log steps. The allocator's peak belongs to a ``PeakTracker``: a log
record's peak covers its interval, the published one a sliding window, the summary's the run.
``summary()`` is what ``train()`` returns and rank 0 writes to ``summary.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from monitoring.memory import read_cuda_allocator, read_device_memory, read_host
from monitoring.metrics import spec
from monitoring.publisher import PeakTracker, Publisher
from trainer.memory import peak_memory_bytes

if TYPE_CHECKING:
    from trainer.context import WorkerContext
    from trainer.loop import StepResult
    from trainer.oom import BatchPlan
    from trainer.state import TrainState

log = logging.getLogger("memtrain")


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"


def device_values(device: torch.device, uuid: str, peaks: PeakTracker | None,
                  pinned_bytes: int) -> dict[str, float]:
    """Host memory and, on CUDA, the allocator's and the device's figures for the metrics
    contract; with ``peaks`` the allocator's peak is the tracker's window (and is reset)."""
    values = read_host(pinned_bytes)
    if device.type == "cuda":
        values.update(read_cuda_allocator(torch.cuda.memory_stats(device)))
        if peaks is not None:
            values["memtrain_gpu_memory_peak_allocated_bytes"] = peaks.sample()
        values.update(read_device_memory(device, uuid))
    return values


def peak_tracker(device: torch.device, window_seconds: float) -> PeakTracker:
    """The allocator's peak on CUDA; the process's peak RSS (never reset) on CPU."""
    if device.type == "cuda":
        return PeakTracker(lambda: torch.cuda.max_memory_allocated(device),
                           lambda: torch.cuda.reset_peak_memory_stats(device), window_seconds)
    return PeakTracker(lambda: peak_memory_bytes(device), lambda: None, window_seconds)


@dataclass
class _Window:
    """Steps since the last log step: what tokens/s and the data-wait share are taken over."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    wait_seconds: float = 0.0


@dataclass
class RunMetrics:
    ctx: WorkerContext
    run_name: str
    tokens_per_step: int  # all ranks together
    samples_per_rank_step: int
    seq_len: int
    wall_start: float = field(default_factory=time.perf_counter)
    steps_this_run: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    step_seconds: float = 0.0
    wait_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    first_loss: float | None = None
    last_loss: float | None = None
    eval_loss: float | None = None
    checkpoints_written: list[int] = field(default_factory=list)
    publish_seconds: float = 5.0
    peak_window_seconds: float = 60.0
    window: _Window = field(default_factory=_Window)

    def __post_init__(self) -> None:
        path = self.ctx.run_dir / "metrics" / f"rank-{self.ctx.rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self.peaks = peak_tracker(self.ctx.device, self.peak_window_seconds)
        self._gauges: dict[str, float] = {}  # the last log step's
        self._loader: Any = None
        self._publisher: Publisher | None = None

    def start_publishing(self, loader: Any) -> None:
        """Publish to the context's sink (if any) from now on; ``loader`` gives pinned bytes and
        skipped shards."""
        if self.ctx.metrics_sink is None:
            return
        sink = self.ctx.metrics_sink
        self._loader = loader
        self._uuid = sink.labels["gpu_uuid"]  # the sink's labels named the device already
        interval = min(self.publish_seconds, sink.max_publish_seconds or self.publish_seconds)
        self._publisher = Publisher(sink, self._current_values, interval).start()

    def close(self) -> None:
        """Publish the final values, the run no longer active, and close the log."""
        if self._publisher is not None:
            self._publisher.close({"memtrain_train_run_active": 0.0})
        self._log.close()

    def _current_values(self) -> dict[str, float]:
        """Every published value now (the publisher's thread): reads counters, no host sync."""
        samples = self.steps_this_run * self.samples_per_rank_step
        return {
            "memtrain_train_run_active": 1.0, **self._gauges,
            "memtrain_train_world_size": self.ctx.world_size,
            "memtrain_train_world_size_changes_total": int(
                self._loader.resized_from is not None),
            # This run's running totals (since the last start or resume).
            "memtrain_train_samples_total": samples,
            "memtrain_train_tokens_total": samples * self.seq_len,
            "memtrain_train_skipped_steps_total": self.skipped_steps,
            "memtrain_data_wait_seconds_total": self.wait_seconds,
            "memtrain_checkpoint_seconds_total": self.checkpoint_seconds,
            "memtrain_data_skipped_shards_total": self._loader.skipped_shards,
            **device_values(self.ctx.device, self._uuid, self.peaks, self._loader.pinned_bytes),
        }

    def _write(self, record: dict[str, Any]) -> None:
        self._log.write(json.dumps(record, sort_keys=True) + "\n")

    def step_done(self, result: StepResult, seconds: float) -> None:
        """Count one optimizer step (every step; no host sync)."""
        self.steps_this_run += 1
        self.skipped_steps += int(result.skipped)
        self.consecutive_skips = self.consecutive_skips + 1 if result.skipped else 0
        self.step_seconds += seconds
        self.wait_seconds += result.data_wait_seconds
        self.window.steps += 1
        self.window.wait_seconds += result.data_wait_seconds
        if self.ctx.metrics_sink is not None:
            self.ctx.metrics_sink.observe(spec("memtrain_train_step_seconds").name, seconds)

    def log_step(self, state: TrainState, result: StepResult, plan: BatchPlan) -> None:
        """A log step: the JSON-lines record, the publisher's gauges, rank 0's console line."""
        loss_value = result.loss.item()  # host sync: logging steps only
        self.first_loss = loss_value if self.first_loss is None else self.first_loss
        self.last_loss = loss_value
        elapsed = time.perf_counter() - self.window.start
        record: dict[str, Any] = {
            "step": state.step, "loss": loss_value, "grad_norm": result.grad_norm.item(),
            "lr": state.scheduler.get_last_lr()[0], "scale": state.scaler.get_scale(),
            "skipped_steps": self.skipped_steps,
            "tokens_per_second": self.window.steps * self.tokens_per_step / elapsed,
            "step_seconds": elapsed / self.window.steps,
            "data_wait_share": self.window.wait_seconds / elapsed,
            "peak_memory_bytes": self.peaks.take(),
            "micro_batch_size": plan.running_micro_batch,
            "accumulation_steps": plan.running_accumulation, "time": time.time(),
        }
        self._write(record)
        self._gauges = {
            "memtrain_train_loss": loss_value, "memtrain_train_grad_norm": record["grad_norm"],
            "memtrain_train_grad_scale": record["scale"],
            "memtrain_train_micro_batch_size": record["micro_batch_size"],
            "memtrain_train_accumulation_steps": record["accumulation_steps"]}
        if self._publisher is not None:
            self._publisher.poke()
        if self.ctx.is_main:
            log.info("step %5d | loss %.4f | %8.0f tok/s | peak %s | data wait %4.1f%%",
                     state.step, loss_value, record["tokens_per_second"],
                     format_bytes(record["peak_memory_bytes"]), 100 * record["data_wait_share"])
        self.window = _Window()

    def eval_done(self, step: int, loss: float) -> None:
        self.eval_loss = loss
        self._write({"step": step, "eval_loss": loss, "time": time.time()})
        if self.ctx.is_main:
            log.info("step %5d | eval loss %.4f", step, loss)

    def checkpoint_done(self, step: int, seconds: float) -> None:
        self.checkpoint_seconds += seconds
        self.checkpoints_written.append(step)

    def summary(self, state: TrainState, plan: BatchPlan, resumed_from: int | None,
                config: dict[str, Any], leak_guard: Any) -> dict[str, Any]:
        """The run's summary (``config``: run-level facts such as precision and workers)."""
        device = self.ctx.device
        findings = leak_guard.findings() if leak_guard is not None else []
        for finding in findings:
            log.warning("leak guard (rank %d): %s", self.ctx.rank, finding)
        seconds = self.step_seconds
        return {
            **config,
            "micro_batch_size": plan.running_micro_batch,
            "accumulation_steps": plan.running_accumulation, "oom_recoveries": plan.recoveries,
            "resumed_from_step": resumed_from, "final_step": state.step,
            "steps_this_run": self.steps_this_run, "first_loss": self.first_loss,
            "final_loss": self.last_loss, "eval_loss": self.eval_loss,
            "skipped_steps": self.skipped_steps,
            "tokens_per_second": (self.steps_this_run * self.tokens_per_step / seconds
                                  if seconds else None),
            "data_wait_share": self.wait_seconds / seconds if seconds else None,
            "peak_memory_bytes": self.peaks.overall(),
            "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "host_max_rss",
            "checkpoints_written": self.checkpoints_written, "leak_findings": findings,
            "leak_samples": [[x.step, x.live_tensors, x.resident_bytes, x.cuda_allocated_bytes]
                             for x in (leak_guard.samples if leak_guard is not None else [])],
            "wall_seconds": time.perf_counter() - self.wall_start,
            "run_dir": str(self.ctx.run_dir),
        }

    def write_summary(self, summary: dict[str, Any]) -> Path | None:
        if not self.ctx.is_main:
            return None
        path = self.ctx.run_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=2, sort_keys=True))
        return path


def row_fingerprint(row: Any) -> str:
    """A row's fingerprint in ``data.record_rows``' log: 8 bytes of blake2b, in hex, over its
    token ids as little-endian int64 (whatever the dataset's integer type): computed the same
    from a batch the loop trained on or from a row read from the dataset."""
    data = np.asarray(row, dtype="<i8")
    return hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()


class RowRecord:
    """``data.record_rows``: one JSON line per step, ``{"step", "rows": [fingerprint, ...],
    "world_size", "time"}``, the rows in the order this rank trained them. A step redone after a
    restart is recorded again, by the ranks of the group that redid it: a step's rows are those
    of the last group to train it (its latest lines, at that group's world size)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int):
        path = run_dir / "metrics" / f"rows-rank-{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self.world_size = world_size

    def record(self, step: int, micro_batches: list[Any]) -> None:
        rows = [row_fingerprint(row) for batch in micro_batches
                for row in np.asarray(batch.cpu().numpy(), dtype="<i8")]  # one copy a batch
        self._file.write(json.dumps({"step": step, "rows": rows, "world_size": self.world_size,
                                     "time": time.time()}) + "\n")

    def close(self) -> None:
        self._file.close()
