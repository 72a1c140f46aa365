"""The training loop in plain torch, written once against a ``WorkerContext``.

Three functions, from small to large:
- ``forward_backward``: one micro-batch under autocast, loss scaled for accumulation, backward.
- ``train_step``: one optimizer step over its micro-batches; DDP's ``no_sync()`` on all but the
  last so gradients are all-reduced once per step, then unscale, clip, non-finite check, step,
  ``zero_grad(set_to_none=True)``.
- ``train``: builds everything from the config slices, resumes, and keeps the cadence of logging,
  evaluation and checkpoints.

Loss normalisation: each rank divides its summed token loss by the tokens it sees in the whole
optimizer step (micro-batch x accumulation x sequence length); DDP then averages over ranks, so the
gradient is that of the mean loss over the global batch, whatever the split into micro-batches and
ranks. Every rank sees the same number of tokens per step (fixed-length rows), which this needs.

Host syncs: one per optimizer step (the finite check of the grad norm, which GradScaler needs
anyway) and loss values only on logging steps. Nothing holds a graph across steps: the loss is
accumulated detached.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from datapipe.loader import BatchLoader
from monitoring.memory import read_cuda_allocator, read_host, read_nvml
from trainer.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.compat import allocator_settings
from trainer.context import WorkerContext
from trainer.diagnostics import LeakGuard, ProfilerWindow, cpu_peak_bytes, write_memory_summary
from trainer.loss import summed_loss
from trainer.memory import (
    PrecisionPolicy,
    apply_activation_checkpointing,
    bf16_norm_inputs,
    peak_memory_bytes,
    precision_policy,
    set_loss_chunking,
)
from trainer.model import build_model
from trainer.oom import (
    OOMAgreement,
    StepOutOfMemory,
    all_reduce_gradients,
    injected_oom,
    start_memory_history,
    write_oom_report,
)
from trainer.sharding import is_sharded, load_sharded, local_tensor, save_sharded, shard_model

if TYPE_CHECKING:  # the loop runs without pydantic too (scripts/gpu_check.py)
    from trainer.config import Config, MemoryConfig, TrainConfig

log = logging.getLogger("memtrain")


@dataclass
class StepResult:
    loss: torch.Tensor  # detached mean token loss over this rank's micro-batches
    grad_norm: torch.Tensor
    skipped: bool  # non-finite gradients: the optimizer did not step
    data_wait_seconds: float = 0.0  # filled in by the caller, which fetches the batches


class NonFiniteError(RuntimeError):
    """Training produced non-finite numbers that it cannot step over."""


class TimedBatches:
    """Wraps a batch iterator and accumulates the seconds spent waiting on it."""

    def __init__(self, batches: Iterator[torch.Tensor]):
        self.batches = batches
        self.wait_seconds = 0.0

    def __next__(self) -> torch.Tensor:
        start = time.perf_counter()
        batch = next(self.batches)
        self.wait_seconds += time.perf_counter() - start
        return batch


def forward_backward(model: nn.Module, tokens_BT: torch.Tensor, policy: PrecisionPolicy,
                     scaler: torch.amp.GradScaler, tokens_per_step: int) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its summed token loss, detached."""
    loss_sum = summed_loss(model, tokens_BT, policy)
    scaler.scale(loss_sum / tokens_per_step).backward()
    return loss_sum.detach()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               micro_batches: list[torch.Tensor], splits: int, policy: PrecisionPolicy,
               grad_clip: float, agreement: OOMAgreement | None = None,
               inject_oom: bool = False) -> StepResult:
    """One optimizer step over ``micro_batches``, each cut into ``splits`` chunks.

    ``splits`` > 1 after an OOM: the same samples in smaller pieces, so the update is the same.
    With an ``agreement``, an OOM on any rank raises ``StepOutOfMemory`` on every rank.
    """
    chunks = [chunk for mb in micro_batches for chunk in mb.chunk(splits)]  # views, no copies
    tokens_per_step = sum(chunk[:, 1:].numel() for chunk in chunks)
    loss_sum = torch.zeros((), device=chunks[0].device)
    # With OOM agreement across ranks, DDP must not all-reduce inside backward (a peer may have
    # failed): every micro-batch runs under no_sync and gradients are reduced after the check.
    reduce_after_check = isinstance(model, DDP) and agreement is not None \
        and agreement.distributed
    oom_message = None
    try:
        for i, tokens_BT in enumerate(chunks):
            is_last = i == len(chunks) - 1
            if inject_oom and i == len(chunks) // 2:
                raise torch.OutOfMemoryError("out of memory (injected by MEMTRAIN_INJECT_OOM)")
            # Gradients are all-reduced (DDP) or reduce-scattered (FSDP) only on the last
            # micro-batch of the step.
            sync = model.no_sync() if isinstance(model, DDP) and \
                (reduce_after_check or not is_last) else contextlib.nullcontext()
            if is_sharded(model):
                model.set_requires_gradient_sync(is_last)  # type: ignore[operator]
            with sync:
                loss_sum += forward_backward(model, tokens_BT, policy, scaler, tokens_per_step)
    except torch.OutOfMemoryError as err:
        if agreement is None:
            raise
        oom_message = str(err).strip().splitlines()[0] if str(err) else "out of memory"
    # Outside the handler: the OOM's traceback, and the activations its frames hold, are gone.
    del chunks
    if agreement is not None:  # (an OOM without an agreement was re-raised above)
        try:
            agreement.check(local_oom=oom_message)
        except StepOutOfMemory:
            optimizer.zero_grad(set_to_none=True)  # drop the partial gradients
            raise
    if reduce_after_check:
        all_reduce_gradients(list(model.parameters()), dist.get_world_size())
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: the norm is a DTensor
        grad_norm = grad_norm.full_tensor()
    finite = bool(torch.isfinite(grad_norm))  # host sync: once per optimizer step
    if finite or scaler.is_enabled():
        scaler.step(optimizer)  # with fp16 the scaler itself skips non-finite steps
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum / tokens_per_step, grad_norm.detach(), not finite)


