"""The training loop in plain torch, written once against a ``WorkerContext``.

Three functions, from small to large:
- ``forward_backward``: one micro-batch under autocast, loss scaled for accumulation, backward.
- ``train_step``: one optimizer step over its micro-batches; DDP's ``no_sync()`` on all but the
  last so gradients are all-reduced once per step, then unscale, clip, non-finite check, step,
  ``zero_grad(set_to_none=True)``.
- ``train``: builds everything from the config slices, resumes, and keeps the cadence of logging,
  evaluation and checkpoints. What a checkpoint holds is a ``TrainState`` (``trainer.state``);
  counters, logs and the summary are ``RunMetrics`` (``trainer.run_metrics``); the micro-batch
  a step runs at is a ``BatchPlan`` (``trainer.oom``); gc policy, loader threads, profiler and
  metrics log live in one ``ExitStack``, released on any exception.

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
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from datapipe.loader import BatchLoader
from trainer.build import (
    MemoryTransforms,
    build_model,
    checkpointed_blocks,
    compile_model,
    model_factory,
)
from trainer.compat import allocator_settings, compile_counts
from trainer.context import WorkerContext
from trainer.diagnostics import LeakGuard, cpu_peak_bytes, profiler_window, write_memory_summary
from trainer.errors import first_line
from trainer.faults import maybe_kill, maybe_stall, wanted
from trainer.loss import summed_loss
from trainer.memory import (
    PrecisionChoice,
    PrecisionPolicy,
    computes_own_loss,
    precision_policy,
    resolve_precision,
)
from trainer.oom import (
    BatchPlan,
    OOMAgreement,
    StepOutOfMemory,
    all_reduce_gradients,
    start_memory_history,
    write_oom_report,
)
from trainer.run_metrics import RowRecord, RunMetrics
from trainer.sharding import is_sharded, shard_model
from trainer.state import NonFiniteError, TrainState

if TYPE_CHECKING:  # the loop runs without pydantic too (scripts/gpu_check.py)
    from trainer.config import Config, DataConfig, MemoryConfig, TrainConfig

__all__ = ["NonFiniteError", "StepResult", "build_optimizer", "evaluate", "forward_backward",
           "train", "train_step"]

log = logging.getLogger("memtrain")


@dataclass
class StepResult:
    loss: torch.Tensor  # detached mean token loss over this rank's micro-batches
    grad_norm: torch.Tensor
    skipped: bool  # non-finite gradients: the optimizer did not step
    data_wait_seconds: float = 0.0  # filled in by the caller, which fetches the batches


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

    def take(self, count: int) -> tuple[list[torch.Tensor], float]:
        """The next ``count`` batches and the seconds spent waiting for them."""
        before = self.wait_seconds
        taken = [next(self) for _ in range(count)]
        return taken, self.wait_seconds - before


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
                raise torch.OutOfMemoryError("out of memory (injected by MEMTRAIN_FAULTS)")
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
        oom_message = first_line(err, "out of memory")
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


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter the state a first optimizer step creates (AdamW's moments) without a
    forward or backward: a step on zero gradients, whose Adam update is zero (weight decay alone
    moves the weights). ``step_peak_bytes`` counts that state as held before the step it
    measures; this readies it at none of a training step's cost."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


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


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95),
                    fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases).

    ``fused``: torch's fused kernel, one launch per parameter group and no temporary of a
    moment's size (None: on CUDA parameters, as ``train.fused_optimizer: auto``); else torch's
    default (foreach on CUDA, a per-parameter loop on CPU). Both keep the same state, so a
    checkpoint of one loads into the other.
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if fused is None:
        fused = any(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True if fused else None)


def _step_seed(seed: int, rank: int, step: int) -> int:
    return (seed * 1_000_003 + rank * 7919 + step) % (2**63)


def train(cfg: Config, ctx: WorkerContext, until_step: int | None = None) -> dict[str, Any]:
    """Train ``cfg.train.steps`` optimizer steps (resuming if a checkpoint exists).

    ``until_step`` stops early, with a checkpoint, at that step of the same schedule: a planned
    interruption (time-boxed jobs, resume tests).

    Returns the summary; rank 0 also writes it to ``run_dir/summary.json``.
    """
    device, plan = ctx.device, BatchPlan(cfg.train.micro_batch(),
                                         cfg.train.accumulation_steps(ctx.world_size))
    model = build_model(model_factory(cfg.model), MemoryTransforms.of(cfg.memory), device,
                        seed=cfg.run.seed)  # identical initial weights on every rank
    precision = resolve_precision(cfg.memory.precision, device, cfg.parallel.strategy)
    policy = precision_policy(precision.name, device)
    recording_history = start_memory_history(device, cfg.memory.record_memory_history)
    sharded = cfg.parallel.strategy == "fsdp" and ctx.world_size > 1
    watch = None
    if cfg.train.compile is True or (cfg.train.compile == "auto" and device.type == "cuda"):
        watch = CompileWatch(ctx.rank)  # after checkpointing's wrappers, before DDP/FSDP's
        compiled = compile_model(model)
        if ctx.is_main:
            log.info("torch.compile: %s (the first step compiles)", compiled)
    if sharded:
        shard_model(model)  # before the optimizer: it must see the sharded parameters
    fused = cfg.train.fused_optimizer
    optimizer = build_optimizer(model, cfg.train.lr, cfg.train.weight_decay, cfg.train.betas,
                                None if fused == "auto" else fused)
    with contextlib.ExitStack() as resources:
        state = TrainState(
            model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train)),
            policy.grad_scaler(device, cfg.memory.grad_scaler_init_scale),
            resources.enter_context(build_loader(cfg.data, ctx, plan.micro_batch_size,
                                                 cfg.run.seed)),
            cfg.parallel.strategy)
        resumed_from = state.restore(ctx)
        state.wrap_ddp(ctx)
        _log_start(cfg, ctx, state, plan, precision, resumed_from, recording_history)
        val_batches = None
        if cfg.data.val_path and cfg.train.eval_every:
            val_batches = resources.enter_context(
                build_loader(cfg.data, ctx, plan.micro_batch_size, cfg.run.seed, validation=True))
        metrics = RunMetrics(ctx, cfg.run.name, cfg.train.global_batch_size * cfg.model.seq_len,
                             cfg.train.global_batch_size // ctx.world_size, cfg.model.seq_len,
                             publish_seconds=cfg.monitoring.publish_seconds,
                             peak_window_seconds=cfg.monitoring.peak_window_seconds)
        resources.callback(metrics.close)
        metrics.start_publishing(state.loader)
        batches = TimedBatches(state.loader)
        rows = None
        if cfg.data.record_rows:
            rows = RowRecord(ctx.run_dir, ctx.rank, ctx.world_size)
            resources.callback(rows.close)
        guard = LeakGuard() if cfg.memory.leak_check_every else None
        profiler = resources.enter_context(profiler_window(
            cfg.memory.profile_steps, state.step + 1, ctx.run_dir, ctx.rank, device))
        resources.enter_context(gc_policy(cfg.memory.gc_every))
        state.model.train()
        stop_at = min(cfg.train.steps, until_step or cfg.train.steps)
        while state.step < stop_at:
            step_start = time.perf_counter()
            micro_batches, data_wait = batches.take(plan.accumulation_steps)
            if rows is not None:
                rows.record(state.step + 1, micro_batches)
            result, plan = step_with_oom_recovery(ctx, state, micro_batches, plan, policy, cfg)
            del micro_batches
            result.data_wait_seconds = data_wait
            state.scheduler.step()
            state.step += 1
            metrics.step_done(result, time.perf_counter() - step_start)
            if watch is not None and metrics.steps_this_run == 1:
                watch.settle()  # the first step compiled forward and backward
            check_skips(metrics.consecutive_skips, cfg.train.max_nonfinite_steps, state.step,
                        ctx.rank, result)
            is_last = state.step == stop_at
            if due(state.step, cfg.train.log_every, is_last) or metrics.steps_this_run == 1:
                metrics.log_step(state, result, plan)
                if watch is not None:
                    watch.check(state.step)
            if val_batches is not None and due(state.step, cfg.train.eval_every, is_last):
                val_batches.rewind()
                if watch is not None:
                    watch.check(state.step)
                first_eval = metrics.eval_loss is None
                metrics.eval_done(state.step, evaluate(state.model, val_batches,
                                                       cfg.train.eval_batches, policy))
                if watch is not None and first_eval:
                    watch.settle()  # evaluation runs without grad: compiled once more
            if due(state.step, cfg.train.checkpoint_every, is_last):
                checkpoint_start = time.perf_counter()
                state.save(ctx, {"step": state.step, "loss": metrics.last_loss})
                metrics.checkpoint_done(state.step, time.perf_counter() - checkpoint_start)
            after_step(cfg.memory, ctx, state.step, guard, profiler)
        summary = metrics.summary(state, plan, resumed_from, {
            "run": cfg.run.name, "workers": ctx.world_size, "device": device.type,
            "precision": policy.name,
            "activation_checkpointing": cfg.memory.activation_checkpointing,
            "global_batch_size": cfg.train.global_batch_size,
            **(watch.summary() if watch is not None else
               {"compile_seconds": None, "recompilations": None})}, guard)
    metrics.write_summary(summary)
    return summary


class CompileWatch:
    """What torch.compile costs a run: the seconds it spent compiling, and the frames it
    compiled after warm-up (the first step, and the first evaluation, which runs without
    grad). Each of those is a recompilation: a new input shape (an OOM recovery's smaller
    micro-batch) or a changed guard, paid at a compile's price again, so each is warned."""

    def __init__(self, rank: int):
        self.rank = rank
        self.seconds_at_start = compile_counts()[1]
        self.settled: int | None = None
        self.recompilations = 0

    def settle(self) -> None:
        self.settled = compile_counts()[0]

    def check(self, step: int) -> None:
        frames = compile_counts()[0]
        if self.settled is not None and frames > self.settled:
            self.recompilations += frames - self.settled
            log.warning("rank %d: torch.compile recompiled %d frame(s) by step %d (%d in this "
                        "run): a new input shape or a changed guard, each paid at a compile's "
                        "price (TORCH_LOGS=recompiles says which)", self.rank,
                        frames - self.settled, step, self.recompilations)
            self.settled = frames

    def summary(self) -> dict[str, Any]:
        return {"compile_seconds": compile_counts()[1] - self.seconds_at_start,
                "recompilations": self.recompilations}


