"""GPU check: the CUDA-only claims of memtrain, measured on the real device in one short run.

Needs only torch (2.6 or newer), pyarrow, numpy: no Ray, no pydantic, nothing installed. Run from
the source tree: ``make gpu-check`` (``PYTHONPATH=. python3 -m bench.gpu_check --out
bench/results``).

On a CUDA GPU it measures, for a GPT-2-124M-shaped model at sequence length 1024 and a fixed
micro-batch, through the trainer's own ``train_step``:
- peak memory (``max_memory_allocated``, ``max_memory_reserved``) and tokens/s for fp32, bf16 and
  fp16 + GradScaler, each with activation checkpointing none / selective / full;
- the planner's predicted peak beside each measured peak;
- MFU against a bf16 matmul peak measured in the same run (plus one ``torch.compile`` row);
- the input stall with the real loader (pinned staging, non-blocking copies) over Arrow shards
  written to local disk;
- OOM recovery: a micro-batch too large for the device, a real OOM, the micro-batch halved with
  the global batch kept, and a memory snapshot that loads with ``pickle``;
- the peer: a plain nanoGPT-style loop on the same model and micro-batch (eager, and compiled
  with ``--compile``), with memtrain's rows as ratios to it (tokens/s, peak memory);
- the largest micro-batch under a memory cap (``--memory-cap-gib``, 24): the peer's, found by
  doubling, against the one memtrain's planner chooses for the cap, each run under it;
- the output projection and cross-entropy alone at Llama 3's vocabulary (128,256): the plain
  loss, memtrain's chunked one and, where ``liger_kernel`` installs, Liger-Kernel's fused linear
  cross-entropy (peak bytes and tokens/s);
- every CUDA metric family of the contract, published through the standalone exporter;
- a recorded ``torch.cuda.memory_stats()`` dict, for the metric readers' CPU tests;
- FSDP2 on one rank (``bench.gpu_fsdp``): bf16 through autocast, through
  ``MixedPrecisionPolicy``, and with CPU offload, each peak beside the planner's;
- the memory strategies beyond the guide (``bench.gpu_strategies``): the step in backward,
  activation offload, 8-bit, 4-bit and bf16 AdamW states, bf16 weights, LoRA and QLoRA, each
  alone on bf16 with full checkpointing, each peak beside the planner's (a row whose library is
  missing recorded as skipped);
- sequence parallelism over two ranks (``bench.gpu_sequence``), with and without the tiled MLP,
  the highest rank's peak beside the planner's for a rank of the split (two GPUs; on one,
  recorded as skipped).

Without CUDA (``--dry`` is implied) it runs the same code paths on a tiny model on CPU, so the
script cannot rot; CI runs that. It writes ``gpu-check-<date>-<host>.json`` and ``.md`` to --out
(``gpu-check-dry-...`` in dry mode) through ``bench.results``, as every bench does.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import os
import pickle
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import gpu_sequence, gpu_strategies
from bench.gpu_fsdp import case_rows, fsdp_rows
from bench.results import result_path, write_json
from datapipe.loader import BatchLoader
from datapipe.manifest import ColumnSpec
from datapipe.writer import write_rows
from trainer.compat import allocator_settings, record_memory_history
from trainer.context import LocalContext
from trainer.memory.allocator import configure_allocator_env
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, build_model
from trainer.models.build import compile_model as compile_blocks
from trainer.models.gpt import GPT, GPTConfig
from trainer.oom import BatchPlan, OOMAgreement, StepOutOfMemory, start_memory_history
from trainer.optim import build_optimizer
from trainer.plan.calibrate import cpu_speed
from trainer.plan.candidates import Request, choose, feasible_plans
from trainer.plan.devices import DeviceSpeed, named_gpu_speed
from trainer.plan.measure import spearman
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.speed import SpeedModel
from trainer.plan.static import static_bytes
from trainer.step import StepResult, step_peak_bytes, train_step
from trainer.telemetry.diagnostics import cpu_peak_bytes

GPT2_124M = GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, n_embd=768)
TINY = GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, n_embd=64)
PRECISIONS = ("fp32", "bf16", "fp16")
AC_MODES = ("none", "selective", "full")
TARGETS = {"bf16_selective_peak_vs_fp32_none": 0.40, "mfu_bf16": 0.40,
           "planner_error": 0.10, "input_stall": 0.01}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_tflops(device: torch.device, dry: bool) -> float:
    """bf16 matrix-product throughput: the MFU denominator measured on this device."""
    n = 256 if dry else 8192  # dry: the code path only (bf16 products are slow where emulated)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    repeats = 3 if dry else 20
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def make_model(cfg: GPTConfig, ac: str, device: torch.device, loss_chunk_tokens: int,
               compile_model: bool = False) -> torch.nn.Module:
    """The GPT with memtrain's defaults (bf16 norm inputs) and this row's choices, compiled
    as ``train.compile`` compiles it (each block, in place)."""
    model = build_model(partial(GPT, cfg), transforms(ac, loss_chunk_tokens), device)
    if compile_model:
        compile_blocks(model)
    return model


def transforms(ac: str, loss_chunk_tokens: int) -> MemoryTransforms:
    return MemoryTransforms(ac, activation_checkpointing_every=2,
                            loss_chunk_tokens=loss_chunk_tokens)


def attention_backend(name: str) -> contextlib.AbstractContextManager:
    """``default``: torch's own choice; ``flash``: only FlashAttention (CUDA)."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def phase_peaks(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler, policy: Any, tokens: torch.Tensor,
                device: torch.device) -> dict[str, int]:
    """One more step, phase by phase: the allocator peak of forward, backward, optimizer."""
    from trainer.memory.loss import summed_loss

    peaks = {}
    torch.cuda.reset_peak_memory_stats(device)
    loss = summed_loss(model, tokens, policy)
    sync(device)
    peaks["forward"] = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    scaler.scale(loss / tokens[:, 1:].numel()).backward()
    sync(device)
    peaks["backward"] = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    peaks["optimizer"] = torch.cuda.max_memory_allocated(device)
    return peaks