def step_peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, tokens_BT: torch.Tensor,
                    policy: PrecisionPolicy, grad_clip: float = 1.0) -> int:
    """CPU: the allocator's peak over one ``train_step`` on ``tokens_BT``, counting the
    parameters, optimizer state and tokens alive before it (``diagnostics.cpu_peak_bytes``)."""
    state = [value for per_param in optimizer.state.values() for value in per_param.values()
             if isinstance(value, torch.Tensor)]
    return cpu_peak_bytes(
        lambda: train_step(model, optimizer, scaler, [tokens_BT], 1, policy, grad_clip),
        held=[*model.parameters(), *state, tokens_BT])


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterator[torch.Tensor], num_batches: int,
             policy: PrecisionPolicy) -> float:
    """Mean token loss over ``num_batches`` batches on every rank, under ``no_grad``."""
    was_training = model.training
    model.eval()
    total = None  # [summed loss, token count], on the device so NCCL can reduce it
    for _ in range(num_batches):
        tokens_BT = next(batches)
        loss = summed_loss(model, tokens_BT, policy)
        targets_BT = tokens_BT[:, 1:]
        count = torch.tensor(targets_BT.numel(), dtype=torch.float64, device=loss.device)
        batch_total = torch.stack([loss.double(), count])
        total = batch_total if total is None else total + batch_total
    assert total is not None, "evaluate needs num_batches >= 1"
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak."""
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine
    return factor


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def _step_seed(seed: int, rank: int, step: int) -> int:
    return (seed * 1_000_003 + rank * 7919 + step) % (2**63)


class MetricsLog:
    """Per-rank JSON lines in ``run_dir/metrics/rank-<rank>.jsonl`` (appended across resumes)."""

    def __init__(self, run_dir: Path, rank: int):
        path = run_dir / "metrics" / f"rank-{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        self._file.close()


def train(cfg: Config, ctx: WorkerContext, until_step: int | None = None) -> dict[str, Any]:
    """Train ``cfg.train.steps`` optimizer steps (resuming if a checkpoint exists).

    ``until_step`` stops early, with a checkpoint, at that step of the same schedule: a planned
    interruption (time-boxed jobs, resume tests).

    Returns the summary; rank 0 also writes it to ``run_dir/summary.json``.
    """
    wall_start = time.perf_counter()
    device = ctx.device
    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
    model = build_model(cfg.model.name, **cfg.model.model_dump(exclude={"name"})).to(device)
    checkpointed = apply_activation_checkpointing(model, cfg.memory.activation_checkpointing,
                                                  cfg.memory.checkpoint_every_k)
    set_loss_chunking(model, cfg.memory.loss_chunk_tokens)
    bf16_norm_inputs(model, cfg.memory.bf16_norm_inputs)
    policy = precision_policy(cfg.memory.precision, device)
    scaler = policy.grad_scaler(device, cfg.memory.grad_scaler_init_scale)
    recording_history = start_memory_history(device, cfg.memory.record_memory_history)
    sharded = cfg.parallel.strategy == "fsdp" and ctx.world_size > 1
    if sharded:
        shard_model(model)  # before the optimizer: it must see the sharded parameters
    optimizer = build_optimizer(model, cfg.train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
    accumulation = cfg.train.accumulation_steps(ctx.world_size)
    loader = BatchLoader(cfg.data.path, cfg.data.column, rank=ctx.rank,
                         world_size=ctx.world_size, batch_size=cfg.train.micro_batch(),
                         seed=cfg.run.seed, shuffle=cfg.data.shuffle, device=device,
                         shuffle_window=cfg.data.shuffle_window, prefetch=cfg.data.prefetch,
                         read_ahead=cfg.data.read_ahead, on_bad_shard=cfg.data.on_bad_shard)

    resumed_from = restore_latest(ctx, model, optimizer, scaler, scheduler, loader, sharded,
                                  cfg.parallel.strategy)
    step = resumed_from or 0
    if ctx.world_size > 1 and not sharded:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    samples_per_rank_step = cfg.train.global_batch_size // ctx.world_size
    if ctx.is_main:
        where = f"resuming from step {resumed_from}" if resumed_from is not None else "from scratch"
        log.info("training %s: %d workers, %s, precision %s, activation checkpointing %s "
                 "(blocks %s), micro-batch %d x accumulation %d x %d workers = global batch %d; %s",
                 cfg.run.name, ctx.world_size, device.type, policy.name,
                 cfg.memory.activation_checkpointing, checkpointed, cfg.train.micro_batch(),
                 accumulation, ctx.world_size, cfg.train.global_batch_size, where)
        if device.type == "cuda":
            log.info("CUDA allocator settings: %s; memory history %s",
                     allocator_settings(), "recording" if recording_history else "off")

    metrics_log = MetricsLog(ctx.run_dir, ctx.rank)
    batches = TimedBatches(loader)
    val_batches = None
    if cfg.data.val_path and cfg.train.eval_every:
        val_batches = BatchLoader(cfg.data.val_path, cfg.data.column, rank=ctx.rank,
                                  world_size=ctx.world_size,
                                  batch_size=cfg.train.micro_batch(), seed=cfg.run.seed,
                                  shuffle=False, device=device,
                                  on_bad_shard=cfg.data.on_bad_shard)
    first_loss = last_loss = eval_loss = None
    checkpoints_written: list[int] = []
    window_start, window_steps, window_wait = time.perf_counter(), 0, 0.0
    total_wait = total_step_seconds = checkpoint_seconds = 0.0
    steps_this_run = skipped_steps = consecutive_skips = 0
    run_peak_bytes = 0  # on CUDA the allocator's peak is reset per metrics interval
    model.train()
    stop_at = min(cfg.train.steps, until_step or cfg.train.steps)
    guard = LeakGuard() if cfg.memory.leak_check_every else None
    profiler = ProfilerWindow(cfg.memory.profile_steps, ctx.run_dir, ctx.rank, device)
    splits = 1  # pieces each loaded micro-batch is cut into; doubles after each OOM
    if cfg.memory.gc_every:
        gc.disable()  # collected on our cadence below, not in the middle of a step
    while step < stop_at:
        profiler.before_step(step + 1)
        step_start = time.perf_counter()
        wait_before = batches.wait_seconds
        micro_batches = [next(batches) for _ in range(accumulation)]
        data_wait = batches.wait_seconds - wait_before
        # Under FSDP the reduce-scatter cannot wait for an agreement: OOM recovery there is per
        # rank only (world size 1), see trainer/oom.py.
        result, splits = step_with_oom_recovery(
            ctx, step, model, optimizer, scaler, micro_batches, splits, policy, cfg,
            agree=oom_recovery_on(cfg, ctx.device) and not sharded)
        del micro_batches
        result.data_wait_seconds = data_wait
        scheduler.step()
        step += 1
        steps_this_run += 1
        skipped_steps += int(result.skipped)
        consecutive_skips = consecutive_skips + 1 if result.skipped else 0
        if consecutive_skips >= cfg.train.max_nonfinite_steps:
            raise NonFiniteError(
                f"non-finite gradient norm for {consecutive_skips} consecutive steps, the last "
                f"at step {step} on rank {ctx.rank} (loss {result.loss.item():.4g}); "
                f"train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}")
        step_seconds = time.perf_counter() - step_start
        total_step_seconds += step_seconds
        if ctx.metrics_sink is not None:
            ctx.metrics_sink.observe("memtrain_train_step_seconds", step_seconds)
        total_wait += result.data_wait_seconds
        window_steps += 1
        window_wait += result.data_wait_seconds

        is_last = step == stop_at
        if step % cfg.train.log_every == 0 or is_last or steps_this_run == 1:
            loss_value = result.loss.item()  # host sync: logging steps only
            first_loss = loss_value if first_loss is None else first_loss
            last_loss = loss_value
            elapsed = time.perf_counter() - window_start
            record: dict[str, Any] = {
                "step": step, "loss": loss_value, "grad_norm": result.grad_norm.item(),
                "lr": scheduler.get_last_lr()[0], "scale": scaler.get_scale(),
                "skipped_steps": skipped_steps,
                "tokens_per_second": window_steps * tokens_per_step / elapsed,
                "step_seconds": elapsed / window_steps,
                "data_wait_share": window_wait / elapsed,
                "peak_memory_bytes": peak_memory_bytes(device),
                "micro_batch_size": -(-cfg.train.micro_batch() // splits),
                "accumulation_steps": accumulation * splits, "time": time.time(),
            }
            metrics_log.write(record)
            run_peak_bytes = max(run_peak_bytes, record["peak_memory_bytes"])
            if ctx.metrics_sink is not None:
                publish_metrics(ctx.metrics_sink, record, device, loader.pinned_bytes, {
                    "memtrain_train_samples_total": steps_this_run * samples_per_rank_step,
                    "memtrain_train_tokens_total": steps_this_run * samples_per_rank_step
                    * cfg.model.seq_len,
                    "memtrain_train_skipped_steps_total": skipped_steps,
                    "memtrain_data_wait_seconds_total": total_wait,
                    "memtrain_checkpoint_seconds_total": checkpoint_seconds,
                    "memtrain_data_skipped_shards_total": loader.skipped_shards,
                })
            if ctx.is_main:
                log.info("step %5d | loss %.4f | %8.0f tok/s | peak %s | data wait %4.1f%%",
                         step, loss_value, record["tokens_per_second"],
                         format_bytes(record["peak_memory_bytes"]),
                         100 * record["data_wait_share"])
            window_start, window_steps, window_wait = time.perf_counter(), 0, 0.0

        if val_batches is not None and (step % cfg.train.eval_every == 0 or is_last):
            val_batches.rewind()
            eval_loss = evaluate(model, val_batches, cfg.train.eval_batches, policy)
            metrics_log.write({"step": step, "eval_loss": eval_loss, "time": time.time()})
            if ctx.is_main:
                log.info("step %5d | eval loss %.4f", step, eval_loss)

        if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or is_last:
            checkpoint_start = time.perf_counter()
            _checkpoint(ctx, step, model, optimizer, scaler, scheduler, loader,
                        {"step": step, "loss": last_loss}, sharded)
            checkpoint_seconds += time.perf_counter() - checkpoint_start
            checkpoints_written.append(step)
        if cfg.memory.gc_every and step % cfg.memory.gc_every == 0:
            gc.collect(1)
        trace = profiler.after_step(step)
        if trace is not None and ctx.is_main:
            log.info("step %5d | profiler trace (memory on) written to %s", step, trace)
        if step in cfg.memory.memory_summary_steps:
            summary_path = write_memory_summary(ctx.run_dir, step, ctx.rank, device)
            if summary_path is None and ctx.is_main and step == cfg.memory.memory_summary_steps[0]:
                log.warning("memory.memory_summary_steps: torch.cuda.memory_summary needs CUDA; "
                            "ignored on %s", device.type)
        if guard is not None and step % cfg.memory.leak_check_every == 0:
            guard.sample(step, device)
        maybe_kill_for_test(ctx, step)
    if cfg.memory.gc_every:
        gc.enable()

    metrics_log.close()
    leak_findings = guard.findings() if guard is not None else []
    for finding in leak_findings:
        log.warning("leak guard (rank %d): %s", ctx.rank, finding)
    summary = {
        "run": cfg.run.name, "workers": ctx.world_size, "device": device.type,
        "precision": policy.name, "activation_checkpointing": cfg.memory.activation_checkpointing,
        "micro_batch_size": -(-cfg.train.micro_batch() // splits),
        "accumulation_steps": accumulation * splits, "oom_recoveries": splits.bit_length() - 1,
        "global_batch_size": cfg.train.global_batch_size, "resumed_from_step": resumed_from,
        "final_step": step, "steps_this_run": steps_this_run, "first_loss": first_loss,
        "final_loss": last_loss, "eval_loss": eval_loss, "skipped_steps": skipped_steps,
        "tokens_per_second": (steps_this_run * tokens_per_step / total_step_seconds
                              if total_step_seconds else None),
        "data_wait_share": total_wait / total_step_seconds if total_step_seconds else None,
        "peak_memory_bytes": max(run_peak_bytes, peak_memory_bytes(device)),
        "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "host_max_rss",
        "checkpoints_written": checkpoints_written, "leak_findings": leak_findings,
        "leak_samples": [[x.step, x.live_tensors, x.resident_bytes, x.cuda_allocated_bytes]
                         for x in (guard.samples if guard is not None else [])],
        "wall_seconds": time.perf_counter() - wall_start,
        "run_dir": str(ctx.run_dir),
    }
    loader.close()
    if val_batches is not None:
        val_batches.close()
    if ctx.is_main:
        (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def restore_latest(ctx: WorkerContext, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler, scheduler: torch.optim.lr_scheduler.LRScheduler,
                   loader: BatchLoader, sharded: bool, strategy: str) -> int | None:
    """Load the context's latest checkpoint into everything; returns its step, or None."""
    with ctx.latest_checkpoint() as checkpoint_dir:
        if checkpoint_dir is None:
            return None
        state = load_checkpoint(checkpoint_dir)
        if bool(state.get("sharded")) != sharded:
            how = "with" if state.get("sharded") else "without"
            raise CheckpointError(
                f"checkpoint {checkpoint_dir} was written {how} FSDP sharding; this run has "
                f"parallel.strategy {strategy!r} on {ctx.world_size} workers")
        if sharded:
            load_sharded(checkpoint_dir, model, optimizer)
        else:
            load_model_state(model, state["model"], str(checkpoint_dir))
            optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        return int(state["step"])