def due(step: int, every: int, is_last: bool) -> bool:
    """Whether a cadence of ``every`` steps (0: never, but always on the last step) is due."""
    return is_last or bool(every and step % every == 0)


def check_skips(consecutive: int, limit: int, step: int, rank: int, result: StepResult) -> None:
    """Raise NonFiniteError when ``limit`` optimizer steps in a row had non-finite gradients."""
    if consecutive >= limit:
        raise NonFiniteError(
            f"non-finite gradient norm for {consecutive} consecutive steps, the last at step "
            f"{step} on rank {rank} (loss {result.loss.item():.4g}); "
            f"train.max_nonfinite_steps={limit}")


def after_step(memory: MemoryConfig, ctx: WorkerContext, step: int, guard: LeakGuard | None,
               profiler: Any) -> None:
    """The memory hygiene and diagnostics of a step's end, each on its own cadence."""
    if memory.gc_every and step % memory.gc_every == 0:
        gc.collect(1)
    profiler.step()
    if step in memory.memory_summary_steps:
        summary_path = write_memory_summary(ctx.run_dir, step, ctx.rank, ctx.device)
        if summary_path is None and ctx.is_main and step == memory.memory_summary_steps[0]:
            log.warning("memory.memory_summary_steps: torch.cuda.memory_summary needs CUDA; "
                        "ignored on %s", ctx.device.type)
    if guard is not None and step % memory.leak_check_every == 0:
        guard.sample(step, ctx.device)
    maybe_stall(ctx.run_dir, step, ctx.rank)  # MEMTRAIN_FAULTS=stall@STEP:RANK (tests)
    maybe_kill(ctx.run_dir, step, ctx.rank)  # MEMTRAIN_FAULTS=kill@STEP:RANK (tests)


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


