"""The training entry point: one worker's run, written once against a ``WorkerContext``.

``train(cfg, ctx)`` builds a ``Trainer`` and runs it. ``Trainer.train`` reads top to bottom, as
torchtitan's ``Trainer.train`` and nanoGPT's loop do: build the state, restore the latest
checkpoint, a step loop, finish. Every concern of the loop is a named method or object:

- the step itself (``Trainer.step``: the step's RNG seed, OOM recovery around
  ``trainer.step.train_step``);
- the cadences of logging, evaluation and checkpoints (``due``), each a method that also tells
  the ``CompileWatch`` what to expect;
- what a checkpoint holds: ``TrainState`` (``trainer.state``); counters, logs, the summary and
  the metrics sink: ``RunMetrics`` (``trainer.telemetry.run_metrics``), which only records; the
  micro-batch a step runs at: a ``BatchPlan`` (``trainer.oom``);
- gc policy, loader threads, profiler and the metrics log: one ``ExitStack``, released on any
  exception.

The loop takes every decision (when to log, to stop on non-finite steps, to checkpoint); the
objects it calls do one thing each.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from datapipe.audit import RowRecord
from monitoring.run_files import rank_rows
from monitoring.trackers import Trackers, flatten, open_trackers
from trainer import faults
from trainer.batches import DOCUMENT_IDS, LOSS_MASK, TokenBatch, TokenLoader
from trainer.checkpoint.adapters import base_record
from trainer.checkpoint.async_save import AsyncSaves
from trainer.compat import allocator_settings, compile_counts
from trainer.context import WorkerContext
from trainer.errors import NonFiniteError
from trainer.memory.allocator import settle_host_memory
from trainer.memory.lora import describe_adapters
from trainer.memory.loss import computes_own_loss, takes_position_ids
from trainer.memory.nf4 import nf4_kept_in_bf16
from trainer.memory.optimizers import InBackward
from trainer.memory.precision import precision_policy, resolve_precision
from trainer.models.build import (
    checkpointed_blocks,
    compile_model,
)
from trainer.oom import (
    BatchPlan,
    OOMAgreement,
    oom_recovery_on,
    start_memory_history,
    step_with_oom_recovery,
)
from trainer.optim import Schedule, build_optimizer
from trainer.parallel.choice import parallelism_for, runs_fp16
from trainer.parallel.mesh import Mesh
from trainer.parallel.strategy import precision_route, step_policy
from trainer.state import TrainState
from trainer.step import StepResult, evaluate, step_seed, train_step
from trainer.telemetry.diagnostics import (
    Diagnostics,
    LeakGuard,
    profiler_window,
    write_memory_summary,
)
from trainer.telemetry.restarts import Restarts
from trainer.telemetry.run_metrics import RunMetrics, StepRecord

if TYPE_CHECKING:  # the loop runs without pydantic too (bench/gpu_check.py)
    from trainer.config import Config, DataConfig, MemoryConfig

log = logging.getLogger("memtrain")


def train(cfg: Config, ctx: WorkerContext, until_step: int | None = None) -> dict[str, Any]:
    """Train ``cfg.train.steps`` optimizer steps (resuming if a checkpoint exists).

    ``until_step`` stops early, with a checkpoint, at that step of the same schedule: a planned
    interruption (time-boxed jobs, resume tests).

    Returns the summary; rank 0 also writes it to ``run_dir/summary.json``.
    """
    return Trainer(cfg, ctx).train(until_step)


class Trainer:
    """One worker's training run."""

    def __init__(self, cfg: Config, ctx: WorkerContext):
        self.cfg, self.ctx = cfg, ctx
        self.precision = resolve_precision(cfg.memory.precision, ctx.device, runs_fp16(cfg))
        # how the work is split over the ranks: everything that differs between the ways
        self.parallel = parallelism_for(cfg, ctx.world_size, self.precision.name)
        # the ranks' layout: which rows this rank reads (the global batch divides over the
        # data ranks) and which slice of their tokens it trains
        self.mesh = self.parallel.mesh
        self.batch_plan = BatchPlan(cfg.train.micro_batch(),
                                    cfg.train.accumulation_steps(self.mesh.data_ranks))
        if ctx.device.type == "cpu":
            settle_host_memory(self.parallel.steady_transients, lean=cfg.model.lean_base())
        self.policy = step_policy(self.parallel, precision_policy(self.precision.name,
                                                                  ctx.device))
        self.watch = CompileWatch(ctx.rank, enabled=cfg.compiles_model(ctx.device.type))
        self.consecutive_skips = 0
        # train.checkpoint_async under the local launcher: saves on a thread
        # (trainer.checkpoint.async_save)
        self.saves = AsyncSaves() if ctx.saves_in_background else None

    def train(self, until_step: int | None = None) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        recording_history = start_memory_history(ctx.device, cfg.memory.record_memory_history)
        with contextlib.ExitStack() as resources:
            state = self.build_state(resources)
            resumed_from = state.restore(ctx, cfg.train.init_from, cfg.train.resume_from)
            state.wrap()
            self.log_start(state, resumed_from, recording_history)
            restarts = Restarts.begin(ctx.run_dir, ctx.is_main, ctx.launch_id, resumed_from,
                                      ctx.node_addresses(), ctx.lost_nodes)
            resources.callback(restarts.close)
            metrics = self.start_metrics(resources, state, resumed_from)
            metrics.restarts = restarts
            val_batches = self.validation_loader(resources)
            rows = self.row_record(resources)
            guard = LeakGuard() if cfg.memory.leak_check_every else None
            diagnostics = Diagnostics(ctx.rank)
            profiler = resources.enter_context(profiler_window(
                cfg.memory.profile_steps, state.step + 1, ctx.run_dir, ctx.rank, ctx.device))
            resources.enter_context(gc_policy(cfg.memory.gc_every))
            batches = TimedBatches(state.loader)
            first_step = state.step + 1
            stop_at = min(cfg.train.steps, until_step or cfg.train.steps)
            state.model.train()
            while state.step < stop_at:
                step_start = time.perf_counter()
                micro_batches, data_wait = batches.take(self.batch_plan.accumulation_steps)
                if rows is not None:
                    rows.record(state.step + 1, [batch.tokens for batch in micro_batches])
                result = self.step(state, micro_batches)
                del micro_batches
                state.scheduler.step()
                state.step += 1
                metrics.step_done(time.perf_counter() - step_start, data_wait, result.skipped,
                                  result.trained_tokens)
                restarts.step_done(state.step)
                if state.step == first_step:
                    self.watch.settle()  # the first step compiled forward and backward
                self.check_skips(result, state.step)
                is_last = state.step == stop_at
                if due(state.step, cfg.train.log_every, is_last) or state.step == first_step:
                    self.log_step(metrics, state, result)
                if val_batches is not None and due(state.step, cfg.train.eval_every, is_last):
                    self.evaluate(metrics, state, val_batches)
                if due(state.step, cfg.train.checkpoint_every, is_last):
                    self.checkpoint(metrics, state)
                after_step(cfg.memory, ctx, state.step, guard, profiler, diagnostics)
            if self.saves is not None:
                self.saves.wait()  # the last checkpoint is published before the run ends
            restarts.finish(state.step)
            summary = self.summary(metrics, state, resumed_from, guard, diagnostics)
            summary.update(restarts.summary())
            metrics.write_summary(summary)
        return summary

    def build_state(self, resources: contextlib.ExitStack) -> TrainState:
        """The model with its memory transforms (compiled, sharded where asked), AdamW, the
        schedule, the GradScaler and this rank's loader: everything a checkpoint holds."""
        cfg, ctx = self.cfg, self.ctx
        # built and made ready for its way of splitting, before the optimizer (FSDP's shards)
        model = self.parallel.build(cfg, ctx.device, self.compile)
        optimizer = build_optimizer(model, cfg.train.lr, cfg.train.weight_decay,
                                    cfg.train.betas, cfg.train.fused(),
                                    cfg.memory.optimizer_states, self.backward_hooks())
        return TrainState(
            model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, Schedule.of(cfg.train)),
            self.policy.grad_scaler(ctx.device, cfg.memory.grad_scaler_init_scale),
            resources.enter_context(build_loader(cfg.data, self.mesh, ctx.device,
                                                 self.batch_plan.micro_batch_size, cfg.run.seed)),
            # rank 0's checkpoints record a frozen base's files (hashed once here, if hashes)
            records=base_record(cfg) if ctx.is_main else {},
            parallel=self.parallel)

    def backward_hooks(self) -> InBackward | None:
        """Where the optimizer steps in backward (``memory.optimizer_in_backward``): as the way
        of splitting attaches its hooks; None: after backward."""
        return self.parallel.backward_hooks if self.cfg.memory.optimizer_in_backward else None

    def compile(self, model: torch.nn.Module) -> None:
        """torch.compile where asked: after checkpointing's wrappers, before DDP's or FSDP's."""
        if self.watch.enabled:
            compiled = compile_model(model)
            if self.ctx.is_main:
                log.info("torch.compile: %s (the first step compiles)", compiled)

    def start_metrics(self, resources: contextlib.ExitStack, state: TrainState,
                      resumed_from: int | None) -> RunMetrics:
        cfg, ctx = self.cfg, self.ctx
        trackers = Trackers([])
        if ctx.is_main and cfg.monitoring.trackers:
            trackers = open_trackers(
                cfg.monitoring.trackers, ctx.run_dir, cfg.run.name,
                mlflow_uri=cfg.monitoring.mlflow_tracking_uri,
                mlflow_experiment=cfg.monitoring.mlflow_experiment,
                params=flatten(cfg.model_dump(mode="json")), resumed_from=resumed_from)
        # tokens counted once: each rank counts the rows it reads at the tokens it holds of them
        metrics = RunMetrics(self.ctx, cfg.run.name,
                             cfg.train.global_batch_size * cfg.model.seq_len,
                             cfg.train.global_batch_size // self.mesh.data_ranks,
                             cfg.model.seq_len // self.mesh.sequence,
                             counts_rows=self.mesh.records_rows,
                             publish_seconds=cfg.monitoring.publish_seconds,
                             peak_window_seconds=cfg.monitoring.peak_window_seconds,
                             trackers=trackers, total_steps=cfg.train.steps)
        resources.callback(metrics.close)
        metrics.start_publishing(state.loader)
        return metrics

    def validation_loader(self, resources: contextlib.ExitStack) -> TokenLoader | None:
        if not (self.cfg.data.val_path and self.cfg.train.eval_every):
            return None
        return resources.enter_context(build_loader(
            self.cfg.data, self.mesh, self.ctx.device, self.batch_plan.micro_batch_size,
            self.cfg.run.seed, validation=True))

    def row_record(self, resources: contextlib.ExitStack) -> RowRecord | None:
        if not self.cfg.data.record_rows or not self.mesh.records_rows:  # one per data rank
            return None
        rows = RowRecord(self.ctx.run_dir / rank_rows(self.mesh.data_rank), self.mesh.data_ranks)
        resources.callback(rows.close)
        return rows

    def step(self, state: TrainState, micro_batches: list[TokenBatch]) -> StepResult:
        """One optimizer step on ``micro_batches``, retried at half the micro-batch after an
        OOM that the ranks agree on (``memory.oom_recovery``; not under FSDP over several ranks,
        whose reduce-scatter cannot wait for an agreement). Later steps keep the plan it took."""
        cfg, ctx = self.cfg, self.ctx

        def attempt(splits: int, agreement: OOMAgreement | None) -> StepResult:
            # Dropout's masks: from (seed, rank, step) alone, so a resumed or retried step
            # draws the same ones.
            torch.manual_seed(step_seed(cfg.run.seed, ctx.rank, state.step))
            return train_step(state.model, state.optimizer, state.scaler, micro_batches,
                              splits, self.policy, cfg.train.grad_clip, agreement,
                              self.parallel)

        agree = oom_recovery_on(cfg.memory.oom_recovery, ctx.device) \
            and self.parallel.agrees_on_oom \
            and not cfg.memory.optimizer_in_backward  # a retry would step twice
        result, self.batch_plan = step_with_oom_recovery(
            attempt, self.batch_plan, ctx, state.step + 1, agree, cfg.memory.max_oom_retries)
        return result

    def check_skips(self, result: StepResult, step: int) -> None:
        """Raise NonFiniteError when ``train.max_nonfinite_steps`` optimizer steps in a row had
        non-finite gradients (each one skipped)."""
        self.consecutive_skips = self.consecutive_skips + 1 if result.skipped else 0
        limit = self.cfg.train.max_nonfinite_steps
        if self.consecutive_skips >= limit:
            raise NonFiniteError(
                f"non-finite gradient norm for {self.consecutive_skips} consecutive steps, the "
                f"last at step {step} on rank {self.ctx.rank} (loss {result.loss.item():.4g}); "
                f"train.max_nonfinite_steps={limit}")

    def log_step(self, metrics: RunMetrics, state: TrainState, result: StepResult) -> None:
        metrics.log_step(StepRecord(
            step=state.step, loss=result.loss.item(),  # host sync: logging steps only
            grad_norm=result.grad_norm.item(), lr=float(state.scheduler.get_last_lr()[0]),
            grad_scale=state.scaler.get_scale(),
            micro_batch_size=self.batch_plan.running_micro_batch,
            accumulation_steps=self.batch_plan.running_accumulation,
            oom_recoveries=self.batch_plan.recoveries))
        self.watch.check(state.step)

    def evaluate(self, metrics: RunMetrics, state: TrainState, val_batches: TokenLoader) -> None:
        val_batches.rewind()
        self.watch.check(state.step)
        first_eval = metrics.eval_loss is None
        metrics.eval_done(state.step, evaluate(state.model, val_batches,
                                               self.cfg.train.eval_batches, self.policy,
                                               self.parallel))
        if first_eval:
            self.watch.settle()  # evaluation runs without grad: compiled once more

    def checkpoint(self, metrics: RunMetrics, state: TrainState) -> None:
        start = time.perf_counter()
        state.save(self.ctx, {"step": state.step, "loss": metrics.last_loss}, self.saves,
                   metrics.save_done)
        metrics.checkpoint_done(state.step, time.perf_counter() - start,
                                in_background=self.saves is not None)

    def summary(self, metrics: RunMetrics, state: TrainState, resumed_from: int | None,
                guard: LeakGuard | None, diagnostics: Diagnostics) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        findings = guard.findings() if guard is not None else []
        for finding in findings:
            log.warning("leak guard (rank %d): %s", ctx.rank, finding)
        return metrics.summary({
            "run": cfg.run.name, "workers": ctx.world_size, "device": ctx.device.type,
            "precision": self.policy.name,
            "activation_checkpointing": cfg.memory.activation_checkpointing,
            "global_batch_size": cfg.train.global_batch_size,
            "micro_batch_size": self.batch_plan.running_micro_batch,
            "accumulation_steps": self.batch_plan.running_accumulation,
            "oom_recoveries": self.batch_plan.recoveries, "resumed_from_step": resumed_from,
            "final_step": state.step, "leak_findings": findings,
            "diagnostics_off": diagnostics.off,
            "leak_samples": [[x.step, x.live_tensors, x.resident_bytes, x.cuda_allocated_bytes]
                             for x in (guard.samples if guard is not None else [])],
            **self.watch.summary()})

    def log_start(self, state: TrainState, resumed_from: int | None,
                  recording_history: bool) -> None:
        cfg, ctx, plan, precision = self.cfg, self.ctx, self.batch_plan, self.precision
        if not ctx.is_main:
            return
        if precision.warning:
            log.warning("%s", precision.warning)
        where = (f"resuming from step {resumed_from}" if resumed_from is not None else
                 f"from the weights of {cfg.train.init_from} (train.init_from; the optimizer, "
                 "schedule and data from their start)" if cfg.train.init_from else
                 "from scratch")
        loader = state.loader
        if loader.resized_from is not None:
            log.info("resized: the checkpoint was written by %d workers, this run has %d; the "
                     "global batch is kept by the accumulation steps, and epoch %d continues "
                     "with the %d batches per rank no rank has read yet (datapipe/split.py)",
                     loader.resized_from, self.mesh.data_ranks, loader.epoch,
                     loader.batches_in(loader.epoch) - loader.batch_index)
        log.info("training %s: %d workers, %s, precision %s, activation checkpointing %s "
                 "(blocks %s), micro-batch %d x accumulation %d x %d %s = global batch "
                 "%d; %s", cfg.run.name, ctx.world_size, ctx.device.type,
                 f"{precision.name} ({precision.reason}{precision_route(self.parallel)})",
                 cfg.memory.activation_checkpointing,
                 checkpointed_blocks(state.unwrapped), plan.micro_batch_size,
                 plan.accumulation_steps, self.mesh.data_ranks,
                 "workers" if self.mesh.sequence == 1 else
                 f"data ranks (sequence groups of {self.mesh.sequence})",
                 cfg.train.global_batch_size, where)
        if state.schedule_change is not None:
            log.info("%s", state.schedule_change)
        description = self.parallel.describe()
        if description is not None:
            log.info("%s", description)
        strategies = describe_strategies(cfg.memory, state.unwrapped, ctx.device)
        if strategies:
            log.info("memory strategies: %s", "; ".join(strategies))
        kept = nf4_kept_in_bf16(state.unwrapped)
        if kept is not None:
            log.warning("%s", kept)
        chunk = getattr(state.unwrapped, "loss_chunk_tokens", 0)
        log.info("loss: %s (memory.loss_chunk_tokens %s)",
                 f"output projection and cross-entropy in chunks of {chunk} tokens" if chunk else
                 "full logits, then cross-entropy" + ("" if computes_own_loss(state.unwrapped)
                                                      else " (the model computes no loss of "
                                                           "its own)"),
                 cfg.memory.loss_chunk_tokens)
        if loader.masked:
            log.info("data: %s", describe_masks(loader.columns, state.unwrapped))
        if ctx.device.type == "cuda":
            log.info("CUDA allocator settings: %s; memory history %s",
                     allocator_settings(), "recording" if recording_history else "off")


