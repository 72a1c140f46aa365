"""``memtrain export RUN --hf OUT``: a run's trained weights back in the model's own format.

For a run of a Hugging Face model (``model.name: hf:<dir>``), the checkpoint's weights (DCP
files, written under any way of splitting and world size) are written as ``save_pretrained``
would: ``AutoModelForCausalLM.from_pretrained(OUT)`` then gives the trained model. They are
converted a safetensors file at a time: the model is built on the meta device, each file's
tensors are read from the DCP files alone (``--max-shard-size``'s worth, 2 GB by default),
written, and freed, so the whole model is never in memory. The tokenizer the run's dataset was
written with (the dataset's copy, checked against its manifest) is written beside it, so
``AutoTokenizer.from_pretrained(OUT)`` works too. A LoRA run (``model.lora``) exports PEFT's adapter
directory (``adapter_model.safetensors``, ``adapter_config.json``), or with ``--merge`` the model
with the adapters folded into its weights. The run directory must be local (a run on object storage:
its working copy, ``run.work_dir``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from datapipe.manifest import DatasetError, read_manifest
from datapipe.tokenize import SPECIAL_TOKENS, TOKENIZER_FILE, dataset_tokenizer
from monitoring.run_files import CONFIG
from monitoring.units import format_bytes
from trainer.checkpoint.adapters import export_adapters
from trainer.checkpoint.files import (
    CheckpointReadError,
    latest_whole,
    load_checkpoint,
    load_tensors,
    published_checkpoints,
    verified,
)
from trainer.config import ConfigError, load_config
from trainer.models.build import MemoryTransforms, build_model, model_factory
from trainer.models.hf import PREFIX, HFCausalLM
from trainer.tensors import storage_key

log = logging.getLogger(__name__)


class Exported(NamedTuple):
    out: Path
    step: int  # the checkpoint's
    tokenizer: bool  # whether the dataset's tokenizer.json was written beside the model


DEFAULT_MAX_SHARD_BYTES = 2 * 10**9


def export_hf(run_dir: Path, out: Path, step: int | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, merge: bool = False) -> Exported:
    """Write checkpoint ``step`` (default: the latest) of ``run_dir`` as a ``save_pretrained``
    directory ``out``, with the dataset's tokenizer where it kept one. A LoRA run
    (``model.lora``): PEFT's adapter directory, or with ``merge`` the model with its adapters
    folded in (``trainer.checkpoint.adapters.export_adapters``)."""
    config_path = run_dir / CONFIG
    if not config_path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml (not a memtrain run directory)")
    cfg = load_config(config_path)
    if not cfg.model.name.startswith(PREFIX):
        raise ConfigError(f"--hf needs a run of a Hugging Face model (model.name hf:...); "
                          f"{run_dir}'s is {cfg.model.name!r}")
    checkpoints = dict(published_checkpoints(run_dir))
    hashes = cfg.run.checkpoint_verify == "hashes"
    if step is None:  # the latest whole one, past any that is not
        latest = latest_whole(sorted(checkpoints.items()), hashes)
        if latest is None:
            raise CheckpointReadError(f"{run_dir}: no complete checkpoint to export")
        directory = latest
    elif step not in checkpoints:
        raise CheckpointReadError(f"{run_dir}: no checkpoint of step {step} (there are "
                                  f"{sorted(checkpoints)})")
    else:
        directory = verified(checkpoints[step], hashes)
    state = load_checkpoint(directory)
    if cfg.model.frozen_base():
        export_adapters(cfg, directory, state, out, merge)
    else:
        with torch.device("meta"):  # sizes and names only: no weights in memory
            model = build_model(model_factory(cfg.model, load_weights=False), MemoryTransforms(),
                                seed=None)
        assert isinstance(model, HFCausalLM), type(model)
        files = write_safetensors_from_dcp(directory, model, out, max_shard_bytes)
        log.info("exported %s a file at a time from the DCP shards (%d file(s), at most %s of "
                 "weights in memory)", directory.name, files, format_bytes(max_shard_bytes))
    return Exported(out, int(state["step"]), _write_tokenizer(cfg.data.path, out))


def _write_tokenizer(dataset: str, out: Path) -> bool:
    """The tokenizer the dataset was written with, beside the model in ``out``, with the
    ``tokenizer_config.json`` that ``AutoTokenizer`` needs (its end-of-text token, and a chat
    dataset's template and special tokens, so the model is prompted as it was trained); False
    where the dataset kept none (said in the log when it cannot be read)."""
    try:
        tokenizer = dataset_tokenizer(dataset)
    except DatasetError as err:  # the weights are written; say why the tokenizer is not
        log.warning("no tokenizer written: %s", err)
        return False
    if tokenizer is None:
        return False
    from tokenizers import Tokenizer

    raw, eot_id = tokenizer
    (out / TOKENIZER_FILE).write_bytes(raw)
    metadata = read_manifest(dataset).metadata
    config = {"eos_token": Tokenizer.from_str(raw.decode("utf-8")).id_to_token(eot_id)}
    # A chat dataset's special tokens, as its template rendered the rows with them.
    config |= {name: metadata[name] for name in SPECIAL_TOKENS if metadata.get(name)}
    if metadata.get("chat_template"):
        config["chat_template"] = metadata["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return True


def _saved_names(model: HFCausalLM) -> list[tuple[str, torch.Tensor]]:
    """The tensors ``save_pretrained`` writes, by the Hugging Face model's names: its state
    dict, a tied weight once (under its first name, the input embedding)."""
    seen: set[int] = set()
    names = []
    for name, tensor in model.hf.state_dict(keep_vars=True).items():
        key = storage_key(tensor)
        if key not in seen:
            seen.add(key)
            names.append((name, tensor))
    return names


def _files(tensors: list[tuple[str, torch.Tensor]], max_bytes: int
           ) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors in files of at most ``max_bytes`` (a larger tensor alone)."""
    files: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append((name, tensor))
        size += nbytes
    return files


def write_safetensors_from_dcp(directory: Path, model: HFCausalLM, out: Path,
                               max_shard_bytes: int) -> int:
    """``model``'s weights from the DCP checkpoint ``directory`` into ``out`` as safetensors,
    one file's tensors in memory at a time, with the index ``from_pretrained`` reads when
    there is more than one, and the model's config; returns the number of files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    groups = _files(_saved_names(model), max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for index, group in enumerate(groups, start=1):
        file = "model.safetensors" if len(groups) == 1 else \
            f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        tensors = load_tensors(directory, {
            "hf." + name: torch.empty(meta.shape, dtype=meta.dtype) for name, meta in group})
        save_file({name.removeprefix("hf."): t.contiguous() for name, t in tensors.items()},
                  str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: file for name, _ in group})
        del tensors
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    model.hf.config.save_pretrained(out)
    generation = getattr(model.hf, "generation_config", None)
    if generation is not None and model.hf.can_generate():
        generation.save_pretrained(out)
    return len(groups)
