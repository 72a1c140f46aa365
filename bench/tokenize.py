"""Tokenized writing against the tokenizer alone: `memtrain data write --tokenizer` on text
files, and Hugging Face ``tokenizers``' own batch encoding of the same files on the same cores.

Input: the Python standard library's ``.py`` files (real text, on every machine), copied once
into ``--cache`` up to ``--max-mb``. Tokenizer: byte-level BPE with ``--vocab-size`` tokens,
trained once on the same files (``datapipe.tokenize.train_tokenizer``; not timed).

- (t) tokenizers alone: each file read and decoded, ``encode_batch_fast`` over batches of about
  4 MiB of text (memtrain's batch size, the tokenizer's best case), ids counted, nothing kept.
- (m) memtrain: ``datapipe.convert.write_dataset`` with the tokenizer: the same reading and
  encoding, plus packing into rows of 1025 tokens, Arrow shards, checksums and the manifest.

Each is run ``--repeats`` times, alternating, best of each. Target: (m) >= 0.8 x (t).
Run: ``python -m bench.tokenize`` (writes ``bench/results/tokenize-<date>-<host>.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.results import write_json
from datapipe.convert import write_dataset
from datapipe.corpus import stdlib_source_files
from datapipe.tokenize import BATCH_BYTES, load_tokenizer, train_tokenizer


def corpus(root: Path, max_mb: float) -> list[Path]:
    """Up to ``max_mb`` of the standard library's source as text files (cached)."""
    if not root.exists():
        tmp = root.with_name(root.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        total = 0
        for i, source in enumerate(stdlib_source_files()):
            try:
                text = source.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            if not text.strip():  # empty __init__.py files: data write refuses empty input
                continue
            (tmp / f"{i:05d}.txt").write_text(text, encoding="utf-8")
            total += len(text.encode())
            if total >= max_mb * 2**20:
                break
        tmp.rename(root)
    return sorted(root.iterdir())


def tokenizer_alone(files: list[Path], tokenizer_path: Path) -> int:
    """Tokens of ``files`` through ``encode_batch_fast``, batched as memtrain batches."""
    tokenizer, _ = load_tokenizer(tokenizer_path)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    tokens, batch, size = 0, [], 0
    for file in files:
        text = file.read_bytes().decode("utf-8")
        batch.append(text)
        size += len(text)
        if size >= BATCH_BYTES:
            tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
            batch, size = [], 0
    if batch:
        tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--max-mb", type=float, default=24.0)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default=None, help="Where the corpus and tokenizer are kept.")
    args = parser.parse_args()
    cache = Path(args.cache or Path(tempfile.gettempdir()) / "memtrain-bench-tokenize")
    files = corpus(cache / f"text-{args.max_mb:g}mb", args.max_mb)
    nbytes = sum(f.stat().st_size for f in files)
    tokenizer_path = cache / f"tokenizer-{args.vocab_size}-{args.max_mb:g}mb.json"
    if not tokenizer_path.exists():
        train_tokenizer(files, "text", tokenizer_path, args.vocab_size)

    best: dict[str, float] = {}
    for _ in range(args.repeats):
        start = time.perf_counter()
        tokenizer_alone(files, tokenizer_path)
        best["t"] = min(best.get("t", float("inf")), time.perf_counter() - start)
        out = cache / "written"
        start = time.perf_counter()
        write_dataset(files, out, tokenizer=tokenizer_path, seq_len=1024, overwrite=True)
        best["m"] = min(best.get("m", float("inf")), time.perf_counter() - start)
    results: dict[str, Any] = {
        key: {"name": name, "seconds": best[key], "mb_per_second": nbytes / best[key] / 2**20}
        for key, name in (("t", "tokenizers encode_batch_fast alone"),
                          ("m", "memtrain data write --tokenizer"))}
    for key, row in results.items():
        print(f"({key}) {row['name']:38s} {row['mb_per_second']:8.2f} MB/s "
              f"({row['seconds']:.2f} s)")
    ratio = results["m"]["mb_per_second"] / results["t"]["mb_per_second"]
    print(f"ratio m/t {ratio:.2f} (target >= 0.8), {nbytes / 2**20:.1f} MB of text, "
          f"{len(files)} files, {os.cpu_count()} CPUs")
    report = {
        "bench": "tokenize", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "cpus": os.cpu_count(), "input_bytes": nbytes,
        "files": len(files), "vocab_size": args.vocab_size, "results": results,
        "ratios": {"m_over_t": ratio}, "targets": {"m_over_t": 0.8},
    }
    print(f"wrote {write_json(args.out, 'tokenize', report)}")


if __name__ == "__main__":
    main()