def describe_masks(columns: list[str], model: torch.nn.Module) -> str:
    """The log's line on what a fine-tuning dataset's columns change (``trainer.batches``)."""
    said = []
    if LOSS_MASK in columns:
        said.append(f"the loss takes the targets its {LOSS_MASK} marks (tokens/s counts them)")
    if DOCUMENT_IDS in columns:
        said.append("packed documents (document_ids): no target across a boundary; " + (
            "attention within each document (positions restart at each)"
            if takes_position_ids(model) else
            f"{type(model).__name__} takes no position_ids, so attention crosses documents"))
    return "; ".join(said)


def describe_strategies(memory: MemoryConfig, model: torch.nn.Module,
                        device: torch.device) -> list[str]:
    """The log's line on the memory strategies a run has on (none: an empty list)."""
    said = describe_adapters(model)
    if any(p.dtype == torch.bfloat16 for p in model.parameters() if p.requires_grad):
        said.append("weights bf16 with no fp32 copy (model.dtype), each update rounded into "
                    "them stochastically")
    if memory.optimizer_states != "fp32":
        said.append(f"AdamW states {memory.optimizer_states} (torchao)")
    if memory.optimizer_in_backward:
        said.append("the optimizer steps in backward, each parameter as its gradient completes")
    if memory.activation_offload != "none":
        where = "pinned host buffers on a side stream" if device.type == "cuda" else \
            "copies within host memory: on CPU host and device are one memory, so it saves " \
            "nothing here"
        said.append(f"activation offload {memory.activation_offload} ({where})")
    return said