def measure_step(cfg: GPTConfig, precision: str, ac: str, micro_batch: int,
                 device: torch.device, steps: int, warmup: int, loss_chunk_tokens: int,
                 batches: BatchLoader | None = None, compile_model: bool = False,
                 sdpa: str = "default") -> dict[str, Any]:
    """Train ``warmup + steps`` steps with the trainer's train_step; peak memory and speed."""
    with attention_backend(sdpa):
        row = _measure_step(cfg, precision, ac, micro_batch, device, steps, warmup,
                            loss_chunk_tokens, batches, compile_model)
    row["sdpa"] = sdpa
    return row


def release_memory(device: torch.device) -> int:
    """Free what earlier rows left (cyclic garbage included); returns bytes still allocated.

    Each row starts from a collected heap and an empty cache, and the bytes still allocated at
    its start are recorded, so memory carried over from an earlier row shows in the report. On
    CPU (dry mode) there is nothing to release: a row's peak there counts only what its own step
    allocates and the tensors it names (``diagnostics.cpu_peak_bytes``), and a collection of
    torch's heap costs ~0.15 s, sixty times a run.
    """
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def _measure_step(cfg: GPTConfig, precision: str, ac: str, micro_batch: int,
                  device: torch.device, steps: int, warmup: int, loss_chunk_tokens: int,
                  batches: BatchLoader | None, compile_model: bool) -> dict[str, Any]:
    allocated_at_start = release_memory(device)
    model = make_model(cfg, ac, device, loss_chunk_tokens, compile_model)
    policy = precision_policy(precision, device, warn=False)
    scaler = policy.grad_scaler(device)
    optimizer = build_optimizer(model, lr=3e-4)
    fixed = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), device=device)
    wait = 0.0
    result = None
    for i in range(warmup + steps):
        if i == warmup:
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start, wait = time.perf_counter(), 0.0
        if batches is not None:
            t0 = time.perf_counter()
            tokens = next(batches)
            wait += time.perf_counter() - t0
        else:
            tokens = fixed
        result = train_step(model, optimizer, scaler, [tokens], 1, policy, 1.0)
    sync(device)
    elapsed = time.perf_counter() - start
    assert result is not None
    row: dict[str, Any] = {
        "precision": precision, "activation_checkpointing": ac, "micro_batch_size": micro_batch,
        "compiled": compile_model, "loss_chunk_tokens": loss_chunk_tokens, "steps": steps,
        "allocated_at_start_bytes": allocated_at_start,
        "tokens_per_second": steps * micro_batch * cfg.seq_len / elapsed,
        "step_seconds": elapsed / steps, "data_wait_seconds": wait,
        "input_stall": wait / elapsed, "final_loss": float(result.loss),
    }
    if device.type == "cuda":
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        try:  # diagnostics only: a failure here must not lose the row's figures
            row["phase_peak_bytes"] = phase_peaks(model, optimizer, scaler, policy, fixed,
                                                  device)
        except Exception as err:
            row["phase_peak_error"] = f"{type(err).__name__}: {err}"[:300]
    else:  # dry mode: the CPU allocator's record of one more step stands in for CUDA's peak
        row["peak_allocated_bytes"] = step_peak_bytes(model, optimizer, scaler, fixed, policy)
        row["peak_reserved_bytes"] = None
    del model, optimizer, scaler, result, fixed
    release_memory(device)  # between phases: the next configuration starts from nothing
    return row


