"""What checkpoints cost.

1. Checking one against its manifest: two checkpoints, each written as memtrain writes one
   (``trainer.checkpoint.files.write_states`` with one process and no process group: the model's
   and optimizer's DCP files, ``state.pt``, then ``meta.json``, which hashes every file) and
   then checked as a reader checks it (``trainer.checkpoint.integrity.local_problem``): sizes
   alone, and sizes with SHA-256. ``load_checkpoint`` must accept each. The demo's: its GPT
   (configs/demo-cpu.yaml) and AdamW after one step, through ``model_and_optimizer_states``,
   with a ``state.pt`` of the step, RNG, LR-schedule and GradScaler state (no loader position:
   a few integers). The ``--gib`` one: DCP's save of a plain dict of fp32 tensors of 64 MiB
   each as the model, with no optimizer state (a module would make DCP initialise an
   optimizer's state with gradients of the model's size). The time of ``write_states`` is
   the write; publishing (a copy and a rename into the run directory) is not in it. The files
   are read back from the page cache (just written): a checkpoint read from a cold disk or
   downloaded from a store pays its read once either way, and the hash reads it a second time.
2. What saving costs the step: the demo's model and data on the local launcher, fp32, with
   ``parallel.workers`` each of ``--workers`` (default 1 and 2), ``--steps`` steps with no
   checkpoint but the final one, then a checkpoint every step saved synchronously and
   asynchronously (``train.checkpoint_async``); the wall time of the steps (the run's
   ``wall_seconds``, from the model built to the summary), best of ``--repeats``. Target:
   asynchronous saves add at most 5% to the step.

   Threads: N > 1 workers are processes, each with ``torch.set_num_threads(cores // N)`` from
   the launcher. One worker runs in this process and keeps torch's default, every core, which
   would leave the save's thread no free core; a step on an accelerator leaves the host's cores
   free. So for the one-worker row this bench calls ``torch.set_num_threads(1)`` around the
   launch (and restores the count after): the step on one core, the save's thread free to use
   the others. Product code is unchanged.

Run: ``make bench-checkpoints`` (writes ``bench/results/checkpoints-<date>-<host>.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench.results import describe_cpu, write_json
from trainer.checkpoint.files import (
    load_checkpoint,
    model_and_optimizer_states,
    rng_state,
    write_states,
)
from trainer.checkpoint.integrity import local_problem
from trainer.config import load_config
from trainer.launch.prepare import available_cpus
from trainer.models.build import model_factory
from trainer.optim import Schedule, build_optimizer

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo-cpu.yaml"
TARGET_ASYNC_OVERHEAD = 0.05
ONE_WORKER_THREADS = 1  # the one-worker step's torch threads (module docstring)
States = tuple[dict[str, Any], dict[str, Any]]


def demo_states() -> tuple[dict[str, Any], States]:
    """The demo GPT's checkpoint after one AdamW step: ``state.pt``'s dict, and the model's
    and optimizer's state dicts as ``model_and_optimizer_states`` gives them."""
    cfg = load_config(DEMO)
    model = model_factory(cfg.model)()
    optimizer = build_optimizer(model, cfg.train.lr, cfg.train.weight_decay, cfg.train.betas)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, Schedule.of(cfg.train))
    tokens_BT = torch.zeros(1, 8, dtype=torch.long)
    model(tokens_BT, tokens_BT).backward()
    optimizer.step()
    scheduler.step()
    state = {"scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
             "scheduler": scheduler.state_dict(), "rng": rng_state(), "step": 1,
             "dcp": True}
    return state, model_and_optimizer_states(model, optimizer)


def sized_states(gib: float) -> tuple[dict[str, Any], States]:
    """A model-like dict of fp32 tensors of 64 MiB each, ``gib`` GiB in all (at least one),
    with no optimizer state; ``state.pt``'s dict holds the step."""
    count = max(1, round(gib * 16))
    model = {f"w{i}": torch.randn(16 << 20) for i in range(count)}
    return {"step": 1, "dcp": True}, (model, {})


