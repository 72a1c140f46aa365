"""``TrainState``: everything a checkpoint holds, and how it is saved and restored.

The state owns the model (wrapped for its way of splitting once restored: ``parallel``), the
optimizer, the LR schedule, the GradScaler, the loader's position, the step and, in every
checkpoint, the RNG. ``state_dict()`` / ``load_state_dict()`` carry the plain part (``state.pt``,
rank 0's); the model and optimizer go through DCP beside it, under DDP and FSDP alike: every rank
writes its part (FSDP: its shards; DDP: DCP spreads the replicated tensors over the ranks, each
written once), and a checkpoint of either loads under the other at any world size, DCP resharding
it. ``save`` refuses non-finite weights and writes this rank's part for the worker context to
publish; ``restore`` loads the context's latest checkpoint. How checkpoints are written, named and
read is ``trainer.checkpoint.files``; how they are published, ``trainer.checkpoint.publish``.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.batches import TokenLoader
from trainer.checkpoint.async_save import AsyncSaves, staged
from trainer.checkpoint.files import (
    load_checkpoint,
    load_states,
    load_weights,
    model_and_optimizer_states,
    rng_state,
    set_rng_state,
    write_states,
)
from trainer.checkpoint.publish import clear_rank_parts, rank_parts_prefix
from trainer.context import WorkerContext
from trainer.errors import NonFiniteError
from trainer.models.hf import PREFIX as HF_PREFIX
from trainer.optim import resume_schedule
from trainer.parallel.strategy import OneProcess, Parallelism
from trainer.tensors import local_tensor


@dataclass
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    loader: TokenLoader
    step: int = 0
    schedule_change: str | None = None  # what a resume changed in the learning rate, if anything
    # Entries every checkpoint's state.pt saves as they are: what a run that trains adapters
    # records of its frozen base (``trainer.checkpoint.adapters.base_record``).
    records: dict[str, Any] = field(default_factory=dict)

    # How the model is split over ranks (``trainer.parallel``): one process unless given.
    parallel: Parallelism = field(default_factory=OneProcess)

    @property
    def unwrapped(self) -> nn.Module:
        """The model as built, without the wrapper of its way of splitting (DDP's)."""
        return self.parallel.unwrap(self.model)

    def wrap(self) -> None:
        """The model wrapped for its way of splitting, after ``restore`` (DDP broadcasts rank
        0's weights as it wraps)."""
        self.model = self.parallel.wrap(self.model, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``state.pt``: everything but the model and optimizer, which go to
        the DCP files beside it (the key ``dcp`` says so)."""
        state: dict[str, Any] = {
            "scaler": self.scaler.state_dict(), "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(), "rng": rng_state(), "step": self.step,
            "dcp": True,  # the model and optimizer are in DCP files beside it
        }
        return state | self.records

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of ``state_dict`` (DCP model and optimizer: see ``restore``)."""
        self.scaler.load_state_dict(state["scaler"])
        assert isinstance(self.scheduler, torch.optim.lr_scheduler.LambdaLR)
        self.schedule_change = resume_schedule(self.scheduler, state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])

    def restore(self, ctx: WorkerContext, init_from: str | None = None,
                resume_from: str | None = None) -> int | None:
        """Load the context's latest checkpoint; returns its step, or None (nothing to load:
        the run starts, from the weights of the checkpoint ``init_from`` where given). A run
        with no checkpoint of its own resumes from the checkpoint ``resume_from`` where given
        (``train.resume_from``: every part of its state)."""
        if ctx.local_rank == 0:  # a killed attempt's parts: no rank of this one saves before
            clear_rank_parts(ctx.run_dir)  # the collectives of its first step wait for it
        with ctx.latest_checkpoint() as own:
            checkpoint_dir = own if own is not None or resume_from is None else Path(resume_from)
            if checkpoint_dir is None:
                if init_from is not None and not init_from.startswith(HF_PREFIX):  # at build
                    load_weights(Path(init_from), self.unwrapped)
                return None
            state = load_checkpoint(checkpoint_dir)
            # any way of splitting and world size: DCP reshards to this one
            load_states(checkpoint_dir, self.unwrapped, self.optimizer)
            self.load_state_dict(state)
            return self.step

    def save(self, ctx: WorkerContext, metrics: dict[str, Any], saves: AsyncSaves | None = None,
             saved: Callable[[float], None] = lambda seconds: None) -> None:
        """Write a checkpoint of this step into a staging directory and hand it to ``ctx``:
        here, or with ``saves`` on its thread once staged (``trainer.checkpoint.async_save``),
        ``saved`` then told the seconds it took.

        Every rank calls. Raises NonFiniteError on every rank, writing nothing, when any rank
        holds a non-finite weight: the last good checkpoint stays the latest.
        """
        # the weights that train (a frozen base does not change), FSDP: this rank's shards
        bad = [name for name, p in self.unwrapped.named_parameters() if p.requires_grad
               and not bool(torch.isfinite(local_tensor(p.detach())).all())]  # host sync: here
        flag = torch.tensor([1.0 if bad else 0.0], device=ctx.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank refuses together
        if flag.item():
            where = f"in {bad[:3]}" if bad else "on another rank"
            raise NonFiniteError(f"refusing to checkpoint step {self.step} on rank {ctx.rank}: "
                                 f"non-finite weights {where}; the last good checkpoint stays "
                                 "the latest")
        step, state = self.step, self.state_dict() if ctx.is_main else None
        states = model_and_optimizer_states(self.unwrapped, self.optimizer)
        if saves is None:
            _write_and_report(ctx, metrics, step, state, states, None)
            return
        saves.wait()  # at most one save in flight
        state, states = copy.deepcopy(state), staged(states)  # the small rest: deepcopy
        saves.start(lambda: _write_and_report(ctx, metrics, step, state, states, saves.group),
                    saved)


def _write_and_report(ctx: WorkerContext, metrics: dict[str, Any], step: int,
                      state: dict[str, Any] | None,
                      states: tuple[dict[str, Any], dict[str, Any]], group: Any) -> None:
    """Write this rank's part of step ``step``'s checkpoint and hand it to ``ctx``, its
    collectives on ``group``; the files go with it unless ``ctx`` takes them over."""
    directory = Path(tempfile.mkdtemp(prefix=rank_parts_prefix(ctx.run_dir)))
    try:
        ctx.report(metrics, write_states(directory, state, states, group), step, group)
    finally:
        if not ctx.takes_checkpoint_files:
            shutil.rmtree(directory, ignore_errors=True)
