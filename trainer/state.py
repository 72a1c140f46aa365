"""``TrainState``: everything a checkpoint holds; and ``StepResult``, what one step gives back.

The state owns the model (DDP-wrapped once the process group needs it), the optimizer, the LR
schedule, the GradScaler, the loader's position, the step and, in every checkpoint, the RNG.
``state_dict()`` / ``load_state_dict()`` carry the plain part (``state.pt``, rank 0's); the
model and optimizer go through DCP beside it, under DDP and FSDP alike: every rank writes its
part (FSDP: its shards; DDP: DCP spreads the replicated tensors over the ranks, each written
once), and a checkpoint of either loads under the other at any world size, DCP resharding it.
``save`` refuses non-finite weights and writes this rank's part for the worker context to
publish; ``restore`` loads the context's latest checkpoint. How checkpoints are written, named,
published and read is ``trainer.checkpoint``.

A checkpoint written before DDP's went through DCP holds the model and optimizer in its
``state.pt``: it still loads under DDP, and is refused in one line under FSDP.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.checkpoint import (
    CheckpointReadError,
    load_checkpoint,
    load_model_state,
    load_sharded,
    load_weights,
    model_and_optimizer_states,
    rng_state,
    set_rng_state,
    write_states,
)
from trainer.context import WorkerContext
from trainer.hf import PREFIX as HF_PREFIX
from trainer.hf import has_weights
from trainer.manifest import sha256_of
from trainer.memory.optimizers import BackwardSteps
from trainer.saves import AsyncSaves, staged
from trainer.schedule import resume_schedule
from trainer.sharding import is_sharded, local_tensor
from trainer.tokens import TokenLoader


def rank_parts_prefix(run_dir: Path) -> str:
    """How the directories start, in the system's temporary directory, where this run's ranks
    write their parts of a checkpoint before the context publishes them
    (``run_dir/checkpoint-<step>``) or Ray Train uploads them: named after the run directory,
    so that the part a worker killed mid-save leaves behind is found by the run's next start
    (``clear_rank_parts``)."""
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return f"memtrain-ckpt-{key}-"


def clear_rank_parts(run_dir: Path) -> None:
    """Remove the parts killed workers of this run left in this machine's temporary directory:
    directories of this user only, never a link."""
    for path in Path(tempfile.gettempdir()).glob(rank_parts_prefix(run_dir) + "*"):
        try:
            found = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def lora_base_source(model_name: str, init_from: str | None) -> str | None:
    """The ``hf:`` directory a LoRA model's frozen base takes its weights from, as the loop
    builds it: ``train.init_from``'s where it names one, else ``model.name``'s where that holds
    weights; None for a base of its seeded initialisation."""
    if init_from is not None and init_from.startswith(HF_PREFIX):
        return init_from
    if model_name.startswith(HF_PREFIX) and has_weights(model_name.removeprefix(HF_PREFIX)):
        return model_name
    return None


def weights_fingerprint(source: str, hashes: bool) -> dict[str, dict[str, Any]]:
    """The weight files of an ``hf:`` directory (``model.safetensors``, or the index and the
    files it names) by name: their size, and their SHA-256 where ``hashes``; empty where it
    holds none."""
    path = Path(source.removeprefix(HF_PREFIX)).expanduser()
    directory = path if path.is_dir() else path.parent
    index = directory / "model.safetensors.index.json"
    names = {"model.safetensors"}
    if index.is_file():
        names = {index.name, *json.loads(index.read_text())["weight_map"].values()}
    return {name: {"size": (directory / name).stat().st_size,
                   **({"sha256": sha256_of(directory / name)} if hashes else {})}
            for name in sorted(names) if (directory / name).is_file()}


def lora_base(model_name: str, init_from: str | None, hashes: bool) -> dict[str, Any] | None:
    """What a LoRA model's checkpoints record of its base (``TrainState.lora_base``); None
    for a base of its seeded initialisation."""
    source = lora_base_source(model_name, init_from)
    if source is None:
        return None
    return {"source": source, "files": weights_fingerprint(source, hashes)}


class NonFiniteError(RuntimeError):
    """Training produced non-finite numbers that it cannot step over."""


@dataclass
class StepResult:
    """What one optimizer step gives back, on the device (no host sync until read)."""

    loss: torch.Tensor  # detached mean token loss over this rank's micro-batches
    grad_norm: torch.Tensor
    skipped: bool  # non-finite gradients: the optimizer did not step
    # The targets trained over every rank, where a loss mask or packed documents leave some out
    # (None: every target of the global batch is trained).
    trained_tokens: torch.Tensor | None = None


@dataclass
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    loader: TokenLoader
    step: int = 0
    schedule_change: str | None = None  # what a resume changed in the learning rate, if anything
    # A LoRA model's base weights, {"source": "hf:DIR", "files": weights_fingerprint}: its
    # checkpoints hold the adapters alone, so an export rebuilds the base and checks it is this.
    lora_base: dict[str, Any] | None = None

    @property
    def sharded(self) -> bool:
        """FSDP-wrapped: model and optimizer state are this rank's shards."""
        return is_sharded(self.model)

    @property
    def unwrapped(self) -> nn.Module:
        return self.model.module if isinstance(self.model, DDP) else self.model

    def wrap_ddp(self, ctx: WorkerContext) -> None:
        """DDP when more than one rank holds the whole model (after ``restore``: DDP
        broadcasts rank 0's weights when it wraps)."""
        if ctx.world_size > 1 and not self.sharded:
            device = ctx.device
            self.model = DDP(self.model,
                             device_ids=[device.index] if device.type == "cuda" else None)
            in_backward = BackwardSteps.of(self.optimizer)
            if in_backward is not None:  # each parameter steps once its bucket is reduced
                in_backward.attach_ddp(self.model)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``state.pt``: model and optimizer too unless they go to DCP files
        (the key ``sharded`` says which)."""
        state: dict[str, Any] = {
            "scaler": self.scaler.state_dict(), "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(), "rng": rng_state(), "step": self.step,
            "sharded": True,  # the model and optimizer are in DCP files beside it
        }
        if self.lora_base is not None:
            state["lora_base"] = self.lora_base
        return state

    def load_state_dict(self, state: dict[str, Any], source: str) -> None:
        """The inverse of ``state_dict`` (DCP model and optimizer: see ``restore``)."""
        if "model" in state:  # the single-file format
            load_model_state(self.unwrapped, state["model"], source)
            self.optimizer.load_state_dict(state["optimizer"])
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
            if state.get("sharded"):  # any strategy and world size: DCP reshards to this one
                load_sharded(checkpoint_dir, self.unwrapped, self.optimizer)
            elif self.sharded:
                raise CheckpointReadError(
                    f"checkpoint {checkpoint_dir} holds the whole model in its state.pt (the "
                    "format before DDP's checkpoints went through DCP), which FSDP cannot "
                    "load: resume it once under parallel.strategy ddp, whose next checkpoint "
                    "FSDP loads")
            self.load_state_dict(state, str(checkpoint_dir))
            return self.step

    def save(self, ctx: WorkerContext, metrics: dict[str, Any], saves: AsyncSaves | None = None,
             saved: Callable[[float], None] = lambda seconds: None) -> None:
        """Write a checkpoint of this step into a staging directory and hand it to ``ctx``:
        here, or with ``saves`` on its thread once staged (``trainer.saves``), ``saved`` then
        told the seconds it took.

        Every rank calls. Raises NonFiniteError on every rank, writing nothing, when any rank
        holds a non-finite weight: the last good checkpoint stays the latest.
        """
        bad = [name for name, p in self.unwrapped.named_parameters()  # FSDP: this rank's shard
               if not bool(torch.isfinite(local_tensor(p.detach())).all())]  # host sync: here
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
