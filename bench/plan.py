"""The planner's time model against measured steps, on this CPU: does ``auto`` pick the fastest
plan that fits?

For each model shape (memtrain's GPT at two sizes, and a Hugging Face Llama built from
``LlamaConfig``), every candidate of the grid precision (fp32, bf16) x activation checkpointing
(none, selective, full) x micro-batch (the divisors of the global batch) is:
- predicted: peak bytes (``trainer.plan.peak.plan_row``) and tokens/s
  (``trainer.plan.speed``, this CPU's calibration);
- measured: optimizer steps of the trainer's own ``train_step``, one rank, after a warm-up
  step (``trainer.plan.measure.PlanRun``), alternating with steps of ``auto``'s row: the row's
  speed relative to ``auto``'s (the fastest of ``--steps`` steps of each), the median over
  ``--rounds`` passes over the grid in shuffled order, times ``auto``'s own tokens/s. This
  machine's speed drifts by tens of percent within minutes; a ratio measured within a second
  does not.
The memory budget of a shape is the median of its grid's predicted peaks, so that about half
the grid fits; ``auto`` is what ``train`` decides (``trainer.plan.candidates.choose``, the
time model over the rows that fit).

Targets, per shape: Spearman rank correlation of predicted and measured tokens/s over the
whole grid >= 0.9; the measured tokens/s of ``auto``'s row >= 0.95x the best measured row that
fits the same budget (by predicted peak); planning (probes, operator counts, calibration
cached) <= 30 s. The planning time of GPT-2 124M (``configs/gpt2-124m-8xgpu.yaml``, an H200's
figures) is reported beside them.
Run: ``make bench-plan`` (writes ``bench/results/plan-<date>-<host>.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.results import cpu_description, describe_cpu, write_json
from trainer.compat import fake_tensor_mode
from trainer.models.build import MemoryTransforms, build_model
from trainer.models.gpt import GPT, GPTConfig
from trainer.plan.calibrate import cpu_speed
from trainer.plan.candidates import Request, choose
from trainer.plan.measure import PlanRun, spearman
from trainer.plan.peak import PlanRow, plan_row
from trainer.plan.probe import AC_MODES, profile_all
from trainer.plan.speed import SpeedModel
from trainer.plan.static import static_bytes

PRECISIONS = ("fp32", "bf16")
TARGETS = {"spearman": 0.9, "auto_over_best": 0.95, "planning_seconds": 30.0}


def llama(vocab_size: int, seq_len: int) -> nn.Module:
    """A small Llama (4 layers of width 256, grouped-query attention, tied embeddings)."""
    import transformers

    from trainer.models.hf import HFCausalLM

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len + 1,
        tie_word_embeddings=True)
    return HFCausalLM(transformers.AutoModelForCausalLM.from_config(config,
                                                                    dtype=torch.float32))


def shapes(quick: bool) -> dict[str, tuple[Callable[[], nn.Module], int, int]]:
    """name -> (factory, seq_len, vocab_size)."""
    small = GPTConfig(seq_len=128 if quick else 256, n_layer=2 if quick else 4, n_head=4,
                      n_embd=64 if quick else 128)
    found = {f"gpt {small.n_layer}x{small.n_embd}, seq {small.seq_len}":
             (partial(GPT, small), small.seq_len, small.vocab_size)}
    if quick:
        return found
    medium = GPTConfig(seq_len=128, n_layer=6, n_head=6, n_embd=384)
    found[f"gpt {medium.n_layer}x{medium.n_embd}, seq {medium.seq_len}"] = (
        partial(GPT, medium), medium.seq_len, medium.vocab_size)
    found["hf llama 4x256, vocab 32,000, seq 128"] = (partial(llama, 32_000, 128), 128, 32_000)
    return found


def run_shape(name: str, factory: Callable[[], nn.Module], seq_len: int, vocab_size: int,
              global_batch: int, steps: int, rounds: int) -> dict[str, Any]:
    transforms = MemoryTransforms("none", loss_chunk_tokens="auto")
    start = time.perf_counter()
    profiles = profile_all(factory, transforms, seq_len, vocab_size, PRECISIONS, AC_MODES,
                           work=True)
    with fake_tensor_mode():
        static = static_bytes(build_model(factory, transforms))
    speed = SpeedModel(cpu_speed())
    planning = time.perf_counter() - start
    micros = [m for m in range(1, global_batch + 1) if global_batch % m == 0]
    plans = [(profile, plan_row(static, profile, micro, global_batch // micro, speed))
             for profile in profiles for micro in micros]
    budget = int(statistics.median(row.predicted_peak_bytes for _profile, row in plans))
    # auto: train's own decision (trainer.plan.candidates.choose) over the probed grid
    request = Request(global_batch, 1, budget, PRECISIONS, AC_MODES, headroom=1.0)
    auto = choose(request, lambda precision, _norm: (
        static, [p for p in profiles if p.precision == precision]), speed).plan
    assert auto is not None, "the median peak fits at least one row"

    def run(precision: str, ac: str, micro: int) -> PlanRun:
        return PlanRun(factory, transforms.replace(activation_checkpointing=ac), seq_len,
                       vocab_size, precision, micro, global_batch // micro)

    ratios, reference_seconds = measure_against_auto(run, auto, [row for _p, row in plans],
                                                     steps, rounds)
    reference_tokens_per_s = global_batch * seq_len / statistics.median(reference_seconds)
    rows = []
    for (_profile, row), ratio in zip(plans, ratios, strict=True):
        relative = statistics.median(ratio)
        rows.append({"precision": row.precision, "ac": row.activation_checkpointing,
                     "micro_batch": row.micro_batch_size, "accumulation": row.accumulation_steps,
                     "predicted_peak_bytes": row.predicted_peak_bytes,
                     "predicted_tokens_per_s": row.tokens_per_s,
                     "measured_relative_to_auto": relative,
                     "measured_tokens_per_s": relative * reference_tokens_per_s})
        print(f"  {name}: {row.precision} {row.activation_checkpointing:9s} micro "
              f"{row.micro_batch_size:2d}  predicted {row.tokens_per_s:8,.0f}  measured "
              f"{rows[-1]['measured_tokens_per_s']:8,.0f} tokens/s ({relative:.3f}x auto's)",
              flush=True)
    fitting = [r for r in rows if r["predicted_peak_bytes"] <= budget]
    fastest = max(fitting, key=lambda r: r["measured_tokens_per_s"])
    picked = next(r for r in rows if (r["precision"], r["ac"], r["micro_batch"])
                  == (auto.precision, auto.activation_checkpointing, auto.micro_batch_size))
    return {"shape": name, "global_batch": global_batch, "budget_bytes": budget,
            "planning_seconds": planning, "rows": rows,
            "reference_tokens_per_s": reference_tokens_per_s,
            "spearman": spearman([r["predicted_tokens_per_s"] for r in rows],
                                 [r["measured_tokens_per_s"] for r in rows]),
            "auto": picked, "best_fitting": fastest,
            "auto_over_best": picked["measured_tokens_per_s"]
            / fastest["measured_tokens_per_s"]}


def measure_against_auto(run: Callable[[str, str, int], PlanRun], auto: PlanRow,
                         plans: list[PlanRow], steps: int, rounds: int
                         ) -> tuple[list[list[float]], list[float]]:
    """Each plan's speed relative to ``auto``'s, one figure a round, and ``auto``'s step times.

    This machine's speed drifts by tens of percent within minutes, more than many rows
    differ: each row's steps alternate with auto's, and a row's figure is its speed relative
    to auto's measured beside it (each the fastest of ``steps`` steps of either), over
    ``rounds`` passes over the grid in shuffled order."""
    reference = run(auto.precision, auto.activation_checkpointing, auto.micro_batch_size)
    reference.step()
    ratios: list[list[float]] = [[] for _ in plans]
    reference_seconds = []
    order = list(range(len(plans)))
    for round_index in range(rounds):
        random.Random(round_index).shuffle(order)  # drift within a round spread over the grid
        for i in order:
            row = plans[i]
            candidate = run(row.precision, row.activation_checkpointing, row.micro_batch_size)
            candidate.step()  # warm-up
            mine, theirs = [], []
            for _ in range(steps):
                theirs.append(reference.step())
                mine.append(candidate.step())
            ratios[i].append(min(theirs) / min(mine))
            reference_seconds.append(min(theirs))
            del candidate
    return ratios, reference_seconds


def gpt2_planning_seconds() -> float:
    """``memtrain plan``'s work for GPT-2 124M on 8 GPUs: every probe and operator count."""
    from trainer.config import load_config
    from trainer.plan.auto import probe_config, speed_model

    cfg = load_config(Path("configs/gpt2-124m-8xgpu.yaml"), [])
    start = time.perf_counter()
    probe_config(cfg, PRECISIONS, AC_MODES, work=True)
    speed_model(cfg, "h200")
    return time.perf_counter() - start


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Planner: predicted against measured tokens/s ({report['date']})", "",
             f"Machine: {describe_cpu(report['cpu'])}, torch {report['torch']}, "
             f"{report['threads']} threads.",
             f"Command: `make bench-plan`; one rank; each row's steps alternate with the "
             f"steps of auto's row; a row's figure: its speed relative to auto's (the fastest "
             f"of {report['steps']} steps of each, the median of {report['rounds']} rounds over "
             f"the grid in shuffled order) times auto's tokens/s.", "",
             "| shape | rows | Spearman | auto's pick | best measured that fits | auto / best "
             "| planning |", "|---|---|---|---|---|---|---|"]
    for shape in report["shapes"]:
        auto, best = shape["auto"], shape["best_fitting"]

        def name(row: dict[str, Any]) -> str:
            return (f"{row['precision']} {row['ac']} x{row['micro_batch']}: "
                    f"{row['measured_tokens_per_s']:,.0f} tok/s")

        lines.append(f"| {shape['shape']} | {len(shape['rows'])} | {shape['spearman']:.3f} | "
                     f"{name(auto)} | {name(best)} | {shape['auto_over_best']:.3f}x | "
                     f"{shape['planning_seconds']:.1f} s |")
    if "gpt2_planning_seconds" in report:
        lines += ["", f"Planning GPT-2 124M (configs/gpt2-124m-8xgpu.yaml, 6 probes with "
                      f"operator counts): {report['gpt2_planning_seconds']:.1f} s."]
    lines += ["", "Targets: " + ", ".join(f"{k} {'<=' if k.endswith('seconds') else '>='} {v}"
                                          for k, v in TARGETS.items())
              + f": **{'met' if report['met'] else 'missed'}**."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--steps", type=int, default=2, help="Timed steps per row and round.")
    parser.add_argument("--rounds", type=int, default=2,
                        help="Passes over each grid; a row's median ratio to auto's row is its "
                             "figure.")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--quick", action="store_true",
                        help="One small shape, a small batch: the check that it runs.")
    args = parser.parse_args()
    started = time.perf_counter()
    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(), "host": platform.node(), "cpu": cpu_description(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "steps": args.steps,
        "rounds": args.rounds,
        "calibration": cpu_speed().as_dict(), "targets": TARGETS, "shapes": []}
    for name, (factory, seq_len, vocab_size) in shapes(args.quick).items():
        report["shapes"].append(run_shape(name, factory, seq_len, vocab_size, args.global_batch,
                                          args.steps, args.rounds))
    if not args.quick:
        report["gpt2_planning_seconds"] = gpt2_planning_seconds()
    report["met"] = all(
        s["spearman"] >= TARGETS["spearman"] and s["auto_over_best"] >= TARGETS["auto_over_best"]
        and s["planning_seconds"] <= TARGETS["planning_seconds"] for s in report["shapes"])
    report["seconds"] = time.perf_counter() - started
    path = write_json(args.out, "plan", report)
    path.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {path} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