def oom_recovery_on(cfg: Config, device: torch.device) -> bool:
    """``memory.oom_recovery``, with ``auto`` resolved: on for CUDA, off on CPU."""
    if cfg.memory.oom_recovery == "auto":
        return device.type == "cuda"
    return bool(cfg.memory.oom_recovery)


def step_with_oom_recovery(ctx: WorkerContext, step: int, model: nn.Module,
                           optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                           micro_batches: list[torch.Tensor], splits: int,
                           policy: PrecisionPolicy, cfg: Config, agree: bool
                           ) -> tuple[StepResult, int]:
    """``train_step``, retried with the micro-batches cut in two after each agreed OOM.

    Returns the result and the splits it took (the caller keeps them for later steps).
    """
    attempt = 0
    while True:
        torch.manual_seed(_step_seed(cfg.run.seed, ctx.rank, step))  # resume-exact dropout
        agreement = OOMAgreement(ctx.device) if agree else None
        try:
            result = train_step(model, optimizer, scaler, micro_batches, splits, policy,
                                cfg.train.grad_clip, agreement,
                                inject_oom=injected_oom(step + 1, ctx.rank, attempt))
            return result, splits
        except StepOutOfMemory as err:
            attempt += 1
            splits = recover_from_oom(ctx, step + 1, splits, attempt, cfg.memory,
                                      cfg.train.micro_batch(),
                                      cfg.train.accumulation_steps(ctx.world_size), str(err))


