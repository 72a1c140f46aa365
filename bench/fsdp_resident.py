"""Resident memory of the product's own FSDP workers: ``memtrain train`` with the local launcher,
2 gloo ranks, an ``hf:`` Llama read from its safetensors, each worker's resident memory sampled
every 0.01 s from outside, through build, load and training (a gather's spike lasts a few tens
of milliseconds: samples 0.1 s apart miss most of it).

The figures are multiples of the model's fp32 bytes: each worker's highest resident memory up
to a point, above its own first sample (a worker is forked from the launcher's preloaded server,
so that sample is the imports' pages, not the model's), in all and its anonymous part alone
(less the file-backed pages: the libraries' code a worker touches after the fork, about 0.2-0.34x
here, which other processes share, and the safetensors file while the build reads it):
- ``start``: through the build and the load, until step 1 begins (its row's time less its
  seconds);
- ``step 1``, ``step 5`` and ``step N``: through the end of those steps; the last two's ratio is
  the creep.
Beside them, the launcher's own peak (it plans from shapes, never reading the weights), the
worker's high-water mark as the run logs it (``peak_memory_bytes``: on CPU the process's
``ru_maxrss``, its baseline included), and tokens/s at steady state. Rows (``--rows``): plain
fp32 AdamW, LoRA on a bf16 base, and QLoRA (LoRA on an NF4 base).

Targets (2 ranks, every rank, fp32 AdamW): at most 0.75x at start, 3.0x through step 1, step N
within 5% of step 5; LoRA on a bf16 base at most 0.6x through step 1; QLoRA at most 0.35x.
Run: ``make bench-fsdp`` (with ``bench.fsdp``), or ``python -m bench.fsdp_resident --out
bench/results``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.results import cpu_description, describe_cpu, write_json

REPO = Path(__file__).resolve().parent.parent
# About 100M parameters, 46% of them the embedding and the untied output layer (vocab 32,000).
LLAMA = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
         "num_hidden_layers": 8, "num_attention_heads": 12, "num_key_value_heads": 4,
         "max_position_embeddings": 512, "tie_word_embeddings": False}
SEQ_LEN = 256
INTERVAL = 0.01  # seconds between samples
LORA_BASES = {"lora": "bf16", "qlora": "nf4"}  # the rows' frozen bases


def save_model(directory: Path) -> int:
    """The Llama's random weights as safetensors in ``directory`` (kept between runs);
    returns its parameter count."""
    import torch
    import transformers

    if not (directory / "model.safetensors").is_file():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
        model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = hidden * config["num_key_value_heads"] // config["num_attention_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config["intermediate_size"] \
        + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


class Sampler:
    """Resident bytes of a process tree every ``interval`` s: {pid: [(time, bytes)]}."""

    def __init__(self, root: psutil.Process, interval: float = INTERVAL) -> None:
        self.root, self.interval = root, interval
        self.series: dict[int, list[tuple[float, int]]] = {}
        # the file-backed and shared part of each sample (a mapped safetensors file's pages)
        self.file_backed: dict[int, list[tuple[float, int]]] = {}
        self.names: dict[int, str] = {}
        self.parents: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            now = time.time()
            for process in processes:
                try:
                    info = process.memory_info()
                    self.names.setdefault(process.pid, " ".join(process.cmdline()))
                    self.parents.setdefault(process.pid, process.ppid())
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                self.series.setdefault(process.pid, []).append((now, info.rss))
                self.file_backed.setdefault(process.pid, []).append((now, info.shared))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _rows(run_dir: Path, rank: int) -> dict[int, dict[str, Any]]:
    lines = (run_dir / "metrics" / f"rank-{rank}.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines) if "loss" in row}


def _through(series: list[tuple[float, int]], when: float) -> int:
    """The most of the samples up to ``when``: a high-water mark, which a creep raises."""
    return max((rss for t, rss in series if t <= when), default=series[0][1])


def worker_figures(series: list[tuple[float, int]], rows: dict[int, dict[str, Any]],
                   model_bytes: int, last: int) -> dict[str, Any]:
    """One worker's figures (the module docstring) from its samples and its metrics rows."""
    baseline = series[0][1]
    step1_end = rows[1]["time"]
    step1_start = step1_end - rows[1]["step_seconds"]
    through_1 = max(rss for t, rss in series if t <= step1_end)  # the row's time: step 1 done

    def share(rss: int) -> float:
        return round((rss - baseline) / model_bytes, 3)

    return {"baseline_bytes": baseline, "start": share(_through(series, step1_start)),
            "step_1": share(through_1), "step_5": share(_through(series, rows[5]["time"])),
            f"step_{last}": share(_through(series, rows[last]["time"])),
            "process_peak": round(max(r["peak_memory_bytes"] for r in rows.values())
                               / model_bytes, 3),
            "tokens_per_s": round(sum(r["tokens_per_second"] for s, r in rows.items()
                                      if s > 5) / max(1, len(rows) - 5), 1)}


