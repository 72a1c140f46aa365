"""``auto`` choices resolved in the driver before launch, with the memory planner.

``resolve_auto`` replaces ``train.micro_batch_size: auto``, ``memory.activation_checkpointing:
auto`` and ``memory.bf16_norm_inputs: auto`` by the planner's choice
(``trainer.memory.planner.choose_plan``, ``choose_norm_inputs``), against one device's memory
(``memory.device_memory``, or what the driver can read). ``probe_config`` gives the planner its
inputs for a config; ``memtrain plan`` uses it too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from monitoring.units import parse_bytes
from trainer.build import MemoryTransforms, build_model, model_factory
from trainer.compat import fake_tensor_mode
from trainer.config import Config, ConfigError
from trainer.memory.planner import (
    AC_MODES,
    ActivationProfile,
    PlanRow,
    StaticBytes,
    choose_norm_inputs,
    choose_plan,
    profile_all,
    static_bytes,
)
from trainer.memory.precision import resolve_precision

log = logging.getLogger("memtrain")


def device_memory_bytes(cfg: Config) -> int:
    """Memory of one device for the planner's ``auto`` choices."""
    if cfg.memory.device_memory:
        try:
            return parse_bytes(cfg.memory.device_memory, "memory.device_memory")
        except ValueError as err:
            raise ConfigError(str(err)) from err
    if cfg.parallel.use_gpu:
        if not torch.cuda.is_available():
            raise ConfigError("memory.device_memory must be set for 'auto' when this machine "
                              "has no GPU to read it from")
        return torch.cuda.get_device_properties(0).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // cfg.parallel.workers


def planned_precision(cfg: Config) -> str:
    """The precision the planner plans ``cfg`` with: ``memory.precision``, ``auto`` resolved on
    this machine's device (the workers resolve it again on theirs, ``trainer.loop``). A driver
    without the GPU a run asks for plans bf16, what ``auto`` picks on every GPU since Ampere."""
    if cfg.memory.precision != "auto":
        return cfg.memory.precision
    if cfg.parallel.use_gpu and not torch.cuda.is_available():
        return "bf16"
    device = torch.device("cuda", 0) if cfg.parallel.use_gpu else torch.device("cpu")
    return resolve_precision("auto", device, cfg.parallel.strategy).name


def probe_config(cfg: Config, precisions: Iterable[str], ac_modes: Iterable[str]
                 ) -> tuple[StaticBytes, list[ActivationProfile]]:
    """The planner's inputs for ``cfg``: one rank's static bytes and an activation profile per
    (precision, checkpointing) pair, probed on CPU for the configured device type."""
    factory = model_factory(cfg.model)
    transforms = MemoryTransforms.of(cfg.memory)
    profiles = profile_all(factory, transforms, cfg.model.seq_len, cfg.model.vocab_size,
                           precisions, ac_modes,
                           target="cuda" if cfg.parallel.use_gpu else "cpu")
    with fake_tensor_mode():  # only sizes are counted: no memory, no initialisation
        plain = build_model(factory, transforms.replace(activation_checkpointing="none"))
        static = static_bytes(plain, cfg.parallel.strategy, cfg.parallel.workers)
    return static, profiles


def resolve_auto(cfg: Config) -> Config:
    """Replace ``micro_batch_size: auto``, ``activation_checkpointing: auto`` and
    ``bf16_norm_inputs: auto`` by the planner's choice (``trainer.memory.planner.choose_plan``,
    ``choose_norm_inputs``); configs without ``auto`` pass unchanged."""
    micro_auto = cfg.train.micro_batch_size == "auto"
    ac_auto = cfg.memory.activation_checkpointing == "auto"
    norm_auto = cfg.memory.bf16_norm_inputs == "auto"
    if not (micro_auto or ac_auto or norm_auto):
        return cfg
    world = cfg.parallel.workers
    if cfg.train.global_batch_size % world:
        raise ConfigError(f"train.global_batch_size ({cfg.train.global_batch_size}) must be a "
                          f"multiple of the workers ({world})")
    precision = planned_precision(cfg)

    def resolved(plan: PlanRow | None, norm: bool | str) -> Config:
        memory: dict[str, Any] = {"bf16_norm_inputs": norm}
        train: dict[str, Any] = {}
        if plan is not None:
            memory["activation_checkpointing"] = plan.activation_checkpointing
            train["micro_batch_size"] = plan.micro_batch_size
        return cfg.model_copy(update={
            "train": cfg.train.model_copy(update=train),
            "memory": cfg.memory.model_copy(update=memory)})

    if norm_auto and precision != "bf16":  # the copies exist only under bf16 autocast
        cfg, norm_auto = resolved(None, False), False
        if not (micro_auto or ac_auto):
            return cfg
    try:
        budget = device_memory_bytes(cfg)
    except ConfigError:
        if micro_auto or ac_auto:
            raise
        log.info("auto: bf16 norm inputs on (this machine cannot read the GPU's memory and "
                 "memory.device_memory is unset; on fits more)")
        return resolved(None, True)
    modes = AC_MODES if ac_auto else (cfg.memory.activation_checkpointing,)
    fixed = None if micro_auto else cfg.train.micro_batch()

    def plan_with(norm: bool) -> PlanRow | None:
        static, profiles = probe_config(
            cfg.model_copy(update={"memory": cfg.memory.model_copy(
                update={"bf16_norm_inputs": norm})}), [precision], modes)
        return choose_plan(static, profiles, cfg.train.global_batch_size, world, budget, fixed)

    norm: bool | str = cfg.memory.bf16_norm_inputs
    if norm_auto:
        without, with_ = plan_with(False), plan_with(True)
        norm, why = choose_norm_inputs(without, with_, cfg.train.global_batch_size // world)
        plan = with_ if norm else without
        log.info("auto: bf16 norm inputs %s (%s)", "on" if norm else "off", why)
    else:
        plan = plan_with(norm is True)
    if plan is None:
        if micro_auto or ac_auto:
            raise ConfigError(f"nothing fits {budget / 2**30:.1f} GiB per device with "
                              f"precision {precision} (memory.device_memory); try FSDP, a "
                              "shorter sequence or a smaller model")
        return resolved(None, norm)  # the run's own OOM handling has the last word
    log.info("auto: activation checkpointing %s, micro-batch %d x accumulation %d; predicted "
             "peak %.2f GiB of %.2f GiB", plan.activation_checkpointing, plan.micro_batch_size,
             plan.accumulation_steps, plan.predicted_peak_bytes / 2**30, budget / 2**30)
    return resolved(plan, norm)
