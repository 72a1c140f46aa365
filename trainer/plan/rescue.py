"""What ``auto`` adds when nothing fits with the memory strategies a config has: the optimizer
step in backward, activation offload and low-bit optimizer states, each only where the config
leaves its field unset (a field the config sets, to any value, is kept as set).

The candidates come in tiers, each tried only where nothing in the tiers before it fits:

1. the strategies that keep the arithmetic: the step in backward (where the config allows it:
   ``train.grad_clip`` 0, no fp16, no OOM retries; the micro-batch becomes the per-rank batch,
   as the step in backward needs one micro-batch a step), activation offload (``all``; on a GPU
   only: on a CPU host and device are the same memory, so it frees nothing), and both;
2. 8-bit AdamW states, alone and with each of the above;
3. 4-bit AdamW states, the same way.

Within a tier the most predicted tokens/s wins: the time model counts offload's copies over the
host link and the low-bit step's quantize and dequantize work (``trainer.plan.speed``). LoRA is
never added: it changes what is trained. Each candidate is planned as any config is
(``trainer.plan.auto.rescued``), the activations probed once per offload setting: the step in
backward and the state dtype change only the static bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monitoring.units import format_bytes
from trainer.config import Config, strategy_combinations
from trainer.global_batch import per_rank_batch
from trainer.memory.optimizers import MissingExtraError, torchao_optim
from trainer.plan.candidates import Decision, Request

log = logging.getLogger("memtrain")

# The memory fields the rescue may set (only where the config leaves them unset).
FIELDS = ("optimizer_in_backward", "activation_offload", "optimizer_states")


@dataclass(frozen=True)
class Rescue:
    """A candidate that fits: the config with the strategies added, the request it was planned
    with, and ``choose``'s decision (its ``plan`` is not None)."""

    cfg: Config
    request: Request
    decision: Decision
    tier_size: int  # how many candidates its tier had

    @property
    def added(self) -> str:
        return describe_added(self.cfg)


def describe_added(cfg: Config) -> str:
    """The rescue's strategies of ``cfg`` in words: ``memory.optimizer_states 8bit, ...``."""
    memory = cfg.memory
    parts = []
    if memory.optimizer_in_backward:
        parts.append("memory.optimizer_in_backward true")
    if memory.activation_offload != "none":
        parts.append(f"memory.activation_offload {memory.activation_offload}")
    if memory.optimizer_states != "fp32":
        parts.append(f"memory.optimizer_states {memory.optimizer_states}")
    return ", ".join(parts)


def tried_in_words(tried: list[Config]) -> str:
    """The strategies ``rescue`` tried, each field once with its values: ``memory.optimizer_in_
    backward true, memory.activation_offload all, memory.optimizer_states 8bit or 4bit``."""
    values: dict[str, list[str]] = {}
    for candidate in tried:
        for part in describe_added(candidate).split(", "):
            field, value = part.rsplit(" ", 1)
            if value not in values.setdefault(field, []):
                values[field].append(value)
    return ", ".join(f"{field} {' or '.join(found)}" for field, found in values.items())


def _with(cfg: Config, in_backward: bool, offload: str, states: str) -> Config | None:
    """``cfg`` with these strategies (and, for the step in backward, one micro-batch a step),
    or None where the config's other fields refuse the combination."""
    memory: dict[str, Any] = {"optimizer_in_backward": in_backward,
                              "activation_offload": offload, "optimizer_states": states}
    train: dict[str, Any] = {}
    if in_backward and cfg.train.micro_batch_size == "auto":
        try:
            parallel = cfg.parallel
            train["micro_batch_size"] = per_rank_batch(
                cfg.train.global_batch_size, parallel.data_workers(parallel.workers),
                parallel.sequence)
        except ValueError:
            return None
    candidate = cfg.model_copy(update={
        "memory": cfg.memory.model_copy(update=memory),
        "train": cfg.train.model_copy(update=train)})
    try:
        strategy_combinations(candidate)
    except ValueError:
        return None
    return candidate


