"""The plans ``auto`` chooses between, and the rules that choose among them.

Pure functions over the planner's figures (static bytes, activation profiles, ``plan_row``)
and its time model (``trainer.plan.speed``): which (precision, checkpointing, micro-batch, loss
chunk) keep the global batch and fit the device, fastest first
(``feasible_plans``); whether bf16 norm inputs pay (``choose_norm_inputs``); and ``auto``'s one
decision over a request's precisions, norm inputs and compile (``choose``). No config here:
``trainer.plan.auto`` reads a config into a ``Request``, and ``make gpu-check`` calls
``choose`` on a machine without the config's dependencies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.global_batch import micro_batch_candidates, per_rank_batch
from trainer.memory.loss import MIN_AUTO_LOSS_CHUNK_TOKENS, ChunkedLossShape
from trainer.plan.peak import PlanRow, plan_row
from trainer.plan.profile import ActivationProfile
from trainer.plan.speed import SpeedModel
from trainer.plan.static import StaticBytes

# The smallest micro-batch ``auto`` calls useful: below it, a plan with more recomputation (or
# bf16 norm copies) that reaches it is preferred.
MIN_MICRO_BATCH = 4
# Plans fill at most this share of the device: the allocator's rounding and caching, kernel
# workspaces and the CUDA context are not modelled.
HEADROOM = 0.9


def loss_chunk_candidates(profile: ActivationProfile, max_tokens: int) -> list[int]:
    """``memory.loss_chunk_tokens: auto`` with the time model: the chunks to choose from for a
    profile whose loss is chunked (none for a plain loss), powers of two from a quarter of the
    probed chunk (``auto_loss_chunk_tokens``, at least ``MIN_AUTO_LOSS_CHUNK_TOKENS``) up to
    16 times it, and none above the smallest that holds ``max_tokens`` (a micro-batch's: the
    probed chunk alone where even the smallest holds it)."""
    shape = profile.loss_shape
    if not isinstance(shape, ChunkedLossShape):
        return []
    chunk = max(MIN_AUTO_LOSS_CHUNK_TOKENS, shape.chunk_tokens // 4)
    if chunk >= max_tokens:  # every candidate holds a whole micro-batch: nothing to choose
        return [shape.chunk_tokens]
    found = []
    while chunk <= 16 * shape.chunk_tokens:
        found.append(chunk)
        if chunk >= max_tokens:
            break
        chunk *= 2
    return found


def feasible_plans(static: StaticBytes, profiles: list[ActivationProfile],
                   global_batch_size: int, data_ranks: int, device_memory_bytes: int,
                   headroom: float = HEADROOM, speed: SpeedModel | None = None,
                   micro_batch_size: int | None = None, choose_loss_chunk: bool = False
                   ) -> list[PlanRow]:
    """Every (precision, checkpointing, micro-batch) that keeps the global batch and fits.

    Micro-batches are the divisors of the per-rank batch (only ``micro_batch_size`` where one
    is given). Without a ``speed`` model, each profile keeps the largest micro-batch that fits
    ``headroom`` of the device, and rows are sorted by recompute cost, then by predicted peak.
    With one, each profile keeps its fastest fitting micro-batch, and rows are sorted by
    predicted tokens/s, fastest first; ``choose_loss_chunk`` (with a chunked loss): each
    micro-batch with its fastest fitting chunk (``loss_chunk_candidates``).
    """
    per_rank = per_rank_batch(global_batch_size, data_ranks)
    budget = int(device_memory_bytes * headroom)
    micros = [micro_batch_size] if micro_batch_size else micro_batch_candidates(per_rank)
    rows = []
    for profile in profiles:
        chunks: list[int | None] = [None]
        if choose_loss_chunk and speed is not None:
            chunks = [*loss_chunk_candidates(profile, max(micros) * profile.seq_len)] or [None]
        fitting = [row for row in (plan_row(static, profile, micro, per_rank // micro, speed,
                                            chunk)
                                   for micro in micros for chunk in chunks)
                   if row.predicted_peak_bytes <= budget]
        if fitting:
            rows.append(max(fitting, key=lambda r: r.tokens_per_s) if speed else fitting[0])
    if speed is not None:
        return sorted(rows, key=lambda r: -r.tokens_per_s)
    return sorted(rows, key=lambda r: (r.recompute_cost, r.predicted_peak_bytes))


def choose_norm_inputs(without: PlanRow | None, with_: PlanRow | None, per_rank: int,
                       min_micro_batch: int = MIN_MICRO_BATCH) -> tuple[bool, str]:
    """``memory.bf16_norm_inputs: auto``: whether the plan with bf16 norm inputs (``with_``)
    beats the one without (``without``; each the best plan that fits, None: nothing fits),
    and why, in words for the log.

    The bf16 copies save memory and cost time (5.5% of an eager GPT-2 step, measured on an
    H200). With both plans' tokens/s predicted (``trainer.plan.speed``), the faster wins.
    Without, they are on only when their bytes buy something: a plan that fits at all, less
    recomputation, or a useful micro-batch (at least ``min_micro_batch``) where the
    plan without them has none. Recomputation costs more than they do (a sixth of a step for
    selective checkpointing)."""
    if without is None:
        return True, "needed to fit" if with_ is not None else "nothing fits without them"
    if with_ is None:
        return False, "not needed"
    if with_.tokens_per_s and without.tokens_per_s:
        faster = with_.tokens_per_s > without.tokens_per_s
        return faster, (f"predicted {with_.tokens_per_s:,.0f} tokens/s with them "
                        f"(checkpointing {with_.activation_checkpointing}, micro-batch "
                        f"{with_.micro_batch_size}), {without.tokens_per_s:,.0f} without "
                        f"({without.activation_checkpointing}, {without.micro_batch_size})")
    if with_.recompute_cost < without.recompute_cost:
        return True, (f"checkpointing {with_.activation_checkpointing} fits with them, "
                      f"{without.activation_checkpointing} without")
    useful = min(min_micro_batch, per_rank)
    if without.micro_batch_size < useful <= with_.micro_batch_size:
        return True, (f"micro-batch {with_.micro_batch_size} fits with them, "
                      f"{without.micro_batch_size} without")
    return False, (f"not needed: checkpointing {without.activation_checkpointing}, micro-batch "
                   f"{without.micro_batch_size} fits without them")


# One (precision, bf16 norm inputs) pair's planner inputs: one rank's static bytes and an
# activation profile per checkpointing mode, with the step's work recorded.
Probe = Callable[[str, bool], tuple[StaticBytes, list[ActivationProfile]]]


@dataclass(frozen=True)
class Request:
    """What ``auto`` is asked to decide, with no config: ``trainer.plan.auto`` reads one from
    a config, benches and gpu-check set one up for their shapes.

    ``precisions``: the candidates, the device's own first. ``micro_batch_size`` None: every
    divisor of the per-rank batch. ``norm_inputs`` ``"auto"``: with and without bf16 norm
    inputs, under bf16. ``weigh_compile``: the speed model's compiled plans against eager ones
    (``train.compile: auto`` on a GPU)."""

    global_batch_size: int
    data_ranks: int  # the ranks the global batch divides over (under a sequence split, groups)
    device_memory_bytes: int
    precisions: tuple[str, ...]
    ac_modes: tuple[str, ...]
    micro_batch_size: int | None = None
    norm_inputs: bool | str = False
    choose_loss_chunk: bool = False
    weigh_compile: bool = False
    headroom: float = HEADROOM


@dataclass(frozen=True)
class Decision:
    """``choose``'s answer: the plan (None: nothing fits), every fitting plan fastest first
    (one per precision and checkpointing mode), the bf16 norm inputs each precision was planned
    with, whether to compile (None: not weighed), and why, as the log's lines."""

    plan: PlanRow | None
    rows: list[PlanRow]
    norm_inputs: dict[str, bool | str]
    compile: bool | None
    why: list[str] = field(default_factory=list)

    @property
    def runner_up(self) -> PlanRow | None:
        return self.rows[1] if len(self.rows) > 1 and self.rows[0] is self.plan else None