def measure(states: tuple[dict[str, Any], States], directory: Path) -> dict[str, Any]:
    """Write one checkpoint with ``write_states`` and check it by sizes and by SHA-256;
    returns its bytes, files and the seconds of each."""
    state, model_and_optimizer = states
    directory.mkdir(parents=True)
    started = time.perf_counter()
    write_states(directory, state, model_and_optimizer)
    written = time.perf_counter() - started
    load_checkpoint(directory)  # raises CheckpointReadError unless it is memtrain's format
    timings = {}
    for mode, hashes in (("sizes", False), ("hashes", True)):
        started = time.perf_counter()
        problem = local_problem(directory, hashes)
        timings[mode] = time.perf_counter() - started
        assert problem is None, problem
    files = [p for p in directory.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    return {"bytes": total, "files": len(files),
            "dcp_files": sum(p.suffix == ".distcp" for p in files),
            "write_with_manifest_s": round(written, 4),
            "check_sizes_s": round(timings["sizes"], 5),
            "check_hashes_s": round(timings["hashes"], 4),
            "hash_s_per_gib": round(timings["hashes"] / (total / 2**30), 3)}


def threads_of(workers: int) -> int:
    """torch threads of each worker's step in the bench's run of ``workers`` workers."""
    return ONE_WORKER_THREADS if workers == 1 else max(1, available_cpus() // workers)


def thread_setting(workers: int) -> str:
    """How the bench's run of ``workers`` workers got its threads, in words."""
    if workers == 1:
        return (f"torch.set_num_threads({ONE_WORKER_THREADS}) by this bench around the "
                f"in-process launch, of {available_cpus()} cores")
    return (f"torch.set_num_threads({threads_of(workers)}) in each worker by the launcher "
            f"({available_cpus()} cores // {workers})")


@contextlib.contextmanager
def step_threads(workers: int) -> Iterator[None]:
    """This process's torch threads at ``threads_of(workers)`` while a one-worker run trains
    in it; the count as it was after. Nothing for N > 1 workers (their own processes)."""
    if workers != 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads_of(workers))
    try:
        yield
    finally:
        torch.set_num_threads(before)


MODES = {"none": ("train.checkpoint_every=0",),
         "sync": ("train.checkpoint_every=1",),
         "async": ("train.checkpoint_every=1", "train.checkpoint_async=true")}


def run_summary(corpus: Path, work: Path, workers: int, steps: int, mode: str,
                repeat: int) -> dict[str, Any]:
    """One run of the demo on the local launcher with ``workers`` workers, saving as ``mode``
    says (``MODES``); rank 0's summary."""
    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run

    cfg = load_config(DEMO, [f"data.path={corpus / 'train'}", "data.val_path=null",
                             "parallel.launcher=local", f"parallel.workers={workers}",
                             "memory.precision=fp32", f"train.steps={steps}",
                             "train.eval_every=0", "train.log_every=1000",
                             f"run.dir={work / 'runs'}",
                             f"run.name={workers}w-{mode}-{repeat}", *MODES[mode]])
    with step_threads(workers):
        return launch_local(*prepare_run(cfg))


def overhead_row(corpus: Path, work: Path, workers: int, steps: int,
                 repeats: int) -> dict[str, Any]:
    """Seconds per step of ``workers`` workers with no checkpoints, a synchronous one every
    step and an asynchronous one every step (best of ``repeats``), and the two overheads."""
    seconds: dict[str, float] = {}
    saving: dict[str, dict[str, float]] = {}
    for repeat in range(repeats):
        for mode in MODES:  # interleaved: a drift of the machine touches every mode alike
            summary = run_summary(corpus, work, workers, steps, mode, repeat)
            per_step = summary["wall_seconds"] / steps
            if per_step <= seconds.get(mode, per_step):
                seconds[mode] = per_step
                saving[mode] = {"saving_s_per_step": summary["checkpoint_seconds"] / steps,
                                "waited_s_per_step":
                                    summary["checkpoint_blocking_seconds"] / steps,
                                "checkpoints_written": summary["checkpoints_written"]}
    async_overhead = seconds["async"] / seconds["none"] - 1
    return {"workers": workers, "torch_threads_per_worker": threads_of(workers),
            "thread_setting": thread_setting(workers), "step_seconds": seconds,
            "saves": saving, "sync_overhead": seconds["sync"] / seconds["none"] - 1,
            "async_overhead": async_overhead,
            "async_target_met": async_overhead <= TARGET_ASYNC_OVERHEAD}


def step_overhead(steps: int, repeats: int, workers: list[int], work: Path) -> dict[str, Any]:
    """``overhead_row`` for each worker count of ``workers``, on a corpus built in ``work``."""
    from datapipe.corpus import build_stdlib_corpus

    corpus = work / "corpus"
    build_stdlib_corpus(corpus, seq_len=256, max_bytes=2_000_000, rows_per_shard=1000)
    return {"steps": steps, "repeats": repeats, "checkpoint_every": 1,
            "available_cpus": available_cpus(), "target_async_overhead": TARGET_ASYNC_OVERHEAD,
            "rows": [overhead_row(corpus, work, count, steps, repeats) for count in workers]}


def worker_counts(text: str) -> list[int]:
    """``--workers``: a comma list of positive worker counts ("1,2")."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"--workers {text!r}: give a comma list of positive worker counts, e.g. 1,2")
    return counts


def print_report(report: dict[str, Any]) -> None:
    print(describe_cpu(report["cpu"]))
    for name in ("demo", "sized"):
        row = report[name]
        print(f"{name}: {row['bytes'] / 2**20:,.1f} MiB in {row['files']} files "
              f"({row['dcp_files']} DCP), written with its manifest in "
              f"{row['write_with_manifest_s']:.3f} s; checked by sizes in "
              f"{row['check_sizes_s'] * 1e3:.2f} ms, by SHA-256 in {row['check_hashes_s']:.3f} s "
              f"({row['hash_s_per_gib']:.2f} s per GiB)")
    if "step" not in report:
        return
    step = report["step"]
    print(f"a checkpoint every step, {step['steps']} steps, best of {step['repeats']}:")
    for row in step["rows"]:
        times = ", ".join(f"{mode} {value * 1e3:.1f} ms"
                          for mode, value in row["step_seconds"].items())
        print(f"  {row['workers']} worker(s), {row['thread_setting']}: a step {times}: "
              f"synchronous {row['sync_overhead']:+.1%}, asynchronous "
              f"{row['async_overhead']:+.1%} (target <= +{TARGET_ASYNC_OVERHEAD:.0%}: "
              f"{'met' if row['async_target_met'] else 'NOT met'})")
        for mode in ("sync", "async"):
            save = row["saves"][mode]
            print(f"    {mode}: {len(save['checkpoints_written'])} checkpoints, saving "
                  f"{save['saving_s_per_step'] * 1e3:.1f} ms a step, of which the step waited "
                  f"{save['waited_s_per_step'] * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=worker_counts, default=[1, 2],
                        help="comma list of worker counts for the step's cost (default 1,2)")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="memtrain-bench-ckpt-") as tmp:
        report["demo"] = measure(demo_states(), Path(tmp) / "demo")
        report["sized"] = measure(sized_states(args.gib), Path(tmp) / "sized")
        if args.steps:
            report["step"] = step_overhead(args.steps, args.repeats, args.workers, Path(tmp))
    path = write_json(args.out, "checkpoints", report)
    print_report(report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
