"""The longest sequence whose training step fits a per-rank memory budget on 4 gloo ranks: the
best plan for a long row on one rank against the row split over the 4 ranks
(``parallel.sequence: 4``) with the tiled MLP.

Each trial is the product itself: ``memtrain train`` with the local launcher, one step, on 4
workers, of memtrain's GPT (vocabulary 256, 4 layers, 4 heads, width 128, fp32) or, with
``--model llama``, an ``hf:`` Llama of the same shape (MLP 512, rotary positions, seeded
weights), under one of two plans:

- ``single``: each rank trains a row of its own (DDP over 4 ranks, global batch 4), with full
  activation checkpointing, ``memory.activation_offload: checkpointed`` and the chunked loss;
- ``sequence``: the 4 ranks share one row (``parallel.sequence: 4``, global batch 1), each
  holding a quarter of its tokens, with ``memory.tiled_mlp`` (8 tiles) and the same
  checkpointing, offload and loss.

Each worker's resident memory is sampled from outside every 0.1 s
(``bench.fsdp_resident.Sampler``); a trial fits when every worker's anonymous resident memory
stays within the budget above its first sample (the fork server's imports) through the end of
the run (step 1 and the checkpoint a run saves at its end, of the weights' size). Both plans'
workers run with glibc returning freed memory (``RETURNED_HEAP``), as a run short of memory
would.
``model.seq_len`` is doubled until a trial does not fit, then bisected to 1/16 of the longest
that fits (in multiples of 256 tokens). The data are the standard library's bytes in
rows of ``seq_len + 1`` (``datapipe.corpus``), one dataset per length, as a run refuses rows
of another length.

Beside each trial: the planner's predicted peak for the rank (``trainer.plan.peak.plan_row``
on the run's config, its activation offload's host bytes added, as on a CPU they are the same
memory) and step time, and the step's measured time (rank 0's ``step_seconds``).

The model's weights are small beside its activations at these lengths, except the GPT's
learned positions (``seq_len x 128`` weights with their gradients and AdamW state), which grow
with the sequence and which every rank holds whole under either plan; the Llama has none.
The loss is chunked by 1,024 tokens (``--loss-chunk-tokens``): ``auto`` sizes a chunk for
256 MiB of fp32 logits, which at a vocabulary of 256 is the whole row.

``--allocator 8192,16384`` measures instead what the planner predicts: the CPU allocator's
record of a rank's step (``trainer.step.step_peak_bytes``, the median of 3 steps on each rank)
of ``--allocator-plan`` (``sequence`` by default) at those lengths, on 4 gloo ranks built as
the run builds them (the config above, ``parallelism_for`` and ``Parallelism.build``), beside
the planner's peak, and what the step added to the allocator's record and to the process's
resident memory by the kernel's high-water mark (``allocator_rank``); its own results file
(``long-sequence-allocator``). The allocator's record is what the planner counts (tensor
bytes); resident memory can lie below it (pages of a buffer not yet written are not resident)
or above it (the heap), and the 0.1 s sampling of the trials above can miss a short peak.

Target: a sequence at least 3.5x longer with ``sequence``. Run: ``make bench-long`` or
``python -m bench.long_sequence --out bench/results`` (the Llama, ``--budget-mib`` 96 a rank and
lengths from 2,048 by default: a budget that keeps the longest trials' attention within
minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.fsdp_resident import Sampler
from bench.results import cpu_description, describe_cpu, write_json
from bench.search import largest_fitting

REPO = Path(__file__).resolve().parent.parent
GPT = {"vocab_size": 256, "n_layer": 4, "n_head": 4, "n_embd": 128}
# The same shape as an hf: Llama (rotary positions: nothing in it grows with the sequence)
LLAMA: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1 << 20,
    "tie_word_embeddings": True}
WORKERS = 4
TILES = 8
STEP_TOKENS = 256  # the search's granularity; a multiple of the sequence degree
MIB = 1 << 20
PLANS = ("single", "sequence")
# glibc's malloc as FSDP's CPU workers set it (``trainer.memory.allocator``
# ``return_freed_host_memory``: an allocation above 128 KiB mapped on its own and unmapped when
# freed), for both plans' workers alike: a DDP worker otherwise keeps freed memory in its heap
# for the next step's speed, and its resident peak is then about twice its tensors' (a
# 1,024-token row of the Llama: 69 MiB resident, 33.6 MiB in the allocator's record). A user's
# own malloc variables are left alone by memtrain, so this is how one chooses it.
RETURNED_HEAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def dataset(work: Path, seq_len: int) -> Path:
    """The standard library's bytes in rows of ``seq_len + 1`` tokens (8 training rows, at
    least 1 validation row), written once per length."""
    from datapipe.corpus import build_stdlib_corpus

    data = work / f"data-{seq_len}"
    if not (data / "train" / "manifest.json").is_file():
        build_stdlib_corpus(data, seq_len=seq_len, max_bytes=8 * (seq_len + 1))
    return data


def llama_dir(work: Path) -> Path:
    """``LLAMA``'s config.json (no weights: the seeded build's are used)."""
    import transformers

    directory = work / "llama"
    if not (directory / "config.json").is_file():
        transformers.LlamaConfig(**LLAMA).save_pretrained(directory)
    return directory


def settings(spec: dict[str, Any]) -> list[str]:
    """The run's ``--set`` values for ``spec``'s plan and length, with the workers that
    ``prepare_run`` accepts on this machine (``run_trial`` sets the 4 after it)."""
    data = Path(spec["data"])
    sequence = spec["plan"] == "sequence"
    model = [f"model.name=hf:{spec['llama']}"] if spec.get("llama") else \
        [*(f"model.{key}={value}" for key, value in GPT.items()), "model.name=gpt"]
    return [*model,
            f"model.seq_len={spec['seq_len']}", "memory.precision=fp32",
            "memory.bf16_norm_inputs=false", "memory.activation_checkpointing=full",
            "memory.activation_offload=checkpointed",
            f"memory.loss_chunk_tokens={spec['loss_chunk_tokens']}",
            f"memory.tiled_mlp={spec['tiles'] if sequence else 1}",
            "parallel.strategy=ddp", "parallel.launcher=local",
            f"parallel.workers={1 if sequence else 2}", f"data.path={data / 'train'}",
            f"data.val_path={data / 'val'}", f"run.dir={spec['runs']}", f"run.name={spec['name']}",
            "train.steps=1", f"train.global_batch_size={1 if sequence else WORKERS}",
            "train.micro_batch_size=1", "train.log_every=1", "train.eval_every=0",
            "train.checkpoint_every=0", "train.warmup_steps=0"]


def predicted(cfg: Any) -> dict[str, Any]:
    """The planner's peak for one rank of ``cfg`` (its activation offload's host bytes added:
    on a CPU they are the same memory) and its step time, from the fake-tensor probe."""
    from trainer.plan.auto import data_ranks, probe_config, speed_model
    from trainer.plan.peak import plan_row

    memory = cfg.memory
    static, (profile,) = probe_config(cfg, [memory.precision],
                                      [memory.activation_checkpointing], work=True)
    row = plan_row(static, profile, cfg.train.micro_batch(),
                   cfg.train.accumulation_steps(data_ranks(cfg)), speed_model(cfg))
    return {"predicted_peak_mib": round((row.predicted_peak_bytes + row.host_bytes) / MIB, 1),
            "predicted_seconds": round(row.step_seconds, 2),
            "all_to_all_mib": round(row.all_to_all_bytes / MIB, 1)}


def with_workers(cfg: Any, plan: str) -> Any:
    """``cfg`` on the bench's 4 workers (more than this machine's CPUs, which ``prepare_run``
    refuses to protect a user's), split 4 ways under ``sequence``; validated again as a whole,
    so the sequence split's own refusals still apply."""
    from trainer.config import Config

    parallel = cfg.parallel.model_copy(update={
        "workers": WORKERS, "sequence": WORKERS if plan == "sequence" else 1})
    return Config.model_validate(cfg.model_copy(update={"parallel": parallel}).model_dump())