def _tokens(row: PlanRow) -> str:
    return f"{row.tokens_per_s:,.0f} tokens/s"


def choose(request: Request, probe: Probe, speed: SpeedModel) -> Decision:
    """``auto``'s one decision: the fitting plan with the most predicted tokens/s over the
    request's precisions, checkpointing modes, micro-batches and (``choose_loss_chunk``) loss
    chunks; with bf16 norm inputs where they pay (``norm_inputs: "auto"``), compiled where that
    is faster (``weigh_compile``). ``train`` (``trainer.plan.auto.resolve_auto``),
    ``memtrain plan``, ``make bench-plan`` and ``make gpu-check`` all take their ``auto``
    from here. Each pair's probe runs once."""
    probes: dict[tuple[str, bool], tuple[StaticBytes, list[ActivationProfile]]] = {}

    def plans_with(precision: str, norm: bool, model: SpeedModel = speed) -> list[PlanRow]:
        if (precision, norm) not in probes:
            probes[precision, norm] = probe(precision, norm)
        static, profiles = probes[precision, norm]
        return feasible_plans(static, profiles, request.global_batch_size, request.data_ranks,
                              request.device_memory_bytes, request.headroom, speed=model,
                              micro_batch_size=request.micro_batch_size,
                              choose_loss_chunk=request.choose_loss_chunk)

    why: list[str] = []
    norms: dict[str, bool | str] = {}
    found: dict[str, list[PlanRow]] = {}
    for precision in request.precisions:
        if precision == "bf16" and request.norm_inputs == "auto":
            without, with_ = plans_with("bf16", False), plans_with("bf16", True)
            on, reason = choose_norm_inputs(without[0] if without else None,
                                            with_[0] if with_ else None,
                                            request.global_batch_size // request.data_ranks)
            why.append(f"auto: bf16 norm inputs {'on' if on else 'off'} ({reason})")
            norms["bf16"], found["bf16"] = on, with_ if on else without
        else:  # without bf16 an "auto" is off: the copies exist only under bf16 autocast
            norms[precision] = False if request.norm_inputs == "auto" else request.norm_inputs
            found[precision] = plans_with(precision, norms[precision] is True)
    rows = sorted((row for plans in found.values() for row in plans),
                  key=lambda r: -r.tokens_per_s)
    if not rows:
        return Decision(None, [], norms, None, why)
    compiles = None
    if speed.compiled and request.weigh_compile:
        # Each way's fastest plan: compiled (the model's fusion, GPU_COMPILED_SHARE) or eager.
        eager_model = dataclasses.replace(speed, compiled=False)
        eager = max((row for precision in found for row in plans_with(
            precision, norms[precision] is True, eager_model)), key=lambda r: r.tokens_per_s,
            default=None)
        compiles = eager is None or rows[0].tokens_per_s > eager.tokens_per_s
        reason = ""
        if eager is not None:
            reason = (f"predicted {_tokens(rows[0])} compiled, {_tokens(eager)} eager, each "
                      "its fastest plan; compile time not counted")
            if not compiles:
                rows = [eager]
        why.append(f"auto: train.compile {'on' if compiles else 'off'} ({reason})")
    decision = Decision(rows[0], rows, norms, compiles, why)
    why.append(_plan_line(decision, request, speed))
    return decision


def _plan_line(decision: Decision, request: Request, speed: SpeedModel) -> str:
    """The decision in one line: the plan, its predicted speed and peak, the runner-up."""
    plan, other = decision.plan, decision.runner_up
    assert plan is not None
    runner_up = (f"; next: {other.precision}, checkpointing {other.activation_checkpointing}, "
                 f"micro-batch {other.micro_batch_size}, {_tokens(other)}") if other else ""
    loading = ""
    if speed.loader:
        data = speed.loader.seconds(plan.micro_batch_size) * plan.accumulation_steps
        loading = f", of which the data loader {data * 1e3:,.2f} ms"
    chunk = f", loss chunks of {plan.loss_chunk_tokens:,} tokens" \
        if request.choose_loss_chunk and plan.loss_chunk_tokens else ""
    return (f"auto: precision {plan.precision}, activation checkpointing "
            f"{plan.activation_checkpointing}, micro-batch {plan.micro_batch_size} x "
            f"accumulation {plan.accumulation_steps}{chunk}: predicted {_tokens(plan)} "
            f"({speed.device.name}; {plan.step_seconds * 1e3:.1f} ms a step{loading}), the "
            f"fastest of {len(decision.rows)} plans that fit{runner_up}; predicted peak "
            f"{plan.predicted_peak_bytes / 2**30:.2f} GiB of "
            f"{request.device_memory_bytes / 2**30:.2f} GiB")
