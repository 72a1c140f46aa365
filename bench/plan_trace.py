"""One block's forward and backward: the planner's own terms for it, and torch's ``MemTracker``
tracing it on fake tensors, each against the bytes the real block allocates on this CPU.

For each set-up (the demo's GPT, ``configs/demo-cpu.yaml``, at its width, sequence length and
micro-batch; a Hugging Face Llama built from ``LlamaConfig`` through ``hf:<dir>``, with the
chunked loss a run plans by default and with the plain loss) and each precision (fp32, bf16
autocast) x checkpointing (none, full: the first block recomputed), the first block runs
forward and backward alone, called with the arguments the model's own forward passed it (a
Llama layer takes its rotary embeddings), its input given, its output's gradient made inside
(``(y * g).sum()``, so the block's output is not kept alive: in a model, the next block owns it):

- (a) planned: what ``trainer.plan`` plans for the first block's backward at the end of
  backward (``trainer.plan.peak.row_terms``' ``first_block``) beside that block's parameter
  gradients: its saved activations (``BlockBackward.first_block_bytes``), its incoming gradient
  and largest temporary (``held_bytes``), the recomputed block's autocast weight copies
  (``Recompute.block_fixed_bytes``) and an emulated-bf16 CPU's buffers;
- (b) traced: the peak of ``torch.distributed._tools.mem_tracker.MemTracker`` over the block on
  fake tensors (no data; what ``FSDPMemTracker`` builds on), less the parameters and the
  gradient ``g``;
- (c) measured: the CPU allocator's peak over the real block (``torch.profiler`` with
  ``profile_memory``: every allocation, kernels' own buffers included; the instrument the
  planner's step-peak tests use, ``trainer.telemetry.diagnostics.cpu_peak_bytes``), after a
  warm-up run. Beside it, ``MemTracker`` on the real tensors: what a dispatch-level trace sees
  of the same run, so a gap between (b) and (c) is told apart as fake against real, or as
  buffers a kernel allocates and frees inside itself (which no trace of operators sees).

Each counts the block's input (alive throughout). Times: the planner's probe of the whole model
for that precision and checkpointing (``profile_activations``, what a run's start pays), and
the trace of the one block (the fake model and the block's call already at hand, as the probe
has them); each the fastest of ``--repeats``. The planner's tests hold a step's predicted peak
within 8% of the allocator's, and the probe's saved bytes within 5%.
Run: ``PYTHONPATH=. python -m bench.plan_trace`` (writes ``bench/results/plan-trace-<date>-<host>
.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from bench.results import cpu_description, describe_cpu, write_json
from trainer.batches import as_batch
from trainer.compat import fake_tensor_mode, modules_kept_in_place
from trainer.config import ModelConfig, load_config
from trainer.memory.loss import summed_loss
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, ModelFactory, build_model, model_factory
from trainer.plan.probe import probe_batch, profile_activations
from trainer.plan.profile import ActivationProfile
from trainer.telemetry.diagnostics import cpu_peak_bytes
from trainer.tensors import tensor_bytes

PRECISIONS = ("fp32", "bf16")
CHECKPOINTING = ("none", "full")
TOLERANCE = 0.08  # the planner's step-peak tests: predicted within 8% of the allocator's peak
LLAMA: dict[str, Any] = {"vocab_size": 32_000, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "tie_word_embeddings": True}
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Setup:
    name: str
    factory: ModelFactory
    seq_len: int
    vocab_size: int
    micro_batch: int
    transforms: MemoryTransforms


def setups(llama_dir: Path) -> list[Setup]:
    """The demo's GPT as ``configs/demo-cpu.yaml`` configures it, and a Llama (4 layers of width
    256, grouped-query attention, vocabulary 32,000) at the same sequence length and
    micro-batch, with the chunked loss and the plain one."""
    import transformers

    demo = load_config(Path("configs/demo-cpu.yaml"))
    seq_len, micro = demo.model.seq_len, demo.train.micro_batch_size
    assert isinstance(micro, int), "the demo's micro-batch is set, not auto"
    transformers.LlamaConfig(**LLAMA, max_position_embeddings=seq_len + 1).save_pretrained(
        llama_dir)
    llama = model_factory(ModelConfig(name=f"hf:{llama_dir}", vocab_size=LLAMA["vocab_size"],
                                      seq_len=seq_len))
    chunked = MemoryTransforms.of(demo.memory)  # loss_chunk_tokens: auto, bf16 norm inputs
    gpt = demo.model
    return [
        Setup(f"gpt {gpt.n_layer}x{gpt.n_embd} (demo-cpu)", model_factory(gpt), seq_len,
              gpt.vocab_size, micro, chunked),
        Setup("hf llama 4x256, vocab 32,000", llama, seq_len, LLAMA["vocab_size"], micro,
              chunked),
        Setup("hf llama 4x256, vocab 32,000, plain loss", llama, seq_len,
              LLAMA["vocab_size"], micro, chunked.replace(loss_chunk_tokens=0)),
    ]


def first_block(model: nn.Module) -> nn.Module:
    return model.get_submodule("blocks.0")


class _Called(Exception):
    """Raised by the hook that records the first block's call: the rest of the forward is
    not needed."""


def first_block_call(model: nn.Module, batch: int, seq_len: int, vocab_size: int,
                     precision: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments ``model``'s forward passes its first block, at ``batch`` rows (real or fake
    tensors, as the active mode makes them)."""
    called: dict[str, Any] = {}

    def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        called.update(args=args, kwargs=kwargs)
        raise _Called

    handle = first_block(model).register_forward_pre_hook(record, with_kwargs=True)
    policy = precision_policy(precision, CPU, warn=False)
    try:
        with torch.no_grad(), contextlib.suppress(_Called):
            summed_loss(model, as_batch(probe_batch(batch, seq_len, vocab_size, CPU)), policy)
    finally:
        handle.remove()
    return called["args"], called["kwargs"]


