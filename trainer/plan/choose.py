"""``auto`` choices resolved in the driver before launch, with the memory planner and its time
model.

``resolve_auto`` replaces ``train.micro_batch_size: auto``, ``memory.activation_checkpointing:
auto`` and ``memory.bf16_norm_inputs: auto`` (and ``memory.precision: auto`` and
``memory.loss_chunk_tokens: auto`` where it searches micro-batch or checkpointing) by the plan
with the most predicted tokens/s among those that fit one device's memory
(``memory.device_memory``, or what the driver can read): the planner's peak
(``trainer.plan.peak``), step time (``trainer.plan.speed``) and rules
(``trainer.plan.candidates``). ``probe_config`` and ``speed_model`` give the planner its inputs
for a config; ``memtrain plan`` uses them too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from monitoring.units import parse_bytes
from trainer.build import MemoryTransforms, build_model, model_factory
from trainer.compat import fake_tensor_mode
from trainer.config import Config, ConfigError
from trainer.memory.precision import resolve_precision
from trainer.oom import oom_recovery_on
from trainer.plan.candidates import choose_norm_inputs, feasible_plans
from trainer.plan.peak import (
    AC_MODES,
    ActivationProfile,
    PlanRow,
    StaticBytes,
    profile_all,
    static_bytes,
)
from trainer.plan.speed import (
    LoaderCost,
    SpeedModel,
    cpu_speed,
    measure_loader,
    named_gpu_speed,
)

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


def probe_config(cfg: Config, precisions: Iterable[str], ac_modes: Iterable[str],
                 work: bool = False) -> tuple[StaticBytes, list[ActivationProfile]]:
    """The planner's inputs for ``cfg``: one rank's static bytes and an activation profile per
    (precision, checkpointing) pair, probed on CPU for the configured device type (``work``:
    with the step's operators recorded, for ``speed_model``)."""
    factory = model_factory(cfg.model)
    transforms = MemoryTransforms.of(cfg.memory)
    profiles = profile_all(factory, transforms, cfg.model.seq_len, cfg.model.vocab_size,
                           precisions, ac_modes,
                           target="cuda" if cfg.parallel.use_gpu else "cpu", work=work)
    with fake_tensor_mode():  # only sizes are counted: no memory, no initialisation
        plain = build_model(factory, transforms.replace(activation_checkpointing="none"))
        static = static_bytes(plain, cfg.parallel.strategy, cfg.parallel.workers)
    return static, profiles


def loader_cost(cfg: Config) -> LoaderCost | None:
    """The data loader's cost on ``cfg``'s dataset, measured here (about a second): rank 0's
    share at the per-rank batch (``trainer.plan.speed.measure_loader``); None, said in the
    log, where this machine cannot read the dataset (the run checks it again)."""
    data = cfg.data
    try:
        cost = measure_loader(data.path, data.column, cfg.parallel.workers,
                              cfg.train.global_batch_size // cfg.parallel.workers,
                              cfg.run.seed, data.shuffle, data.shuffle_window)
    except (OSError, ValueError) as err:  # DatasetError is a ValueError
        log.info("planner: the data loader's cost is not in the time model (%s cannot be "
                 "read here: %s)", data.path, str(err).splitlines()[0])
        return None
    log.info("planner: data loader %s (%s)", cost.source, data.path)
    return cost


def speed_model(cfg: Config, gpu: str | None = None, measure_data: bool = False
                ) -> SpeedModel:
    """The time model for ``cfg``'s device: this CPU, calibrated (``trainer.plan.speed.
    cpu_speed``, cached), or a GPU's peak figures: ``gpu`` by name, else the driver's own GPU,
    else an H200's (said in the log); compiled where ``train.compile`` is on (``auto``: on a
    GPU). ``measure_data``: with the data loader's cost on the configured dataset
    (``loader_cost``)."""
    if cfg.parallel.use_gpu:
        if gpu is None and torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
        device = named_gpu_speed(gpu)
    else:
        device = cpu_speed()
    overlap = not oom_recovery_on(cfg.memory.oom_recovery,
                                  torch.device("cuda" if cfg.parallel.use_gpu else "cpu"))
    return SpeedModel(device, cfg.parallel.workers, overlap_allreduce=overlap,
                      loader=loader_cost(cfg) if measure_data else None,
                      compiled=cfg.parallel.use_gpu and cfg.train.compile is not False)


def precision_candidates(cfg: Config) -> list[str]:
    """``memory.precision: auto``: the precision ``auto`` resolves to on this device, and the
    other of fp32 and the low precision, for the time model to choose between."""
    planned = planned_precision(cfg)
    if cfg.memory.precision != "auto":
        return [planned]
    return [planned, "bf16" if planned == "fp32" else "fp32"]


def _tokens(row: PlanRow) -> str:
    return f"{row.tokens_per_s:,.0f} tokens/s"


def resolve_auto(cfg: Config) -> Config:
    """Replace ``micro_batch_size: auto``, ``activation_checkpointing: auto`` and
    ``bf16_norm_inputs: auto`` (and ``precision: auto`` with either of the first two) by the
    fitting plan with the most predicted tokens/s; configs without ``auto`` pass unchanged."""
    micro_auto = cfg.train.micro_batch_size == "auto"
    ac_auto = cfg.memory.activation_checkpointing == "auto"
    norm_auto = cfg.memory.bf16_norm_inputs == "auto"
    if not (micro_auto or ac_auto or norm_auto):
        return cfg
    world = cfg.parallel.workers
    if cfg.train.global_batch_size % world:
        raise ConfigError(f"train.global_batch_size ({cfg.train.global_batch_size}) must be a "
                          f"multiple of the workers ({world})")
    searching = micro_auto or ac_auto
    precisions = precision_candidates(cfg) if searching else [planned_precision(cfg)]

    # The loss's chunk is chosen with the rest where it is "auto" and the model chunks it.
    chunk_auto = searching and cfg.memory.loss_chunk_tokens == "auto"

    def resolved(plan: PlanRow | None, norm: bool | str) -> Config:
        memory: dict[str, Any] = {"bf16_norm_inputs": norm}
        train: dict[str, Any] = {}
        if plan is not None:
            memory["activation_checkpointing"] = plan.activation_checkpointing
            train["micro_batch_size"] = plan.micro_batch_size
            if len(precisions) > 1:
                memory["precision"] = plan.precision
            if chunk_auto and plan.loss_chunk_tokens:
                memory["loss_chunk_tokens"] = plan.loss_chunk_tokens
        return cfg.model_copy(update={
            "train": cfg.train.model_copy(update=train),
            "memory": cfg.memory.model_copy(update=memory)})

    if norm_auto and "bf16" not in precisions:  # the copies exist only under bf16 autocast
        cfg, norm_auto = resolved(None, False), False
        if not searching:
            return cfg
    try:
        budget = device_memory_bytes(cfg)
    except ConfigError:
        if searching:
            raise
        log.info("auto: bf16 norm inputs on (this machine cannot read the GPU's memory and "
                 "memory.device_memory is unset; on fits more)")
        return resolved(None, True)
    modes = AC_MODES if ac_auto else (cfg.memory.activation_checkpointing,)
    fixed = None if micro_auto else cfg.train.micro_batch()
    # The loader's cost per batch weighs micro-batches against each other: measured only when
    # they are chosen between.
    speed = speed_model(cfg, measure_data=searching)

    probes: dict[tuple[str, bool], tuple[StaticBytes, list[ActivationProfile]]] = {}

    def plans_with(precision: str, norm: bool, model: SpeedModel = speed) -> list[PlanRow]:
        """The fitting plans, fastest first (one per checkpointing mode)."""
        if (precision, norm) not in probes:
            probes[precision, norm] = probe_config(
                cfg.model_copy(update={"memory": cfg.memory.model_copy(
                    update={"bf16_norm_inputs": norm})}), [precision], modes, work=True)
        static, profiles = probes[precision, norm]
        return feasible_plans(static, profiles, cfg.train.global_batch_size, world, budget,
                              speed=model, micro_batch_size=fixed, choose_loss_chunk=chunk_auto)

    fallback_norm = cfg.memory.bf16_norm_inputs
    norms: dict[str, bool | str] = {}
    found: dict[str, list[PlanRow]] = {}
    for precision in precisions:
        if precision == "bf16" and norm_auto:
            without, with_ = plans_with("bf16", False), plans_with("bf16", True)
            on, why = choose_norm_inputs(without[0] if without else None,
                                         with_[0] if with_ else None,
                                         cfg.train.global_batch_size // world)
            fallback_norm = on
            log.info("auto: bf16 norm inputs %s (%s)", "on" if on else "off", why)
            norms["bf16"], found["bf16"] = on, with_ if on else without
        else:  # without bf16 an "auto" is off: the copies exist only under bf16 autocast
            norms[precision] = False if norm_auto else cfg.memory.bf16_norm_inputs
            found[precision] = plans_with(precision, norms[precision] is True)
    rows = sorted((row for plans in found.values() for row in plans),
                  key=lambda r: -r.tokens_per_s)
    if not rows:
        if searching:
            raise ConfigError(f"nothing fits {budget / 2**30:.1f} GiB per device with "
                              f"precision {' or '.join(precisions)} (memory.device_memory); "
                              "try FSDP, a shorter sequence or a smaller model")
        return resolved(None, fallback_norm)  # the run's own OOM handling has the last word
    compile_why = ""
    if speed.compiled and cfg.train.compile == "auto" and searching:
        # Each way's fastest plan: compiled (the model's fusion, GPU_COMPILED_SHARE) or eager.
        eager_model = dataclasses.replace(speed, compiled=False)
        eager = max((row for precision in found for row in plans_with(
            precision, norms[precision] is True, eager_model)), key=lambda r: r.tokens_per_s,
            default=None)
        compiles = eager is None or rows[0].tokens_per_s > eager.tokens_per_s
        if eager is not None:
            compile_why = (f"predicted {_tokens(rows[0])} compiled, {_tokens(eager)} eager, "
                           "each its fastest plan; compile time not counted")
            if not compiles:
                rows = [eager]
        log.info("auto: train.compile %s (%s)", "on" if compiles else "off", compile_why)
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(
            update={"compile": compiles})})
    plan, others = rows[0], rows[1:]
    runner_up = (f"; next: {others[0].precision}, checkpointing "
                 f"{others[0].activation_checkpointing}, micro-batch "
                 f"{others[0].micro_batch_size}, {_tokens(others[0])}") if others else ""
    loading = ""
    if speed.loader:
        data = speed.loader.seconds(plan.micro_batch_size) * plan.accumulation_steps
        loading = f", of which the data loader {data * 1e3:,.2f} ms"
    chunk = f", loss chunks of {plan.loss_chunk_tokens:,} tokens" \
        if chunk_auto and plan.loss_chunk_tokens else ""
    log.info("auto: precision %s, activation checkpointing %s, micro-batch %d x accumulation %d"
             "%s: predicted %s (%s; %.1f ms a step%s), the fastest of %d plans that fit%s; "
             "predicted peak %.2f GiB of %.2f GiB", plan.precision, plan.activation_checkpointing,
             plan.micro_batch_size, plan.accumulation_steps, chunk, _tokens(plan),
             speed.device.name, plan.step_seconds * 1e3, loading, len(rows), runner_up,
             plan.predicted_peak_bytes / 2**30, budget / 2**30)
    return resolved(plan, norms[plan.precision])
