"""``parallel.strategy: auto`` and ``parallel.fsdp``'s ``auto`` fields, resolved before the rest
of ``auto``: ``resolve_auto`` is the whole of it, what ``train`` runs.

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
from typing import Any

from monitoring.units import format_bytes
from trainer.config import Config, ConfigError
from trainer.plan.candidates import Probe, choose
from trainer.plan.choose import (
    config_probe,
    config_static,
    decide,
    device_memory_bytes,
    request_from,
    searches,
    speed_model,
)
from trainer.plan.peak import ActivationProfile, StaticBytes
from trainer.plan.rescue import rescue_tiers

log = logging.getLogger("memtrain")


def _with(cfg: Config, strategy: str, **fsdp: Any) -> Config:
    parallel = cfg.parallel.model_copy(update={
        "strategy": strategy, "fsdp": cfg.parallel.fsdp.model_copy(update=fsdp)})
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
            candidates.append(_with(cfg, "ddp", reshard_after_forward=reshards[0],
                                    offload=offloads[0]))
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
    if not fitting and rescuable(cfg):
        # The memory strategies auto may add are planned on the candidate holding least.
        least, _ = min(zip(candidates, statics, strict=True), key=lambda pair: (
            pair[1].device_static, pair[0].parallel.fsdp.reshard_after_forward is False))
        log.info("auto: nothing fits %s per device under %s with the memory strategies as "
                 "configured; the strategies auto may add are planned on the candidate holding "
                 "least: %s",
                 format_bytes(budget), " or ".join(describe(c) for c, _ in decisions),
                 describe(least))
        return least
    if not fitting:
        raise ConfigError(f"nothing fits {format_bytes(budget)} per device under "
                          + " or ".join(describe(c) for c, _ in decisions)
                          + " (memory.device_memory); try more workers, a shorter sequence or "
                            "a smaller model")
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
    then micro-batch, checkpointing, precision and the rest (``trainer.plan.choose.decide``):
    what ``train`` runs (``trainer.launch.prepare``)."""
    return decide(decide_sharding(cfg))[0]
