"""Out-of-memory recovery that keeps the global batch, agreed on by every rank.

When a micro-batch runs out of memory on any rank, every rank must learn it at the same point, or
the healthy ones wait forever in a gradient all-reduce. So, with recovery on and more than one
rank, every micro-batch of a step runs under DDP's ``no_sync()``; then one small all-reduce (the
agreement) tells every rank whether any rank hit an OOM; only then are the gradients all-reduced,
once, in buckets (``all_reduce_gradients``). A rank that ran out of memory joins the agreement
with a 1, the others with a 0, and all of them raise ``StepOutOfMemory`` together. The loop
then writes a memory snapshot, cuts each micro-batch in two (accumulation doubles, the samples
and the global batch are unchanged), empties the CUDA cache and retries the same step.

Under FSDP over several ranks the reduce-scatter runs inside backward and cannot wait for an
agreement, so an OOM there fails the run (``Parallelism.agrees_on_oom``, ``trainer.parallel``);
one FSDP worker is one process and recovers as one.

Under sequence parallelism with DDP the ranks of a sequence group also meet inside every
micro-batch, in each attention layer's all-to-alls, where a rank that ran out would leave its
peers waiting. ``GroupOOMWatch`` makes those meetings agree first: before each of the group's
collectives (its buffers allocated), one flag is all-reduced over the group; a rank that ran out
sends 1 at the meeting its peers wait in, and every rank of the group raises
``PeerOutOfMemory`` there, before any all-to-all is left unmatched (both in
``trainer.parallel.sequence``). The step's agreement then carries it to the other groups as
above.

The price: the gradient all-reduce no longer overlaps the last micro-batch's backward (with
``memory.oom_recovery: false`` DDP's own overlapped all-reduce is used). An OOM inside the
gradient all-reduce itself, after the agreement, is re-raised and fails the run.

The micro-batch a step runs at is a ``BatchPlan``: the configured micro-batch and accumulation
and how many pieces each loaded micro-batch is cut into. ``step_with_oom_recovery`` is the one
call that runs a step under this policy (the loop and ``make gpu-check`` both use it). Tests
inject an OOM on CPU with ``MEMTRAIN_FAULTS=oom@STEP:RANK`` (``trainer.faults``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from monitoring.run_files import MEMORY_DIR
from trainer import faults
from trainer.compat import dump_memory_snapshot, record_memory_history
from trainer.context import WorkerContext
from trainer.parallel.rendezvous import any_rank

log = logging.getLogger("memtrain")
Result = TypeVar("Result")


@dataclass(frozen=True)
class BatchPlan:
    """How one rank's share of the global batch is cut: ``micro_batch_size`` rows are loaded
    at a time, ``accumulation_steps`` of them per optimizer step, and after OOMs each loaded
    micro-batch runs in ``splits`` pieces (the samples, and so the update, stay the same)."""

    micro_batch_size: int
    accumulation_steps: int
    splits: int = 1

    @property
    def running_micro_batch(self) -> int:
        """Rows per forward/backward: the loaded micro-batch cut into ``splits`` pieces."""
        return -(-self.micro_batch_size // self.splits)

    @property
    def running_accumulation(self) -> int:
        """Forward/backward passes per optimizer step."""
        return self.accumulation_steps * self.splits

    @property
    def recoveries(self) -> int:
        """OOM recoveries so far (each doubled ``splits``)."""
        return self.splits.bit_length() - 1

    def can_halve(self) -> bool:
        return self.splits * 2 <= self.micro_batch_size

    def halved(self) -> BatchPlan:
        """The same samples in pieces half as large."""
        return replace(self, splits=self.splits * 2)


class StepOutOfMemory(RuntimeError):
    """Some rank ran out of memory during this step; every rank raises it at the same point."""


class OOMAgreement:
    """One small all-reduce per step that tells every rank whether any rank hit an OOM."""

    def __init__(self, device: torch.device):
        self.device = device
        self.distributed = dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1

    def _any(self, local_oom: bool) -> bool:
        if not self.distributed:
            return local_oom
        return any_rank(local_oom, self.device)  # host sync: once a step, over several ranks

    def check(self, local_oom: str | None = None) -> None:
        """After the step's micro-batches: raise ``StepOutOfMemory`` if any rank ran out.

        ``local_oom`` is this rank's OOM message, or None when its micro-batches all fit.
        """
        if self._any(local_oom is not None):
            raise StepOutOfMemory(local_oom or "a peer rank ran out of memory in this step")


def start_memory_history(device: torch.device, enabled: bool) -> bool:
    """Record CUDA allocations with Python stacks from the start, for snapshots on OOM."""
    if not enabled or device.type != "cuda":
        return False
    record_memory_history()
    return True


def write_oom_report(run_dir: Path, step: int, rank: int, device: torch.device,
                     detail: str, micro_batch_size: int) -> Path:
    """Write what is known about the OOM; on CUDA a pickled snapshot for PyTorch's visualizer.

    Returns the snapshot (CUDA) or report (CPU) path.
    """
    out = run_dir / MEMORY_DIR
    out.mkdir(parents=True, exist_ok=True)
    stem = f"oom-step{step:08d}-rank{rank}"
    report = {"step": step, "rank": rank, "device": str(device), "detail": detail,
              "micro_batch_size": micro_batch_size, "time": time.time()}
    if device.type == "cuda":
        snapshot = out / f"{stem}.pickle"
        dump_memory_snapshot(snapshot)  # opens in pytorch.org/memory_viz
        (out / f"{stem}.summary.txt").write_text(torch.cuda.memory_summary(device))
        report["snapshot"] = snapshot.name
        (out / f"{stem}.json").write_text(json.dumps(report, indent=2, sort_keys=True))
        return snapshot
    path = out / f"{stem}.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=True))
    return path


def oom_recovery_on(setting: bool | str, device: torch.device) -> bool:
    """``memory.oom_recovery``, with ``auto`` resolved: on for CUDA, off on CPU."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


def step_with_oom_recovery(step: Callable[[int, OOMAgreement | None], Result], plan: BatchPlan,
                           ctx: WorkerContext, step_number: int, agree: bool, max_retries: int
                           ) -> tuple[Result, BatchPlan]:
    """``step(splits, agreement)``, retried with the micro-batches cut in two after each OOM
    that the ranks agreed on (``agree``: one ``OOMAgreement`` per attempt; without it an OOM
    fails the run). ``step_number`` is the 1-based optimizer step, for reports and faults.

    Returns the step's result and the plan it took (the caller keeps it for later steps).
    """
    attempt = 0
    while True:
        agreement = OOMAgreement(ctx.device) if agree else None
        try:
            with faults.oom_armed(step_number, ctx.rank, first_attempt=attempt == 0):
                return step(plan.splits, agreement), plan
        except StepOutOfMemory as err:
            attempt += 1
            plan = recover_from_oom(ctx, step_number, plan, attempt, max_retries, str(err))


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
