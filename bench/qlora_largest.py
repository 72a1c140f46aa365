"""The largest ``hf:`` Llama whose LoRA fine-tune fits a per-rank memory budget: NF4 base
(QLoRA) against bf16 base, on one process and on 4 gloo ranks under FSDP.

Each trial is the product itself: ``memtrain train`` with the local launcher on a Llama of L
layers read from safetensors (LoRA rank 8 on every linear layer of the blocks, bf16 autocast,
full activation checkpointing, the chunked loss, sequence 256, one row a rank), built, loaded
and trained for one step. Each worker's resident memory is sampled from outside every 0.1 s
(``bench.fsdp_resident.Sampler``); a trial fits when every worker's anonymous resident memory
(less the mapped safetensors' pages, which the kernel can drop) stays within the budget above
its first sample (the fork server's imports) through the end of step 1. The layer count is
doubled until a trial does not fit, then bisected.

The model: width 1,024 (``--width``; 512 is the other choice), 8 heads on 2 key/value heads, MLP
2.75x as wide (every block's weight fills NF4's blocks in each of 4 ranks' row shards),
vocabulary 4,096, untied: 11.3M parameters a layer (2.8M at width 512) and 8.4M in the
embedding and output layer. What a layer costs a rank beyond its base shard does not shrink
with the base's dtype: the adapters with their gradients and AdamW state, the checkpointed
block input, and about 0.8 MiB that is not a tensor's bytes (Python's modules, 84 a layer with
PEFT's, and the tensors' and FSDP's C++ objects; ``bench.qlora_layer_bytes``, at width
1,024). At width 512 those outweigh a rank's NF4 shard of the layer (0.35 MiB); at 1,024 the
shard is 1.39 MiB against bf16's 5.4, nearer a real model's proportions. The weights are
random (bf16, written layer by layer, one file each; a trial's directory names its first L).

Target: on 4 ranks, at least 2.5x the parameters with the NF4 base (2 against about 0.56
bytes a base parameter). Run: ``make bench-qlora-largest`` or ``python -m bench.qlora_largest
--out bench/results``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
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
# The MLP's width for each model width (2.75x, rounded so every weight fills NF4's blocks in
# each of 4 ranks' row shards).
MLP = {512: 1408, 1024: 2816}


def llama(width: int) -> dict[str, Any]:
    """The Llama's config, but for its layer count."""
    return {"vocab_size": 4096, "hidden_size": width, "intermediate_size": MLP[width],
            "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
SEQ_LEN = 256
MIB = 1 << 20


def _layer_shapes(index: int, width: int) -> dict[str, tuple[int, ...]]:
    config = llama(width)
    hidden, inter = width, config["intermediate_size"]
    kv = hidden * config["num_key_value_heads"] // config["num_attention_heads"]
    shapes = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv, hidden),
              "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
              "post_attention_layernorm.weight": (hidden,)}
    return {f"model.layers.{index}.{name}": shape for name, shape in shapes.items()}


def _layer_tensors(index: int, width: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(index)
    return {name: torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1
            else (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            for name, shape in _layer_shapes(index, width).items()}


def model_dir(work: Path, layers: int, width: int = 512) -> tuple[Path, int]:
    """A directory whose config names ``layers`` layers over the shared weight files (written
    as first needed); returns it and the model's parameter count."""
    import torch
    from safetensors.torch import save_file

    weights = work / ("weights" if width == 512 else f"weights-{width}")
    weights.mkdir(parents=True, exist_ok=True)
    hidden, vocab = width, llama(width)["vocab_size"]
    if not (weights / "outside.safetensors").is_file():
        generator = torch.Generator().manual_seed(10_000)
        save_file({"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=generator)
                                                 * 0.02).to(torch.bfloat16),
                   "lm_head.weight": (torch.randn(vocab, hidden, generator=generator) * 0.02)
                   .to(torch.bfloat16),
                   "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)},
                  str(weights / "outside.safetensors"))
    weight_map = {name: "outside.safetensors"
                  for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    params = 2 * vocab * hidden + hidden
    for index in range(layers):
        path = weights / f"layer-{index:04d}.safetensors"
        if not path.is_file():
            save_file(_layer_tensors(index, width), str(path))
        shapes = _layer_shapes(index, width)
        params += sum(math.prod(shape) for shape in shapes.values())
        weight_map.update(dict.fromkeys(shapes, path.name))
    directory = work / (f"llama-{layers}" if width == 512 else f"llama-{width}-{layers}")
    directory.mkdir(exist_ok=True)
    for file in set(weight_map.values()):
        link = directory / file
        if not link.exists():
            link.symlink_to(weights / file)
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "num_hidden_layers": layers, **llama(width)}))
    return directory, params


def trial(work: Path, data: Path, layers: int, base_dtype: str, workers: int,
          budget: int, width: int) -> dict[str, Any]:
    """One fine-tune of L layers for one step (``run_trial``, in a process of its own); its
    workers' peaks and whether every one fits ``budget``."""
    directory, params = model_dir(work, layers, width)
    spec = {"model": str(directory), "data": str(data), "runs": str(work / "runs"),
            "base_dtype": base_dtype, "workers": workers,
            "name": f"{base_dtype}-{workers}-{layers}-{time.strftime('%H%M%S')}"}
    done = subprocess.run([sys.executable, "-m", "bench.qlora_largest", "--trial",
                           json.dumps(spec)], cwd=REPO, capture_output=True, text=True,
                          timeout=3600)
    result: dict[str, Any] = {"layers": layers, "parameters": params}
    if done.returncode != 0:
        return {**result, "fits": False, "failed": done.stderr.strip().splitlines()[-1:]}
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, **measured, "fits": len(measured["peaks_mib"]) == workers
            and max(measured["peaks_mib"]) <= budget / MIB}


