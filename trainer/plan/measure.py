"""Plans run for real on this CPU, to hold the time model against: ``PlanRun`` (one plan's
steps, to alternate with another's), ``measure_plan`` and the rank correlation of predicted and
measured speeds (``spearman``).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

from trainer.memory.allocator import keep_freed_host_memory
from trainer.memory.optimizers import InBackward
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, ModelFactory, build_model
from trainer.optim import build_optimizer
from trainer.step import step_peak_bytes, train_step

log = logging.getLogger("memtrain.planner")

@dataclass(frozen=True)
class Measured:
    """A plan run for real on this CPU: median step seconds and tokens/s, the fastest step's
    seconds, and the allocator's peak."""

    step_seconds: float
    tokens_per_s: float
    peak_bytes: int
    best_step_seconds: float = 0.0


class PlanRun:
    """A plan built once to be trained for real on this CPU, one rank: its model, optimizer and
    random micro-batches, each ``step`` one optimizer step of the trainer's own ``train_step``
    (``measure_plan`` times a few; ``make bench-plan`` alternates two plans' steps). The
    optimizer is the run's: AdamW with ``states`` moments (``memory.optimizer_states``),
    stepping in backward where ``in_backward`` (``memory.optimizer_in_backward``), fused as
    ``fused`` says (None: torch's default on this CPU)."""

    def __init__(self, factory: ModelFactory, transforms: MemoryTransforms, seq_len: int,
                 vocab_size: int, precision: str, micro_batch: int, accumulation: int,
                 states: str = "fp32", in_backward: bool = False,
                 fused: bool | None = None) -> None:

        device = torch.device("cpu")
        keep_freed_host_memory()  # as the trainer's CPU workers run
        self.model = build_model(factory, transforms)
        self.model.train()
        self.policy = precision_policy(precision, device, warn=False)
        self.scaler = self.policy.grad_scaler(device)
        self.optimizer = build_optimizer(self.model, lr=1e-4, fused=fused, states=states,
                                         backward_hooks=InBackward() if in_backward else None)
        generator = torch.Generator().manual_seed(0)
        self.micro_batches = [torch.randint(0, vocab_size, (micro_batch, seq_len + 1),
                                            generator=generator) for _ in range(accumulation)]
        self.tokens = micro_batch * accumulation * seq_len

    def step(self) -> float:
        """Train one optimizer step; its seconds."""

        start = time.perf_counter()
        train_step(self.model, self.optimizer, self.scaler, self.micro_batches, 1, self.policy,
                   1.0)
        return time.perf_counter() - start

    def peak_bytes(self) -> int:
        """One more step under the CPU allocator's record (``trainer.step.step_peak_bytes``)."""

        return step_peak_bytes(self.model, self.optimizer, self.scaler, self.micro_batches[0],
                               self.policy)


def measure_plan(factory: ModelFactory, transforms: MemoryTransforms, seq_len: int,
                 vocab_size: int, precision: str, micro_batch: int, accumulation: int,
                 steps: int = 3, warmup: int = 1, peak: bool = True, states: str = "fp32",
                 in_backward: bool = False, fused: bool | None = None) -> Measured:
    """Train ``steps`` optimizer steps (after ``warmup``) of the plan with the trainer's own
    ``train_step`` on random tokens, one rank on this CPU, with ``PlanRun``'s optimizer; then,
    with ``peak``, one more step under the CPU allocator's record
    (``trainer.step.step_peak_bytes``)."""
    run = PlanRun(factory, transforms, seq_len, vocab_size, precision, micro_batch,
                  accumulation, states, in_backward, fused)
    times = [run.step() for _ in range(warmup + steps)][warmup:]
    seconds = statistics.median(times)
    return Measured(seconds, run.tokens / seconds, run.peak_bytes() if peak else 0, min(times))


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0
