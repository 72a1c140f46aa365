"""gloo's collectives over loopback on this CPU: all-reduce, all-gather, reduce-scatter and
all-to-all, in bus bytes/s (the bytes each rank sends, ``(world - 1) / world`` of the buffer,
twice for the all-reduce), at 2 and 4 ranks, 16 MiB a rank, one thread each, the median of 5
calls after one to warm. The planner's CPU figures (``trainer.plan.devices``:
``ALLREDUCE_BYTES_PER_S``, which also times sequence parallelism's all-to-alls,
``GATHER_BYTES_PER_S``) come from it. Beside them, the seconds of one all-reduce of one number
over the ranks (the mean of 1,000): what ``trainer.oom.GroupOOMWatch`` adds before each of a
sequence group's collectives while OOM recovery is on. Run idle: ``python -m bench.gloo_link``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from bench.results import describe_cpu, write_json
from trainer.launch.local import free_port, start_workers
from trainer.parallel.sequence import GroupOOMWatch


def _timed(fn: Callable[[], object], calls: int = 5) -> float:
    fn()
    dist.barrier()
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _flag_seconds(calls: int = 1000) -> float:
    """One meeting of an armed ``GroupOOMWatch`` over every rank (``ready``: one all-reduce of
    a one-number host tensor, read back)."""
    watch = GroupOOMWatch(dist.group.WORLD)
    watch.armed = True
    watch.ready()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        watch.ready()
    return (time.perf_counter() - start) / calls


def _rank(rank: int, port: int, world: int, mib: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        shard = mib * 2**20 // 4
        whole, part = torch.randn(shard * world), torch.randn(shard)
        received = torch.empty_like(whole)
        share = (world - 1) / world * whole.numel() * 4
        rates = {
            "all_reduce": 2 * share / _timed(lambda: dist.all_reduce(whole)),
            "all_gather": share / _timed(lambda: dist.all_gather_into_tensor(whole, part)),
            "reduce_scatter": share / _timed(lambda: dist.reduce_scatter_tensor(part, whole)),
            "all_to_all": share / _timed(lambda: dist.all_to_all_single(received, whole)),
        }
        rates["flag_all_reduce_s"] = _flag_seconds()
        if rank == 0:
            torch.save(rates, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    report: dict = {"mib_per_rank": args.mib, "bus_bytes_per_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 4):
            out = str(Path(tmp) / f"{world}.pt")
            start_workers(_rank, (free_port(), world, args.mib, out), world)
            rates = torch.load(out, weights_only=True)
            report["bus_bytes_per_s"][world] = rates
            flag = rates.pop("flag_all_reduce_s")
            report.setdefault("flag_all_reduce_s", {})[world] = flag
            print(f"{world} ranks: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s"
                                                 for k, v in rates.items()) +
                  f"; one-number all-reduce {flag * 1e6:.0f} us", flush=True)
    path = write_json(args.out, "gloo-link", report)
    print(f"{describe_cpu(report['cpu'])}; wrote {path}")


if __name__ == "__main__":
    main()