def trial_spec(work: Path, plan: str, seq_len: int, args: argparse.Namespace, name: str
               ) -> dict[str, Any]:
    """What a trial of ``plan`` at ``seq_len`` runs (``settings``), its data written once."""
    return {"plan": plan, "seq_len": seq_len, "data": str(dataset(work, seq_len)),
            "runs": str(work / "runs"), "tiles": args.tiles,
            "loss_chunk_tokens": args.loss_chunk_tokens,
            "llama": str(llama_dir(work)) if args.model == "llama" else None, "name": name}


def run_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """One step through the local launcher (``launch_local``) on 4 workers, more than this
    machine's CPUs as the tests do, sampled from a thread of this process: each worker's
    anonymous resident memory above its first sample; then the planner's figures."""
    from trainer.config import load_config
    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run

    cfg, run_dir = prepare_run(load_config(REPO / "configs" / "demo-cpu.yaml", settings(spec)))
    cfg = with_workers(cfg, spec["plan"])
    with Sampler(psutil.Process()) as sampler:
        launch_local(cfg, run_dir)
    pids = [pid for pid in sampler.series if "forkserver" in sampler.names.get(
        sampler.parents.get(pid, -1), "")]
    peaks = []
    for pid in pids:
        series = [rss - shared for (_, rss), (_, shared)
                  in zip(sampler.series[pid], sampler.file_backed[pid], strict=True)]
        peaks.append(round((max(series) - series[0]) / MIB, 1))
    rows = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()
    step = [json.loads(row) for row in rows if '"loss"' in row][0]
    return {"peaks_mib": peaks, "seconds": round(step["step_seconds"], 2), **predicted(cfg)}


