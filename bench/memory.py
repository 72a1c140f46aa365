"""Memory benchmark on CPU: saved-activation bytes and step time per precision x checkpointing.

For the GPT at two sizes, every combination of precision (fp32, bf16) and activation
checkpointing (none, selective, full) is measured against fp32 without checkpointing:
- saved-activation bytes of one training forward, counted with ``saved_tensors_hooks`` at the
  benchmark micro-batch (``trainer.plan.probe.measure_saved_bytes``);
- the planner's prediction for the same micro-batch, from probes at micro-batch 1 and 2;
- the median step time of the trainer's own ``train_step`` (forward, backward, AdamW);
- the peak of one more step as the CPU allocator recorded it (``trainer.telemetry.diagnostics.
  cpu_peak_bytes``) beside the planner's predicted step peak
  (``trainer.plan.peak.plan_row``): the check of the whole prediction, transients included,
  not only of the saved bytes.

Targets: full checkpointing >= 60% fewer activation bytes for <= 35% more step time;
bf16 <= 55% of fp32's activation bytes. Run: ``make bench-memory`` (writes
``bench/results/memory-<date>-<host>.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import socket
from functools import partial
from typing import Any

import torch

from bench.results import describe_cpu, result_path, write_json
from trainer.models.build import MemoryTransforms, build_model
from trainer.models.gpt import GPT, GPTConfig
from trainer.plan.measure import measure_plan
from trainer.plan.peak import plan_row
from trainer.plan.probe import measure_saved_bytes, profile_activations
from trainer.plan.static import static_bytes

SIZES = {
    "gpt-small (4x128, seq 256)": GPTConfig(seq_len=256, n_layer=4, n_head=4, n_embd=128),
    "gpt-medium (8x256, seq 512)": GPTConfig(seq_len=512, n_layer=8, n_head=8, n_embd=256),
}
PRECISIONS = ("fp32", "bf16")
AC_MODES = ("none", "selective", "full")


def transforms(ac: str, loss_chunk_tokens: int) -> MemoryTransforms:
    """memtrain's defaults (bf16 norm inputs on) with this row's checkpointing and loss."""
    return MemoryTransforms(ac, activation_checkpointing_every=2,
                            loss_chunk_tokens=loss_chunk_tokens)


def step_seconds_and_peak(cfg: GPTConfig, precision: str, ac: str, micro_batch: int,
                          steps: int, loss_chunk_tokens: int) -> tuple[float, int]:
    """Median step time, then the CPU allocator's peak of one more (untimed) step."""
    got = measure_plan(partial(GPT, cfg), transforms(ac, loss_chunk_tokens), cfg.seq_len,
                       cfg.vocab_size, precision, micro_batch, 1, steps=steps, warmup=2)
    return got.step_seconds, got.peak_bytes


def run(micro_batch: int, steps: int, loss_chunk_tokens: int) -> dict[str, Any]:
    rows = []
    for size, cfg in SIZES.items():
        base = None
        for precision in PRECISIONS:
            for ac in AC_MODES:
                model = build_model(partial(GPT, cfg), transforms(ac, loss_chunk_tokens))
                tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1))
                saved, _ = measure_saved_bytes(model, tokens, precision)
                del model
                profile = profile_activations(partial(GPT, cfg),
                                              transforms(ac, loss_chunk_tokens), cfg.seq_len,
                                              cfg.vocab_size, precision)
                seconds, peak = step_seconds_and_peak(cfg, precision, ac, micro_batch, steps,
                                                      loss_chunk_tokens)
                plan = plan_row(static_bytes(GPT(cfg)), profile, micro_batch, 1)
                row = {"model": size, "precision": precision, "activation_checkpointing": ac,
                       "saved_bytes": saved, "predicted_saved_bytes":
                       profile.saved_bytes(micro_batch), "step_seconds": seconds,
                       "measured_peak_bytes": peak,
                       "predicted_peak_bytes": plan.predicted_peak_bytes,
                       "peak_moment": plan.peak_moment,
                       "peak_error": plan.predicted_peak_bytes / peak - 1}
                if base is None:
                    base = row
                row["bytes_vs_fp32_none"] = saved / base["saved_bytes"]
                row["time_vs_fp32_none"] = seconds / base["step_seconds"]
                row["prediction_error"] = row["predicted_saved_bytes"] / saved - 1
                rows.append(row)
                print(f"{size} {precision}/{ac}: {saved / 2**20:.1f} MiB saved "
                      f"({100 * row['bytes_vs_fp32_none']:.0f}%), {1000 * seconds:.0f} ms/step "
                      f"({100 * row['time_vs_fp32_none']:.0f}%), step peak "
                      f"{peak / 2**20:.1f} MiB, predicted {row['peak_error']:+.1%}", flush=True)
    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "micro_batch_size": micro_batch, "loss_chunk_tokens": loss_chunk_tokens,
            "steps": steps, "rows": rows, "targets": check_targets(rows)}


