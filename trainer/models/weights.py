"""Filling a built model's tensors from an ``hf:`` directory's safetensors, each rank its rows:
``load_hf_weights`` for a whole model (``train.init_from: hf:DIR``), ``owners`` and
``fill_from_file`` for the sharded build (``trainer.parallel.fsdp``), which fills each rank's
shards before anything else is made. Names are matched as ``from_pretrained`` matches them
(``SafetensorsRows.names_for``); a tensor of another shape, or tied tensors that differ in the
files, are refused in one line naming the directory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.memory.lora import base_name, is_adapter
from trainer.memory.nf4 import fill_nf4, is_nf4
from trainer.models.hf import SafetensorsRows
from trainer.tensors import fill_local, shard_rows, storage_key

log = logging.getLogger(__name__)


@dataclass
class Owner:
    """Where a parameter or buffer of the meta-built model lives: its module and name."""

    module: nn.Module
    name: str
    fqn: str
    meta: torch.Tensor


def owners(model: nn.Module) -> dict[int, list[Owner]]:
    """Every parameter and buffer of ``model`` by its storage (tied weights share one), with
    the names they had before any wrapper was applied."""
    owners: dict[int, list[Owner]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is not None:
                fqn = f"{prefix}.{name}" if prefix else name
                owners.setdefault(storage_key(tensor), []).append(  # ``detach``: a
                    Owner(module, name, fqn, tensor.detach()))  # later cast keeps this storage
    return owners


def load_hf_weights(model: nn.Module, weights: SafetensorsRows | None) -> None:
    """``train.init_from: hf:DIR`` into a whole model: every tensor the directory's safetensors
    hold, by the Hugging Face model's own names (a LoRA target's base weight included; the
    adapters keep their initialisation); ValueError naming the directory where a tensor does
    not fit or none is the model's."""
    fill_from_file(owners(model), weights, getattr(model, "hf", None))


def fill_owner(owner: Owner, value: torch.Tensor) -> None:
    fill(owner, lambda rows: value if rows is None else value[rows])


def fill(owner: Owner, read: Callable[[slice | None], torch.Tensor]) -> None:
    """This rank's part of ``owner``'s whole tensor, from ``read(rows)`` (``fill_local``); an
    NF4 weight is quantized as it is read, its error kept on its module for the run's log."""
    target = getattr(owner.module, owner.name)
    if is_nf4(target):
        owner.module.nf4_error = fill_nf4(target, read, owner.meta.shape)  # type: ignore[assignment]
    else:
        fill_local(target, read, owner.meta.shape)


def fill_from_file(owners: dict[int, list[Owner]], weights: SafetensorsRows | None,
                    hf_model: Any = None) -> set[int]:
    """Each rank's rows of every tensor ``weights`` holds, matched to the model's names as
    ``from_pretrained`` matches them for ``hf_model`` (``SafetensorsRows.names_for``); returns
    the storages filled. ValueError naming the directory where a tensor does not fit
    (``check_fits``) or where the files hold none of the model's tensors."""
    if weights is None:
        return set()
    names = weights.names_for({file_key(o.fqn) for found in owners.values() for o in found},
                              hf_model)
    filled = set()
    missing = []
    for key, found in owners.items():
        matched = [(o, names[file_key(o.fqn)]) for o in found if file_key(o.fqn) in names]
        if not matched:
            missing += [file_key(o.fqn) for o in found
                        if o.name in o.module._parameters and not is_adapter(o.fqn)]
            continue
        check_fits(weights, matched)
        file_name = matched[0][1]
        for owner in found:
            fill(owner, partial(weights.read, file_name,
                                dtype=getattr(owner.module, owner.name).dtype))
        filled.add(key)
    if not filled:
        raise ValueError(f"{weights.directory}: none of the model's parameters is in its "
                         "safetensors (they load into a model of the same architecture)")
    if missing:  # as from_pretrained does: said, and left to the model's own initialisation
        log.warning("%d parameter(s) not in the model's safetensors, initialised as the model "
                    "initialises them: %s", len(missing), ", ".join(missing[:5])
                    + (", ..." if len(missing) > 5 else ""))
    return filled


def file_key(fqn: str) -> str:
    """A model tensor's name as the files name it (a LoRA target's base weight is the file's)."""
    return base_name(fqn.removeprefix("hf."))


def check_fits(weights: SafetensorsRows, matched: list[tuple[Owner, str]]) -> None:
    """ValueError naming the directory where a file's tensor is of another shape than the
    model's (``from_pretrained`` refuses it too; a slice would cut it to fit), or where tensors
    the model ties (one storage) are two different tensors in the files: ``from_pretrained``
    then unties them, and a tied fill would train another model. The values are compared on
    each rank's rows, agreed over the process group."""
    for owner, file_name in matched:
        shape = weights.shape(file_name)
        if shape != tuple(owner.meta.shape):
            raise ValueError(f"{weights.directory}: {weights.stored_as(file_name)} has shape "
                             f"{list(shape)} in its safetensors, the model's "
                             f"{file_key(owner.fqn)} {list(owner.meta.shape)}")
    distinct = list(dict.fromkeys(file_name for _, file_name in matched))
    if len(distinct) < 2:
        return
    rows = None
    if dist.is_available() and dist.is_initialized():
        rows = shard_rows(matched[0][0].meta.shape[0], dist.get_rank(), dist.get_world_size())
    first = weights.read(distinct[0], rows, torch.float32)
    differ = torch.tensor([float(any(not torch.equal(first, weights.read(name, rows,
                                                                           torch.float32))
                                     for name in distinct[1:]))])
    if rows is not None:
        dist.all_reduce(differ, op=dist.ReduceOp.MAX)
    if differ.item():
        raise ValueError(f"{weights.directory}: {' and '.join(distinct)} are one tensor in the "
                         "model (its config ties them) but differ in its safetensors, where "
                         "from_pretrained unties them: set tie_word_embeddings false in its "
                         "config.json")
