"""``make bench``: every CPU benchmark in one run, one JSON and one markdown table.

Runs ``bench.loader``, ``bench.memory``, ``bench.metrics_overhead`` and ``bench.trainer`` (each
also runnable alone), then writes ``bench/results/<date>-<host>.json`` (all their reports) and
``bench/results/<date>-<host>.md`` (the headline figures against their targets, with the
command that reproduces each row). ``docs/benchmarks.md`` holds the latest table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.results import cpu_description, describe_cpu, result_path, write_json

BENCHES = {  # name -> (module, result file stem)
    "loader": ("bench.loader", "loader"),
    "memory": ("bench.memory", "memory"),
    "metrics": ("bench.metrics_overhead", "metrics-overhead"),
    "trainer": ("bench.trainer", "trainer"),
}
COMMANDS = {"loader": "make bench-data", "memory": "make bench-memory",
            "metrics": "make bench-metrics", "trainer": "python -m bench.trainer"}


def run(out: Path, only: list[str], execute: bool = True) -> dict[str, Any]:
    """Run each benchmark (unless ``execute`` is false) and load today's report of each."""
    reports: dict[str, Any] = {}
    for name in only:
        module, stem = BENCHES[name]
        if execute:
            print(f"== {name}: python -m {module}", flush=True)
            subprocess.run([sys.executable, "-m", module, "--out", str(out)], check=True)
        reports[name] = json.loads(result_path(out, stem).read_text())
    return reports


def yes(met: bool) -> str:
    return "yes" if met else "**no**"


Row = tuple[str, str, str, str, str]  # figure, measured, target, met, command


def _loader_rows(reports: dict[str, Any]) -> list[Row]:
    """The loader bench's figures against their targets."""
    rows: list[Row] = []
    if "loader" not in reports:
        return rows
    loader = reports["loader"]
    rate = {k: r.get("samples_per_second") for k, r in loader["results"].items()}
    ratios = loader["ratios"]
    shape = f"{loader['rows']} x {loader['seq_len']} int32, batch {loader['batch_size']}"
    if "b_over_g" in ratios:
        rows.append((f"loader, shuffled, vs raw shuffled gather ({shape})",
                     f"{ratios['b_over_g']:.2f}x ({rate['b']:,.0f} vs {rate['g']:,.0f} "
                     "samples/s)", ">= 0.9x", yes(ratios["b_over_g"] >= 0.9),
                     COMMANDS["loader"]))
    if "f_over_a" in ratios:
        rows.append(("loader, shuffle off, vs raw Arrow mmap",
                     f"{ratios['f_over_a']:.2f}x ({rate['f']:,.0f} samples/s)", ">= 0.9x",
                     yes(ratios["f_over_a"] >= 0.9), COMMANDS["loader"]))
    for peer, name in (("c", "HF datasets + DataLoader"), ("d", "HF datasets .iter()"),
                       ("e", "Ray Data iter_torch_batches")):
        if f"b_over_{peer}" in ratios:
            target = ">= 10x" if peer == "c" else "-"
            met = yes(ratios["b_over_c"] >= 10) if peer == "c" else "-"
            rows.append((f"loader, shuffled, vs {name}",
                         f"{ratios[f'b_over_{peer}']:.1f}x ({rate[peer]:,.0f} samples/s)",
                         target, met, COMMANDS["loader"]))
    return rows


