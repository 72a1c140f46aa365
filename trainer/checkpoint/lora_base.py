"""What a LoRA run's checkpoints record of its frozen base: the ``hf:`` directory it takes its
weights from and those files' sizes (and SHA-256 under ``run.checkpoint_verify: hashes``). A
LoRA checkpoint holds the adapters alone, so an export rebuilds the base and refuses one that is
missing or changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.checkpoint.integrity import sha256_of
from trainer.models.hf import PREFIX as HF_PREFIX
from trainer.models.hf import has_weights


def lora_base_source(model_name: str, init_from: str | None) -> str | None:
    """The ``hf:`` directory a LoRA model's frozen base takes its weights from, as the loop
    builds it: ``train.init_from``'s where it names one, else ``model.name``'s where that holds
    weights; None for a base of its seeded initialisation."""
    if init_from is not None and init_from.startswith(HF_PREFIX):
        return init_from
    if model_name.startswith(HF_PREFIX) and has_weights(model_name.removeprefix(HF_PREFIX)):
        return model_name
    return None


def weights_fingerprint(source: str, hashes: bool) -> dict[str, dict[str, Any]]:
    """The weight files of an ``hf:`` directory (``model.safetensors``, or the index and the
    files it names) by name: their size, and their SHA-256 where ``hashes``; empty where it
    holds none."""
    path = Path(source.removeprefix(HF_PREFIX)).expanduser()
    directory = path if path.is_dir() else path.parent
    index = directory / "model.safetensors.index.json"
    names = {"model.safetensors"}
    if index.is_file():
        names = {index.name, *json.loads(index.read_text())["weight_map"].values()}
    return {name: {"size": (directory / name).stat().st_size,
                   **({"sha256": sha256_of(directory / name)} if hashes else {})}
            for name in sorted(names) if (directory / name).is_file()}


def lora_base(model_name: str, init_from: str | None, hashes: bool) -> dict[str, Any] | None:
    """What a LoRA model's checkpoints record of its base (``TrainState.lora_base``); None
    for a base of its seeded initialisation."""
    source = lora_base_source(model_name, init_from)
    if source is None:
        return None
    return {"source": source, "files": weights_fingerprint(source, hashes)}


def changed_files(before: dict[str, dict[str, Any]], source: str
                  ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The weight files of ``source`` now (``weights_fingerprint``, hashed where ``before``,
    a checkpoint's record of them, was) and the names of those that differ from ``before``
    (missing, added, another size or SHA-256), sorted."""
    hashes = any("sha256" in found for found in before.values())
    now = weights_fingerprint(source, hashes)
    return now, sorted(name for name in set(now) | set(before)
                       if now.get(name) != before.get(name))


def base_changes(recorded: dict[str, Any], source: str | None) -> list[str]:
    """How the base ``source`` (None: a seeded initialisation) differs from the one a checkpoint
    ``recorded`` (``lora_base``): another directory, or a weight file missing, added or of
    other size or SHA-256 (hashed where the record was); one phrase each, empty where none."""
    if source is None or source != recorded["source"]:
        return [f"the base {recorded['source']} -> {source or 'a seeded initialisation'}"]
    before = recorded["files"]
    now, changed = changed_files(before, source)
    phrases = []
    for name in changed:
        old, new = before.get(name), now.get(name)
        if old is None or new is None:
            phrases.append(f"{name} {'added' if old is None else 'missing'}")
        else:
            key = "size" if old["size"] != new["size"] else "sha256"
            phrases.append(f"{name} {key} {str(old[key])[:12]} -> {str(new[key])[:12]}")
    return phrases