class CompileWatch:
    """What torch.compile costs a run: the seconds it spent compiling, and the frames it
    compiled after warm-up (the first step, and the first evaluation, which runs without
    grad). Each of those is a recompilation: a new input shape (an OOM recovery's smaller
    micro-batch) or a changed guard, paid at a compile's price again, so each is warned.
    Disabled (``train.compile`` off), it watches nothing and sums up to None."""

    def __init__(self, rank: int, enabled: bool):
        self.rank, self.enabled = rank, enabled
        self.seconds_at_start = compile_counts()[1] if enabled else 0.0
        self.settled: int | None = None
        self.recompilations = 0

    def settle(self) -> None:
        if self.enabled:
            self.settled = compile_counts()[0]

    def check(self, step: int) -> None:
        if not self.enabled:
            return
        frames = compile_counts()[0]
        if self.settled is not None and frames > self.settled:
            self.recompilations += frames - self.settled
            log.warning("rank %d: torch.compile recompiled %d frame(s) by step %d (%d in this "
                        "run): a new input shape or a changed guard, each paid at a compile's "
                        "price (TORCH_LOGS=recompiles says which)", self.rank,
                        frames - self.settled, step, self.recompilations)
            self.settled = frames

    def summary(self) -> dict[str, Any]:
        if not self.enabled:
            return {"compile_seconds": None, "recompilations": None}
        return {"compile_seconds": compile_counts()[1] - self.seconds_at_start,
                "recompilations": self.recompilations}