def check_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for size in SIZES:
        by = {(r["precision"], r["activation_checkpointing"]): r for r in rows
              if r["model"] == size}
        full = by[("fp32", "full")]
        out[size] = {
            "full_ckpt_bytes_saved": 1 - full["bytes_vs_fp32_none"],
            "full_ckpt_extra_time": full["time_vs_fp32_none"] - 1,
            "full_ckpt_met": (1 - full["bytes_vs_fp32_none"] >= 0.60
                              and full["time_vs_fp32_none"] - 1 <= 0.35),
            "bf16_bytes_ratio": by[("bf16", "none")]["bytes_vs_fp32_none"],
            "bf16_met": by[("bf16", "none")]["bytes_vs_fp32_none"] <= 0.55,
            # Not an issue target on CPU (there it is <= 10% on CUDA); the same bound, shown.
            "peak_error_max": max(abs(r["peak_error"]) for r in by.values()),
        }
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [f"CPU: {describe_cpu(report['cpu'])}. Micro-batch {report['micro_batch_size']}, "
             f"loss chunk "
             f"{report['loss_chunk_tokens'] or 'off'}, {report['threads']} threads, torch "
             f"{report['torch']}, median of {report['steps']} steps.", "",
             "| model | precision | act. ckpt | saved MiB | vs fp32/none | predicted MiB | "
             "error | ms/step | vs fp32/none | step peak MiB | predicted peak MiB | "
             "peak error | peak moment |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['activation_checkpointing']} | "
            f"{r['saved_bytes'] / 2**20:.1f} | {100 * r['bytes_vs_fp32_none']:.0f}% | "
            f"{r['predicted_saved_bytes'] / 2**20:.1f} | {100 * r['prediction_error']:+.2f}% | "
            f"{1000 * r['step_seconds']:.0f} | {100 * r['time_vs_fp32_none']:.0f}% | "
            f"{r['measured_peak_bytes'] / 2**20:.1f} | {r['predicted_peak_bytes'] / 2**20:.1f} | "
            f"{100 * r['peak_error']:+.1f}% | {r['peak_moment']} |")
    lines += ["", "| model | full ckpt: bytes saved | full ckpt: extra time | met | "
                  "bf16 bytes vs fp32 | met | largest step-peak error |",
              "|---|---|---|---|---|---|---|"]
    for size, t in report["targets"].items():
        lines.append(f"| {size} | {100 * t['full_ckpt_bytes_saved']:.0f}% (>= 60%) | "
                     f"{100 * t['full_ckpt_extra_time']:+.0f}% (<= 35%) | "
                     f"{'yes' if t['full_ckpt_met'] else '**no**'} | "
                     f"{100 * t['bf16_bytes_ratio']:.0f}% (<= 55%) | "
                     f"{'yes' if t['bf16_met'] else '**no**'} | "
                     f"{100 * t['peak_error_max']:.1f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=9)  # the VM moves medians by 10-15 points
    parser.add_argument("--loss-chunk-tokens", type=int, default=4096)
    args = parser.parse_args()
    report = run(args.micro_batch, args.steps, args.loss_chunk_tokens)
    write_json(args.out, "memory", report, sort_keys=True)
    table = markdown(report)
    result_path(args.out, "memory", ".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