def window_peaks(samples: list[tuple[float, int, int]], window: float = 0.1
                 ) -> list[tuple[float, int, int]]:
    """The samples kept in the results file: each ``window`` seconds' one of most anonymous
    memory (resident less shared), so the file stays small and keeps every peak."""
    kept: dict[int, tuple[float, int, int]] = {}
    for t, rss, shared in samples:
        key = int(t // window)
        if key not in kept or rss - shared > kept[key][1] - kept[key][2]:
            kept[key] = (round(t, 3), rss, shared)
    return [kept[key] for key in sorted(kept)]


def run(work: Path, model_dir: Path, data: Path, name: str, steps: int, model_bytes: int,
        *overrides: str, env: dict[str, str] | None = None, interval: float = INTERVAL
        ) -> dict[str, Any]:
    """One ``memtrain train`` of the Llama on 2 local workers under FSDP, sampled."""
    command = [sys.executable, "-m", "trainer.cli", "train", "--config",
               str(REPO / "configs" / "demo-cpu.yaml"), "--launcher", "local", "--workers", "2",
               "--run-name", name]
    settings = [f"model.name=hf:{model_dir}", f"model.seq_len={SEQ_LEN}",
                f"data.path={data / 'train'}", f"data.val_path={data / 'val'}",
                f"run.dir={work / 'runs'}", "parallel.strategy=fsdp", "memory.precision=fp32",
                "memory.activation_checkpointing=full", "memory.loss_chunk_tokens=auto",
                f"train.steps={steps}", "train.global_batch_size=2", "train.micro_batch_size=1",
                "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
                "train.warmup_steps=2", *overrides]
    for setting in settings:
        command += ["--set", setting]
    launcher = psutil.Popen(command, cwd=REPO, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with Sampler(launcher, interval) as sampler:
        output, _ = launcher.communicate(timeout=3600)
    if launcher.returncode != 0:
        raise SystemExit(f"bench.fsdp_resident: {name} failed:\n{output[-3000:]}")
    run_dir = work / "runs" / name
    # the workers: the fork server's children (the server's command line names its module)
    workers = [pid for pid in sampler.series
               if "forkserver" in sampler.names.get(sampler.parents[pid], "")]
    if len(workers) != 2:
        raise SystemExit(f"bench.fsdp_resident: {name}: {len(workers)} worker processes seen")
    figures = {}
    for rank, pid in enumerate(sorted(workers)):
        rows = _rows(run_dir, rank)
        anonymous = [(t, rss - shared) for (t, rss), (_, shared)
                     in zip(sampler.series[pid], sampler.file_backed[pid], strict=True)]
        figures[f"rank_{rank}"] = worker_figures(sampler.series[pid], rows, model_bytes, steps)
        figures[f"rank_{rank}"]["anonymous"] = {
            key: value for key, value in worker_figures(anonymous, rows, model_bytes,
                                                        steps).items()
            if key not in ("process_peak", "tokens_per_s")}
    figures["series"] = {name: window_peaks([(t, rss, shared) for (t, rss), (_, shared) in
                                             zip(sampler.series[pid], sampler.file_backed[pid],
                                                 strict=True)])
                         for name, pid in (("rank_0", min(workers)), ("rank_1", max(workers)),
                                           ("launcher", launcher.pid))}
    figures["step_times"] = {step: (row["time"] - row["step_seconds"], row["time"])
                             for step, row in _rows(run_dir, 0).items() if step <= 5}
    launcher_series = sampler.series[launcher.pid]
    figures["launcher_peak"] = round(max(r for _, r in launcher_series) / model_bytes, 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--work", default=None, help="where the model, data and runs go")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rows", default="plain,lora,qlora",
                        help="plain, lora, qlora (comma-separated)")
    parser.add_argument("--interval", type=float, default=INTERVAL,
                        help="seconds between samples (a short spike falls between wider ones)")
    parser.add_argument("--env", action="append", default=[],
                        help="KEY=VALUE for the run's processes (a malloc setting, say)")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    work = Path(args.work or tempfile.mkdtemp(prefix="memtrain-fsdp-resident-"))
    params = save_model(work / "llama")
    data = work / "data"
    if not (data / "train" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "trainer.cli", "data", "corpus", str(data)],
                       cwd=REPO, check=True, capture_output=True)
    model_bytes = 4 * params
    rows: dict[str, Any] = {}
    stamp = time.strftime("%H%M%S")
    for row in args.rows.split(","):
        lora = (("model.lora.rank=8", f"model.lora.base_dtype={LORA_BASES[row]}",
                 "memory.precision=bf16") if row in LORA_BASES else ())
        rows[row] = run(work, work / "llama", data, f"{row}-{stamp}", args.steps, model_bytes,
                        *lora, env=env, interval=args.interval)
        print(f"{row}: {json.dumps({k: v for k, v in rows[row].items() if k != 'series'})}",
              flush=True)
    cpu = cpu_description()
    report = {"machine": describe_cpu(cpu), "cpu": cpu, "env": env, "parameters": params,
              "interval_s": args.interval,
              "model_fp32_bytes": model_bytes, "steps": args.steps, "rows": rows}
    path = write_json(args.out, "fsdp-resident", report)
    print(f"bench.fsdp_resident: {path}")


if __name__ == "__main__":
    main()