class TimedBatches:
    """Wraps a batch iterator and accumulates the seconds spent waiting on it."""

    def __init__(self, batches: Iterator[TokenBatch]):
        self.batches = batches
        self.wait_seconds = 0.0

    def __next__(self) -> TokenBatch:
        start = time.perf_counter()
        batch = next(self.batches)
        self.wait_seconds += time.perf_counter() - start
        return batch

    def take(self, count: int) -> tuple[list[TokenBatch], float]:
        """The next ``count`` batches and the seconds spent waiting for them."""
        before = self.wait_seconds
        taken = [next(self) for _ in range(count)]
        return taken, self.wait_seconds - before


def due(step: int, every: int, is_last: bool) -> bool:
    """Whether a cadence of ``every`` steps (0: never, but always on the last step) is due."""
    return is_last or bool(every and step % every == 0)


def after_step(memory: MemoryConfig, ctx: WorkerContext, step: int, guard: LeakGuard | None,
               profiler: Any, diagnostics: Diagnostics) -> None:
    """The memory hygiene and diagnostics of a step's end, each on its own cadence; a
    diagnostic that fails is turned off with a warning (``Diagnostics``), never the run."""
    if memory.gc_every and step % memory.gc_every == 0:
        gc.collect(1)
    diagnostics.run("the profiler", profiler.step)
    if step in memory.memory_summary_steps:
        summary_path = diagnostics.run("memory.memory_summary_steps", lambda: write_memory_summary(
            ctx.run_dir, step, ctx.rank, ctx.device))
        if summary_path is None and ctx.is_main and step == memory.memory_summary_steps[0] \
                and ctx.device.type != "cuda":
            log.warning("memory.memory_summary_steps: torch.cuda.memory_summary needs CUDA; "
                        "ignored on %s", ctx.device.type)
    if guard is not None and step % memory.leak_check_every == 0:
        diagnostics.run("the leak guard", lambda: guard.sample(step, ctx.device))
    faults.at_step_end(ctx.run_dir, step, ctx.rank)  # MEMTRAIN_FAULTS stall and kill