def trial(work: Path, plan: str, seq_len: int, args: argparse.Namespace) -> dict[str, Any]:
    """One step of ``plan`` at ``seq_len`` (``run_trial``, in a process of its own); its
    workers' peaks and whether every one fits the budget."""
    spec = trial_spec(work, plan, seq_len, args, f"{plan}-{seq_len}-{time.strftime('%H%M%S')}")
    done = subprocess.run([sys.executable, "-m", "bench.long_sequence", "--trial",
                           json.dumps(spec)], cwd=REPO, capture_output=True, text=True,
                          timeout=args.trial_timeout, env={**os.environ, **RETURNED_HEAP})
    result: dict[str, Any] = {"seq_len": seq_len}
    if done.returncode != 0:
        return {**result, "fits": False, "failed": done.stderr.strip().splitlines()[-1:]}
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, **measured, "fits": len(measured["peaks_mib"]) == WORKERS
            and max(measured["peaks_mib"]) <= args.budget_mib}


def longest(work: Path, plan: str, start: int, args: argparse.Namespace) -> dict[str, Any]:
    """The longest ``seq_len`` that fits: doubled from ``start`` until a trial does not fit,
    then bisected to 1/16 of the longest that fits, in steps of ``STEP_TOKENS``."""
    trials: list[dict[str, Any]] = []

    def fits(seq_len: int) -> bool:
        trials.append(trial(work, plan, seq_len, args))
        print(f"{plan}: {json.dumps(trials[-1])}", flush=True)
        return bool(trials[-1]["fits"])

    largest_fitting(fits, start, STEP_TOKENS)
    best = max((t for t in trials if t["fits"]), key=lambda t: t["seq_len"], default=None)
    return {"longest": best, "trials": trials}


