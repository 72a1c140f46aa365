"""A checkpoint's manifest: its ``meta.json`` lists every other file of the checkpoint with its
size and SHA-256, so that a reader can tell a whole checkpoint from a partial one.

Why: a local checkpoint is published by an atomic rename, but object stores have no rename.
memtrain's own uploads write ``meta.json`` last, while Ray Train uploads each worker's files in
no fixed order, so ``meta.json`` may be on the store before ``state.pt`` or a DCP shard is whole;
and a disk can truncate or corrupt a file after the fact. So nothing trusts a checkpoint because
its ``meta.json`` exists:

- **every listing** (a run directory's, a store's) checks that each listed file is there at
  its size (a ``stat`` or one store listing per checkpoint: no bytes read);
- **every read** (restore, export) also checks the bytes against their hashes, where
  ``run.checkpoint_verify`` is ``hashes`` (the default): SHA-256 costs about 1.1 s per GiB on
  one core (docs/reliability.md has the figures); ``sizes`` leaves the hashes for runs whose
  checkpoints are too large to read twice.

Each rank hashes the files it wrote, as it writes them; rank 0 gathers every rank's list into
``meta.json`` (``trainer.checkpoint.files.write_states``). A ``meta.json`` without a file list
(written before manifests) is accepted when its ``state.pt`` is there: it cannot say more.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "meta.json"
STATE = "state.pt"
VERIFY_MODES = ("hashes", "sizes")

Entry = dict[str, Any]  # {"size": int, "sha256": str}


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def describe(directory: Path) -> dict[str, Entry]:
    """Every file under ``directory`` but its manifest, by its path relative to it."""
    return {path.relative_to(directory).as_posix():
            {"size": path.stat().st_size, "sha256": sha256_of(path)}
            for path in sorted(directory.rglob("*"))
            if path.is_file() and path.name != MANIFEST}


def write_manifest(directory: Path, step: int, files: dict[str, Entry]) -> None:
    """``meta.json`` in ``directory``, whole or not at all (written aside, then renamed)."""
    text = json.dumps({"step": step, "files": dict(sorted(files.items()))}, indent=1)
    staging = directory / f".{MANIFEST}.tmp"
    staging.write_text(text)
    os.replace(staging, directory / MANIFEST)


def parse(text: str) -> dict[str, Any] | None:
    """A manifest's contents; None when they are not one (truncated, not JSON)."""
    try:
        manifest = json.loads(text)
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) and "step" in manifest else None


def size_problem(manifest: dict[str, Any] | None, sizes: dict[str, int]) -> str | None:
    """What is missing from a checkpoint whose files are ``sizes`` (relative path: bytes), as
    its ``manifest`` lists them; None when nothing is."""
    if manifest is None:
        return f"{MANIFEST} is unreadable" if MANIFEST in sizes else f"{MANIFEST} is missing"
    listed: dict[str, Entry] = manifest.get("files") or {STATE: {}}
    missing = sorted(name for name in listed if name not in sizes)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"{', '.join(missing[:3])}{more} missing"
    for name, entry in sorted(listed.items()):
        if "size" in entry and sizes[name] != entry["size"]:
            return f"{name} has {sizes[name]:,} bytes where {MANIFEST} lists {entry['size']:,}"
    return None


def local_problem(directory: Path, hashes: bool) -> str | None:
    """What makes the local checkpoint ``directory`` unusable, or None: its files' sizes and,
    with ``hashes``, their bytes, against its manifest."""
    sizes = {path.relative_to(directory).as_posix(): path.stat().st_size
             for path in directory.rglob("*") if path.is_file()}
    manifest_path = directory / MANIFEST
    manifest = parse(manifest_path.read_text()) if manifest_path.is_file() else None
    problem = size_problem(manifest, sizes)
    if problem is not None or not hashes or manifest is None:
        return problem
    for name, entry in sorted((manifest.get("files") or {}).items()):
        if "sha256" in entry and sha256_of(directory / name) != entry["sha256"]:
            return f"{name}'s bytes differ from the SHA-256 {MANIFEST} lists"
    return None
