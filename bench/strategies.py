"""The memory strategies, cumulative, on a Hugging Face Llama on this CPU, as torchtune's README
tabulates them: each row adds one strategy to the row before.

1. full fine-tune: AdamW (fp32 states), no activation checkpointing;
2. + activation checkpointing (every block);
3. + the optimizer step in backward (gradient clipping off for it);
4. + activation offload (what the checkpoints keep);
5. + 8-bit AdamW states (torchao);
6. + LoRA (rank 8 on every linear layer of the blocks; the base frozen);
7. + QLoRA: LoRA's base with the blocks' linear weights in NF4 (torchao's ``NF4Tensor``), the
   rest of the base in bf16, computing under bf16 autocast (torchtune's QLoRA row);

and beside them, not cumulative, the other low-bit states each in place of the 8-bit row's:
4-bit AdamW (torchao) and bf16 moments.

The model is a Llama built from ``LlamaConfig`` (nothing downloaded) as ``model.name: hf:<dir>``
builds it, with the chunked loss, in fp32; every row trains it from the same seed on the same
tokens through the trainer's own ``train_step`` (the loss in chunks of 256 tokens, so that the
model's own bytes, not the loss's, set the peaks). Per row: the step's peak as the CPU allocator
records it (``trainer.telemetry.diagnostics.cpu_peak_bytes``, the parameters, optimizer state and
tokens held before the step counted), the planner's prediction beside it (``trainer.plan.peak``: its
device peak, and the host bytes offload would hold on a GPU; on a CPU both are one memory, so the
offload rows' measured peak holds both, and their error is taken against device + host), tokens/s
(the median of ``--steps`` steps) and the loss after them (one batch, memorised: each step trains on
it again). Targets: 8-bit states cut the optimizer state's bytes by at least 70% against fp32
AdamW's; LoRA's step peak at most half the full fine-tune's; the planner within 5% of every row's
measured peak. Run: ``make bench-strategies`` (writes
``bench/results/strategies-<date>-<host>.json``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.results import describe_cpu, write_json
from trainer.memory.lora import LoraSettings, apply_lora
from trainer.memory.optimizers import InBackward, held_state_bytes
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, build_model
from trainer.models.hf import build_hf_model
from trainer.optim import build_optimizer
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.static import static_bytes
from trainer.step import create_optimizer_state, step_peak_bytes, train_step


@dataclass(frozen=True)
class Row:
    """One row's strategies (each row adds one to the row before)."""

    name: str
    checkpointing: str = "none"
    in_backward: bool = False
    offload: str = "none"
    states: str = "fp32"
    lora: bool = False
    base_dtype: str = "fp32"  # LoRA's frozen base: fp32, or nf4 (QLoRA; computes in bf16)

    @property
    def precision(self) -> str:
        return "fp32" if self.base_dtype == "fp32" else "bf16"


ROWS = [Row("full fine-tune")]
for _name, _change in (("+ activation checkpointing", {"checkpointing": "full"}),
                       ("+ optimizer step in backward", {"in_backward": True}),
                       ("+ activation offload", {"offload": "checkpointed"}),
                       ("+ 8-bit AdamW", {"states": "8bit"}),
                       ("+ LoRA", {"lora": True}),
                       ("+ QLoRA (NF4 base)", {"base_dtype": "nf4"})):
    ROWS.append(replace(ROWS[-1], name=_name, **_change))
# The other low-bit states, each in place of the 8-bit row's (not cumulative: beside it).
ROWS += [replace(ROWS[4], name="(4-bit AdamW in its place)", states="4bit"),
         replace(ROWS[4], name="(bf16 AdamW states in its place)", states="bf16")]


def llama_dir(out: Path, vocab_size: int, seq_len: int, width: int, layers: int) -> Path:
    import transformers

    transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=int(width * 8 / 3) // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=width // 64, num_key_value_heads=width // 128,
        max_position_embeddings=seq_len, tie_word_embeddings=True).save_pretrained(out)
    return out


