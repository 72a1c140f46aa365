"""The plans ``auto`` chooses between, and the rules that choose among them.

Pure functions over the planner's figures (``trainer.plan.peak``: static bytes, activation
profiles, ``plan_row``) and its time model (``trainer.plan.speed``): which (precision,
checkpointing, micro-batch, loss chunk) keep the global batch and fit the device, fastest first
(``feasible_plans``); the one ``auto`` takes (``choose_plan``); whether bf16 norm inputs pay
(``choose_norm_inputs``). No config here: ``trainer.plan.choose`` reads a config into these
figures, and ``make gpu-check`` calls them on a machine without the config's dependencies.
"""

from __future__ import annotations

from trainer.memory.loss import MIN_AUTO_LOSS_CHUNK_TOKENS, ChunkedLossShape
from trainer.plan.peak import ActivationProfile, PlanRow, StaticBytes, plan_row
from trainer.plan.speed import SpeedModel

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
                   global_batch_size: int, world_size: int, device_memory_bytes: int,
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
    per_rank, remainder = divmod(global_batch_size, world_size)
    if remainder:
        raise ValueError(f"global batch {global_batch_size} is not divisible by world size "
                         f"{world_size}")
    budget = int(device_memory_bytes * headroom)
    micros = [micro_batch_size] if micro_batch_size else \
        sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True)
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


def choose_plan(static: StaticBytes, profiles: list[ActivationProfile], global_batch_size: int,
                world_size: int, device_memory_bytes: int, micro_batch_size: int | None = None,
                min_micro_batch: int = MIN_MICRO_BATCH, headroom: float = HEADROOM,
                speed: SpeedModel | None = None, choose_loss_chunk: bool = False
                ) -> PlanRow | None:
    """The plan for ``auto``; None when nothing fits.

    ``micro_batch_size`` None means auto: every divisor of the per-rank batch is a candidate.
    With a ``speed`` model (and profiles with their work recorded): the fitting row with the
    most predicted tokens/s. Without: the least recomputation, provided its
    micro-batch is at least ``min_micro_batch`` (or the whole per-rank batch, if smaller);
    otherwise the row with the largest micro-batch.
    """
    rows = feasible_plans(static, profiles, global_batch_size, world_size, device_memory_bytes,
                          headroom, speed, micro_batch_size, choose_loss_chunk)
    if not rows:
        return None
    if speed is not None and all(row.tokens_per_s for row in rows):
        return rows[0]
    per_rank = global_batch_size // world_size
    useful = [r for r in rows if r.micro_batch_size >= min(min_micro_batch, per_rank)]
    return useful[0] if useful else max(rows, key=lambda r: r.micro_batch_size)


def choose_norm_inputs(without: PlanRow | None, with_: PlanRow | None, per_rank: int,
                       min_micro_batch: int = MIN_MICRO_BATCH) -> tuple[bool, str]:
    """``memory.bf16_norm_inputs: auto``: whether the plan with bf16 norm inputs (``with_``)
    beats the one without (``without``; each the best plan that fits, None: nothing fits),
    and why, in words for the log.

    The bf16 copies save memory and cost time (5.5% of an eager GPT-2 step, measured on an
    H200). With both plans' tokens/s predicted (``trainer.plan.speed``), the faster wins.
    Without, they are on only when their bytes buy something: a plan that fits at all, less
    recomputation, or a useful micro-batch (``choose_plan``'s ``min_micro_batch``) where the
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