def run_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """The fine-tune through the local launcher (``launch_local``) with ``spec``'s workers (more
    than this machine's CPUs if asked, as the tests do), sampled from a thread of this process:
    its workers' anonymous resident memory above their first samples (one worker runs in this
    process: above this process's own, once everything is imported)."""
    from trainer.config import load_config
    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run

    workers = spec["workers"]
    settings = [f"model.name=hf:{spec['model']}", f"model.seq_len={SEQ_LEN}",
                "model.lora.rank=8", f"model.lora.base_dtype={spec['base_dtype']}",
                "memory.precision=bf16", f"parallel.strategy={'fsdp' if workers > 1 else 'ddp'}",
                "parallel.launcher=local", f"parallel.workers={min(workers, 2)}",
                f"data.path={Path(spec['data']) / 'train'}",
                f"data.val_path={Path(spec['data']) / 'val'}", f"run.dir={spec['runs']}",
                f"run.name={spec['name']}", "memory.activation_checkpointing=full",
                "memory.loss_chunk_tokens=auto", "train.steps=1",
                f"train.global_batch_size={workers}", "train.micro_batch_size=1",
                "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
                "train.warmup_steps=0"]
    cfg, run_dir = prepare_run(load_config(REPO / "configs" / "demo-cpu.yaml", settings))
    # more workers than this machine's CPUs, which prepare_run refuses to protect a user's
    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(
        update={"workers": workers})})
    # One worker runs in this process: what preparing the run left in malloc's free lists is
    # returned first, or the build would reuse it unseen above this process's first sample.
    gc.collect()
    if sys.platform == "linux":
        ctypes.CDLL(None).malloc_trim(0)
    with Sampler(psutil.Process()) as sampler:
        launch_local(cfg, run_dir)
    me = os.getpid()
    pids = [me] if workers == 1 else [
        pid for pid in sampler.series if "forkserver" in sampler.names.get(
            sampler.parents.get(pid, -1), "")]
    peaks = []
    for pid in pids:
        series = [rss - shared for (_, rss), (_, shared)
                  in zip(sampler.series[pid], sampler.file_backed[pid], strict=True)]
        peaks.append(round((max(series) - series[0]) / MIB, 1))
    rows = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()
    step = [json.loads(row) for row in rows if '"loss"' in row][0]
    return {"peaks_mib": peaks, "seconds": round(step["step_seconds"], 1)}


def largest(work: Path, data: Path, base_dtype: str, workers: int, budget: int,
            start: int, width: int) -> dict[str, Any]:
    """The most layers that fit: doubled from ``start`` until a trial does not fit, then
    bisected to 1/16 of the most that fit (``bench.search.largest_fitting``)."""
    trials: list[dict[str, Any]] = []

    def fits(layers: int) -> bool:
        trials.append(trial(work, data, layers, base_dtype, workers, budget, width))
        print(f"{base_dtype} x{workers}: {json.dumps(trials[-1])}", flush=True)
        return bool(trials[-1]["fits"])

    largest_fitting(fits, start)
    best = max((t for t in trials if t["fits"]), key=lambda t: t["layers"], default=None)
    return {"largest": best, "trials": trials}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--work", default=None, help="where the weights, data and runs go")
    parser.add_argument("--budget-mib", type=int, default=192, help="per rank")
    parser.add_argument("--workers", default="1,4")
    parser.add_argument("--width", type=int, default=1024, choices=sorted(MLP),
                        help="the model's width (hidden size)")
    parser.add_argument("--trial", help=argparse.SUPPRESS)  # one trial, in its own process
    args = parser.parse_args()
    if args.trial:
        print(json.dumps(run_trial(json.loads(args.trial))))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="memtrain-qlora-largest-"))
    data = work / "data"
    if not (data / "train" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "trainer.cli", "data", "corpus", str(data)],
                       cwd=REPO, check=True, capture_output=True)
    budget = args.budget_mib * MIB
    rows: dict[str, Any] = {}
    for workers in map(int, args.workers.split(",")):
        for base_dtype in ("bf16", "nf4"):
            rows[f"{base_dtype} x{workers}"] = largest(work, data, base_dtype, workers, budget,
                                                        start=4 * workers, width=args.width)
        bf16, nf4 = (rows[f"{d} x{workers}"]["largest"] for d in ("bf16", "nf4"))
        if bf16 and nf4:
            rows[f"ratio x{workers}"] = round(nf4["parameters"] / bf16["parameters"], 2)
            print(f"x{workers}: NF4 {nf4['parameters'] / 1e6:.0f}M against bf16 "
                  f"{bf16['parameters'] / 1e6:.0f}M parameters: {rows[f'ratio x{workers}']}x",
                  flush=True)
    cpu = cpu_description()
    report = {"machine": describe_cpu(cpu), "cpu": cpu, "budget_mib": args.budget_mib,
              "llama": llama(args.width), "seq_len": SEQ_LEN, "rows": rows}
    print(f"bench.qlora_largest: {write_json(args.out, 'qlora-largest', report)}")


if __name__ == "__main__":
    main()
