"""gpu-check's FSDP rows: ``parallel.fsdp``'s settings on one device, measured and planned.

One rank (a process group of one: NCCL on CUDA, gloo on CPU) still runs every part of FSDP2 that
moves memory: the meta-device build (``trainer.parallel.fsdp.build_sharded``), the all-gather into
the parameter dtype (``MixedPrecisionPolicy``), the reduce-scatter's copies, and CPU offload's
copies between pinned host memory and the device (``CPUOffloadPolicy``). Each row trains the model
with the trainer's own ``train_step`` and records the device's peak (CUDA's
``max_memory_allocated``; dry, on CPU, the allocator's record of one step) beside the planner's
prediction for it (``trainer.plan.peak.plan_row`` with the same settings, its host bytes apart).
Rows: bf16 through autocast over fp32 shards, bf16 parameters through ``MixedPrecisionPolicy``, and
the latter with CPU offload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms
from trainer.models.gpt import GPT, GPTConfig
from trainer.optim import build_optimizer
from trainer.parallel.fsdp import FsdpSettings, build_sharded
from trainer.parallel.rendezvous import backend_for
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.static import static_bytes
from trainer.step import step_peak_bytes, train_step

CASES = {
    "bf16 autocast": FsdpSettings(),
    "bf16 parameters": FsdpSettings(param_dtype="bf16"),
    "bf16 parameters, cpu offload": FsdpSettings(param_dtype="bf16", offload="cpu"),
}


@contextlib.contextmanager
def one_rank(device: torch.device) -> Iterator[None]:
    """A process group of this process alone (none outside it is touched)."""
    if dist.is_initialized():
        yield
        return
    # On a GPU, NCCL with gloo beside it: CPU offload reduces host tensors (the product's group)
    dist.init_process_group(backend_for(device.type), store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp_row(cfg: GPTConfig, name: str, device: torch.device, micro_batch: int, steps: int,
             warmup: int) -> dict[str, Any]:
    """One setting's measured step (peak and tokens/s) and the planner's prediction of it."""
    settings = CASES[name]
    transforms = MemoryTransforms(activation_checkpointing="selective", bf16_norm_inputs=False)
    model = build_sharded(partial(GPT, cfg), transforms, device, 0, settings, model_name="gpt")
    policy = settings.step_policy(precision_policy("bf16", device, warn=False))
    scaler = policy.grad_scaler(device)
    optimizer = build_optimizer(model, lr=3e-4)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), device=device)
    peak, elapsed = measured_steps(model, optimizer, scaler, tokens, policy, 1.0, steps, warmup)
    profile = profile_activations(partial(GPT, cfg), transforms, cfg.seq_len, cfg.vocab_size,
                                  "bf16", device=device)
    with torch.device("meta"):
        shape = GPT(cfg)
    plan = plan_row(static_bytes(shape, "fsdp", 1, settings), profile, micro_batch, 1)
    del model, optimizer
    return {"setting": name, **dataclasses.asdict(settings),
            **measured_row(micro_batch, cfg.seq_len, steps, peak, elapsed, plan)}


def measured_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
                   tokens: torch.Tensor, policy: Any, grad_clip: float, steps: int,
                   warmup: int, parallel: Any = None) -> tuple[int, float]:
    """``warmup`` then ``steps`` of the trainer's ``train_step`` on ``tokens`` (``parallel``:
    its way of splitting them, as ``train_step`` takes it): (the peak bytes of the timed steps,
    CUDA's ``max_memory_allocated``, or dry on CPU the allocator's record of one more step; the
    seconds the timed steps took)."""
    device = tokens.device
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
        train_step(model, optimizer, scaler, [tokens], 1, policy, grad_clip, parallel=parallel)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = step_peak_bytes(model, optimizer, scaler, tokens, policy, grad_clip,
                               parallel=parallel)
    return peak, time.perf_counter() - start


def measured_row(micro_batch: int, seq_len: int, steps: int, peak: int, seconds: float,
                 plan: Any) -> dict[str, Any]:
    """A gpu-check row's measured figures beside ``plan``'s (a ``PlanRow``) prediction."""
    return {"micro_batch_size": micro_batch, "peak_allocated_bytes": peak,
            "tokens_per_second": steps * micro_batch * seq_len / seconds,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_host_bytes": plan.host_bytes, "predicted_peak_moment": plan.peak_moment,
            "planner_error": plan.predicted_peak_bytes / peak - 1 if peak else None}


def case_rows(section: Any, label: str, row: Any, cases: Iterable[str], *args: Any
              ) -> list[dict[str, Any]]:
    """``row(args[0], name, *args[1:])`` for every case ``name``, each a gpu-check section named
    ``label name`` (one failing keeps the others): the rows that did not fail."""
    first, *rest = args
    rows = [section(f"{label} {name}", row, first, name, *rest) for name in cases]
    return [row for row in rows if row is not None]


def fsdp_rows(section: Any, cfg: GPTConfig, device: torch.device, micro_batch: int, steps: int,
              warmup: int) -> list[dict[str, Any]]:
    """Every setting's row, each a gpu-check section, in a one-rank process group."""
    with one_rank(device):
        return case_rows(section, "fsdp", fsdp_row, CASES, cfg, device, micro_batch, steps,
                         warmup)
