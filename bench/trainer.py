"""Trainer overhead, accumulation communication and time to first step, on CPU with gloo.

1. **Overhead.** memtrain's loop (local launcher, 2 workers: loader, metrics log every 10
   steps, accumulation, its defaults) against a minimal hand-written DDP loop
   (``torch.multiprocessing`` + gloo, ``no_sync`` on all but the last micro-batch, batches
   sliced from an in-memory tensor) on the same model, data, batch, precision and threads.
   Steady-state step time: the median over steps (memtrain: over its 10-step log windows)
   after the first 10. Target: ratio <= 1.03. A second memtrain row turns the cross-rank OOM
   agreement on (``memory.oom_recovery: true``; ``auto`` leaves it off on CPU).
2. **Accumulation communication.** Gradient all-reduce rounds per optimizer step and the bytes
   they carry, counted by a DDP comm hook (and by wrapping ``dist.all_reduce`` for memtrain's
   own bucketed reduction): memtrain does 1 round for ``k`` micro-batches, a naive loop without
   ``no_sync`` does ``k``.
3. **Time to first step.** From the command's start to the end of optimizer step 1, under the
   local launcher and under Ray Train (a fresh local Ray on 127.0.0.1), from the metrics log.

Run: ``python -m bench.trainer`` (``make bench`` runs it with the others).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.results import write_json
from trainer.compat import cpu_bf16_support
from trainer.launch.local import free_port

REPO = Path(__file__).resolve().parents[1]
WORKERS = 2
MICRO, ACCUM = 8, 2  # global batch 32 = 8 x 2 x 2 workers, as the demo
# What ``memory.precision: auto`` runs on this CPU: bf16 only where it is native (emulated, it
# is 3-9x slower than fp32, and both loops would measure the emulation).
PRECISION = "bf16" if cpu_bf16_support() == "native" else "fp32"
SETTINGS = ["model.n_layer=4", "model.n_embd=128", "model.n_head=4", "model.seq_len=256",
            "train.global_batch_size=32", "train.micro_batch_size=8", "train.log_every=10",
            "train.eval_every=0", "train.checkpoint_every=0", f"memory.precision={PRECISION}",
            "memory.activation_checkpointing=none", "memory.leak_check_every=0"]


def _counted_ddp(rank: int, port: int) -> tuple[DDP, dict[str, int]]:
    """Join the gloo group; the benchmark's GPT under DDP with a comm hook that counts the
    gradient all-reduce rounds and their bytes."""
    from trainer.models.gpt import GPT, GPTConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORKERS)
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(vocab_size=256, seq_len=256, n_layer=4, n_head=4, n_embd=128)))
    rounds = {"n": 0, "bytes": 0}

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        state["n"] += 1
        state["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(None, bucket)

    model.register_comm_hook(rounds, counting_hook)
    return model, rounds


def _naive_worker(rank: int, port: int, data: str, steps: int, out: str, no_sync: bool) -> None:
    """The hand-written loop: what a careful user writes with plain torch."""
    import contextlib

    import pyarrow as pa

    from datapipe.manifest import read_manifest

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // WORKERS))
    model, rounds = _counted_ddp(rank, port)
    tables = [pa.ipc.open_file(pa.memory_map(f"{data}/{s.path}")).read_all()
              for s in read_manifest(data).shards]
    tokens = torch.cat([torch.from_numpy(c.flatten().to_numpy().reshape(len(c), -1))
                        for t in tables for c in t.column("tokens").chunks]).long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=False)
    times, cursor = [], rank * MICRO
    for _ in range(steps):
        start = time.perf_counter()
        for micro in range(ACCUM):
            batch = tokens[cursor:cursor + MICRO]
            cursor = (cursor + WORKERS * MICRO) % (len(tokens) - WORKERS * MICRO)
            sync = contextlib.nullcontext() if micro == ACCUM - 1 or not no_sync \
                else model.no_sync()
            with sync, torch.autocast("cpu", dtype=torch.bfloat16,
                                      enabled=PRECISION == "bf16"):
                logits = model(batch[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                         batch[:, 1:].flatten()) / ACCUM
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_seconds": times, "rounds": rounds["n"],
                                         "bytes": rounds["bytes"], "steps": steps}))
    dist.destroy_process_group()


def naive(data: Path, steps: int, no_sync: bool = True) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "naive.json"
        mp.spawn(_naive_worker, args=(free_port(), str(data), steps, str(out), no_sync),
                 nprocs=WORKERS, start_method="spawn")
        return json.loads(out.read_text())


def memtrain_run(data: Path, steps: int, launcher: str, run_dir: Path,
                 extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """A real `memtrain train` command; step times and step 1's wall time from its logs."""
    run = f"bench-{launcher}-{int(time.time() * 1000)}"
    command = [sys.executable, "-m", "trainer.cli", "train", "--config",
               str(REPO / "configs/demo-cpu.yaml"), "--launcher", launcher, "--workers",
               str(WORKERS), "--run-name", run, "--set", f"data.path={data}", "--set",
               "data.val_path=null", "--set", f"run.dir={run_dir}", "--set",
               f"train.steps={steps}", *[a for s in (*SETTINGS, *extra) for a in ("--set", s)]]
    started = time.time()
    out = subprocess.run(command, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    if out.returncode != 0:
        raise RuntimeError(f"memtrain train failed: {out.stderr[-2000:]}")
    records = [json.loads(line) for line in
               (run_dir / run / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    steps_logged = [r for r in records if "step_seconds" in r]
    return {"step_seconds": [r["step_seconds"] for r in steps_logged],
            "first_step_after_start_seconds": steps_logged[0]["time"] - started,
            "wall_seconds": time.time() - started}


def _memtrain_rounds_worker(rank: int, port: int, out: str, agreement: bool) -> None:
    """memtrain's train_step on DDP with both counters: the comm hook and dist.all_reduce."""
    from trainer.memory.precision import precision_policy
    from trainer.oom import OOMAgreement
    from trainer.step import train_step

    model, rounds = _counted_ddp(rank, port)
    original = dist.all_reduce

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.numel() > 1:  # gradients; the OOM agreement's 1-element flag is not
            rounds["n"] += 1
            rounds["bytes"] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce  # type: ignore[assignment]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    device = torch.device("cpu")
    policy = precision_policy(PRECISION, device, warn=False)
    scaler = policy.grad_scaler(device)
    micro = [torch.randint(0, 256, (MICRO, 257)) for _ in range(ACCUM)]
    steps = 3
    for _ in range(steps):
        train_step(model, optimizer, scaler, micro, 1, policy, 1.0,
                   agreement=OOMAgreement(device) if agreement else None)
    if rank == 0:
        Path(out).write_text(json.dumps({"rounds": rounds["n"], "bytes": rounds["bytes"],
                                         "steps": steps}))
    dist.destroy_process_group()


def memtrain_rounds(agreement: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rounds.json"
        mp.spawn(_memtrain_rounds_worker, args=(free_port(), str(out), agreement),
                 nprocs=WORKERS, start_method="spawn")
        return json.loads(out.read_text())


def steady(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


def overhead(data: Path, steps: int, runs: Path) -> dict[str, Any]:
    """memtrain's step time against the hand-written DDP loop's, with and without the OOM
    agreement. The runs alternate so that drift in the machine's speed hits all alike; the
    best of each is kept."""
    times: dict[str, list[float]] = {"naive": [], "memtrain": [], "memtrain_oom_agreement": []}
    for _ in range(2):
        times["naive"].append(steady(naive(data, steps)["step_seconds"], 10))
        times["memtrain"].append(steady(memtrain_run(data, steps, "local", runs)
                                        ["step_seconds"], 1))
        times["memtrain_oom_agreement"].append(steady(memtrain_run(
            data, steps, "local", runs, ("memory.oom_recovery=true",))["step_seconds"], 1))
    best = {name: min(values) for name, values in times.items()}
    found = {"naive_step_seconds": best["naive"], "memtrain_step_seconds": best["memtrain"],
             "ratio": best["memtrain"] / best["naive"],
             "ratio_with_oom_agreement": best["memtrain_oom_agreement"] / best["naive"],
             "target": 1.03, "runs": times}
    print(f"overhead: hand-written DDP {best['naive'] * 1e3:.1f} ms/step, memtrain "
          f"{best['memtrain'] * 1e3:.1f} ms/step (ratio {found['ratio']:.3f}), with the OOM "
          f"agreement {best['memtrain_oom_agreement'] * 1e3:.1f} ms/step (ratio "
          f"{found['ratio_with_oom_agreement']:.3f})", flush=True)
    return found


def accumulation_rounds(data: Path) -> dict[str, Any]:
    """All-reduce rounds and bytes per step with accumulation: the naive loop, the loop
    under ``no_sync``, and memtrain's."""
    plain = naive(data, 3, no_sync=False)
    careful = naive(data, 3, no_sync=True)
    mine = memtrain_rounds(agreement=True)
    acc = {"micro_batches": ACCUM,
           "naive_rounds_per_step": plain["rounds"] / plain["steps"],
           "naive_bytes_per_step": plain["bytes"] / plain["steps"],
           "no_sync_rounds_per_step": careful["rounds"] / careful["steps"],
           "memtrain_rounds_per_step": mine["rounds"] / mine["steps"],
           "memtrain_bytes_per_step": mine["bytes"] / mine["steps"]}
    print(f"all-reduce rounds per step with {ACCUM} micro-batches: naive "
          f"{acc['naive_rounds_per_step']:.0f} ({acc['naive_bytes_per_step'] / 1e6:.1f} MB),"
          f" memtrain {acc['memtrain_rounds_per_step']:.0f} "
          f"({acc['memtrain_bytes_per_step'] / 1e6:.1f} MB)", flush=True)
    return acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--data", default=None, help="A token dataset of rows of 257.")
    parser.add_argument("--skip-ray", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="memtrain-bench-trainer-") as tmp:
        data = Path(args.data) if args.data else Path(tmp) / "corpus" / "train"
        if not args.data:
            from datapipe.corpus import build_stdlib_corpus

            build_stdlib_corpus(data.parent, seq_len=256, max_bytes=4 << 20)
        runs = Path(tmp) / "runs"
        report: dict[str, Any] = {"bench": "trainer", "host": socket.gethostname(),
                                  "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                                  "cpus": len(os.sched_getaffinity(0)), "workers": WORKERS,
                                  "micro_batch": MICRO, "accumulation": ACCUM,
                                  "torch": torch.__version__, "precision": PRECISION}
        report["overhead"] = overhead(data, args.steps, runs)
        report["accumulation"] = accumulation_rounds(data)
        first = {"local": memtrain_run(data, 2, "local", runs)}
        if not args.skip_ray:
            first["ray"] = memtrain_run(data, 2, "ray", runs)
        report["time_to_first_step"] = {k: v["first_step_after_start_seconds"]
                                        for k, v in first.items()}
        print("time to first step: " + ", ".join(f"{k} {v:.1f} s" for k, v in
                                                 report["time_to_first_step"].items()))
    print(f"wrote {write_json(args.out, 'trainer', report)}")


if __name__ == "__main__":
    main()
