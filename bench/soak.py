"""Soak: thousands of steps of a tiny model through the real loop, watching for leaks.

The trainer's own leak guard (``trainer/telemetry/diagnostics.py``) samples the live-tensor count
and the process's resident memory every ``--every`` steps; this runs ``trainer.loop.train``
in-process (local launcher, one worker, loader, metrics exporter, accumulation, checkpoints all on)
and reports the growth between the first sample after warm-up and the last. Target: under 1% for
both. ``tests/unit/test_soak.py`` runs a short version with a looser bound. Run: ``python -m
bench.soak`` (writes ``bench/results/soak-<date>-<host>.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.results import write_json
from datapipe.corpus import build_stdlib_corpus
from trainer.config import load_config
from trainer.context import LocalContext
from trainer.launch.local import attach_metrics
from trainer.launch.prepare import prepare_run
from trainer.loop import train

REPO = Path(__file__).resolve().parents[1]


def soak(steps: int, every: int, warmup_share: float, work: Path) -> dict[str, Any]:
    corpus = work / "corpus"
    if not (corpus / "train" / "manifest.json").exists():
        build_stdlib_corpus(corpus, seq_len=32, max_bytes=200_000, rows_per_shard=500)
    cfg = load_config(REPO / "configs" / "demo-cpu.yaml", [
        f"data.path={corpus / 'train'}", f"data.val_path={corpus / 'val'}",
        f"run.dir={work / 'runs'}", "run.name=soak", "parallel.launcher=local",
        "parallel.workers=1", "model.seq_len=32", "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2", f"train.steps={steps}", "train.global_batch_size=8",
        "train.micro_batch_size=4", "train.warmup_steps=10", "train.log_every=50",
        f"train.eval_every={max(1, steps // 10)}", "train.eval_batches=2",
        f"train.checkpoint_every={max(1, steps // 5)}", f"memory.leak_check_every={every}",
        "monitoring.port=0"])
    cfg, run_dir = prepare_run(cfg)
    ctx = LocalContext(0, 0, 1, torch.device("cpu"), run_dir)
    attach_metrics(ctx, cfg)
    summary = train(cfg, ctx)
    samples = summary["leak_samples"]
    kept = samples[int(len(samples) * warmup_share):]
    first, last = kept[0], kept[-1]
    return {
        "steps": steps, "sample_every": every, "samples": samples,
        "from_step": first[0], "to_step": last[0],
        "live_tensors": [first[1], last[1]],
        "live_tensor_growth": (last[1] - first[1]) / first[1],
        "resident_bytes": [first[2], last[2]],
        "resident_growth": (last[2] - first[2]) / first[2],
        "leak_findings": summary["leak_findings"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--warmup-share", type=float, default=0.2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="memtrain-soak-") as tmp:
        report = soak(args.steps, args.every, args.warmup_share, Path(tmp))
    report.update(bench="soak", host=socket.gethostname(), torch=torch.__version__,
                  date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), target=0.01)
    print(f"{args.steps} steps: live tensors {report['live_tensors'][0]} -> "
          f"{report['live_tensors'][1]} ({report['live_tensor_growth']:+.2%}), resident "
          f"{report['resident_bytes'][0] / 2**20:.1f} -> {report['resident_bytes'][1] / 2**20:.1f}"
          f" MiB ({report['resident_growth']:+.2%}) between steps {report['from_step']} and "
          f"{report['to_step']}; target < 1% each")
    print(f"wrote {write_json(args.out, 'soak', report)}")


if __name__ == "__main__":
    main()
