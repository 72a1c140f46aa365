"""FSDP on gloo ranks: the largest GPT that builds, and builds and trains one step, with every
rank under a resident-memory budget; the build before the meta device against memtrain's.

Both paths shard the same models with FSDP2 (``trainer.parallel.fsdp``) on ``--workers`` gloo ranks
of this CPU:
- (p) the host build: every rank builds the whole model (seeded), then shards it;
- (m) memtrain's: built on the meta device, sharded, each rank's shards filled with the same
  weights (``trainer.parallel.fsdp.build_sharded``).
Each path is trained two ways, the same for both:
- plain: fp32 weights, fp32 AdamW after backward, activation checkpointing off;
- lean: what memtrain offers where memory is short: bf16 weights with no fp32 copy
  (``model.dtype: bf16``), 4-bit AdamW states, the step in backward, full checkpointing.
Through the build, each rank's resident memory above its own baseline (a process that has built
a tiny model the same way once, so code pages are not counted) is sampled every millisecond
(``monitoring.memory.PeakResident``), with glibc's mmap threshold fixed (``MALLOC_ENV``).
Through the build and one step, the CPU allocator's record of live tensors is the measure
(``trainer.telemetry.diagnostics.cpu_peak_bytes``), as a device's allocator would hold them; the
step's resident memory, printed beside it, also counts what the process keeps for itself (for the
lean path most likely torch.compile's work on torchao's step, host memory on a GPU). GPTs of width
512 (vocabulary 8,192, sequence 64) grow by layers until a path's worst rank goes over ``--budget``.
For every size it also prints rank 0's step peak as the planner predicts it
(``trainer.plan.peak.plan_row``) beside the one measured. Target: (m) builds and trains a model at
least 3x (p)'s parameters. Run: ``make bench-fsdp`` (writes
``bench/results/fsdp-<date>-<host>.json``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.results import describe_cpu, write_json
from monitoring.memory import PeakResident
from trainer.launch.local import free_port, start_workers
from trainer.models.build import Bf16Weights, MemoryTransforms, build_model
from trainer.models.gpt import GPT, GPTConfig
from trainer.optim import build_optimizer
from trainer.parallel.fsdp import (
    FsdpSettings,
    ShardedDataParallel,
    build_sharded,
    shard_model,
)
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.static import static_bytes
from trainer.telemetry.diagnostics import cpu_peak_bytes

LAYERS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LEAN_LAYERS = (8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
TINY = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)
LEAN_STATES = "4bit"


def gpt(n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=8192, seq_len=64, n_layer=n_layer, n_head=8, n_embd=512)


def _factory(cfg: GPTConfig, lean: bool) -> Callable[[], torch.nn.Module]:
    return Bf16Weights(partial(GPT, cfg)) if lean else partial(GPT, cfg)


def _settings(lean: bool) -> tuple[MemoryTransforms, FsdpSettings]:
    if lean:
        return MemoryTransforms("full"), FsdpSettings("bf16", "bf16", weight_dtype="bf16")
    return MemoryTransforms(), FsdpSettings()


def _build(path: str, cfg: GPTConfig, lean: bool) -> torch.nn.Module:
    factory, (transforms, settings) = _factory(cfg, lean), _settings(lean)
    if path == "meta":
        return build_sharded(factory, transforms, torch.device("cpu"), 0, settings,
                             model_name="gpt")
    return shard_model(build_model(factory, transforms, torch.device("cpu"), 0), settings)


def _train_one_step(model: torch.nn.Module, cfg: GPTConfig, lean: bool) -> None:
    if lean:  # the step runs inside backward, parameter by parameter
        build_optimizer(model, 1e-4, states=LEAN_STATES,
                        backward_hooks=ShardedDataParallel.backward_hooks)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    if not lean:
        optimizer.step()


def _rank(rank: int, port: int, world_size: int, path: str, lean: bool, n_layer: int,
          out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        warm = _build(path, TINY, lean)  # the baseline: code paths taken once
        _train_one_step(warm, TINY, lean)
        del warm
        cfg = gpt(n_layer)
        build = PeakResident()

        def build_and_step() -> None:
            with build.watch():
                model = _build(path, cfg, lean)
            _train_one_step(model, cfg, lean)

        with PeakResident().watch() as resident:
            step = cpu_peak_bytes(build_and_step)
        torch.save({"build": build.peak, "step": step, "step_resident": resident.peak},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


# glibc's mmap threshold, fixed (its environment variable turns the dynamic one off): a freed
# tensor's pages go back to the system at once, so resident memory follows the live tensors.
# With the dynamic threshold a freed tensor may stay with the process: the same 2-layer meta
# build read 37-56 MiB resident from run to run, 31-32 MiB with this.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def measure(path: str, lean: bool, n_layer: int, world_size: int) -> dict[str, int]:
    """The worst rank's resident peaks through the build and through build and step."""
    os.environ.update(MALLOC_ENV)  # read by glibc as each worker process starts
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "peak")
        start_workers(_rank, (free_port(), world_size, path, lean, n_layer, out), world_size)
        ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(world_size)]
    return {key: max(r[key] for r in ranks) for key in ("build", "step", "step_resident")}