KILL_FILE = ".inject-kill"


def maybe_kill_for_test(ctx: WorkerContext, step: int) -> None:
    """Tests: a file ``RUN_DIR/.inject-kill`` holding ``step:rank`` makes that rank SIGKILL itself
    at the end of that step, once (the file is renamed first, so the restarted worker does not do
    it again). A file, not an environment variable, because Ray's workers are started before a
    test could set one. Costs one ``stat`` per step.
    """
    spec_file = ctx.run_dir / KILL_FILE
    if not spec_file.exists():
        return
    want_step, _, want_rank = spec_file.read_text().strip().partition(":")
    if step == int(want_step) and ctx.rank == int(want_rank or 0):
        spec_file.rename(spec_file.with_name(KILL_FILE + ".done"))
        # Ray's controller registers reported checkpoints when it next polls the workers; give
        # it time, so the kill lands after the checkpoint is known, as a real preemption would.
        time.sleep(3)
        log.warning("rank %d: killing itself after the checkpoint at step %d (%s)", ctx.rank,
                    step, spec_file)
        os.kill(os.getpid(), signal.SIGKILL)


def publish_metrics(sink: Any, record: dict[str, Any], device: torch.device,
                    pinned_bytes: int, totals: dict[str, float]) -> None:
    """One log step's values for the metrics contract (monitoring/metrics.py) into ``sink``.

    Counters are this run's running totals (since the last start or resume). On CUDA the
    allocator's peak is reset afterwards, so the next report's peak covers only its interval.
    """
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
        torch.cuda.reset_peak_memory_stats(device)  # peaks cover one reporting interval
    sink.set(values)