def build_loader(data: DataConfig, ctx: WorkerContext, micro_batch_size: int, seed: int,
                 validation: bool = False) -> BatchLoader:
    """This rank's loader of ``data.path`` (shuffled) or, for ``validation``, of
    ``data.val_path`` (in order, rewound before each evaluation)."""
    if validation:
        assert data.val_path is not None, "validation needs data.val_path"
        return BatchLoader(data.val_path, data.column, rank=ctx.rank, world_size=ctx.world_size,
                           batch_size=micro_batch_size, seed=seed, shuffle=False,
                           device=ctx.device, on_bad_shard=data.on_bad_shard)
    return BatchLoader(data.path, data.column, rank=ctx.rank, world_size=ctx.world_size,
                       batch_size=micro_batch_size, seed=seed, shuffle=data.shuffle,
                       device=ctx.device, shuffle_window=data.shuffle_window,
                       prefetch=data.prefetch, read_ahead=data.read_ahead,
                       on_bad_shard=data.on_bad_shard)


def _log_start(cfg: Config, ctx: WorkerContext, state: TrainState, plan: BatchPlan,
               precision: PrecisionChoice, resumed_from: int | None,
               recording_history: bool) -> None:
    if not ctx.is_main:
        return
    if precision.warning:
        log.warning("warning: %s", precision.warning)
    where = f"resuming from step {resumed_from}" if resumed_from is not None else "from scratch"
    if state.loader.resized_from is not None:
        loader = state.loader
        log.info("resized: the checkpoint was written by %d workers, this run has %d; the "
                 "global batch is kept by the accumulation steps, and epoch %d continues with "
                 "the %d batches per rank no rank has read yet (datapipe/split.py)",
                 loader.resized_from, ctx.world_size, loader.epoch,
                 loader.batches_in(loader.epoch) - loader.batch_index)
    log.info("training %s: %d workers, %s, precision %s, activation checkpointing %s "
             "(blocks %s), micro-batch %d x accumulation %d x %d workers = global batch %d; %s",
             cfg.run.name, ctx.world_size, ctx.device.type,
             f"{precision.name} ({precision.reason})",
             cfg.memory.activation_checkpointing, checkpointed_blocks(state.unwrapped),
             plan.micro_batch_size, plan.accumulation_steps, ctx.world_size,
             cfg.train.global_batch_size, where)
    chunk = getattr(state.unwrapped, "loss_chunk_tokens", 0)
    log.info("loss: %s (memory.loss_chunk_tokens %s)",
             f"output projection and cross-entropy in chunks of {chunk} tokens" if chunk else
             "full logits, then cross-entropy" + ("" if computes_own_loss(state.unwrapped)
                                                  else " (the model computes no loss of its own)"),
             cfg.memory.loss_chunk_tokens)
    if ctx.device.type == "cuda":
        log.info("CUDA allocator settings: %s; memory history %s",
                 allocator_settings(), "recording" if recording_history else "off")


