"""A real text corpus every machine with Python has: the standard library's own source files.

``build_stdlib_corpus`` reads the ``.py`` files of the running interpreter's standard library
(sorted, excluding ``site-packages`` and the test suites), turns them into byte-level tokens
(vocabulary 256) and cuts the stream into fixed-length rows of ``seq_len + 1`` tokens, so each
row gives ``seq_len`` inputs and their next-token targets. Every 20th file goes to the validation
split. The result is deterministic for a given Python installation.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from datapipe.manifest import ColumnSpec, Manifest
from datapipe.writer import ProgressFn, write_rows

TOKENS_COLUMN = "tokens"
VOCAB_SIZE = 256
VAL_EVERY_NTH_FILE = 20
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files in a stable order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py")
        if not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def token_rows(files: list[Path], row_len: int, max_bytes: int | None = None
               ) -> Iterator[np.ndarray]:
    """Yield ``(n, row_len)`` uint8 blocks from the concatenated bytes of ``files`` (at most
    ``max_bytes`` of them; None: all)."""
    carry = b""
    used = 0
    for path in files:
        if max_bytes is not None and used >= max_bytes:
            break
        data = path.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - used]
        used += len(data)
        buf = carry + data
        n = len(buf) // row_len
        if n:
            yield np.frombuffer(buf[: n * row_len], dtype=np.uint8).reshape(n, row_len)
        carry = buf[n * row_len:]


def build_stdlib_corpus(out: str | Path, seq_len: int = 256, max_bytes: int = 8 << 20,
                        rows_per_shard: int = 4096, progress: ProgressFn | None = None,
                        source_root: Path | None = None) -> dict[str, Manifest]:
    """Write ``out/train`` and ``out/val`` datasets; returns their manifests by split.

    ``max_bytes`` caps the training split's source bytes (the validation split gets a twentieth).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    files = stdlib_source_files(source_root)
    if not files:
        raise ValueError(f"no .py files found under {source_root or 'the standard library'}")
    splits = {
        "train": [f for i, f in enumerate(files) if i % VAL_EVERY_NTH_FILE],
        "val": [f for i, f in enumerate(files) if i % VAL_EVERY_NTH_FILE == 0],
    }
    budgets = {"train": max_bytes, "val": max(max_bytes // VAL_EVERY_NTH_FILE, seq_len + 1)}
    row_len = seq_len + 1
    columns = [ColumnSpec(TOKENS_COLUMN, "uint8", (row_len,))]
    manifests = {}
    for split, split_files in splits.items():
        manifests[split] = write_rows(
            Path(out) / split,
            columns,
            ({TOKENS_COLUMN: block} for block in token_rows(split_files, row_len, budgets[split])),
            rows_per_shard=rows_per_shard,
            metadata={"source": "python-stdlib", "split": split, "vocab_size": str(VOCAB_SIZE),
                      "seq_len": str(seq_len)},
            progress=progress,
        )
    return manifests
