"""What a resume changes: the resolved config against the one the run last ran with (its
``config.yaml``), key by key.

A resume is a launch under a run name that has a checkpoint. Every changed key is said, in one
line each. Some changes break an exact resume, and are refused in one line unless
``--allow-changes``: the data read and its order (``data.path``, ``data.column``,
``data.shuffle``, ``data.shuffle_window``), the model (any ``model.*``: its shape, its weights'
meaning), the global batch, the seed, the optimizer's state format (a checkpoint of one
does not load into the other) and, for a LoRA model, ``train.init_from`` (its frozen base: the
checkpoint holds the adapters alone; without LoRA a resume reads every weight from the
checkpoint, and ``init_from`` is not read). The rest take effect as meant: the learning rate and its
schedule (``trainer.optim``), the step count, evaluation, logging, checkpointing, the
parallel strategy (DDP and FSDP checkpoints load under each other), memory strategies that keep
the math (checkpointing, offload, the micro-batch split, which keeps the global batch). Where
the run directory lives (``run.dir``, ``run.work_dir``) is not a change of the run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import yaml

from trainer.config import Config, ConfigError

log = logging.getLogger("memtrain")

BREAKS_EXACTNESS = ("data.path", "data.column", "data.shuffle", "data.shuffle_window", "model.",
                    "train.global_batch_size", "run.seed", "memory.optimizer_states")
NOT_CHANGES = ("run.dir", "run.work_dir")


def flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_keys(previous: Mapping[str, Any], current: Mapping[str, Any]
                 ) -> list[tuple[str, Any, Any]]:
    """(key, before, now) for every key whose value differs, sorted."""
    before, now = flat(previous), flat(current)
    return [(key, before.get(key), now.get(key)) for key in sorted(set(before) | set(now))
            if before.get(key) != now.get(key) and not key.startswith(NOT_CHANGES)]


def breaks_exactness(key: str, frozen_base: bool = False) -> bool:
    """Whether a change of ``key`` breaks an exact resume (of a model that trains adapters
    over a frozen base where ``frozen_base``: the base comes from ``train.init_from``)."""
    return (frozen_base and key == "train.init_from") or any(
        key == rule or (rule.endswith(".") and key.startswith(rule)) for rule in BREAKS_EXACTNESS)


def check_resume(previous_yaml: str, cfg: Config, allow_changes: bool) -> list[str]:
    """The changes of a resume from a run whose config was ``previous_yaml``, one line each,
    logged; ConfigError (exit 2) for one that breaks exactness unless ``allow_changes``."""
    try:
        previous = yaml.safe_load(previous_yaml) or {}
    except yaml.YAMLError:
        previous = {}
    if not isinstance(previous, dict):
        previous = {}
    changes = changed_keys(previous, yaml.safe_load(cfg.to_yaml()))
    frozen_base = cfg.model.frozen_base()
    breaking = [key for key, _, _ in changes if breaks_exactness(key, frozen_base)]
    if breaking and not allow_changes:
        key, before, now = next(change for change in changes if change[0] == breaking[0])
        more = f" (and {', '.join(breaking[1:])})" if len(breaking) > 1 else ""
        raise ConfigError(f"{key}: {before!r} -> {now!r} on resuming run {cfg.run.name!r}{more} "
                          "breaks an exact resume; pass --allow-changes to resume anyway, or "
                          "--fresh to start the run anew")
    lines = [f"resuming with {key} changed: {before!r} -> {now!r}"
             + (" (breaks an exact resume: allowed)" if breaks_exactness(key, frozen_base) else "")
             for key, before, now in changes]
    for line in lines:
        log.info("%s", line)
    return lines
