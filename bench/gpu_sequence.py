"""gpu-check's sequence-parallel rows: each row split over two ranks (``parallel.sequence: 2``,
Ulysses attention, ``trainer.parallel.sequence``), with and without the tiled MLP, measured and
planned.

Two processes, one rank each (NCCL over two GPUs; dry, gloo on CPU), train the model on the same
rows with the trainer's own ``train_step`` under ``DataParallel`` over one sequence group: each
holds half of every row's tokens and attends over whole rows for half of the heads. A row
records the highest rank's peak (CUDA's ``max_memory_allocated``; dry, the allocator's record of
one step) beside the planner's prediction for one rank of the split
(``trainer.plan.peak.plan_row`` on a probe of the split, ``profile_activations(sequence=2)``).
NCCL runs one rank a GPU, so on a machine with one GPU the rows are recorded as skipped, saying
so.
"""

from __future__ import annotations

import os
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.gpu_fsdp import measured_row, measured_steps
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, build_model
from trainer.models.gpt import GPT, GPTConfig
from trainer.optim import build_optimizer
from trainer.parallel.ddp import DataParallel
from trainer.parallel.mesh import Mesh
from trainer.parallel.rendezvous import backend_for, free_port
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.static import static_bytes

RANKS = 2
# name: the MLP's sequence tiles (``memory.tiled_mlp``)
CASES = {"sequence parallel 2": 1, "sequence parallel 2 + tiled MLP 4": 4}


def _transforms(tiles: int) -> MemoryTransforms:
    return MemoryTransforms("full", loss_chunk_tokens=1024, bf16_norm_inputs=False,
                            tiled_mlp=tiles)


def _rank(rank: int, port: int, device_type: str, cfg: GPTConfig, tiles: int, micro_batch: int,
          steps: int, warmup: int, out: str) -> None:
    """One rank's ``warmup`` then ``steps`` steps; writes its peak and the timed seconds."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device_type), rank=rank, world_size=RANKS)
    try:
        if not cuda:
            torch.set_num_threads(1)
        parallel = DataParallel(Mesh.of(RANKS, rank, sequence=RANKS))
        model = build_model(partial(GPT, cfg), _transforms(tiles), device, seed=0)
        parallel.split_sequences(model)
        optimizer = build_optimizer(model, lr=3e-4)
        model = parallel.wrap(model, optimizer)
        policy = precision_policy("bf16", device, warn=False)
        scaler = policy.grad_scaler(device)
        # the same rows on both ranks: each trains its half of every row's tokens
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1),
                               generator=torch.Generator().manual_seed(1)).to(device)
        peak, seconds = measured_steps(model, optimizer, scaler, tokens, policy, 1.0, steps,
                                       warmup, parallel=parallel)
        torch.save({"peak": int(peak), "seconds": seconds}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def sequence_row(cfg: GPTConfig, name: str, device: torch.device, micro_batch: int, steps: int,
                 warmup: int) -> dict[str, Any]:
    """One case's measured step on two ranks (the highest rank's peak; tokens/s of the rows
    both train) and the planner's prediction for a rank of the split."""
    tiles = CASES[name]
    if device.type == "cuda" and torch.cuda.device_count() < RANKS:
        return {"strategy": name, "skipped": f"needs {RANKS} GPUs (NCCL runs one rank a GPU); "
                                             f"this machine has {torch.cuda.device_count()}"}
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "rank")
        mp.start_processes(_rank, args=(free_port(), device.type, cfg, tiles, micro_batch,
                                        steps, warmup, out), nprocs=RANKS, start_method="spawn")
        ranks = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(RANKS)]
    peak = max(rank["peak"] for rank in ranks)
    seconds = max(rank["seconds"] for rank in ranks)
    profile = profile_activations(partial(GPT, cfg), _transforms(tiles), cfg.seq_len,
                                  cfg.vocab_size, "bf16", device=device, sequence=RANKS)
    with torch.device("meta"):
        shape = GPT(cfg)
    plan = plan_row(static_bytes(shape, "ddp", RANKS), profile, micro_batch, 1)
    return {"strategy": name, **measured_row(micro_batch, cfg.seq_len, steps, peak, seconds,
                                             plan)}
