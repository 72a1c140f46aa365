"""The planner's pick over one set of profiles, as the tests judge ``auto`` against it."""

from __future__ import annotations

from trainer.plan.candidates import HEADROOM, MIN_MICRO_BATCH, feasible_plans
from trainer.plan.peak import PlanRow
from trainer.plan.profile import ActivationProfile
from trainer.plan.speed import SpeedModel
from trainer.plan.static import StaticBytes


def choose_plan(static: StaticBytes, profiles: list[ActivationProfile], global_batch_size: int,
                data_ranks: int, device_memory_bytes: int, micro_batch_size: int | None = None,
                min_micro_batch: int = MIN_MICRO_BATCH, headroom: float = HEADROOM,
                speed: SpeedModel | None = None, choose_loss_chunk: bool = False
                ) -> PlanRow | None:
    """One set of profiles' pick; None when nothing fits. ``auto`` itself is ``choose``
    (``trainer.plan.candidates``), which searches a request's precisions, norm inputs and
    compile on top of ``feasible_plans``; this is the rule before it, kept by the tests.

    ``micro_batch_size`` None means auto: every divisor of the per-rank batch is a candidate.
    With a ``speed`` model (and profiles with their work recorded): the fitting row with the
    most predicted tokens/s, ``choose``'s rule. Without: the rule from before the time model,
    which the tests keep as the baseline it is judged against: the least recomputation,
    provided its micro-batch is at least ``min_micro_batch`` (or the whole per-rank batch, if
    smaller); otherwise the row with the largest micro-batch.
    """
    rows = feasible_plans(static, profiles, global_batch_size, data_ranks, device_memory_bytes,
                          headroom, speed, micro_batch_size, choose_loss_chunk)
    if not rows:
        return None
    if speed is not None and all(row.tokens_per_s for row in rows):
        return rows[0]
    per_rank = global_batch_size // data_ranks
    useful = [r for r in rows if r.micro_batch_size >= min(min_micro_batch, per_rank)]
    return useful[0] if useful else max(rows, key=lambda r: r.micro_batch_size)