def predicted_step(n_layer: int, world_size: int, lean: bool) -> int:
    cfg = gpt(n_layer)
    factory, (transforms, settings) = _factory(cfg, lean), _settings(lean)
    profile = profile_activations(factory, transforms.replace(bf16_norm_inputs=False),
                                  cfg.seq_len, cfg.vocab_size, "bf16" if lean else "fp32")
    with torch.device("meta"):
        model = factory()
    static = static_bytes(model, "fsdp", world_size, settings,
                          states=LEAN_STATES if lean else "fp32", in_backward=lean,
                          step_device="cpu")
    return plan_row(static, profile, 1, 1).predicted_peak_bytes


def largest(path: str, lean: bool, budget: int, world_size: int, rows: list[dict[str, Any]],
            layers: tuple[int, ...]) -> dict[str, int]:
    """The most layers whose worst rank stays in ``budget``, through the build and through
    the step (0: none), growing until the build is over it (lean: until the step is)."""
    best = {"build": 0, "step": 0}
    name = f"{path}{' lean' if lean else ''}"
    for n_layer in layers:
        peaks = measure(path, lean, n_layer, world_size)
        params = sum(p.numel() for p in GPT(gpt(n_layer)).parameters())
        predicted = predicted_step(n_layer, world_size, lean) if path == "meta" else None
        rows.append({"path": path, "lean": lean, "n_layer": n_layer, "params": params,
                     **peaks, "predicted_step": predicted})
        print(f"{name:9s} {n_layer:3d} layers {params / 1e6:7.1f}M params: build "
              f"{peaks['build'] / 2**20:7.1f} MiB resident, build+step "
              f"{peaks['step'] / 2**20:7.1f} MiB tensors ({peaks['step_resident'] / 2**20:.0f} "
              f"resident)" + (f"; planner, step: {predicted / 2**20:.1f} MiB"
                              if predicted else ""), flush=True)
        for key in best:
            if peaks[key] <= budget:
                best[key] = params
        if peaks["step" if lean else "build"] > budget:
            break
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--ways", default="plain,lean", help="plain, lean or both")
    parser.add_argument("--quick", action="store_true", help="2 layers only (the tests)")
    args = parser.parse_args()
    budget = args.budget_mib * 2**20
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"workers": args.workers, "budget_bytes": budget, "rows": rows,
                              "target": "meta lean / host lean params >= 3 (build+step)",
                              "measures": {"build": "resident, sampled",
                                           "step": "allocator's record"}}
    for way in args.ways.split(","):
        lean = way == "lean"
        layers = (2,) if args.quick else LEAN_LAYERS if lean else LAYERS
        host = largest("host", lean, budget, args.workers, rows, layers)
        meta = largest("meta", lean, budget, args.workers, rows, layers)
        report[way] = {"host": host, "meta": meta, "ratios": {
            key: meta[key] / host[key] if host[key] else None for key in host}}
    path = write_json(args.out, "fsdp", report)
    print(f"{args.workers} gloo ranks, each under {args.budget_mib} MiB, "
          f"{describe_cpu(report['cpu'])}")
    for way in args.ways.split(","):
        host, meta, ratios = (report[way][k] for k in ("host", "meta", "ratios"))
        for key, label in (("build", "builds"), ("step", "builds and trains one step")):
            ratio = ratios[key]
            print(f"{way}: largest that {label}: host {host[key] / 1e6:.1f}M, meta "
                  f"{meta[key] / 1e6:.1f}M params ({f'{ratio:.2f}x' if ratio else 'n/a'})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