def measure_peer(cfg: GPTConfig, precision: str, micro_batch: int, device: torch.device,
                 steps: int, warmup: int, compile_model: bool = False) -> dict[str, Any]:
    """The peer: a plain nanoGPT-style loop on the same model and batch, measured like
    memtrain's rows. Autocast, the full logits and ``F.cross_entropy`` in fp32, AdamW (fused on
    CUDA, as nanoGPT has it), clipping at 1.0; no checkpointing, no chunked loss, no memtrain
    code in the step."""
    allocated_at_start = release_memory(device)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    forward = torch.compile(model) if compile_model else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True if device.type == "cuda" else None)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].reshape(-1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> torch.Tensor:
        with autocast:
            logits = forward(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                                 targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(warmup + steps):
        if i == warmup:
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
        loss = step()
    sync(device)
    elapsed = time.perf_counter() - start
    row: dict[str, Any] = {
        "loop": "plain (nanoGPT-style)", "precision": precision, "compiled": compile_model,
        "micro_batch_size": micro_batch, "steps": steps,
        "allocated_at_start_bytes": allocated_at_start,
        "tokens_per_second": steps * micro_batch * cfg.seq_len / elapsed,
        "final_loss": float(loss)}
    if device.type == "cuda":
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    else:  # dry mode: the CPU allocator's record of one more step, as for memtrain's rows
        state = [v for per in optimizer.state.values() for v in per.values()
                 if isinstance(v, torch.Tensor)]
        row["peak_allocated_bytes"] = cpu_peak_bytes(step, held=[*model.parameters(), *state,
                                                                 tokens])
    return row  # the next section's release_memory frees this one's model and state


def peer_ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """memtrain's rows against the peer of the same precision and compilation: tokens/s and
    peak memory as ratios (memtrain / peer)."""
    out = []
    for peer in report.get("peer", []):
        for row in report["rows"]:
            if (row["precision"], row["compiled"], row["sdpa"]) != \
                    (peer["precision"], peer["compiled"], "default"):
                continue
            out.append({"precision": row["precision"], "compiled": row["compiled"],
                        "activation_checkpointing": row["activation_checkpointing"],
                        "loss_chunk_tokens": row["loss_chunk_tokens"],
                        "tokens_per_second_ratio": row["tokens_per_second"]
                        / peer["tokens_per_second"],
                        "peak_ratio": row["peak_allocated_bytes"]
                        / peer["peak_allocated_bytes"]})
    return out


def _under_cap(measure: Any, cap: int, device: torch.device) -> dict[str, Any] | None:
    """``measure()``'s row if it ran within ``cap`` bytes, else None. On CUDA the cap is
    enforced (``set_per_process_memory_fraction``: an allocation past it is an OOM); in dry
    mode on CPU it is checked against the allocator's record of the step's peak."""
    try:
        row = measure()
    except torch.cuda.OutOfMemoryError:
        row = None
    if row is None:  # out of the except block: its traceback no longer holds the tensors
        release_memory(device)
        return None
    return row if row["peak_allocated_bytes"] <= cap else None


def memory_cap(cfg: GPTConfig, cap: int, device: torch.device, steps: int, warmup: int,
               loss_chunk_tokens: int, largest: int) -> dict[str, Any]:
    """Largest micro-batch under a memory cap, bf16: the plain loop's (doubled from 1 until
    it no longer fits) against memtrain's: ``auto``'s plan for that cap, as ``train`` decides
    it (CPU probes, as ``memtrain plan`` makes them, and the time model), and the largest
    micro-batch that fits, each measured under the cap with tokens/s."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    try:
        peer, micro = None, 1
        while micro <= largest:
            row = _under_cap(partial(measure_peer, cfg, "bf16", micro, device, steps, warmup),
                             cap, device)
            if row is None:
                break
            peer, micro = row, micro * 2
        profiles = [profile_activations(partial(GPT, cfg), transforms(ac, loss_chunk_tokens),
                                        cfg.seq_len, cfg.vocab_size, "bf16", target="cuda",
                                        work=True)
                    for ac in AC_MODES]
        static = static_bytes(GPT(cfg))
        # What ``train``'s ``auto`` decides for this cap (trainer.plan.candidates.choose: the
        # fastest predicted plan that fits), and the largest micro-batch any checkpointing mode
        # fits (feasible_plans without a time model: least recomputation first).
        fitting = feasible_plans(static, profiles, largest, 1, cap)
        auto = choose(Request(largest, 1, cap, ("bf16",), AC_MODES),
                      lambda _precision, _norm: (static, profiles),
                      SpeedModel(device_speed(device))).plan
        plans = {"auto": auto,
                 "largest": max(fitting, key=lambda r: r.micro_batch_size, default=None)}
        rows: dict[str, Any] = {
            name: None if plan is None else _under_cap(
                partial(measure_step, cfg, "bf16", plan.activation_checkpointing,
                        plan.micro_batch_size, device, steps, warmup, loss_chunk_tokens),
                cap, device)
            for name, plan in plans.items()}
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    out: dict[str, Any] = {"cap_bytes": cap, "peer": peer, "memtrain": rows,
                           "plans": {k: p and p.as_dict() for k, p in plans.items()},
                           "ratios": {}}
    for name, mine in rows.items():
        if peer and mine:
            out["ratios"][name] = {
                "micro_batch": mine["micro_batch_size"] / peer["micro_batch_size"],
                "tokens_per_second": mine["tokens_per_second"] / peer["tokens_per_second"]}
    return out


def predict(cfg: GPTConfig, precision: str, ac: str, micro_batch: int,
            device: torch.device, loss_chunk_tokens: int, compiled: bool = False
            ) -> dict[str, Any]:
    """The planner's prediction, probing on the same device the step runs on: the peak, and
    tokens/s from the time model (this GPU's datasheet peaks, compiled as ``train.compile``'s
    runs are planned, or this CPU's calibration in dry mode)."""
    release_memory(device)
    profile = profile_activations(partial(GPT, cfg), transforms(ac, loss_chunk_tokens),
                                  cfg.seq_len, cfg.vocab_size, precision, device=device,
                                  work=True)
    row = plan_row(static_bytes(GPT(cfg)), profile, micro_batch, 1,
                   SpeedModel(device_speed(device), compiled=compiled and device.type == "cuda"))
    release_memory(device)
    return row.as_dict()


def device_speed(device: torch.device) -> DeviceSpeed:
    """The time model's speed of ``device``: a GPU's datasheet figures (an H200's for a GPU
    without them), or this CPU's calibration."""
    if device.type != "cuda":
        return cpu_speed()
    return named_gpu_speed(torch.cuda.get_device_name(device))


def write_token_shards(directory: Path, cfg: GPTConfig, rows: int) -> None:
    rng = np.random.default_rng(0)
    dtype = "int32"  # CUDA casts from int32 are fully supported; uint16 support is partial
    spec = [ColumnSpec("tokens", dtype, (cfg.seq_len + 1,))]
    blocks = ({"tokens": rng.integers(0, cfg.vocab_size, (1024, cfg.seq_len + 1), dtype=dtype)}
              for _ in range(rows // 1024))
    write_rows(directory, spec, blocks, rows_per_shard=2048)


@contextlib.contextmanager
def patched_environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the block, as it was after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def oom_recovery(cfg: GPTConfig, device: torch.device, micro_batch: int, dry: bool
                 ) -> dict[str, Any]:
    """A micro-batch too large for the device: real OOM, recovery by halving, snapshot; the
    loop's own policy (``step_with_oom_recovery``). ``dry`` injects the OOM instead."""
    from trainer import faults
    from trainer.oom import step_with_oom_recovery

    release_memory(device)
    run_dir = Path(tempfile.mkdtemp(prefix="memtrain-oom-"))  # snapshots can be large
    ctx = LocalContext(0, 0, 1, device, run_dir)
    recording = start_memory_history(device, enabled=True)
    model = make_model(cfg, "none", device, loss_chunk_tokens=4096)
    policy = precision_policy("fp32", device, warn=False)
    scaler = policy.grad_scaler(device)
    optimizer = build_optimizer(model, lr=3e-4)
    batch = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), device=device)
    events: list[str] = []

    def attempt(splits: int, agreement: OOMAgreement | None, model: torch.nn.Module = model,
                optimizer: torch.optim.Optimizer = optimizer, batch: torch.Tensor = batch
                ) -> StepResult:
        try:
            return train_step(model, optimizer, scaler, [batch], splits, policy, 1.0, agreement)
        except StepOutOfMemory as err:
            events.append(str(err)[:200])
            raise

    with patched_environ({faults.ENV: "oom@1:0"} if dry else {}):
        result, plan = step_with_oom_recovery(attempt, BatchPlan(micro_batch, 1), ctx, 1,
                                              agree=True, max_retries=4)
    sync(device)
    snapshots = sorted((run_dir / "memory").glob("*.pickle"))
    snapshot_ok = None
    if snapshots:
        with open(snapshots[0], "rb") as f:
            snapshot = pickle.load(f)  # what PyTorch's memory visualizer does
        snapshot_ok = isinstance(snapshot, dict) and "segments" in snapshot
    if recording:
        record_memory_history(enabled=False)
    row = {"first_micro_batch": micro_batch, "recovered_micro_batch": plan.running_micro_batch,
           "accumulation_after": plan.running_accumulation, "global_batch_kept": True,
           "ooms": len(events),
           "events": events, "loss_after_recovery": float(result.loss),
           "snapshot_files": {p.name: p.stat().st_size for p in snapshots},
           "snapshot_loads_with_pickle": snapshot_ok,
           "reports": sorted(p.name for p in (run_dir / "memory").glob("*"))}
    del model, optimizer, batch, result, attempt  # attempt's defaults hold them too
    release_memory(device)
    shutil.rmtree(run_dir, ignore_errors=True)  # the row names what was written there
    return row


def metric_families(cfg: GPTConfig, device: torch.device, micro_batch: int,
                    loss_chunk_tokens: int) -> dict[str, Any]:
    """A few real steps published through the standalone exporter; which families show up.

    On CUDA every ``cuda`` family metric must be present (allocated, reserved, active and peak
    non-zero); on CPU the ``cuda`` and ``device`` families must be absent, not zero.
    """
    from monitoring.memory import gpu_uuid, worker_labels
    from monitoring.metrics import METRICS
    from monitoring.sinks import PrometheusSink
    from trainer.telemetry.run_metrics import device_values, peak_tracker

    release_memory(device)
    sink = PrometheusSink(worker_labels("gpu-check", 0, 0, socket.gethostname(), device))
    model = make_model(cfg, "selective", device, loss_chunk_tokens)
    policy = precision_policy("bf16", device, warn=False)
    scaler = policy.grad_scaler(device)
    optimizer = build_optimizer(model, lr=3e-4)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), device=device)
    for _ in range(2):
        result = train_step(model, optimizer, scaler, [tokens], 1, policy, 1.0)
    sink.set({"memtrain_train_loss": float(result.loss),
              "memtrain_train_grad_norm": float(result.grad_norm),
              "memtrain_train_grad_scale": scaler.get_scale(),
              "memtrain_train_micro_batch_size": micro_batch,
              "memtrain_train_accumulation_steps": 1,
              "memtrain_train_tokens_total": 2 * micro_batch * cfg.seq_len,
              **device_values(device, gpu_uuid(device), peak_tracker(device, 60.0), 0)})
    values: dict[str, float] = {}
    labels = dict(sink.labels)
    for m in METRICS:
        for name in (m.exposed_name, m.exposed_name + "_total", m.exposed_name + "_count"):
            value = sink.registry.get_sample_value(name, labels)
            if value is not None:
                values[m.exposed_name] = value
    found: dict[str, list[str]] = {m.family: [] for m in METRICS}
    for m in METRICS:
        if m.exposed_name in values:
            found[m.family].append(m.exposed_name)
    cuda = [m for m in METRICS if m.family == "cuda"]
    must_be_positive = ["memtrain_gpu_memory_allocated_bytes", "memtrain_gpu_memory_reserved_bytes",
                        "memtrain_gpu_memory_active_bytes",
                        "memtrain_gpu_memory_peak_allocated_bytes"]
    if device.type == "cuda":
        must_be_positive += ["memtrain_gpu_device_used_bytes", "memtrain_gpu_device_total_bytes"]
        ok = len(found["cuda"]) == len(cuda) and all(
            values.get("ray_" + name, 0) > 0 for name in must_be_positive)
    else:
        ok = not found["cuda"] and not found["device"]
    from monitoring.memory import _nvml

    del model, optimizer, tokens, result
    release_memory(device)
    return {"ok": ok, "families": found, "labels": labels,
            "nvml": device.type == "cuda" and _nvml() is not None,
            "values": {k: v for k, v in values.items() if k.startswith("ray_memtrain_gpu")}}


def recorded_memory_stats(device: torch.device) -> dict[str, Any] | None:
    if device.type != "cuda":
        return None
    return {k: v for k, v in torch.cuda.memory_stats(device).items()
            if isinstance(v, int | float)}


class Sections:
    """Runs gpu-check's sections within its time budget (``deadline``): each section's time
    printed, and one section failing (its error in the report) never losing the others'
    figures."""

    def __init__(self, report: dict[str, Any], deadline: float) -> None:
        self.report, self.deadline = report, deadline

    def __call__(self, name: str, fn: Any, *fargs: Any, **fkwargs: Any) -> Any:
        if time.perf_counter() > self.deadline:
            self.report["errors"].append(f"{name}: skipped, time budget spent")
            return None
        start = time.perf_counter()
        try:
            value = fn(*fargs, **fkwargs)
        except Exception as err:  # one section failing must not lose the others' figures
            self.report["errors"].append(f"{name}: {type(err).__name__}: {err}"[:500])
            traceback.print_exc()
            value = None
        print(f"[gpu-check] {name}: {time.perf_counter() - start:.1f}s", flush=True)
        return value


def run(args: argparse.Namespace) -> dict[str, Any]:
    setting = configure_allocator_env()
    cuda = torch.cuda.is_available() and not args.dry
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dry = not cuda
    cfg = TINY if dry else GPT2_124M
    micro_batch = 4 if dry else args.micro_batch
    steps, warmup = (2, 1) if dry else (args.steps, 3)
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "dry": dry, "device": torch.cuda.get_device_name(0)
        if cuda else platform.processor() or "cpu", "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "allocator_requested": setting, "model": cfg.__dict__, "micro_batch_size": micro_batch,
        "targets": TARGETS, "rows": [], "errors": [],
    }
    if cuda:
        torch.zeros(1, device=device)
        report["allocator_effective"] = allocator_settings()
        report["device_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
    section = Sections(report, time.perf_counter() + args.budget_seconds)
    report["matmul_bf16_tflops"] = section("matmul peak", matmul_peak_tflops, device, dry)
    report["flops_per_token"] = GPT(cfg).flops_per_token()
    step_rows(section, report, args, cfg, device, micro_batch, steps, warmup)
    peers = [("bf16", False)] + ([("bf16", True)] if not dry and args.compile else [])
    report["peer"] = [row for precision, compiled in peers
                      if (row := section(f"peer {precision}{' compiled' if compiled else ''}",
                                         measure_peer, cfg, precision, micro_batch, device,
                                         steps, warmup, compiled)) is not None]
    report["peer_ratios"] = peer_ratios(report)
    report["memory_stats"] = recorded_memory_stats(device)
    report["metrics"] = section("metric families", metric_families, cfg, device, micro_batch,
                                args.loss_chunk_tokens)
    input_stall(section, report, cfg, device, micro_batch, steps, warmup,
                args.loss_chunk_tokens)
    report["oom_recovery"] = section(
        "oom recovery", oom_recovery, cfg, device, 4 if dry else args.oom_micro_batch, dry)
    # Dry mode: a cap just above the plain loop's peak at micro-batch 4, so it fits 4 and not 8.
    cap = (int(report["peer"][0]["peak_allocated_bytes"] * 1.2) if dry and report["peer"]
           else int(args.memory_cap_gib * 2**30))
    report["memory_cap"] = section("memory cap", memory_cap, cfg, cap, device, steps, warmup,
                                   args.loss_chunk_tokens, 64 if dry else 512)
    report["loss_kernels"] = section("loss kernels", loss_kernels, device, dry)
    report["fsdp"] = fsdp_rows(section, cfg, device, micro_batch, steps, warmup)
    report["strategies"] = [
        *case_rows(section, "strategy", gpu_strategies.strategy_row, gpu_strategies.CASES, cfg,
                   device, micro_batch, steps, warmup),
        *case_rows(section, "sequence", gpu_sequence.sequence_row, gpu_sequence.CASES, cfg,
                   device, micro_batch, steps, warmup)]
    report["summary"] = summarize(report)
    return report


def step_rows(section: Sections, report: dict[str, Any], args: argparse.Namespace,
              cfg: GPTConfig, device: torch.device, micro_batch: int, steps: int,
              warmup: int) -> None:
    """Every precision x checkpointing row (and the baselines, FlashAttention's and the
    compiled row on CUDA), measured, each with the planner's prediction and its MFU, into
    ``report["rows"]``."""
    dry = device.type != "cuda"
    chunk = args.loss_chunk_tokens
    configs = [(p, a, chunk, False, "default") for p in PRECISIONS for a in AC_MODES]
    configs += [("fp32", "none", 0, False, "default"),  # the guide's baseline: full logits
                ("bf16", "selective", 0, False, "default")]
    if not dry:  # attention kernels differ in workspace: FlashAttention only, for comparison
        configs += [(p, a, chunk, False, "flash") for p, a in
                    (("bf16", "none"), ("bf16", "selective"), ("bf16", "full"),
                     ("fp16", "selective"))]
    if not dry and args.compile:
        configs.append(("bf16", "none", chunk, True, "default"))
    for precision, ac, loss_chunk, compiled, sdpa in configs:
        name = (f"{precision}/{ac}/chunk {loss_chunk}/{sdpa}"
                f"{' compiled' if compiled else ''}")
        row = section(name, measure_step, cfg, precision, ac, micro_batch, device, steps,
                      warmup, loss_chunk, compile_model=compiled, sdpa=sdpa)
        if row is None:
            continue
        # Compiled rows too: the planner probes the eager model (its peak; docs/benchmarks.md
        # checks that on CPU) and counts the compiled step's fusion (GPU_COMPILED_SHARE).
        plan = section(f"plan {name}", predict, cfg, precision, ac, micro_batch, device,
                       loss_chunk, compiled)
        if plan is not None:
            row["predicted_peak_bytes"] = plan["predicted_peak_bytes"]
            row["predicted_activation_bytes"] = plan["activation_bytes"]
            row["predicted_peak_moment"] = plan["peak_moment"]
            row["predicted_tokens_per_second"] = plan["tokens_per_s"]
            if row["peak_allocated_bytes"]:
                row["planner_error"] = (plan["predicted_peak_bytes"]
                                        / row["peak_allocated_bytes"] - 1)
        if report["matmul_bf16_tflops"]:
            row["mfu"] = (row["tokens_per_second"] * report["flops_per_token"]
                          / (report["matmul_bf16_tflops"] * 1e12))
        report["rows"].append(row)


def input_stall(section: Sections, report: dict[str, Any], cfg: GPTConfig,
                device: torch.device, micro_batch: int, steps: int, warmup: int,
                loss_chunk_tokens: int) -> None:
    """The loader's stall on a step fed from real shards, into ``report["input_stall"]``
    (absent where the shards could not be written)."""
    dry = device.type != "cuda"
    with tempfile.TemporaryDirectory(prefix="memtrain-gpu-check-") as tmp:
        shards = Path(tmp) / "tokens"
        section("write shards", write_token_shards, shards, cfg, 2048 if dry else 8192)
        if (shards / "manifest.json").exists():
            loader = BatchLoader(shards, "tokens", rank=0, world_size=1, batch_size=micro_batch,
                                 seed=0, device=device)
            report["input_stall"] = section("input stall", measure_step, cfg, "bf16",
                                            "selective", micro_batch, device, steps, warmup,
                                            loss_chunk_tokens, batches=loader)


# The loss at a modern vocabulary: Llama 3's, its 1B model's width, 8 x 1024 tokens (dry: tiny).
LOSS_SHAPE = {"tokens": 8192, "width": 2048, "vocab": 128256}
LOSS_SHAPE_DRY = {"tokens": 512, "width": 64, "vocab": 8192}


def _loss_row(step: Any, tokens: int, device: torch.device, dry: bool,
              clear_grads: Any) -> dict[str, Any]:
    """One loss's row: the peak bytes one forward and backward adds, its loss and tokens/s
    (``step()`` runs both and returns the loss; ``clear_grads()`` drops the gradients)."""
    step()  # warm-up: kernels chosen, autotuned
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        clear_grads()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        value = step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        clear_grads()
        peak = cpu_peak_bytes(step)
        value = step()
    repeats = 3 if dry else 10
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / repeats
    return {"peak_added_bytes": peak, "tokens_per_second": tokens / seconds, "loss": value}


def loss_kernels(device: torch.device, dry: bool) -> dict[str, Any]:
    """The output projection and cross-entropy alone, forward and backward, bf16 inputs: the
    plain loss (full logits, then fp32 cross-entropy), memtrain's chunked one
    (``linear_cross_entropy_sum``) and, on CUDA where it installs, Liger-Kernel's fused linear
    cross-entropy (Triton), the GPU reference for the same fusion. Each row: the peak bytes the
    call adds (its inputs and weight held outside it) and tokens/s. memtrain's chunk is what
    ``memory.loss_chunk_tokens: auto`` takes for the vocabulary (512 tokens at 128,256)."""
    from trainer.memory.loss import auto_loss_chunk_tokens, linear_cross_entropy_sum

    shape = LOSS_SHAPE_DRY if dry else LOSS_SHAPE
    # Dry: four chunks, so the code path chunks (auto's would hold the tiny shape in one).
    chunk_tokens = shape["tokens"] // 4 if dry else auto_loss_chunk_tokens(shape["vocab"])
    dtype = torch.bfloat16
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(shape["tokens"], shape["width"], generator=generator) * 0.02).to(
        device, dtype).requires_grad_()
    weight = (torch.randn(shape["vocab"], shape["width"], generator=generator) * 0.02).to(
        device, dtype).requires_grad_()
    targets = torch.randint(0, shape["vocab"], (shape["tokens"],), generator=generator).to(device)
    losses: dict[str, Any] = {
        "plain": lambda: linear_cross_entropy_sum(hidden, weight, targets, 0),
        "memtrain": lambda: linear_cross_entropy_sum(hidden, weight, targets, chunk_tokens),
    }
    liger = "needs CUDA" if device.type != "cuda" else None
    if liger is None:
        try:
            from liger_kernel.transformers.fused_linear_cross_entropy import (
                LigerFusedLinearCrossEntropyLoss,
            )
            fused = LigerFusedLinearCrossEntropyLoss(reduction="sum")
            losses["liger"] = lambda: fused(weight, hidden, targets)
        except ImportError:
            liger = "liger_kernel not installed"

    def clear_grads() -> None:
        hidden.grad = weight.grad = None

    def step(loss_fn) -> float:
        clear_grads()
        loss = loss_fn()
        loss.backward()
        return float(loss)

    rows = {name: _loss_row(partial(step, loss_fn), shape["tokens"], device, dry, clear_grads)
            for name, loss_fn in losses.items()}
    plain = rows["plain"]
    for row in rows.values():
        row["peak_vs_plain"] = row["peak_added_bytes"] / plain["peak_added_bytes"]
        row["tokens_per_second_vs_plain"] = row["tokens_per_second"] / plain["tokens_per_second"]
    return {"shape": shape, "chunk_tokens": chunk_tokens, "rows": rows, "liger_skipped": liger}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    rows = {(r["precision"], r["activation_checkpointing"], r["compiled"],
             r["loss_chunk_tokens"]): r for r in report["rows"] if r["sdpa"] == "default"}
    summary: dict[str, Any] = {}
    # The baseline is the guide's: fp32, no checkpointing, plain loss; against memtrain's setup.
    chunk = max((r["loss_chunk_tokens"] for r in report["rows"]), default=0)
    base = rows.get(("fp32", "none", False, 0))
    best = rows.get(("bf16", "selective", False, chunk))
    if base and best and base["peak_allocated_bytes"]:
        summary["bf16_selective_peak_vs_fp32_none"] = (best["peak_allocated_bytes"]
                                                       / base["peak_allocated_bytes"])
    mfus = [r["mfu"] for r in report["rows"] if r["precision"] == "bf16" and "mfu" in r]
    if mfus:
        summary["mfu_bf16"] = max(mfus)
    errors = [abs(r["planner_error"]) for r in report["rows"] if "planner_error" in r]
    if errors:
        summary["planner_error"] = max(errors)
    if report.get("input_stall"):
        summary["input_stall"] = report["input_stall"]["input_stall"]
    # The time model against this device: how its eager rows rank, and the share of the
    # predicted speed they reach (the factor GPU_EFFICIENCY stands for until it is measured).
    timed = [r for r in report["rows"] if r.get("predicted_tokens_per_second")
             and not r["compiled"] and r["sdpa"] == "default"]
    if len(timed) >= 3:
        summary["speed_spearman"] = spearman([r["predicted_tokens_per_second"] for r in timed],
                                             [r["tokens_per_second"] for r in timed])
        summary["measured_over_predicted_speed"] = statistics.median(
            r["tokens_per_second"] / r["predicted_tokens_per_second"] for r in timed)
    summary["met"] = {k: (v >= TARGETS[k] if k == "mfu_bf16" else v <= TARGETS[k])
                      for k, v in summary.items() if k in TARGETS}
    return summary


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _step_lines(report: dict[str, Any]) -> list[str]:
    """The measured rows beside their predictions, one table line each."""
    lines: list[str] = []
    for r in report["rows"]:
        err = f"{100 * r['planner_error']:+.1f}%" if "planner_error" in r else "-"
        moment = f" ({r['predicted_peak_moment']})" if "predicted_peak_moment" in r else ""
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        phases = " / ".join(gib(v) for v in r["phase_peak_bytes"].values()) \
            if r.get("phase_peak_bytes") else "-"
        lines.append(f"| {r['precision']} | {r['activation_checkpointing']} | "
                     f"{r['loss_chunk_tokens'] or 'off'} | {r['sdpa']} | "
                     f"{'yes' if r['compiled'] else 'no'} | {gib(r['peak_allocated_bytes'])} | "
                     f"{gib(r['peak_reserved_bytes'])} | {phases} | "
                     f"{gib(r.get('predicted_peak_bytes'))}{moment} | "
                     f"{err} | {r['tokens_per_second']:,.0f} | "
                     f"{r.get('predicted_tokens_per_second') or 0:,.0f} | {mfu} |")
    return lines


