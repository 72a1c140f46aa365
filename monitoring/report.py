"""A run report for people without Grafana: a PNG from the per-rank metrics logs.

Reads ``RUN_DIR/metrics/rank-*.jsonl`` (written by the training loop on every log step) and draws
memory per rank over steps, throughput, and the share of step time spent waiting for data.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

from monitoring.run_files import METRICS_DIR, REPORT

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402


def load_metrics(run_dir: Path) -> dict[int, list[dict]]:
    """Training records per rank (evaluation records left out)."""
    files = sorted((run_dir / METRICS_DIR).glob("rank-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{run_dir / METRICS_DIR} has no rank-*.jsonl: not a run "
                                "directory")
    per_rank = {}
    for path in files:
        rank = int(path.stem.removeprefix("rank-"))
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        per_rank[rank] = [r for r in records if "loss" in r]
    return per_rank


def render_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the report PNG (default ``RUN_DIR/report.png``); returns its path."""
    per_rank = load_metrics(run_dir)
    out = out or run_dir / REPORT
    fig, (memory, speed, wait) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for rank, records in sorted(per_rank.items()):
        steps = [r["step"] for r in records]
        memory.plot(steps, [r["peak_memory_bytes"] / 2**20 for r in records],
                    label=f"rank {rank}")
        speed.plot(steps, [r["tokens_per_second"] for r in records], label=f"rank {rank}")
        wait.plot(steps, [100 * r["data_wait_share"] for r in records], label=f"rank {rank}")
    memory.set_ylabel("peak memory (MiB)")
    memory.set_title(f"run {run_dir.name}: memory per rank")
    speed.set_ylabel("tokens/s (global)")
    speed.set_title("throughput")
    wait.set_ylabel("data wait (% of step time)")
    wait.set_title("data wait")
    wait.set_xlabel("optimizer step")
    for axis in (memory, speed, wait):
        axis.grid(alpha=0.3)
        axis.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
