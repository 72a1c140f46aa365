"""QLoRA's quality against LoRA on a bf16 base: the same ``hf:`` Llama, the same data, the same
steps; only the frozen base's linear weights differ (NF4 against bf16).

The Llama's weights are random (nothing is downloaded), pretrained first by this bench for
``--pretrain`` steps of a full fine-tune on the stdlib corpus, so that the base has something to
lose; its safetensors are then both LoRA runs' ``model.name: hf:DIR``, each ``--steps``
steps with evaluation every ``--eval-every``, through ``memtrain train`` on one local worker in
bf16. Reported: both runs' training and eval losses, the gap at every evaluation, and the gap the
quantization alone makes before any step (the pretrained model's loss on the first ``--rows``
validation rows in bf16, against the same model with its blocks' linear weights through NF4
and back: what both LoRA runs start from, their adapters' output zero). The tolerance is
derived from that gap, the loss NF4's per-weight error costs: QLoRA's last eval loss may exceed
LoRA's by at most three times it (one-sided: a lower loss is no regression). The two runs'
trajectories differ from the first step on (other arithmetic), so the gap at each evaluation
moves both ways; its largest size is reported beside. The NF4 layers' quantization error is the
run's own log line. Run: ``python -m bench.qlora_quality --out bench/results``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.results import cpu_description, describe_cpu, write_json

REPO = Path(__file__).resolve().parent.parent
LLAMA = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 256, "tie_word_embeddings": False}


def train(work: Path, name: str, steps: int, eval_every: int, *overrides: str) -> list[dict]:
    """One ``memtrain train`` on one local worker; its rank-0 metric rows."""
    settings = [f"data.path={work / 'data' / 'train'}", f"data.val_path={work / 'data' / 'val'}",
                f"run.dir={work / 'runs'}", "model.seq_len=256", "memory.precision=bf16",
                "memory.activation_checkpointing=none", f"train.steps={steps}",
                "train.global_batch_size=4", "train.micro_batch_size=4", "train.warmup_steps=10",
                "train.log_every=10", f"train.eval_every={eval_every}", "train.eval_batches=8",
                "train.checkpoint_every=0", *overrides]
    command = [sys.executable, "-m", "trainer.cli", "train", "--config",
               str(REPO / "configs" / "demo-cpu.yaml"), "--launcher", "local", "--workers", "1",
               "--run-name", name] + [arg for s in settings for arg in ("--set", s)]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"bench.qlora_quality: {name} failed:\n{out.stderr[-3000:]}")
    lines = [line for line in out.stderr.splitlines() if "NF4 base:" in line]
    if lines:
        print(lines[0].split("memory strategies: ")[-1])
    rows = (work / "runs" / name / "metrics" / "rank-0.jsonl").read_text().splitlines()
    return [json.loads(row) for row in rows]


def pretrain(work: Path, steps: int) -> Path:
    """The Llama's random weights trained ``steps`` steps in full, saved as safetensors."""
    import torch
    import transformers

    from trainer.checkpoint.files import complete_checkpoints, read_model_weights

    base = work / "base"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**LLAMA)).save_pretrained(base)
    train(work, "pretrain", steps, 0, f"model.name=hf:{base}", "train.lr=0.003",
          "memory.optimizer_states=fp32", f"train.checkpoint_every={steps}")
    [(_, checkpoint)] = complete_checkpoints(work / "runs" / "pretrain")[-1:]
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
    model.load_state_dict({name.removeprefix("hf."): tensor for name, tensor
                           in read_model_weights(checkpoint).items()})
    model.save_pretrained(work / "pretrained")
    return work / "pretrained"


def quantization_gap(pretrained: Path, data: Path, rows: int) -> dict[str, float]:
    """The pretrained model's mean loss on ``rows`` validation rows, in bf16 and with its
    blocks' linear weights through NF4 and back (torchao's, as ``base_dtype: nf4`` stores
    them); the loss is computed in fp32 from bf16 logits."""
    import pyarrow as pa
    import torch
    import transformers

    from trainer.memory.nf4 import to_nf4

    shard = json.loads((data / "manifest.json").read_text())["shards"][0]["path"]
    with pa.memory_map(str(data / shard)) as source:
        table = pa.ipc.open_file(source).read_all()
    tokens = torch.tensor(table.column("tokens").to_pylist()[:rows], dtype=torch.long)
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained,
                                                             dtype=torch.bfloat16)

    def loss() -> float:
        with torch.no_grad():
            logits = model(tokens[:, :-1]).logits.float()
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                       tokens[:, 1:].flatten()))

    bf16 = loss()
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = to_nf4(module.weight.data).get_original_weight()
    return {"bf16": bf16, "nf4": loss()}


def losses(rows: list[dict], key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in rows if key in row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--pretrain", type=int, default=200)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--rows", type=int, default=64, help="validation rows of the start gap")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="memtrain-qlora-"))
    subprocess.run([sys.executable, "-m", "trainer.cli", "data", "corpus", str(work / "data")],
                   cwd=REPO, check=True, capture_output=True)
    pretrained = pretrain(work, args.pretrain)
    start = quantization_gap(pretrained, work / "data" / "val", args.rows)
    runs: dict[str, Any] = {}
    for dtype in ("bf16", "nf4"):
        rows = train(work, dtype, args.steps, args.eval_every, f"model.name=hf:{pretrained}",
                     "model.lora.rank=8", f"model.lora.base_dtype={dtype}", "train.lr=0.002",
                     "memory.optimizer_states=fp32")
        runs[dtype] = {"train": losses(rows, "loss"), "eval": losses(rows, "eval_loss")}
    evals = sorted(set(runs["bf16"]["eval"]) & set(runs["nf4"]["eval"]))
    gaps = {step: runs["nf4"]["eval"][step] - runs["bf16"]["eval"][step] for step in evals}
    start_gap = abs(start["nf4"] - start["bf16"])
    tolerance = 3 * start_gap
    final = gaps[evals[-1]]
    cpu = cpu_description()
    spread = max(abs(gap) for gap in gaps.values())
    report = {"machine": describe_cpu(cpu), "cpu": cpu, "model": LLAMA, "args": vars(args),
              "runs": runs, "eval_gap": gaps, "start_losses": start, "start_gap": start_gap,
              "tolerance": tolerance, "final_gap": final, "largest_gap": spread,
              "within": final <= tolerance}
    path = write_json(args.out, "qlora-quality", report)
    print(f"{report['machine']}: eval loss, LoRA on a bf16 base against QLoRA (NF4 base)")
    for step in evals:
        print(f"  step {step:4d}: bf16 {runs['bf16']['eval'][step]:.4f}  nf4 "
              f"{runs['nf4']['eval'][step]:.4f}  gap {gaps[step]:+.4f}")
    print(f"before any step: bf16 {start['bf16']:.4f}, nf4 {start['nf4']:.4f}")
    print(f"the quantization's own gap {start_gap:.4f}; at the last evaluation {final:+.4f} "
          f"(QLoRA - LoRA), at most {tolerance:+.4f} allowed (3x the quantization's): "
          f"{'within' if report['within'] else 'NOT within'}; the largest gap at any "
          f"evaluation {spread:.4f}; {path}")


if __name__ == "__main__":
    main()
