"""What checkpoints cost.

1. Checking one against its manifest: the demo's checkpoint and one of ``--gib`` GiB, each
   written as memtrain writes one (``trainer.checkpoint.files.save_checkpoint``: ``torch.save``,
   then the manifest, which hashes every file) and then checked as a reader checks it
   (``trainer.checkpoint.integrity.local_problem``): sizes alone, and sizes with SHA-256. The files
   are read back from the page cache (just written): a checkpoint read from a cold disk or
   downloaded from a store pays its read once either way, and the hash reads it a second time.
2. What saving costs the step: the demo's model and data on the local launcher (its 2
   workers, fp32), ``--steps`` steps with no checkpoint but the final one, then a checkpoint
   every step saved synchronously and asynchronously (``train.checkpoint_async``); the wall
   time of the steps (the run's ``wall_seconds``, from the model built to the summary), best of
   ``--repeats``. Target: asynchronous saves add at most 5% to the step.

Run: ``make bench-checkpoints`` (writes ``bench/results/checkpoints-<date>-<host>.json``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.results import describe_cpu, write_json
from trainer.checkpoint.files import save_checkpoint
from trainer.checkpoint.integrity import local_problem
from trainer.config import load_config
from trainer.models.gpt import GPT, GPTConfig

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo-cpu.yaml"


def demo_state() -> dict[str, Any]:
    """The demo GPT's model and AdamW state after a step: what its checkpoint's bytes are."""
    cfg = load_config(DEMO).model
    model = GPT(GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_embd=cfg.n_embd))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long))[0].float().sum().backward()
    optimizer.step()
    return {"step": 1, "model": model.state_dict(), "optimizer": optimizer.state_dict()}


def sized_state(gib: float) -> dict[str, Any]:
    """fp32 tensors of 64 MiB each, ``gib`` GiB in all."""
    count = max(1, round(gib * 16))
    return {"step": 1, "model": {f"w{i}": torch.randn(16 << 20) for i in range(count)}}


def measure(state: dict[str, Any], directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    save_checkpoint(directory, state)
    written = time.perf_counter() - started
    timings = {}
    for mode, hashes in (("sizes", False), ("hashes", True)):
        started = time.perf_counter()
        assert local_problem(directory, hashes) is None
        timings[mode] = time.perf_counter() - started
    total = sum(p.stat().st_size for p in directory.iterdir())
    return {"bytes": total, "write_with_manifest_s": round(written, 4),
            "check_sizes_s": round(timings["sizes"], 5),
            "check_hashes_s": round(timings["hashes"], 4),
            "hash_s_per_gib": round(timings["hashes"] / (total / 2**30), 3)}


def step_overhead(steps: int, repeats: int, work: Path) -> dict[str, Any]:
    """Seconds per step of the demo with no checkpoints, a synchronous one every step and an
    asynchronous one every step (best of ``repeats``), and the two overheads."""
    from datapipe.corpus import build_stdlib_corpus
    from trainer.config import load_config as load
    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run

    corpus = work / "corpus"
    build_stdlib_corpus(corpus, seq_len=256, max_bytes=2_000_000, rows_per_shard=1000)
    modes = {"none": ("train.checkpoint_every=0",),
             "sync": ("train.checkpoint_every=1",),
             "async": ("train.checkpoint_every=1", "train.checkpoint_async=true")}
    seconds: dict[str, float] = {}
    saving: dict[str, dict[str, float]] = {}
    for repeat in range(repeats):
        for mode, sets in modes.items():
            cfg = load(DEMO, [f"data.path={corpus / 'train'}", "data.val_path=null",
                              "parallel.launcher=local", "memory.precision=fp32",
                              f"train.steps={steps}", "train.eval_every=0",
                              "train.log_every=1000", f"run.dir={work / 'runs'}",
                              f"run.name={mode}-{repeat}", *sets])
            summary = launch_local(*prepare_run(cfg))
            per_step = summary["wall_seconds"] / steps
            if per_step <= seconds.get(mode, per_step):
                seconds[mode] = per_step
                saving[mode] = {"saving_s_per_step": summary["checkpoint_seconds"] / steps,
                                "waited_s_per_step":
                                    summary["checkpoint_blocking_seconds"] / steps}
    return {"steps": steps, "repeats": repeats, "step_seconds": seconds, "saves": saving,
            "sync_overhead": seconds["sync"] / seconds["none"] - 1,
            "async_overhead": seconds["async"] / seconds["none"] - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="memtrain-bench-ckpt-") as tmp:
        report["demo"] = measure(demo_state(), Path(tmp) / "demo")
        report["sized"] = measure(sized_state(args.gib), Path(tmp) / "sized")
        if args.steps:
            report["step"] = step_overhead(args.steps, args.repeats, Path(tmp))
    path = write_json(args.out, "checkpoints", report)
    print(describe_cpu(report["cpu"]))
    for name in ("demo", "sized"):
        row = report[name]
        print(f"{name}: {row['bytes'] / 2**20:,.1f} MiB, written with its manifest in "
              f"{row['write_with_manifest_s']:.3f} s; checked by sizes in "
              f"{row['check_sizes_s'] * 1e3:.2f} ms, by SHA-256 in {row['check_hashes_s']:.3f} s "
              f"({row['hash_s_per_gib']:.2f} s per GiB)")
    if "step" in report:
        step = report["step"]
        times = ", ".join(f"{mode} {value * 1e3:.1f} ms"
                          for mode, value in step["step_seconds"].items())
        print(f"a step with a checkpoint every step ({times}): synchronous "
              f"{step['sync_overhead']:+.1%}, asynchronous {step['async_overhead']:+.1%} "
              f"(target <= +5%: {'met' if step['async_overhead'] <= 0.05 else 'NOT met'})")
        for mode in ("sync", "async"):
            save = step["saves"][mode]
            print(f"  {mode}: saving {save['saving_s_per_step'] * 1e3:.1f} ms a step, of which "
                  f"the step waited {save['waited_s_per_step'] * 1e3:.1f} ms")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