def _peer_lines(report: dict[str, Any]) -> list[str]:
    """The plain nanoGPT-style loop, and each memtrain row against it."""
    lines: list[str] = []
    if report.get("peer"):
        lines += ["", "The peer, a plain nanoGPT-style loop (full logits, fused AdamW on CUDA, no "
                      "checkpointing), same model and micro-batch:", "",
                  "| precision | compiled | peak alloc GiB | tokens/s |", "|---|---|---|---|"]
        lines += [f"| {p['precision']} | {'yes' if p['compiled'] else 'no'} | "
                  f"{gib(p['peak_allocated_bytes'])} | {p['tokens_per_second']:,.0f} |"
                  for p in report["peer"]]
        lines += ["", "| memtrain row (precision, compiled, act. ckpt, loss chunk) | tokens/s "
                      "vs peer | peak vs peer |", "|---|---|---|"]
        lines += [f"| {r['precision']}, {'compiled' if r['compiled'] else 'eager'}, "
                  f"{r['activation_checkpointing']}, {r['loss_chunk_tokens'] or 'off'} | "
                  f"{r['tokens_per_second_ratio']:.3f}x | {r['peak_ratio']:.3f}x |"
                  for r in report.get("peer_ratios", [])]
    return lines


def _target_lines(report: dict[str, Any]) -> list[str]:
    """The summary's targets, met or not."""
    lines: list[str] = []
    s = report["summary"]
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    for key, goal in TARGETS.items():
        if key in s:
            shown = f"{100 * s[key]:.1f}%"
            lines.append(f"| {key} | {shown} | {'>=' if key == 'mfu_bf16' else '<='} "
                         f"{100 * goal:.0f}% | {'yes' if s['met'][key] else '**no**'} |")
    return lines