class BlockStep:
    """One forward and backward of ``block`` as the model called it, its input a leaf that
    wants a gradient; the output's gradient ``g`` is given, the output itself not kept."""

    def __init__(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 precision: str):
        self.block, self.rest, self.kwargs = block, args[1:], kwargs
        self.x = args[0].detach().clone().requires_grad_()
        self.g = torch.ones(self.x.shape, dtype=torch.float32)
        self.policy = precision_policy(precision, CPU, warn=False)

    def __call__(self) -> None:
        with self.policy.autocast(CPU):
            y = self.block(self.x, *self.rest, **self.kwargs)
        y = y[0] if isinstance(y, tuple | list) else y  # a decoder layer may return more
        loss = (y.float() * self.g).sum()
        del y
        loss.backward()

    def reset(self) -> None:
        self.block.zero_grad(set_to_none=True)
        self.x.grad = None

    def held(self) -> list[torch.Tensor]:
        """The tensors made before the step that it does not count (but the input)."""
        return [self.g, *(t for t in tree_leaves((self.rest, self.kwargs))
                          if isinstance(t, torch.Tensor))]


def traced_bytes(step: BlockStep) -> tuple[int, float]:
    """(``MemTracker``'s peak over ``step`` less the parameters and ``step.held()``, with the
    input; seconds the traced step took)."""
    from torch.distributed._tools.mem_tracker import MemTracker  # torch's own, private

    step.reset()
    tracker = MemTracker()
    tracker.track_external(step.block, step.x, *step.held())
    start = time.perf_counter()
    with tracker:
        step()
    seconds = time.perf_counter() - start
    [peak] = tracker.get_tracker_snapshot("peak").values()
    by_kind = {getattr(kind, "name", kind): value for kind, value in peak.items()}
    return (by_kind["Total"] - by_kind["PARAM"] - by_kind["BUFFER"] - by_kind["OTH"]
            + tensor_bytes(step.x)), seconds


def measured_bytes(step: BlockStep) -> int:
    """The CPU allocator's peak over ``step`` (after a warm-up run), with its input."""
    step.reset()
    step()  # warm-up: first-call allocations (oneDNN's primitive caches) are not the block's
    step.reset()
    return cpu_peak_bytes(step, held=[step.x])


def planned_bytes(profile: ActivationProfile, block: nn.Module, batch: int) -> int:
    """What the planner plans for the first block's backward (``row_terms``' ``first_block``)
    beside the block's parameter gradients."""
    grads = sum(tensor_bytes(p) for p in block.parameters() if p.requires_grad)
    return (grads + profile.block.first_block_bytes(batch) + profile.block.held_bytes(batch)
            + profile.recompute.block_fixed_bytes
            + profile.emulation_workspace_per_sample_bytes * batch)


def fastest(repeats: int, run: Callable[[], object]) -> tuple[object, float]:
    """(``run``'s last result, the fastest of ``repeats`` runs' seconds)."""
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        seconds.append(time.perf_counter() - start)
    return result, min(seconds)


