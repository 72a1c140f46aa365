"""What one more layer costs each FSDP rank of a QLoRA fine-tune: its tensors' bytes, and the
rest of what it adds to the rank's resident memory (the modules, the tensors' C++ objects,
FSDP's and autograd's metadata), of which Python's own allocations are counted too: the bytes
per layer that do not shrink with the base's dtype (``bench.qlora_largest``'s 4-rank figures).

Two gloo ranks build ``bench.qlora_largest``'s Llama at two layer counts as a FSDP worker does
(``Parallelism.build``, LoRA rank 8 on every block linear layer, the NF4 or bf16 base read from
its safetensors, full checkpointing), and after the build each rank reports:

- ``tensors``: the bytes of every parameter's and buffer's storage on the rank (an NF4 shard's
  codes, scales, factors and mean; the adapters; the embeddings' and norms' shards);
- ``resident``: anonymous resident memory (resident less file-backed), less tracemalloc's own
  tables;
- ``other``: ``resident`` less ``tensors``: everything a layer adds that is not a tensor's
  bytes;
- ``python``: of ``other``, Python's allocations (``tracemalloc``, started after the imports):
  the modules (PEFT adds about ten to each adapted linear layer) and their dictionaries;
- ``c_heap``: glibc's allocated bytes (``mallinfo2``: the heap in use and the mapped chunks)
  less ``tensors`` and tracemalloc's tables; Python's objects above 512 bytes are allocated
  there too, so ``python`` and ``c_heap`` overlap and are not added.

The difference between the two layer counts, over the layers added, is each figure per layer
(the highest rank's). Run: ``python -m bench.qlora_layer_bytes --out bench/results`` (needs
``bench.qlora_largest``'s weights at the same width: ``--work`` is the directory that bench
wrote, or one where they are written first).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.qlora_largest import SEQ_LEN, model_dir
from bench.results import cpu_description, describe_cpu, write_json

MIB = 1 << 20
WORKERS = 2


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _malloc_bytes() -> int:
    """glibc's bytes in use: the heap's allocated chunks and the separately mapped ones."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _tensor_bytes(model: Any) -> int:
    """The storages' bytes of ``model``'s parameters and buffers on this rank, each once (an
    NF4 weight by its parts, a DTensor by its local shard: ``trainer.tensors``)."""
    from trainer.tensors import local_tensor, plain_tensors

    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        for plain in plain_tensors(local_tensor(tensor)):
            if plain.device.type != "meta":
                storage = plain.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _rank(rank: int, port: int, spec: dict[str, Any], out: str) -> None:
    import tracemalloc

    import psutil
    import torch
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.memory.allocator import settle_host_memory
    from trainer.parallel.choice import parallelism_for

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORKERS)
    try:
        torch.set_num_threads(1)
        cfg = load_config(None, [
            f"model.name=hf:{spec['model']}", f"model.seq_len={SEQ_LEN}", "model.lora.rank=8",
            f"model.lora.base_dtype={spec['base_dtype']}", "memory.precision=bf16",
            "parallel.strategy=fsdp", f"parallel.workers={WORKERS}",
            "memory.activation_checkpointing=full"])
        parallel = parallelism_for(cfg, WORKERS, "bf16")
        settle_host_memory(parallel.steady_transients, lean=True)  # as the worker does
        gc.collect()
        tracemalloc.start()
        model = parallel.build(cfg, torch.device("cpu"), lambda model: None)
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)
        memory = psutil.Process().memory_info()
        tensors = _tensor_bytes(model)
        tracing = tracemalloc.get_tracemalloc_memory()  # its tables, in the C heap
        resident = memory.rss - memory.shared - tracing
        figures = {"tensors": tensors, "resident": resident, "other": resident - tensors,
                   "python": tracemalloc.get_traced_memory()[0],
                   "c_heap": _malloc_bytes() - tensors - tracing,
                   "modules": sum(1 for _ in model.modules())}
        Path(f"{out}.{rank}").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def measure(work: Path, layers: int, base_dtype: str, width: int) -> list[dict[str, int]]:
    """Each rank's figures after building ``layers`` layers (its own processes)."""
    from trainer.launch.local import free_port, start_workers

    directory, _ = model_dir(work, layers, width)
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "figures")
        start_workers(_rank, (free_port(), {"model": str(directory),
                                            "base_dtype": base_dtype}, out), WORKERS)
        return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(WORKERS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--work", default=None, help="where the weights are (or go)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", default="16,32", help="the two layer counts")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="memtrain-qlora-layer-bytes-"))
    low, high = map(int, args.layers.split(","))
    rows: dict[str, Any] = {}
    for base_dtype in ("nf4", "bf16"):
        first, second = (measure(work, layers, base_dtype, args.width)
                         for layers in (low, high))
        # the rank whose resident memory grew most, every figure its own
        a, b = max(zip(first, second, strict=True), key=lambda pair: pair[1]["resident"]
                   - pair[0]["resident"])
        per_layer = {key: round((b[key] - a[key]) / (high - low) / MIB, 3)
                     for key in ("tensors", "resident", "other", "python", "c_heap")}
        per_layer["modules"] = (second[0]["modules"] - first[0]["modules"]) // (high - low)
        rows[base_dtype] = {"per_layer_mib": per_layer, low: first, high: second}
        print(f"{base_dtype}: a layer costs a rank {json.dumps(per_layer)}", flush=True)
    cpu = cpu_description()
    report = {"machine": describe_cpu(cpu), "cpu": cpu, "width": args.width,
              "workers": WORKERS, "layers": [low, high], "rows": rows,
              "command": " ".join(["python -m bench.qlora_layer_bytes", *sys.argv[1:]])}
    print(f"bench.qlora_layer_bytes: {write_json(args.out, 'qlora-layer-bytes', report)}")


if __name__ == "__main__":
    main()
