"""A run that trains LoRA adapters over a frozen base (``model.lora``), in its checkpoints.

A LoRA checkpoint holds the adapters alone; the base is read again, from ``train.init_from:
hf:DIR`` or ``model.name``, at every start. So the checkpoint records that base (the ``hf:``
directory and its weight files' sizes, and SHA-256 under ``run.checkpoint_verify: hashes``):
a resume refuses a changed base unless allowed (``check_resumed_base``), and an export, which
rebuilds the base, refuses one that is missing or changed (``export_adapters``: PEFT's adapter
directory, or the model with the adapters merged).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.files import load_checkpoint, load_tensors
from trainer.checkpoint.integrity import sha256_of
from trainer.config import Config, ConfigError
from trainer.memory.lora import (
    lora_of,
    merge_adapters,
    peft_adapter_state,
    peft_config,
    trainable_state_dict,
)
from trainer.models.build import MemoryTransforms, build_whole
from trainer.models.hf import PREFIX as HF_PREFIX
from trainer.models.hf import HFCausalLM, has_weights

log = logging.getLogger(__name__)

RECORD = "lora_base"  # the key of ``state.pt`` that records the base (``base_record``)


def base_source(model_name: str, init_from: str | None) -> str | None:
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


def base_record(cfg: Config) -> dict[str, Any]:
    """What the checkpoints of ``cfg``'s run record of its frozen base, as entries of
    ``state.pt`` (``TrainState.records``): ``{RECORD: {"source": "hf:DIR", "files":
    weights_fingerprint}}``; none for a base of its seeded initialisation, or a run with no
    frozen base. Hashes the files where ``run.checkpoint_verify: hashes``."""
    source = base_source(cfg.model.name, cfg.train.init_from)
    if not cfg.model.frozen_base() or source is None:
        return {}
    hashes = cfg.run.checkpoint_verify == "hashes"
    return {RECORD: {"source": source, "files": weights_fingerprint(source, hashes)}}


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
    ``recorded`` (``base_record``): another directory, or a weight file missing, added or of
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


def check_resumed_base(cfg: Config, checkpoint: Path | None, allow_changes: bool,
                       own: bool = True) -> None:
    """A LoRA checkpoint holds the adapters alone: resumed from ``checkpoint`` (the run's
    ``own``, else ``train.resume_from``'s), they train on the base the run builds now, which
    must be the one the checkpoint recorded (its directory, its files' sizes, and their SHA-256
    where the run hashed them: ``run.checkpoint_verify: hashes``). Another one is refused in
    one line (exit 2) unless ``allow_changes``, which logs what changed."""
    if not cfg.model.frozen_base() or checkpoint is None:
        return
    recorded = load_checkpoint(checkpoint).get(RECORD)
    if recorded is None:  # a seeded base, or a checkpoint from before bases were recorded
        return
    source = base_source(cfg.model.name, cfg.train.init_from)
    changes = base_changes(recorded, source)
    if not changes:
        return
    if source != recorded["source"]:  # either field may have named either base
        field = "the LoRA base (model.name or train.init_from)"
    else:
        field = "train.init_from" if source == cfg.train.init_from else "model.name"
    where = f"{checkpoint.name} of run {cfg.run.name!r}" if own else str(checkpoint)
    what = f"{field}: {'; '.join(changes)} since {where} trained its LoRA adapters on that base"
    if not allow_changes:
        raise ConfigError(f"{what}; resuming would train them on another base: restore it, "
                          "pass --allow-changes to resume anyway, or --fresh to start anew")
    log.warning("resuming with %s (allowed: the adapters go on training on this base)", what)


def export_adapters(cfg: Config, directory: Path, state: dict[str, Any], out: Path,
                    merge: bool) -> None:
    """A LoRA run's checkpoint: the base built as the run built it (the weights of
    ``train.init_from: hf:DIR``, else of ``model.name``, else its seeded initialisation),
    checked against what the checkpoint recorded of it, the checkpoint's adapters loaded, then
    PEFT's adapter directory (``PeftModel.from_pretrained(base, out)``), or with ``merge`` the
    merged model (``from_pretrained(out)``)."""
    source = check_exported_base(cfg, state.get(RECORD))
    if not merge and source is None:
        raise ConfigError(f"{cfg.model.name} has no weights of its own (the run's base was its "
                          "seeded initialisation), so an adapter directory would have nothing "
                          "to apply to: export with --merge")
    model = build_whole(cfg.model, cfg.train.init_from, MemoryTransforms(), seed=cfg.run.seed)
    assert isinstance(model, HFCausalLM), type(model)
    adapters = trainable_state_dict(model)
    loaded = load_tensors(directory, {
        name: torch.empty_like(tensor) for name, tensor in adapters.items()})
    model.load_state_dict(loaded, strict=False)
    settings = lora_of(model)
    assert settings is not None
    if merge:
        merge_adapters(model)
        model.hf.save_pretrained(out)
        log.info("exported %s: the adapters merged into the base weights", directory.name)
        return
    from safetensors.torch import save_file

    assert source is not None
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_adapter_state(model), str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    base = Path(source.removeprefix(HF_PREFIX)).expanduser().resolve()
    peft_config(settings, model, str(base)).save_pretrained(str(out))
    log.info("exported %s: the adapters alone (%d tensors), for PeftModel.from_pretrained",
             directory.name, len(adapters))


def check_exported_base(cfg: Config, recorded: dict[str, Any] | None) -> str | None:
    """The ``hf:`` directory the run's LoRA base takes its weights from (None: its seeded
    initialisation). ConfigError where the checkpoint recorded another, or where its weight
    files are missing or not the ones the run trained on (sizes, and SHA-256 where the run
    recorded them); a checkpoint that recorded nothing (written before checkpoints did) is
    checked for its files alone, and the log says so."""
    init_hf = (cfg.train.init_from or "").startswith(HF_PREFIX)
    field = "train.init_from" if init_hf else "model.name"
    configured = cfg.train.init_from if init_hf else cfg.model.name
    source = base_source(cfg.model.name, cfg.train.init_from)
    if recorded is not None:
        if recorded["source"] != configured:
            raise ConfigError(f"{field}: the run's config names the LoRA base {configured}, but "
                              f"its checkpoint was trained on {recorded['source']}")
        source = recorded["source"]
    elif source is not None:
        log.warning("the checkpoint records no fingerprint of its LoRA base %s: its files "
                    "are taken as they are now", source)
    if source is None:
        return None
    now, changed = changed_files(recorded["files"], source) if recorded is not None \
        else (weights_fingerprint(source, hashes=False), [])
    if not now:
        raise ConfigError(f"{field} {source}: the LoRA run's base weights are missing (no "
                          "model.safetensors or its index); export needs the base it trained on")
    if changed:
        raise ConfigError(f"{field} {source}: {changed[0]} is not the file the LoRA run trained "
                          "on (changed since training); export needs the base it trained on")
    return source