def run_row(setup: Setup, precision: str, checkpointing: str, repeats: int) -> dict[str, Any]:
    transforms = setup.transforms.replace(activation_checkpointing=checkpointing)
    batch = setup.micro_batch
    profile, probe_seconds = fastest(repeats, lambda: profile_activations(
        setup.factory, transforms, setup.seq_len, setup.vocab_size, precision))
    assert isinstance(profile, ActivationProfile)
    model = build_model(setup.factory, transforms).train()
    step = BlockStep(first_block(model), *first_block_call(
        model, batch, setup.seq_len, setup.vocab_size, precision), precision)
    measured = measured_bytes(step)
    traced_real, _seconds = traced_bytes(step)
    with fake_tensor_mode(), modules_kept_in_place():
        fake = build_model(setup.factory, transforms).train()
        fake_step = BlockStep(first_block(fake), *first_block_call(
            fake, batch, setup.seq_len, setup.vocab_size, precision), precision)
        traces = [traced_bytes(fake_step) for _ in range(repeats)]
    traced, trace_seconds = traces[-1][0], min(s for _b, s in traces)
    planned = planned_bytes(profile, first_block(model), batch)
    row = {"setup": setup.name, "precision": precision, "checkpointing": checkpointing,
           "micro_batch": batch, "planned_bytes": planned, "traced_bytes": traced,
           "measured_bytes": measured, "traced_real_bytes": traced_real,
           "planned_error": planned / measured - 1, "traced_error": traced / measured - 1,
           "probe_seconds": probe_seconds, "trace_seconds": trace_seconds,
           "block_terms": dataclasses.asdict(profile.block),
           "recompute_block_fixed_bytes": profile.recompute.block_fixed_bytes}
    print(f"  {setup.name}: {precision} {checkpointing:4s}  planned {planned:>12,}  traced "
          f"{traced:>12,}  measured {measured:>12,}  ({row['planned_error']:+.1%}, "
          f"{row['traced_error']:+.1%})  probe {probe_seconds:.2f} s, trace "
          f"{trace_seconds:.2f} s", flush=True)
    return row


def markdown(report: dict[str, Any]) -> str:
    mib = 2**20
    lines = [f"# One block's forward and backward: planned, traced, measured ({report['date']})",
             "", f"Machine: {describe_cpu(report['cpu'])}, torch {report['torch']}, "
             f"{report['threads']} thread.",
             "Command: `PYTHONPATH=. python -m bench.plan_trace`; bytes of the first block's "
             "forward and backward alone, with its input, without its parameters.", "",
             "| set-up | precision | checkpointing | planned (a) | traced, fake (b) | "
             "measured (c) | (a)/(c) | (b)/(c) | MemTracker, real | probe | trace |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(
            f"| {r['setup']} | {r['precision']} | {r['checkpointing']} | "
            f"{r['planned_bytes'] / mib:.2f} MiB | {r['traced_bytes'] / mib:.2f} MiB | "
            f"{r['measured_bytes'] / mib:.2f} MiB | {r['planned_error']:+.1%} | "
            f"{r['traced_error']:+.1%} | {r['traced_real_bytes'] / mib:.2f} MiB | "
            f"{r['probe_seconds']:.2f} s | {r['trace_seconds']:.2f} s |")
    within = sum(abs(r["traced_error"]) <= TOLERANCE for r in report["rows"])
    lines += ["", f"Traced within the planner's {TOLERANCE:.0%} of the measured peak: "
                  f"{within} of {len(report['rows'])} rows; planned: "
                  f"{sum(abs(r['planned_error']) <= TOLERANCE for r in report['rows'])}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--repeats", type=int, default=3,
                        help="Probes and traces per row; the fastest is its time.")
    args = parser.parse_args()
    # Bytes do not depend on the threads; one keeps the times comparable on a shared machine.
    torch.set_num_threads(1)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(), "host": platform.node(), "cpu": cpu_description(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "repeats": args.repeats, "tolerance": TOLERANCE, "rows": []}
    with tempfile.TemporaryDirectory() as llama_dir:
        for setup in setups(Path(llama_dir)):
            for precision in PRECISIONS:
                for checkpointing in CHECKPOINTING:
                    report["rows"].append(run_row(setup, precision, checkpointing,
                                                  args.repeats))
    report["seconds"] = time.perf_counter() - started
    path = write_json(args.out, "plan-trace", report)
    path.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {path} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
