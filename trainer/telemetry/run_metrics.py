"""``RunMetrics``: one run's counters, its JSON-lines log, the summary and the metrics sink.

This is the only trainer code that knows metric names; they come from the contract in
``monitoring/metrics.py``. Per rank it appends to ``run_dir/metrics/rank-<rank>.jsonl`` (across
resumes): a record per log step and per evaluation. Where the context has a metrics sink, a
``monitoring.publisher.Publisher`` thread publishes every value every
``monitoring.publish_seconds`` (and at once on log steps): this run's running totals, the last
log step's gauges, host memory and, on CUDA, the allocator's and the device's figures, so gauges
never lapse between slow log steps. The allocator's peak belongs to a ``PeakTracker``: a log
record's peak covers its interval, the published one a sliding window, the summary's the run.
``summary()`` is what ``train()`` returns and rank 0 writes to ``summary.json``. Where the
config names experiment trackers, rank 0 also logs each record to them
(``monitoring.trackers``), and the summary, config and report at the end.

It is a sink of plain values: the loop reads its tensors (the host syncs are the loop's) and
takes every decision; this records, publishes and sums up.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from monitoring.memory import read_cuda_allocator, read_device_memory, read_host
from monitoring.metrics import spec
from monitoring.publisher import PeakTracker, Publisher
from monitoring.run_files import CONFIG, SUMMARY, rank_metrics
from monitoring.trackers import Trackers
from monitoring.units import format_bytes
from trainer.context import WorkerContext
from trainer.memory.allocator import peak_memory_bytes

log = logging.getLogger("memtrain")


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


@dataclass(frozen=True)
class StepRecord:
    """A log step's values, read by the loop: the JSON-lines record and the gauges."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    grad_scale: float
    micro_batch_size: int
    accumulation_steps: int
    oom_recoveries: int = 0


