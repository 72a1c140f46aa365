"""``RunMetrics``: one run's counters, its JSON-lines log, the summary and the metrics sink.

This is the only trainer code that knows metric names; they come from the contract in
``monitoring/metrics.py``. Per rank it appends to ``run_dir/metrics/rank-<rank>.jsonl`` (across
resumes): a record per log step and per evaluation. On log steps it publishes gauges and this
run's running totals to the context's sink; on CUDA the allocator's peak is reset afterwards,
so the next report's peak covers only its interval. ``summary()`` is what ``train()`` returns
and rank 0 writes to ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from monitoring.memory import read_cuda_allocator, read_host, read_nvml
from monitoring.metrics import spec
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


def publish_metrics(sink: Any, record: dict[str, Any], device: torch.device,
                    pinned_bytes: int, totals: dict[str, float]) -> None:
    """One log step's values for the metrics contract into ``sink``: the step ``record``'s
    gauges, the counters' running ``totals``, host memory and, on CUDA, the allocator's and
    NVML's figures (the allocator's peak is reset afterwards: peaks cover one interval)."""
    values = {
        "memtrain_train_loss": record["loss"], "memtrain_train_grad_norm": record["grad_norm"],
        "memtrain_train_grad_scale": record["scale"],
        "memtrain_train_micro_batch_size": record["micro_batch_size"],
        "memtrain_train_accumulation_steps": record["accumulation_steps"],
        **totals, **read_host(pinned_bytes),
    }
    if device.type == "cuda":
        values.update(read_cuda_allocator(torch.cuda.memory_stats(device)))
        values.update(read_nvml(device.index or 0))
        torch.cuda.reset_peak_memory_stats(device)
    sink.set({spec(name).name: value for name, value in values.items()})


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
    run_peak_bytes: int = 0  # on CUDA the allocator's peak is reset per metrics interval
    window: _Window = field(default_factory=_Window)

    def __post_init__(self) -> None:
        path = self.ctx.run_dir / "metrics" / f"rank-{self.ctx.rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def close(self) -> None:
        self._log.close()

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
        """A log step: the JSON-lines record, the sink, rank 0's console line."""
        device = self.ctx.device
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
            "peak_memory_bytes": peak_memory_bytes(device),
            "micro_batch_size": plan.running_micro_batch,
            "accumulation_steps": plan.running_accumulation, "time": time.time(),
        }
        self._write(record)
        self.run_peak_bytes = max(self.run_peak_bytes, record["peak_memory_bytes"])
        if self.ctx.metrics_sink is not None:
            self._publish(record, state.loader.pinned_bytes, state.loader.skipped_shards)
        if self.ctx.is_main:
            log.info("step %5d | loss %.4f | %8.0f tok/s | peak %s | data wait %4.1f%%",
                     state.step, loss_value, record["tokens_per_second"],
                     format_bytes(record["peak_memory_bytes"]), 100 * record["data_wait_share"])
        self.window = _Window()

    def _publish(self, record: dict[str, Any], pinned_bytes: int, skipped_shards: int) -> None:
        samples = self.steps_this_run * self.samples_per_rank_step
        publish_metrics(self.ctx.metrics_sink, record, self.ctx.device, pinned_bytes, {
            # This run's running totals (since the last start or resume).
            "memtrain_train_samples_total": samples,
            "memtrain_train_tokens_total": samples * self.seq_len,
            "memtrain_train_skipped_steps_total": self.skipped_steps,
            "memtrain_data_wait_seconds_total": self.wait_seconds,
            "memtrain_checkpoint_seconds_total": self.checkpoint_seconds,
            "memtrain_data_skipped_shards_total": skipped_shards,
        })

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
            "peak_memory_bytes": max(self.run_peak_bytes, peak_memory_bytes(device)),
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
