"""Every ``auto`` of a config, resolved in the driver before launch: ``resolve_auto`` is the whole
of it, what ``train`` runs: the strategy first, then the rest, with the memory planner and its
time model.

``decide`` replaces ``train.micro_batch_size: auto``, ``memory.activation_checkpointing:
auto`` and ``memory.bf16_norm_inputs: auto`` (and ``memory.precision: auto`` and
``memory.loss_chunk_tokens: auto`` where it searches micro-batch or checkpointing) by the plan
with the most predicted tokens/s among those that fit one device's memory
(``memory.device_memory``, or what the driver can read): the planner's peak
(``trainer.plan.peak``), step time (``trainer.plan.speed``) and rules
(``trainer.plan.candidates``), once the strategy is concrete. ``probe_config`` and
``speed_model`` give the planner its inputs for a config; ``memtrain plan`` uses them too.

``parallel.strategy: auto`` and ``parallel.fsdp``'s ``auto`` fields, resolved before the rest
of ``auto`` (``decide_sharding``).

Each candidate (DDP; FSDP with ``reshard_after_forward`` true or false; FSDP with CPU offload)
is planned as ``choose`` plans any config: its fastest fitting plan, over whatever else is
``auto``. The candidates are taken in tiers, each only where nothing in the tiers before it
fits: DDP (every rank holds the model, nothing is gathered), then FSDP on the device, then FSDP
with CPU offload (its host-side optimizer step is not in the time model). Within a tier the most
predicted tokens/s wins (blocks kept after forward gather once fewer, where they fit). The
activation probes are shared: only the static bytes and the collectives differ between
candidates. Offload is a candidate on a GPU only: on a CPU run host and device are the same
memory, so it frees nothing. One log line says what was chosen and what each other candidate
would give. Where no candidate fits and ``decide`` may add memory strategies
(``trainer.plan.rescue``), the candidate holding least is kept for it to plan them on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from monitoring.units import format_bytes, parse_bytes
from trainer.batches import DOCUMENT_IDS, dataset_columns
from trainer.config import Config, ConfigError, FsdpConfig
from trainer.memory.precision import resolve_precision
from trainer.models.build import MemoryTransforms, build_model, model_factory
from trainer.models.hf import model_vocab_size
from trainer.oom import oom_recovery_on
from trainer.parallel.choice import runs_fp16
from trainer.parallel.fsdp import FsdpSettings
from trainer.plan.calibrate import cpu_speed
from trainer.plan.candidates import Decision, Probe, Request, choose
from trainer.plan.devices import named_gpu_speed
from trainer.plan.probe import AC_MODES, profile_all
from trainer.plan.profile import ActivationProfile
from trainer.plan.rescue import (
    nf4_would_fit,
    rescue,
    rescue_tiers,
    sequence_would_fit,
    tried_in_words,
)
from trainer.plan.speed import LoaderCost, SpeedModel, measure_loader
from trainer.plan.static import StaticBytes, static_bytes

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
    return resolve_precision("auto", device, runs_fp16(cfg)).name


def probe_config(cfg: Config, precisions: Iterable[str], ac_modes: Iterable[str],
                 work: bool = False) -> tuple[StaticBytes, list[ActivationProfile]]:
    """The planner's inputs for ``cfg``: one rank's static bytes and an activation profile per
    (precision, checkpointing) pair, probed on CPU for the configured device type (``work``:
    with the step's operators recorded, for ``speed_model``)."""
    # Shapes are all a probe needs: an hf: directory's weights are never read here (on a
    # cluster this process is the driver, on the head node).
    profiles = profile_all(model_factory(cfg.model, load_weights=False),
                           MemoryTransforms.of(cfg.memory),
                           cfg.model.seq_len,
                           model_vocab_size(cfg.model.name, cfg.model.vocab_size), precisions,
                           ac_modes,
                           target="cuda" if cfg.parallel.use_gpu else "cpu", work=work,
                           packed=packed_dataset(cfg), sequence=cfg.parallel.sequence)
    return config_static(cfg), profiles


def data_ranks(cfg: Config) -> int:
    """The ranks the global batch divides over: the workers, or under ``parallel.sequence``
    their sequence groups (each group's ranks share its rows)."""
    return cfg.parallel.data_workers(cfg.parallel.workers)


def packed_dataset(cfg: Config) -> bool:
    """Whether ``data.path`` has packed documents (``trainer.batches``), whose masks the probe
    then carries; False where this machine cannot read it (the run checks it again)."""
    try:
        return DOCUMENT_IDS in dataset_columns(cfg.data.path, cfg.data.column)
    except (OSError, ValueError):
        return False


def config_static(cfg: Config) -> StaticBytes:
    """One rank's parameters, gradients and AdamW state under ``cfg``'s strategy and
    ``parallel.fsdp`` (counted on the meta device: shapes, dtypes and which parameters train,
    no memory, no initialisation, no weights read; PEFT's adapters cannot be injected into a
    fake-tensor model, whose parameters it moves)."""
    transforms = MemoryTransforms.of(cfg.memory).replace(activation_checkpointing="none")
    fsdp = FsdpSettings.of(cfg, planned_precision(cfg), cfg.parallel.workers) \
        if cfg.parallel.strategy == "fsdp" else None
    with torch.device("meta"):
        plain = build_model(model_factory(cfg.model, load_weights=False), transforms)
        return static_bytes(plain, cfg.parallel.strategy, cfg.parallel.workers, fsdp,
                            cfg.memory.optimizer_states, cfg.memory.optimizer_in_backward,
                            "cuda" if cfg.parallel.use_gpu else "cpu")


def loader_cost(cfg: Config) -> LoaderCost | None:
    """The data loader's cost on ``cfg``'s dataset, measured here (about a second): rank 0's
    share at the per-rank batch (``trainer.plan.speed.measure_loader``); None, said in the
    log, where this machine cannot read the dataset (the run checks it again)."""
    data = cfg.data
    try:
        cost = measure_loader(data.path, data.column, data_ranks(cfg),
                              cfg.train.global_batch_size // data_ranks(cfg),
                              cfg.run.seed, data.shuffle, data.shuffle_window)
    except (OSError, ValueError) as err:  # DatasetError is a ValueError
        log.info("planner: the data loader's cost is not in the time model (%s cannot be "
                 "read here: %s)", data.path, str(err).splitlines()[0])
        return None
    log.info("planner: data loader %s (%s)", cost.source, data.path)
    return cost


def speed_model(cfg: Config, gpu: str | None = None, measure_data: bool = False
                ) -> SpeedModel:
    """The time model for ``cfg``'s device: this CPU, calibrated
    (``trainer.plan.calibrate.cpu_speed``, cached), or a GPU's peak figures: ``gpu`` by name,
    else the driver's own GPU, else an H200's (said in the log); compiled where the loop
    compiles (``Config.compiles_model``: the compiled step is modelled on GPUs only).
    ``measure_data``: with the data loader's cost on the configured dataset
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
                      compiled=cfg.parallel.use_gpu and cfg.compiles_model("cuda"))


def precision_candidates(cfg: Config) -> list[str]:
    """``memory.precision: auto``: the precision ``auto`` resolves to on this device, and the
    other of fp32 and the low precision, for the time model to choose between."""
    planned = planned_precision(cfg)
    if cfg.memory.precision != "auto" or bf16_weights(cfg):
        return [planned]
    return [planned, "bf16" if planned == "fp32" else "fp32"]


def bf16_weights(cfg: Config) -> bool:
    """Whether weights are stored below fp32 (``ModelConfig.weights_dtype``), which compute
    only in bf16: no other precision is a candidate."""
    return cfg.model.weights_dtype()[1] != "fp32"


def searches(cfg: Config) -> bool:
    """Whether ``auto`` plans ``cfg``'s shape of step: its micro-batch or its checkpointing is
    ``auto`` (the precision, loss chunk and compile are then chosen with them)."""
    return cfg.train.micro_batch_size == "auto" or cfg.memory.activation_checkpointing == "auto"


def request_from(cfg: Config, budget: int) -> Request:
    """The decision ``cfg``'s ``auto`` fields ask for, on a device of ``budget`` bytes: every
    checkpointing mode where it is ``auto``, every micro-batch where that is, the precision
    candidates (``precision_candidates``) where either is searched."""
    micro_auto = cfg.train.micro_batch_size == "auto"
    ac_auto = cfg.memory.activation_checkpointing == "auto"
    searching = searches(cfg)
    return Request(
        global_batch_size=cfg.train.global_batch_size, data_ranks=data_ranks(cfg),
        device_memory_bytes=budget,
        precisions=tuple(precision_candidates(cfg) if searching else [planned_precision(cfg)]),
        ac_modes=AC_MODES if ac_auto else (cfg.memory.activation_checkpointing,),
        micro_batch_size=None if micro_auto else cfg.train.micro_batch(),
        norm_inputs=cfg.memory.bf16_norm_inputs,
        # The loss's chunk is chosen with the rest where it is "auto" and the model chunks it.
        choose_loss_chunk=searching and cfg.memory.loss_chunk_tokens == "auto",
        weigh_compile=searching and cfg.train.compile == "auto")


def config_probe(cfg: Config, ac_modes: Iterable[str]) -> Probe:
    """``choose``'s probe for ``cfg``: its model at one precision, bf16 norm inputs on or off,
    over ``ac_modes``, with the step's work recorded."""
    def probe(precision: str, norm: bool) -> tuple[StaticBytes, list[ActivationProfile]]:
        with_norm = cfg.model_copy(update={"memory": cfg.memory.model_copy(
            update={"bf16_norm_inputs": norm})})
        return probe_config(with_norm, [precision], ac_modes, work=True)

    return probe


def decide(cfg: Config, speed: SpeedModel | None = None, probe: Probe | None = None
           ) -> tuple[Config, Decision | None]:
    """``cfg`` with ``micro_batch_size: auto``, ``activation_checkpointing: auto`` and
    ``bf16_norm_inputs: auto`` (and ``precision``, ``loss_chunk_tokens`` and, on a GPU,
    ``train.compile`` with either of the first two) resolved by ``choose``, with its
    ``Decision`` (None where nothing was planned); configs without ``auto`` pass unchanged. The
    decision's lines go to the log. Where nothing fits as configured, the strategies ``auto``
    may add (``rescued``). ``speed``: the time model (default ``speed_model(cfg)``,
    measuring the data loader where a micro-batch or checkpointing mode is chosen); ``probe``:
    the planner's inputs (default ``config_probe``; ``memtrain plan`` passes the profiles it
    has already probed)."""
    searching = searches(cfg)
    norm_auto = cfg.memory.bf16_norm_inputs == "auto"
    if not (searching or norm_auto):
        return cfg, None
    cfg.train.per_rank_batch(data_ranks(cfg), cfg.parallel.sequence)
    if norm_auto and not searching and planned_precision(cfg) != "bf16":
        # the copies exist only under bf16 autocast: nothing to plan
        return resolved(cfg, None, False), None
    try:
        budget = device_memory_bytes(cfg)
    except ConfigError:
        if searching:
            raise
        log.info("auto: bf16 norm inputs on (this machine cannot read the GPU's memory and "
                 "memory.device_memory is unset; on fits more)")
        return resolved(cfg, None, True), None
    request = request_from(cfg, budget)
    # The loader's cost per batch weighs micro-batches against each other: measured only when
    # they are chosen between.
    speed = speed or speed_model(cfg, measure_data=searching)
    decision = choose(request, probe or config_probe(cfg, request.ac_modes), speed)
    for line in decision.why:
        log.info("%s", line)
    if decision.plan is None and searching:
        cfg, request, decision = rescued(cfg, request, budget, speed)
    if decision.plan is None:
        # Only the norm inputs were asked, and planned under bf16 (other precisions returned
        # above): the run's own OOM handling has the last word.
        return resolved(cfg, None, decision.norm_inputs["bf16"]), decision
    return resolved(cfg, decision, decision.norm_inputs[decision.plan.precision],
                    request.choose_loss_chunk, len(request.precisions) > 1), decision


def rescued(cfg: Config, request: Request, budget: int, speed: SpeedModel
            ) -> tuple[Config, Request, Decision]:
    """Nothing fits with ``cfg``'s memory strategies: the ones ``auto`` may add
    (``trainer.plan.rescue``), said in the log; a ConfigError naming what was tried where none
    fits either."""
    profiles: dict[tuple[str, int, str, bool], list[ActivationProfile]] = {}

    def plan_candidate(candidate: Config) -> tuple[Request, Decision]:
        wanted = request_from(candidate, budget)
        probe_profiles, static = config_probe(candidate, wanted.ac_modes), config_static(candidate)

        def probe(precision: str, norm: bool) -> tuple[StaticBytes, list[ActivationProfile]]:
            key = (candidate.memory.activation_offload, candidate.parallel.sequence, precision,
                   norm)
            if key not in profiles:
                profiles[key] = probe_profiles(precision, norm)[1]
            return static, profiles[key]

        return wanted, choose(wanted, probe, speed)

    found, tried = rescue(cfg, plan_candidate)
    if found is None:
        also = f"; nor with {tried_in_words(tried)}" if tried else ""
        raise ConfigError(f"nothing fits {format_bytes(budget)} per device with "
                          f"precision {' or '.join(request.precisions)} "
                          f"(memory.device_memory){also}{nf4_would_fit(cfg, plan_candidate)}"
                          f"{sequence_would_fit(cfg, plan_candidate)}; try "
                          f"{'more workers' if cfg.parallel.strategy == 'fsdp' else 'FSDP'}, a "
                          "shorter sequence or a smaller model")
    plan = found.decision.plan
    assert plan is not None
    kept = found.cfg.memory.optimizer_states == cfg.memory.optimizer_states
    log.info("auto: nothing fits %s per device with the memory strategies as configured; "
             "added %s: predicted %s tokens/s, the fastest of %d candidates %s (auto adds "
             "only what the config leaves unset)", format_bytes(budget), found.added,
             f"{plan.tokens_per_s:,.0f}", found.tier_size,
             "that keep the arithmetic" if kept else
             f"with {found.cfg.memory.optimizer_states} states (nothing that keeps the "
             "arithmetic fits)")
    for line in found.decision.why:
        log.info("%s", line)
    return found.cfg, found.request, found.decision


def resolved(cfg: Config, decision: Decision | None, norm: bool | str,
             chunk: bool = False, precision: bool = False) -> Config:
    """``cfg`` with bf16 norm inputs ``norm`` and the decision's plan: its checkpointing and
    micro-batch, its loss chunk (``chunk``), precision (``precision``) and compile choice."""
    memory: dict[str, Any] = {"bf16_norm_inputs": norm}
    train: dict[str, Any] = {}
    plan = decision.plan if decision is not None else None
    if plan is not None:
        memory["activation_checkpointing"] = plan.activation_checkpointing
        train["micro_batch_size"] = plan.micro_batch_size
        if precision:
            memory["precision"] = plan.precision
        if chunk and plan.loss_chunk_tokens:
            memory["loss_chunk_tokens"] = plan.loss_chunk_tokens
    if decision is not None and decision.compile is not None:
        train["compile"] = decision.compile
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=train),
                                  "memory": cfg.memory.model_copy(update=memory)})