@dataclass
class _Window:
    """Steps since the last log step: what tokens/s and the data-wait share are taken over."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    wait_seconds: float = 0.0
    trained: Any = 0  # trained targets, where a loss mask leaves some out (a device tensor)


@dataclass
class RunMetrics:
    ctx: WorkerContext
    run_name: str
    tokens_per_step: int  # all ranks together
    samples_per_rank_step: int
    seq_len: int  # the tokens this rank holds of each row
    # False on a sequence-parallel group's other ranks: they hold parts of the first's rows,
    # whose samples are counted there once (their tokens are their own)
    counts_rows: bool = True
    wall_start: float = field(default_factory=time.perf_counter)
    steps_this_run: int = 0
    skipped_steps: int = 0
    step_seconds: float = 0.0
    wait_seconds: float = 0.0
    checkpoint_seconds: float = 0.0  # saving checkpoints, in the step or beside it
    checkpoint_blocking_seconds: float = 0.0  # of which the step waited
    first_loss: float | None = None
    last_loss: float | None = None
    eval_loss: float | None = None
    checkpoints_written: list[int] = field(default_factory=list)
    publish_seconds: float = 5.0
    peak_window_seconds: float = 60.0
    window: _Window = field(default_factory=_Window)
    trackers: Trackers = field(default_factory=lambda: Trackers([]))  # rank 0's, where asked
    # trainer.telemetry.restarts.Restarts: the run's restarts (rank 0's figures)
    restarts: Any = None
    total_steps: int = 0  # train.steps: the console line's N/TOTAL and its time left
    # A loss mask or packed documents: tokens/s counts the trained targets (read at log steps)
    # in place of every token of the global batch.
    counts_trained: bool = False
    trained_this_run: Any = 0

    def __post_init__(self) -> None:
        path = self.ctx.run_dir / rank_metrics(self.ctx.rank)
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
        self.trackers.close()  # ends a run that did not finish as failed
        self._log.close()

    def _current_values(self) -> dict[str, Any]:
        """Every published value now (the publisher's thread): reads counters, no host sync."""
        samples = self.steps_this_run * self.samples_per_rank_step
        return {
            "memtrain_train_run_active": 1.0, **self._gauges,
            "memtrain_train_world_size": self.ctx.world_size,
            "memtrain_train_world_size_changes_total": int(
                self._loader.resized_from is not None),
            # This run's running totals (since the last start or resume).
            "memtrain_train_samples_total": samples if self.counts_rows else 0,
            "memtrain_train_tokens_total": samples * self.seq_len,
            "memtrain_train_skipped_steps_total": self.skipped_steps,
            "memtrain_data_wait_seconds_total": self.wait_seconds,
            "memtrain_checkpoint_seconds_total": self.checkpoint_seconds,
            "memtrain_checkpoint_blocking_seconds_total": self.checkpoint_blocking_seconds,
            "memtrain_data_skipped_shards_total": self._loader.skipped_shards,
            **(self.restarts.metrics() if self.restarts is not None else {}),
            **device_values(self.ctx.device, self._uuid, self.peaks, self._loader.pinned_bytes),
        }

    def _write(self, record: dict[str, Any]) -> None:
        self._log.write(json.dumps(record, sort_keys=True) + "\n")

    def step_done(self, seconds: float, data_wait_seconds: float, skipped: bool,
                  trained: Any = None) -> None:
        """Count one optimizer step (every step; no host sync): ``trained``, the step's trained
        targets over every rank where some are left out (a device tensor, added on the
        device)."""
        if trained is not None:
            self.counts_trained = True
            self.window.trained = self.window.trained + trained
            self.trained_this_run = self.trained_this_run + trained
        self.steps_this_run += 1
        self.skipped_steps += int(skipped)
        self.step_seconds += seconds
        self.wait_seconds += data_wait_seconds
        self.window.steps += 1
        self.window.wait_seconds += data_wait_seconds
        if self.ctx.metrics_sink is not None:
            self.ctx.metrics_sink.observe(spec("memtrain_train_step_seconds").name, seconds)

    def log_step(self, values: StepRecord) -> None:
        """A log step: the JSON-lines record, the publisher's gauges, rank 0's console line."""
        self.first_loss = values.loss if self.first_loss is None else self.first_loss
        self.last_loss = values.loss
        elapsed = time.perf_counter() - self.window.start
        record: dict[str, Any] = {
            "step": values.step, "loss": values.loss, "grad_norm": values.grad_norm,
            "lr": values.lr, "scale": values.grad_scale, "skipped_steps": self.skipped_steps,
            "tokens_per_second": self._tokens(self.window.steps, self.window.trained) / elapsed,
            "tokens_counted": "trained" if self.counts_trained else "all",
            "step_seconds": elapsed / self.window.steps,
            "data_wait_share": self.window.wait_seconds / elapsed,
            "peak_memory_bytes": self.peaks.take(),
            "micro_batch_size": values.micro_batch_size,
            "accumulation_steps": values.accumulation_steps, "time": time.time(),
        }
        self._write(record)
        if self.trackers:
            self.trackers.log_metrics(values.step, {
                "loss": values.loss, "grad_norm": values.grad_norm, "lr": values.lr,
                "tokens_per_second": record["tokens_per_second"],
                "data_wait_share": record["data_wait_share"],
                "peak_memory_bytes": record["peak_memory_bytes"],
                "micro_batch_size": values.micro_batch_size,
                "oom_recoveries": values.oom_recoveries})
        self._gauges = {
            "memtrain_train_loss": values.loss, "memtrain_train_grad_norm": values.grad_norm,
            "memtrain_train_grad_scale": values.grad_scale,
            "memtrain_train_micro_batch_size": values.micro_batch_size,
            "memtrain_train_accumulation_steps": values.accumulation_steps}
        if self._publisher is not None:
            self._publisher.poke()
        if self.ctx.is_main:
            log.info("step %5d/%d | loss %.4f | %8.0f %s | peak %s | data wait %4.1f%% | %s",
                     values.step, self.total_steps, values.loss, record["tokens_per_second"],
                     "trained tok/s" if self.counts_trained else "tok/s",
                     format_bytes(record["peak_memory_bytes"]), 100 * record["data_wait_share"],
                     self.time_left(values.step))
        self.window = _Window()

    def _tokens(self, steps: int, trained: Any) -> float:
        """Tokens of ``steps`` steps: the trained targets where some are left out (a host sync,
        at log steps only), else every token of the global batch."""
        return float(trained) if self.counts_trained else steps * self.tokens_per_step

    def time_left(self, step: int) -> str:
        """``left 3m12s``: the steps still to run at this run's mean step time so far (steps
        only: evaluations and checkpoints to come are not counted)."""
        if not self.steps_this_run:
            return "left -"
        seconds = round(max(0, self.total_steps - step) * self.step_seconds / self.steps_this_run)
        hours, rest = divmod(seconds, 3600)
        text = f"{rest // 60}m{rest % 60:02d}s" if seconds >= 60 else f"{seconds}s"
        return f"left {hours}h{text}" if hours else f"left {text}"

    def eval_done(self, step: int, loss: float) -> None:
        self.eval_loss = loss
        self._write({"step": step, "eval_loss": loss, "time": time.time()})
        if self.trackers:
            self.trackers.log_metrics(step, {"eval_loss": loss})
        if self.ctx.is_main:
            log.info("step %5d | eval loss %.4f", step, loss)

    def checkpoint_done(self, step: int, seconds: float, in_background: bool = False) -> None:
        """A checkpoint the step waited ``seconds`` for: the whole save, or its staging where
        the save goes on ``in_background`` (its duration then comes to ``save_done``)."""
        self.checkpoint_blocking_seconds += seconds
        if not in_background:
            self.checkpoint_seconds += seconds
        self.checkpoints_written.append(step)

    def save_done(self, seconds: float) -> None:
        """A save that ran in the background took ``seconds`` (called on the save's thread)."""
        self.checkpoint_seconds += seconds

    def summary(self, facts: dict[str, Any]) -> dict[str, Any]:
        """The run's summary: ``facts`` (what the loop knows: precision, workers, the final
        step and micro-batch, ...) and what was measured."""
        seconds = self.step_seconds
        return {
            **facts,
            "steps_this_run": self.steps_this_run, "first_loss": self.first_loss,
            "final_loss": self.last_loss, "eval_loss": self.eval_loss,
            "skipped_steps": self.skipped_steps,
            "tokens_per_second": (self._tokens(self.steps_this_run, self.trained_this_run)
                                  / seconds if seconds else None),
            "tokens_counted": "trained" if self.counts_trained else "all",
            "data_wait_share": self.wait_seconds / seconds if seconds else None,
            "peak_memory_bytes": self.peaks.overall(),
            "peak_memory_kind": ("cuda_max_allocated" if self.ctx.device.type == "cuda"
                                 else "host_max_rss"),
            "checkpoints_written": self.checkpoints_written,
            "checkpoint_seconds": self.checkpoint_seconds,
            "checkpoint_blocking_seconds": self.checkpoint_blocking_seconds,
            "wall_seconds": time.perf_counter() - self.wall_start,
            "run_dir": str(self.ctx.run_dir),
        }

    def write_summary(self, summary: dict[str, Any]) -> Path | None:
        if not self.ctx.is_main:
            return None
        path = self.ctx.run_dir / SUMMARY
        path.write_text(json.dumps(summary, indent=2, sort_keys=True))
        if self.trackers:  # every rank's peaks, the run's files, the report drawn for them
            self.trackers.log_rank_peaks(self.ctx.run_dir, summary.get("resumed_from_step") or 0)
            self.trackers.finish([path, self.ctx.run_dir / CONFIG, *self._report()])
        return path

    def _report(self) -> list[Path]:
        """``report.png``, drawn from the metrics logs; a failure costs a warning, not the run."""
        from monitoring.report import render_report

        try:
            return [render_report(self.ctx.run_dir)]
        except Exception as err:
            log.warning("report.png not drawn for the trackers: %s: %s",
                        type(err).__name__, err)
            return []