def _check_lines(report: dict[str, Any]) -> list[str]:
    """The metric families and the OOM recovery, a line each."""
    lines: list[str] = []
    metrics = report.get("metrics")
    if metrics:
        lines += ["", f"Metric families through the standalone exporter: "
                      f"{'as expected' if metrics['ok'] else '**not as expected**'} "
                      f"({', '.join(f'{k}: {len(v)}' for k, v in metrics['families'].items())})"]
    oom = report.get("oom_recovery")
    if oom:
        lines += ["", f"OOM recovery: micro-batch {oom['first_micro_batch']} -> "
                      f"{oom['recovered_micro_batch']} after {oom['ooms']} OOM(s), accumulation "
                      f"x{oom['accumulation_after']}, global batch kept; snapshot loads with "
                      f"pickle: {oom['snapshot_loads_with_pickle']}"]
    return lines


def _cap_lines(report: dict[str, Any]) -> list[str]:
    """The largest micro-batch under a memory cap: the plain loop against memtrain's."""
    lines: list[str] = []
    capped = report.get("memory_cap")
    if capped:
        cap = capped["cap_bytes"]
        shown = f"{cap / 2**30:.1f} GiB" if cap >= 2**30 else f"{cap / 2**20:.2f} MiB"
        lines += ["", f"Largest micro-batch under a {shown} cap, bf16 (memtrain's chosen by "
                      "the planner for the cap: auto's choice, and the largest it fits):", "",
                  "| loop | act. ckpt | micro-batch | peak alloc MiB | tokens/s | micro-batch "
                  "vs plain | tokens/s vs plain |", "|---|---|---|---|---|---|---|"]
        entries = [("plain", capped["peer"], None)] + [
            (f"memtrain ({name})", row, capped["ratios"].get(name))
            for name, row in capped["memtrain"].items()]
        for name, row, ratio in entries:
            if row is None:
                lines.append(f"| {name} | - | nothing fits | - | - | - | - |")
                continue
            lines.append(f"| {name} | {row.get('activation_checkpointing', 'none')} | "
                         f"{row['micro_batch_size']} | {row['peak_allocated_bytes'] / 2**20:,.1f}"
                         f" | {row['tokens_per_second']:,.0f} | "
                         + (f"{ratio['micro_batch']:.1f}x | {ratio['tokens_per_second']:.3f}x |"
                            if ratio else "- | - |"))
    return lines