def recover_from_oom(ctx: WorkerContext, step: int, splits: int, attempt: int,
                     memory: MemoryConfig, micro_batch_size: int, accumulation: int,
                     detail: str) -> int:
    """Snapshot, then halve the micro-batch (double the splits); returns the new splits.

    Raises RuntimeError when retries are used up or the micro-batch cannot be halved further.
    """
    report = write_oom_report(ctx.run_dir, step, ctx.rank, ctx.device, detail,
                              -(-micro_batch_size // splits))
    new_splits = splits * 2
    if attempt > memory.max_oom_retries or new_splits > micro_batch_size:
        raise RuntimeError(
            f"out of memory at step {step} on rank {ctx.rank} with micro-batch "
            f"{-(-micro_batch_size // splits)} after {attempt - 1} recoveries "
            f"(memory.max_oom_retries={memory.max_oom_retries}); report at {report}")
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # documented point: return the failed step's blocks
    log.warning("OOM at step %d (rank %d): micro-batch %d -> %d, accumulation %d -> %d, "
                "global batch unchanged; memory report %s", step, ctx.rank,
                -(-micro_batch_size // splits), -(-micro_batch_size // new_splits),
                accumulation * splits, accumulation * new_splits, report)
    return new_splits


def _checkpoint(ctx: WorkerContext, step: int, model: nn.Module,
                optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                scheduler: torch.optim.lr_scheduler.LRScheduler, loader: BatchLoader,
                metrics: dict[str, Any], sharded: bool) -> None:
    """Write the state to a staging directory and hand it to the context.

    DDP: rank 0 writes everything into ``state.pt``. FSDP: every rank writes its model and
    optimizer shards (DCP), rank 0 adds ``state.pt`` with the rest.
    """
    unwrapped = model.module if isinstance(model, DDP) else model
    bad = [name for name, p in unwrapped.named_parameters()  # FSDP: this rank's shard
           if not bool(torch.isfinite(local_tensor(p.detach())).all())]  # host sync: here only
    flag = torch.tensor([1.0 if bad else 0.0], device=ctx.device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank refuses together
    if flag.item():
        where = f"in {bad[:3]}" if bad else "on another rank"
        raise NonFiniteError(f"refusing to checkpoint step {step} on rank {ctx.rank}: "
                             f"non-finite weights {where}; the last good checkpoint stays the "
                             "latest")
    with tempfile.TemporaryDirectory(prefix="memtrain-ckpt-") as tmp:
        checkpoint_dir = None
        if sharded:
            checkpoint_dir = Path(tmp)
            save_sharded(checkpoint_dir, unwrapped, optimizer)
        if ctx.is_main:
            checkpoint_dir = Path(tmp)
            state: dict[str, Any] = {
                "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict(),
                "loader": loader.state_dict(), "rng": rng_state(), "step": step,
                "sharded": sharded,
            }
            if not sharded:
                state.update(model=unwrapped.state_dict(), optimizer=optimizer.state_dict())
            save_checkpoint(checkpoint_dir, state)
        ctx.report(metrics, checkpoint_dir, step)


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"