def oom_recovery_on(cfg: Config, device: torch.device) -> bool:
    """``memory.oom_recovery``, with ``auto`` resolved: on for CUDA, off on CPU."""
    if cfg.memory.oom_recovery == "auto":
        return device.type == "cuda"
    return bool(cfg.memory.oom_recovery)


def step_with_oom_recovery(ctx: WorkerContext, state: TrainState,
                           micro_batches: list[torch.Tensor], plan: BatchPlan,
                           policy: PrecisionPolicy, cfg: Config) -> tuple[StepResult, BatchPlan]:
    """``train_step``, retried with the micro-batches cut in two after each agreed OOM.

    Returns the result and the plan it took (the caller keeps it for later steps). Under FSDP
    the reduce-scatter cannot wait for an agreement, so OOM recovery there is per rank only
    (world size 1).
    """
    agree = oom_recovery_on(cfg, ctx.device) and not state.sharded
    attempt = 0
    while True:
        torch.manual_seed(_step_seed(cfg.run.seed, ctx.rank, state.step))  # resume-exact dropout
        agreement = OOMAgreement(ctx.device) if agree else None
        try:
            result = train_step(state.model, state.optimizer, state.scaler, micro_batches,
                                plan.splits, policy, cfg.train.grad_clip, agreement,
                                inject_oom=attempt == 0 and wanted("oom", state.step + 1,
                                                                   ctx.rank))
            return result, plan
        except StepOutOfMemory as err:
            attempt += 1
            plan = recover_from_oom(ctx, state.step + 1, plan, attempt,
                                    cfg.memory.max_oom_retries, str(err))


def recover_from_oom(ctx: WorkerContext, step: int, plan: BatchPlan, attempt: int,
                     max_retries: int, detail: str) -> BatchPlan:
    """Snapshot, then halve the micro-batch (double the splits); returns the new plan.

    Raises RuntimeError when retries are used up or the micro-batch cannot be halved further.
    """
    report = write_oom_report(ctx.run_dir, step, ctx.rank, ctx.device, detail,
                              plan.running_micro_batch)
    if attempt > max_retries or not plan.can_halve():
        raise RuntimeError(
            f"out of memory at step {step} on rank {ctx.rank} with micro-batch "
            f"{plan.running_micro_batch} after {attempt - 1} recoveries "
            f"(memory.max_oom_retries={max_retries}); report at {report}")
    halved = plan.halved()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # documented point: return the failed step's blocks
    log.warning("OOM at step %d (rank %d): micro-batch %d -> %d, accumulation %d -> %d, "
                "global batch unchanged; memory report %s", step, ctx.rank,
                plan.running_micro_batch, halved.running_micro_batch,
                plan.running_accumulation, halved.running_accumulation, report)
    return halved