@contextlib.contextmanager
def gc_policy(every: int) -> Iterator[None]:
    """``memory.gc_every`` > 0: automatic gc off (the loop collects on its cadence), and back on
    when the block ends, however it ends."""
    if every:
        gc.disable()
    try:
        yield
    finally:
        if every:
            gc.enable()


def build_loader(data: DataConfig, mesh: Mesh, device: torch.device,
                 micro_batch_size: int, seed: int, validation: bool = False) -> TokenLoader:
    """The loader of this rank's data rank of the ``mesh``'s data ranks, of ``data.path``
    (shuffled) or, for ``validation``, of ``data.val_path`` (in order, rewound before each
    evaluation): its token column and, where the dataset has them, its loss mask and document
    ids (``trainer.batches``)."""
    if validation:
        assert data.val_path is not None, "validation needs data.val_path"
        return TokenLoader(data.val_path, data.column, rank=mesh.data_rank,
                           world_size=mesh.data_ranks, batch_size=micro_batch_size, seed=seed,
                           shuffle=False, device=device, on_bad_shard=data.on_bad_shard)
    return TokenLoader(data.path, data.column, rank=mesh.data_rank, world_size=mesh.data_ranks,
                       batch_size=micro_batch_size, seed=seed, shuffle=data.shuffle,
                       device=device, shuffle_window=data.shuffle_window,
                       prefetch=data.prefetch, read_ahead=data.read_ahead,
                       on_bad_shard=data.on_bad_shard)