def rescue_tiers(cfg: Config) -> list[list[Config]]:
    """The candidates ``cfg`` allows, tier by tier (see the module's docstring); empty where
    every field is set, or nothing the config allows would change."""
    memory, unset = cfg.memory, set(FIELDS) - cfg.memory.model_fields_set
    in_backwards = [False, True] if "optimizer_in_backward" in unset \
        else [memory.optimizer_in_backward]
    offloads = [memory.activation_offload]
    if "activation_offload" in unset and memory.activation_offload == "none" and \
            cfg.parallel.use_gpu:
        offloads = ["none", "all"]
    states: list[str] = []
    if "optimizer_states" in unset and memory.optimizer_states == "fp32":
        try:
            torchao_optim()
            states = ["8bit", "4bit"]
        except MissingExtraError:
            log.info("auto: low-bit optimizer states not considered (torchao is not "
                     "installed: pip install 'memtrain[strategies]')")
    tiers = []
    for state in [memory.optimizer_states, *states]:
        tier = [_with(cfg, in_backward, offload, state)
                for in_backward in in_backwards for offload in offloads]
        tiers.append([c for c in tier if c is not None and describe_added(c)
                      != describe_added(cfg)])
    return [tier for tier in tiers if tier]


def rescue(cfg: Config, plan: Callable[[Config], tuple[Request, Decision]]
           ) -> tuple[Rescue | None, list[Config]]:
    """The first tier's fastest fitting candidate for ``cfg``, each planned by ``plan`` (its
    request and ``choose``'s decision: ``trainer.plan.auto.rescued``), and every candidate
    planned (for the refusal's line where none fits)."""
    tried: list[Config] = []
    for tier in rescue_tiers(cfg):
        fitting = []
        for candidate in tier:
            request, decision = plan(candidate)
            tried.append(candidate)
            if decision.plan is not None:
                fitting.append(Rescue(candidate, request, decision, len(tier)))
        if fitting:
            return max(fitting, key=lambda r: r.decision.plan.tokens_per_s  # type: ignore
                       ), tried
    return None, tried


def nf4_would_fit(cfg: Config, plan_candidate: Callable[[Config], tuple[Request, Decision]]
                  ) -> str:
    """For a LoRA config whose base is not NF4 and that may run in bf16: whether
    ``model.lora.base_dtype: nf4`` would fit, as configured otherwise. ``auto`` never switches a
    base to NF4 itself (it changes the model's arithmetic); the refusal says so instead."""
    lora = cfg.model.lora
    if lora is None or lora.base_dtype == "nf4" or cfg.memory.precision in ("fp32", "fp16"):
        return ""
    candidate = cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"lora": lora.model_copy(update={"base_dtype": "nf4"})})})
    _, decision = plan_candidate(candidate)
    if decision.plan is None:
        return "; nor with model.lora.base_dtype nf4 (QLoRA)"
    return (f"; model.lora.base_dtype nf4 (QLoRA) would fit, at a predicted peak of "
            f"{format_bytes(decision.plan.predicted_peak_bytes)}")


def sequence_candidates(cfg: Config) -> list[int]:
    """The ``parallel.sequence`` degrees above ``cfg``'s that its workers and ``seq_len``
    divide into (the model's heads are checked where it is split), smallest first."""
    workers, seq_len = cfg.parallel.workers, cfg.model.seq_len
    return [size for size in range(cfg.parallel.sequence + 1, workers + 1)
            if workers % size == 0 and seq_len % size == 0
            and cfg.train.global_batch_size % (workers // size) == 0]


def sequence_would_fit(cfg: Config,
                       plan_candidate: Callable[[Config], tuple[Request, Decision]],
                       under: str = "") -> str:
    """Whether a higher ``parallel.sequence`` (each row split over more ranks) would fit, as
    configured otherwise (``under``: the strategy it was planned under, in words): the smallest
    that fits, or those tried. ``auto`` never splits rows itself: the degree changes which
    ranks share a row, so the config names it."""
    tried = []
    for size in sequence_candidates(cfg):
        candidate = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(
            update={"sequence": size})})
        try:
            _, decision = plan_candidate(candidate)
        except ValueError as err:  # heads that do not divide among the ranks
            log.info("auto: parallel.sequence %d not planned: %s", size, err)
            continue
        tried.append(str(size))
        if decision.plan is not None:
            return (f"; parallel.sequence {size} (each row split over {size} ranks) would "
                    f"fit{under}, at a predicted peak of "
                    f"{format_bytes(decision.plan.predicted_peak_bytes)} per rank")
    return f"; nor with parallel.sequence {' or '.join(tried)}{under}" if tried else ""