def _resident_high_water() -> int:
    """This process's resident high-water mark (``VmHWM`` of ``/proc/self/status``), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def allocator_rank(rank: int, port: int, cfg_json: str, out: str) -> None:
    """One rank's step of ``cfg`` (``--allocator``), three ways, saved to ``out``: what its
    resident memory rose by (the kernel's high-water mark ``VmHWM``, reset before the step:
    exact, where sampling may miss a short peak), what the allocator's record rose by over
    the tensors held before it, and the allocator's peak (``step_peak_bytes``: those tensors
    counted); 3 steps each."""
    import torch
    import torch.distributed as dist

    from monitoring.memory import resident_bytes
    from trainer.config import Config
    from trainer.memory.precision import precision_policy
    from trainer.optim import build_optimizer
    from trainer.parallel.choice import parallelism_for
    from trainer.plan.probe import probe_batch
    from trainer.step import create_optimizer_state, step_held, step_peak_bytes, train_step
    from trainer.telemetry.diagnostics import held_bytes

    cfg = Config.model_validate_json(cfg_json)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORKERS)
    try:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        parallel = parallelism_for(cfg, WORKERS, "fp32")
        model = parallel.build(cfg, device, lambda _model: None)
        optimizer = build_optimizer(model, cfg.train.lr, cfg.train.weight_decay,
                                    cfg.train.betas, cfg.train.fused(),
                                    cfg.memory.optimizer_states, None)
        model = parallel.wrap(model, optimizer)
        policy = precision_policy("fp32", device, warn=False)
        scaler = policy.grad_scaler(device)
        torch.manual_seed(parallel.mesh.data_rank)  # a group's rows alike
        batch = probe_batch(1, cfg.model.seq_len, cfg.model.vocab_size, device)
        create_optimizer_state(optimizer)
        train_step(model, optimizer, scaler, [batch], 1, policy, 1.0, parallel=parallel)
        resident = []
        for _ in range(3):
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
            before = resident_bytes()
            train_step(model, optimizer, scaler, [batch], 1, policy, 1.0, parallel=parallel)
            resident.append(_resident_high_water() - before)
        held = held_bytes(step_held(model, optimizer, batch))
        peaks = [step_peak_bytes(model, optimizer, scaler, batch, policy, parallel=parallel)
                 for _ in range(3)]
        Path(f"{out}.{rank}").write_text(json.dumps({
            "peak": peaks, "allocated": [peak - held for peak in peaks], "resident": resident}))
    finally:
        dist.destroy_process_group()


def allocator_rows(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--allocator``: each length's ranks' medians (``allocator_rank``) beside the planner's
    peak; its workers' heap as the trials' (``RETURNED_HEAP``)."""
    import statistics

    from trainer.config import load_config
    from trainer.launch.local import free_port, start_workers

    os.environ.update(RETURNED_HEAP)  # the workers take this process's environment
    rows = []
    for seq_len in (int(n) for n in args.allocator.split(",")):
        spec = trial_spec(work, args.allocator_plan, seq_len, args, f"allocator-{seq_len}")
        cfg = with_workers(load_config(REPO / "configs" / "demo-cpu.yaml", settings(spec)),
                           args.allocator_plan)
        out = work / f"allocator-{args.allocator_plan}-{seq_len}"
        start_workers(allocator_rank, (free_port(), cfg.model_dump_json(), str(out)), WORKERS)
        ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(WORKERS)]

        def medians(key: str) -> list[float]:
            return [round(statistics.median(r[key]) / MIB, 1) for r in ranks]  # noqa: B023

        row = {"seq_len": seq_len, "allocator_peaks_mib": medians("peak"),
               "allocated_in_step_mib": medians("allocated"),
               "resident_in_step_mib": medians("resident"), **predicted(cfg)}
        row["error"] = round(row["predicted_peak_mib"] / max(row["allocator_peaks_mib"]) - 1, 3)
        print(f"{args.allocator_plan}: {json.dumps(row)}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--work", default=None, help="where the data and runs go")
    parser.add_argument("--budget-mib", type=int, default=96, help="per rank")
    parser.add_argument("--plans", default=",".join(PLANS))
    parser.add_argument("--start", type=int, default=2048, help="the first length tried")
    parser.add_argument("--tiles", type=int, default=TILES, help="memory.tiled_mlp (sequence)")
    parser.add_argument("--loss-chunk-tokens", default="1024")
    parser.add_argument("--model", choices=("gpt", "llama"), default="llama",
                        help="memtrain's GPT (learned positions) or an hf: Llama of its shape")
    parser.add_argument("--trial-timeout", type=int, default=3600, help="seconds")
    parser.add_argument("--allocator", help="lengths (comma-separated) whose allocator "
                        "peaks to measure instead of the search")
    parser.add_argument("--allocator-plan", choices=PLANS, default="sequence")
    parser.add_argument("--trial", help=argparse.SUPPRESS)  # one trial, in its own process
    args = parser.parse_args()
    if args.trial:
        print(json.dumps(run_trial(json.loads(args.trial))))
        return
    if args.allocator:
        work = Path(args.work or tempfile.mkdtemp(prefix="memtrain-long-sequence-"))
        report = {"machine": describe_cpu(cpu_description()), "cpu": cpu_description(),
                  "workers": WORKERS, "model": args.model, "plan": args.allocator_plan,
                  "tiled_mlp": args.tiles, "loss_chunk_tokens": args.loss_chunk_tokens,
                  "rows": allocator_rows(work, args)}
        print(f"bench.long_sequence: {write_json(args.out, 'long-sequence-allocator', report)}")
        return
    if args.start % STEP_TOKENS:
        parser.error(f"--start {args.start} is not a multiple of {STEP_TOKENS}")
    work = Path(args.work or tempfile.mkdtemp(prefix="memtrain-long-sequence-"))
    os.makedirs(work, exist_ok=True)
    rows = {plan: longest(work, plan, args.start, args) for plan in args.plans.split(",")}
    single, split = (rows.get(plan, {}).get("longest") for plan in PLANS)
    ratio = None
    if single is not None and split is not None:
        ratio = round(split["seq_len"] / single["seq_len"], 2)
        print(f"sequence 4 + tiled MLP {split['seq_len']:,} tokens against one rank's "
              f"{single['seq_len']:,}: {ratio}x (target 3.5x)", flush=True)
    cpu = cpu_description()
    report = {"machine": describe_cpu(cpu), "cpu": cpu, "budget_mib": args.budget_mib,
              "workers": WORKERS, "model": args.model,
              "shape": GPT if args.model == "gpt" else LLAMA, "tiled_mlp": args.tiles,
              "loss_chunk_tokens": args.loss_chunk_tokens, "rows": rows, "ratio": ratio,
              "target_ratio": 3.5}
    print(f"bench.long_sequence: {write_json(args.out, 'long-sequence', report)}")


if __name__ == "__main__":
    main()