def _loss_lines(report: dict[str, Any]) -> list[str]:
    """The output projection and loss alone, per kernel."""
    lines: list[str] = []
    losses = report.get("loss_kernels")
    if losses:
        shape = losses["shape"]
        lines += ["", f"Output projection + cross-entropy alone, bf16, {shape['tokens']:,} tokens, "
                      f"width {shape['width']:,}, vocabulary {shape['vocab']:,} (forward and "
                      "backward; peak: what the call adds):", "",
                  "| loss | peak added MiB | tokens/s | peak vs plain | tokens/s vs plain |",
                  "|---|---|---|---|---|"]
        for name, row in losses["rows"].items():
            lines.append(f"| {name} | {row['peak_added_bytes'] / 2**20:,.1f} | "
                         f"{row['tokens_per_second']:,.0f} | {row['peak_vs_plain']:.3f}x | "
                         f"{row['tokens_per_second_vs_plain']:.3f}x |")
        if losses["liger_skipped"]:
            lines += ["", f"Liger-Kernel's fused linear cross-entropy: not measured "
                          f"({losses['liger_skipped']})."]
    return lines


def _fsdp_lines(report: dict[str, Any]) -> list[str]:
    rows = report.get("fsdp") or []
    if not rows:
        return []
    lines = ["", "FSDP2 on one rank (bench/gpu_fsdp.py):", "",
             "| setting | peak alloc GiB | predicted GiB (host) | planner error | tokens/s |",
             "|---|---|---|---|---|"]
    for row in rows:
        error = row["planner_error"]
        lines.append(f"| {row['setting']} | {gib(row['peak_allocated_bytes'])} | "
                     f"{gib(row['predicted_peak_bytes'])} ({gib(row['predicted_host_bytes'])}) "
                     f"| {'-' if error is None else f'{error:+.1%}'} | "
                     f"{row['tokens_per_second']:,.0f} |")
    return lines