def _memory_rows(reports: dict[str, Any]) -> list[Row]:
    """The memory bench's figures: checkpointing, bf16, the planner."""
    rows: list[Row] = []
    if "memory" not in reports:
        return rows
    memory = reports["memory"]
    by = {(r["model"], r["precision"], r["activation_checkpointing"]): r
          for r in memory["rows"]}
    for model in sorted({r["model"] for r in memory["rows"]}):
        full, bf16 = by[(model, "fp32", "full")], by[(model, "bf16", "none")]
        saved, extra = 1 - full["bytes_vs_fp32_none"], full["time_vs_fp32_none"] - 1
        rows.append((f"full activation ckpt, {model}",
                     f"{saved:.0%} fewer bytes, {extra:+.0%} time", ">= 60%, <= +35%",
                     yes(saved >= 0.6 and extra <= 0.35), COMMANDS["memory"]))
        rows.append((f"bf16 activations vs fp32, {model}",
                     f"{bf16['bytes_vs_fp32_none']:.0%}", "<= 55%",
                     yes(bf16["bytes_vs_fp32_none"] <= 0.55), COMMANDS["memory"]))
    worst = max(abs(r["prediction_error"]) for r in memory["rows"])
    rows.append(("planner: predicted vs measured saved bytes (CPU)", f"{worst:.1%} worst",
                 "<= 5%", yes(worst <= 0.05), COMMANDS["memory"]))
    if all("peak_error" in r for r in memory["rows"]):
        worst_peak = max(abs(r["peak_error"]) for r in memory["rows"])
        rows.append(("planner: predicted vs CPU allocator's step peak",
                     f"{worst_peak:.1%} worst", "- (CUDA: <= 10%)", "-",
                     COMMANDS["memory"]))
    return rows


def _metrics_rows(reports: dict[str, Any]) -> list[Row]:
    """The metrics bench's overhead."""
    rows: list[Row] = []
    if "metrics" not in reports:
        return rows
    metrics = reports["metrics"]
    share = metrics["rows"]["publish_every_5s"]["share_of_step"]
    rows.append(("metrics overhead (published every 5 s)", f"{share:.4%} of a step", "<= 1%",
                 yes(share <= 0.01), COMMANDS["metrics"]))
    return rows


def _trainer_rows(reports: dict[str, Any]) -> list[Row]:
    """The trainer bench's figures: step time, all-reduces, first step."""
    rows: list[Row] = []
    if "trainer" not in reports:
        return rows
    trainer = reports["trainer"]
    over = trainer["overhead"]
    rows.append(("trainer step time vs hand-written DDP (2 gloo workers)",
                 f"{over['ratio']:.3f}x ({over['memtrain_step_seconds'] * 1e3:.0f} vs "
                 f"{over['naive_step_seconds'] * 1e3:.0f} ms)", "<= 1.03x",
                 yes(over["ratio"] <= 1.03), COMMANDS["trainer"]))
    rows.append(("... with the cross-rank OOM agreement on",
                 f"{over['ratio_with_oom_agreement']:.3f}x", "-", "-", COMMANDS["trainer"]))
    acc = trainer["accumulation"]
    rows.append((f"gradient all-reduce per step, {acc['micro_batches']} micro-batches",
                 f"memtrain {acc['memtrain_rounds_per_step']:.0f} round, "
                 f"{acc['memtrain_bytes_per_step'] / 1e6:.1f} MB; naive "
                 f"{acc['naive_rounds_per_step']:.0f} rounds, "
                 f"{acc['naive_bytes_per_step'] / 1e6:.1f} MB", "1 vs k", yes(
                     acc["naive_bytes_per_step"] >= acc["micro_batches"]
                     * acc["memtrain_bytes_per_step"] * 0.99), COMMANDS["trainer"]))
    first = trainer["time_to_first_step"]
    rows.append(("time to first step", ", ".join(f"{k} {v:.1f} s" for k, v in first.items()),
                 "-", "-", COMMANDS["trainer"]))
    return rows


def table(reports: dict[str, Any]) -> str:
    """Every bench's figures as one markdown table, each beside its target."""
    rows = [*_loader_rows(reports), *_memory_rows(reports), *_metrics_rows(reports),
            *_trainer_rows(reports)]
    lines = ["| figure | measured | target | met | reproduce |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--only", default=",".join(BENCHES))
    parser.add_argument("--no-run", action="store_true",
                        help="Rebuild the table from today's reports without running anything.")
    args = parser.parse_args()
    out = Path(args.out)
    reports = run(out, args.only.split(","), execute=not args.no_run)
    machine = (f"{socket.gethostname()}: {describe_cpu(cpu_description())}, "
               f"{len(os.sched_getaffinity(0))} CPUs, Python {platform.python_version()}")
    summary = write_json(out, "", {"machine": machine, **reports})
    text = f"Machine: {machine}. Command: `make bench`.\n\n{table(reports)}"
    markdown = result_path(out, "", ".md")
    markdown.write_text(text)
    print(text)
    print(f"wrote {summary} and {markdown}")


if __name__ == "__main__":
    main()