def _with(cfg: Config, strategy: str, **fsdp: Any) -> Config:
    # DDP takes parallel.fsdp's defaults: the config refuses FSDP settings under ddp, and the
    # workers validate the resolved config again.
    settings = cfg.parallel.fsdp.model_copy(update=fsdp) if strategy == "fsdp" else FsdpConfig()
    parallel = cfg.parallel.model_copy(update={"strategy": strategy, "fsdp": settings})
    return cfg.model_copy(update={"parallel": parallel})


def sharding_candidates(cfg: Config) -> list[Config]:
    """``cfg`` with each strategy and FSDP setting its ``auto`` fields allow, in the order ties
    go to (DDP first, offload last); ``[cfg]`` where none is ``auto``."""
    fsdp = cfg.parallel.fsdp
    strategies = [cfg.parallel.strategy]
    if cfg.parallel.strategy == "auto":  # fp16 does not run under FSDP; one rank shards nothing
        strategies = ["ddp"] if cfg.memory.precision == "fp16" or cfg.parallel.workers == 1 \
            else ["ddp", "fsdp"]
    reshards = [True, False] if fsdp.reshard_after_forward == "auto" \
        else [fsdp.reshard_after_forward]
    offloads = (["none", "cpu"] if cfg.parallel.use_gpu else ["none"]) \
        if fsdp.offload == "auto" else [fsdp.offload]
    candidates = []
    for strategy in strategies:
        if strategy == "ddp":
            candidates.append(_with(cfg, "ddp"))
            continue
        candidates += [_with(cfg, "fsdp", reshard_after_forward=reshard, offload=offload)
                       for offload in offloads for reshard in reshards]
    return candidates