def measure_row(row: Row, spec: str, seq_len: int, vocab_size: int, micro_batch: int,
                steps: int, loss_chunk_tokens: int = 256) -> dict[str, Any]:
    """One row: the model with the row's strategies, its measured and predicted step peaks, its
    tokens/s and loss after ``steps`` steps."""
    def factory() -> torch.nn.Module:
        model = build_hf_model(spec, vocab_size, seq_len, load_weights=False)
        return apply_lora(model, LoraSettings(rank=8, base_dtype=row.base_dtype)) \
            if row.lora else model

    transforms = MemoryTransforms(row.checkpointing, loss_chunk_tokens=loss_chunk_tokens,
                                  bf16_norm_inputs=False, activation_offload=row.offload)
    model = build_model(factory, transforms, seed=0)
    optimizer = build_optimizer(model, 1e-3, states=row.states,
                                backward_hooks=InBackward() if row.in_backward else None)
    create_optimizer_state(optimizer)
    policy = precision_policy(row.precision, torch.device("cpu"), warn=False)
    scaler = policy.grad_scaler(torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    # One batch, trained on repeatedly: a loss that random tokens cannot lower, memorised.
    batches = [torch.randint(0, vocab_size, (micro_batch, seq_len + 1),
                             generator=generator)] * steps
    clip = 0.0 if row.in_backward else 1.0
    step_peak_bytes(model, optimizer, scaler, batches[0], policy, clip)  # compiles torchao's
    peak = step_peak_bytes(model, optimizer, scaler, batches[0], policy, clip)
    seconds, loss = [], 0.0
    for tokens_BT in batches:
        start = time.perf_counter()
        loss = train_step(model, optimizer, scaler, [tokens_BT], 1, policy, clip).loss.item()
        seconds.append(time.perf_counter() - start)
    profile = profile_activations(factory, transforms, seq_len, vocab_size, row.precision)
    plan = plan_row(static_bytes(model, states=row.states, in_backward=row.in_backward,
                                 step_device="cpu"), profile, micro_batch, 1)
    # On a CPU host and device are one memory: what offload puts on the host is still in the
    # measured peak, so the prediction it is held to is device + host.
    one_memory = plan.predicted_peak_bytes + plan.host_bytes
    return {"row": row.name, "strategies": row.__dict__, "peak_bytes": peak,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_host_bytes": plan.host_bytes, "peak_moment": plan.peak_moment,
            "planner_error": one_memory / peak - 1,
            "optimizer_state_bytes": held_state_bytes(optimizer),
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "tokens_per_second": micro_batch * seq_len / statistics.median(seconds),
            "loss_after": loss, "steps": steps}


def state_cut(rows: dict[str, dict[str, Any]], name: str) -> float:
    """How much less optimizer state row ``name`` holds than fp32 AdamW's (the row before
    the 8-bit one)."""
    return 1 - rows[name]["optimizer_state_bytes"] / \
        rows["+ optimizer step in backward"]["optimizer_state_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = str(llama_dir(Path(tmp), args.vocab_size, args.seq_len, args.width,
                                     args.layers))
        rows = [measure_row(row, spec, args.seq_len, args.vocab_size, args.micro_batch,
                            args.steps) for row in ROWS]
    by_name = {r["row"]: r for r in rows}
    states_cut = state_cut(by_name, "+ 8-bit AdamW")
    lora_share = by_name["+ LoRA"]["peak_bytes"] / by_name["full fine-tune"]["peak_bytes"]
    qlora_share = by_name["+ QLoRA (NF4 base)"]["peak_bytes"] / by_name["+ LoRA"]["peak_bytes"]
    worst = max(abs(r["planner_error"]) for r in rows)
    report = {
        "model": {"family": "llama", "vocab_size": args.vocab_size, "seq_len": args.seq_len,
                  "width": args.width, "layers": args.layers, "micro_batch": args.micro_batch},
        "threads": torch.get_num_threads(), "rows": rows,
        "targets": {"8bit_state_cut": states_cut, "8bit_state_cut_target": 0.70,
                    "lora_peak_share": lora_share, "lora_peak_share_target": 0.5,
                    "qlora_peak_share_of_lora": qlora_share,
                    "planner_worst_error": worst, "planner_error_target": 0.05},
    }
    path = write_json(args.out, "strategies", report)
    print(f"{describe_cpu(report['cpu'])}; Llama width {args.width} x {args.layers} layers, "
          f"vocabulary {args.vocab_size:,}, sequence {args.seq_len}, micro-batch "
          f"{args.micro_batch}, fp32 (QLoRA: bf16 autocast), {report['threads']} threads")
    mib = 2**20
    print(f"{'row':32} {'peak MiB':>9} {'planned':>8} {'err':>6} {'host':>7} {'tok/s':>7} "
          f"{'loss':>6}")
    for r in rows:
        print(f"{r['row']:32} {r['peak_bytes'] / mib:9.1f} {r['predicted_peak_bytes'] / mib:8.1f}"
              f" {r['planner_error']:+6.1%} {r['predicted_host_bytes'] / mib:7.1f} "
              f"{r['tokens_per_second']:7.0f} {r['loss_after']:6.3f}")
    print(f"4-bit states cut it by {state_cut(by_name, '(4-bit AdamW in its place)'):.1%}, "
          f"bf16 states by {state_cut(by_name, '(bf16 AdamW states in its place)'):.1%}")
    print(f"8-bit states cut AdamW's state by {states_cut:.1%} (target >= 70%); LoRA's peak is "
          f"{lora_share:.1%} of the full fine-tune's (target <= 50%), QLoRA's {qlora_share:.1%} "
          f"of LoRA's; planner within "
          f"{worst:.1%} of every row (target 5%); {path}")


if __name__ == "__main__":
    main()
