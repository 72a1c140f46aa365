"""The optimizer and its learning-rate schedule: ``build_optimizer`` (AdamW, with the memory
switches of ``trainer.memory.optimizers``), ``Schedule`` and what a resume with other settings
does to it (``resume_schedule``).

``Schedule`` is the factor of ``train.lr`` at each step: linear warm-up, then a cosine decay to
``min_lr_ratio`` at ``train.steps``. It is ``LambdaLR``'s callable, so its fields go into every
checkpoint with the scheduler's state.

A resume takes the rates of the config it runs under, not of the checkpoint (torch's
``LambdaLR.load_state_dict`` would restore the old peak rate and the old schedule's fields):

- a changed ``train.lr`` scales the schedule from the resume on;
- a changed shape (``train.steps``, ``warmup_steps``, ``min_lr_ratio``) does not restart the
  curve, and the run reaches the peak rate once:
  - a run past its peak continues its decay: from the resume step, the cosine runs from the
    factor the run had reached (``anchor``) down to the new floor at the new last step, so more
    steps stretch the rest of the decay and fewer compress it, and the rate does not jump;
  - a run still in its warm-up rises from the factor it had reached to the peak at the new
    warm-up's last step, then follows the new cosine; where the new warm-up is already over,
    the peak is taken at the resume step and the cosine runs from it to the new floor (the
    new schedule's own rate there would start below the peak and never reach it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.memory.optimizers import BackwardSteps, InBackward, make_adamw

if TYPE_CHECKING:
    from trainer.config import TrainConfig


@dataclass
class Schedule:
    steps: int
    warmup_steps: int
    min_lr_ratio: float
    anchor: tuple[int, float] | None = None  # (step, factor): a resume that changed the shape
    rising: bool = False  # the anchor starts a rise to the peak (else a decay from it)

    @classmethod
    def of(cls, cfg: TrainConfig) -> Schedule:
        return cls(cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)

    @classmethod
    def from_state(cls, saved: dict[str, Any] | None) -> Schedule | None:
        """The schedule a checkpoint ran (``LambdaLR``'s state of it); None where the
        checkpoint kept none."""
        if not saved:
            return None
        anchor = saved.get("anchor")
        return cls(saved["steps"], saved["warmup_steps"], saved["min_lr_ratio"],
                   (int(anchor[0]), float(anchor[1])) if anchor else None,
                   bool(saved.get("rising", False)))

    def __call__(self, step: int) -> float:
        if self.rising and self.anchor is not None and \
                self.anchor[0] <= step < self.warmup_steps - 1:
            start, factor = self.anchor  # linear to 1 at the warm-up's last step
            return factor + (1 - factor) * (step - start) / (self.warmup_steps - 1 - start)
        if not self.rising and self.anchor is not None and step >= self.anchor[0]:
            start, factor = self.anchor
            progress = (step - start) / max(1, self.steps - start)
            return self.min_lr_ratio + (factor - self.min_lr_ratio) * _cosine(progress)
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * _cosine(progress)

    def shape(self) -> tuple[int, int, float]:
        return self.steps, self.warmup_steps, self.min_lr_ratio

    def resumed(self, before: Schedule | None, step: int) -> Schedule:
        """This (the config's) schedule for a run resumed at ``step`` from a checkpoint that
        ran ``before`` (None: one from before schedules were kept, taken as this one)."""
        if before is None or before.shape() == self.shape():
            return before or self
        reached = before(step)
        if not before.warming_up(step) or reached >= 1:  # past the peak: the decay goes on
            return replace(self, anchor=(step, reached))
        if step < self.warmup_steps - 1:  # the rise goes on, to the peak at the new warm-up's end
            return replace(self, anchor=(step, reached), rising=True)
        return replace(self, anchor=(step, 1.0))  # the new warm-up is over: the peak, now

    def warming_up(self, step: int) -> bool:
        """Whether ``step`` is still in this schedule's warm-up (below the peak)."""
        return step < self.warmup_steps and (
            self.anchor is None or self.rising or step < self.anchor[0])


def _cosine(progress: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict[str, Any]
                    ) -> str | None:
    """Load a checkpoint's scheduler ``state`` into ``scheduler`` (built from this run's
    config), keeping the config's peak rates and shape (the module's docstring): the rates
    apply from the next step. Returns a line saying what changed, or None."""
    configured = scheduler.lr_lambdas[0]
    assert isinstance(configured, Schedule), type(configured)
    configured, peaks = replace(configured), list(scheduler.base_lrs)
    before = Schedule.from_state((state.get("lr_lambdas") or [None])[0])
    old_peaks = list(state.get("base_lrs", peaks))
    scheduler.load_state_dict({**state, "lr_lambdas": [None] * len(scheduler.lr_lambdas)})
    step = scheduler.last_epoch
    runs = configured.resumed(before, step)
    scheduler.lr_lambdas = [runs] * len(scheduler.lr_lambdas)
    scheduler.base_lrs = peaks
    for group, peak in zip(scheduler.optimizer.param_groups, peaks, strict=True):
        group["initial_lr"] = peak
        group["lr"] = peak * runs(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    changes = []
    if old_peaks != peaks:
        changes.append(f"peak {old_peaks[0]:g} -> {peaks[0]:g}")
    if before is not None and before.shape() != configured.shape():
        changes.append(f"steps, warm-up, floor {before.shape()} -> {configured.shape()}, "
                       f"{_resumed_in_words(before, runs, step)}")
    if not changes:
        return None
    return (f"learning rate: {'; '.join(changes)}; the next step's rate "
            f"{scheduler._last_lr[0]:.4g}")


def _resumed_in_words(before: Schedule, runs: Schedule, step: int) -> str:
    """What ``Schedule.resumed`` made of a changed shape at ``step``, for the resume's line."""
    if runs.rising:
        return (f"inside a warm-up at step {step}: rising from factor {before(step):.4g} to the "
                f"peak at step {runs.warmup_steps - 1}")
    if runs.anchor is not None and runs.anchor[1] == 1.0 and before(step) < 1:
        return (f"the new warm-up over at step {step}: the peak from there (factor "
                f"{before(step):.4g} -> 1), then the cosine")
    return f"the cosine continuing from factor {before(step):.4g} at step {step}"


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95),
                    fused: bool | None = None, states: str = "fp32",
                    backward_hooks: InBackward | None = None) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms, biases), over the parameters
    that train (``requires_grad``: all but a LoRA model's frozen base).

    ``states``: the moments' dtype (``memory.optimizer_states``, trainer/memory/optimizers.py).
    ``in_backward``: each parameter steps in backward (``memory.optimizer_in_backward``), its
    hooks where the way of splitting says (``Parallelism.backward_hooks``); None: after backward.

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
        fused = states == "fp32" and any(p.is_cuda for p in decay + no_decay)
    bf16 = any(p.dtype == torch.bfloat16 for p in decay + no_decay)  # ``model.dtype: bf16``
    optimizer = make_adamw(groups, lr, betas, states, bool(fused), stochastic_round=bf16)
    if backward_hooks is not None:
        BackwardSteps(optimizer, comm_hook=backward_hooks.comm_hook,
                      norm_over_ranks=backward_hooks.norm_over_ranks)
    return optimizer