def _strategy_lines(report: dict[str, Any]) -> list[str]:
    rows = report.get("strategies") or []
    if not rows:
        return []
    lines = ["", "Memory strategies, each alone on bf16 + full checkpointing "
             "(bench/gpu_strategies.py):", "",
             "| strategy | peak alloc GiB | predicted GiB (host) | planner error | tokens/s |",
             "|---|---|---|---|---|"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['strategy']} | skipped: {row['skipped']} | | | |")
            continue
        error = row["planner_error"]
        lines.append(f"| {row['strategy']} | {gib(row['peak_allocated_bytes'])} | "
                     f"{gib(row['predicted_peak_bytes'])} ({gib(row['predicted_host_bytes'])}) "
                     f"| {'-' if error is None else f'{error:+.1%}'} | "
                     f"{row['tokens_per_second']:,.0f} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown, for docs/benchmarks.md."""
    lines = [f"### gpu-check on {report['device']} ({report['date']}"
             f"{', dry mode on CPU' if report['dry'] else ''})", "",
             f"torch {report['torch']}, CUDA {report['cuda']}, model "
             f"{report['model']['n_layer']}x{report['model']['n_embd']} seq "
             f"{report['model']['seq_len']}, micro-batch {report['micro_batch_size']}; "
             f"bf16 matmul peak {report['matmul_bf16_tflops'] or 0:.1f} TFLOP/s; allocator "
             f"{report.get('allocator_effective', report['allocator_requested'])}", "",
             "| precision | act. ckpt | loss chunk | attention | compiled | peak alloc GiB | "
             "peak reserved GiB | fwd / bwd / optim peak GiB | predicted GiB | planner error | "
             "tokens/s | predicted tokens/s | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for part in (_step_lines, _peer_lines, _target_lines, _check_lines, _cap_lines,
                 _loss_lines, _fsdp_lines, _strategy_lines):
        lines += part(report)
    if report["errors"]:
        lines += ["", "Errors: " + "; ".join(report["errors"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--dry", action="store_true", help="tiny model on CPU even with CUDA")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--oom-micro-batch", type=int, default=320)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--loss-chunk-tokens", type=int, default=4096)
    parser.add_argument("--budget-seconds", type=float, default=270)
    parser.add_argument("--memory-cap-gib", type=float, default=24,
                        help="the cap of the largest-micro-batch rows (CUDA)")
    args = parser.parse_args()
    report = run(args)
    name = "gpu-check-dry" if report["dry"] else "gpu-check"
    write_json(args.out, name, report, sort_keys=True)
    table = markdown(report)
    result_path(args.out, name, ".md").write_text(table)
    print(table)
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