def _tier(cfg: Config) -> int:
    """DDP first, then FSDP on the device, then FSDP with offload: each only where nothing
    before it fits."""
    if cfg.parallel.strategy != "fsdp":
        return 0
    return 2 if cfg.parallel.fsdp.offload == "cpu" else 1


def describe(cfg: Config) -> str:
    if cfg.parallel.strategy != "fsdp":
        return f"parallel.strategy {cfg.parallel.strategy}"
    fsdp = cfg.parallel.fsdp
    return (f"parallel.strategy fsdp (reshard_after_forward "
            f"{str(fsdp.reshard_after_forward).lower()}, offload {fsdp.offload})")


def decide_sharding(cfg: Config) -> Config:
    """``cfg`` with its strategy and FSDP settings concrete: the first tier (``_tier``) with a
    fitting candidate, and in it the candidate whose fastest fitting plan predicts the most
    tokens/s (``cfg`` itself where nothing is ``auto``). Raises ConfigError where no candidate
    fits."""
    candidates = sharding_candidates(cfg)
    if len(candidates) == 1:
        return candidates[0]
    budget = device_memory_bytes(cfg)
    # The activations and the speed are the same under every candidate (a row's own FSDP
    # settings time its collectives, ``plan_row``): probed once, each with its static bytes.
    request = request_from(candidates[0], budget)
    probe_profiles = config_probe(candidates[0], request.ac_modes)
    profiles: dict[tuple[str, bool], list[ActivationProfile]] = {}
    speed = speed_model(cfg)

    def probe_with(static: StaticBytes) -> Probe:
        def probe(precision: str, norm: bool) -> tuple[StaticBytes, list[ActivationProfile]]:
            if (precision, norm) not in profiles:
                profiles[precision, norm] = probe_profiles(precision, norm)[1]
            return static, profiles[precision, norm]
        return probe

    statics = [config_static(c) for c in candidates]
    decisions = [(c, choose(request_from(c, budget), probe_with(static), speed))
                 for c, static in zip(candidates, statics, strict=True)]
    fitting = [(c, d) for c, d in decisions if d.plan is not None]
    # The memory strategies auto may add, and the sequence split the refusal names, are planned
    # on the candidate holding least.
    least, _ = min(zip(candidates, statics, strict=True), key=lambda pair: (
        pair[1].device_static, pair[0].parallel.fsdp.reshard_after_forward is False))
    if not fitting and rescuable(cfg):
        log.info("auto: nothing fits %s per device under %s with the memory strategies as "
                 "configured; the strategies auto may add are planned on the candidate holding "
                 "least: %s",
                 format_bytes(budget), " or ".join(describe(c) for c, _ in decisions),
                 describe(least))
        return least
    if not fitting:
        def plan_candidate(candidate: Config) -> tuple[Request, Decision]:
            wanted = request_from(candidate, budget)
            return wanted, choose(wanted, config_probe(candidate, wanted.ac_modes), speed)

        split = sequence_would_fit(least, plan_candidate, f" under {describe(least)}")
        raise ConfigError(f"nothing fits {format_bytes(budget)} per device under "
                          + " or ".join(describe(c) for c, _ in decisions)
                          + f" (memory.device_memory){split}; try more workers, a shorter "
                            "sequence or a smaller model")
    tier = min(_tier(c) for c, _ in fitting)
    chosen, best = max(((c, d) for c, d in fitting if _tier(c) == tier),
                       key=lambda pair: pair[1].plan.tokens_per_s)  # type: ignore[union-attr]
    others = "; ".join(
        f"{describe(c)}: " + (f"{d.plan.tokens_per_s:,.0f} tokens/s" if d.plan is not None
                              else "does not fit")
        for c, d in decisions if c is not chosen)
    assert best.plan is not None
    log.info("auto: %s: predicted %s tokens/s at a peak of %s of %s per device (%s)",
             describe(chosen), f"{best.plan.tokens_per_s:,.0f}",
             format_bytes(best.plan.predicted_peak_bytes), format_bytes(budget), others)
    return chosen


def rescuable(cfg: Config) -> bool:
    """Whether ``decide`` would add memory strategies to ``cfg`` where nothing fits: it plans
    (micro-batch or checkpointing ``auto``) and some strategy's field is unset
    (``trainer.plan.rescue``)."""
    return searches(cfg) and bool(rescue_tiers(cfg))


def resolve_auto(cfg: Config) -> Config:
    """Every ``auto`` of ``cfg`` resolved: the strategy and FSDP settings (``decide_sharding``),
    then micro-batch, checkpointing, precision and the rest (``trainer.plan.auto.decide``):
    what ``train`` runs (``trainer.launch.prepare``)."""
    return decide(decide_sharding(cfg))[0]
