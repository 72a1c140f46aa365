"""The peak formula's terms, one module per feature: what the feature adds to (or takes from)
one rank's device and host bytes at the moments ``trainer.plan.peak.plan_row`` sums.

Each term is a small frozen dataclass of what the probe measured for the feature (a field of
``trainer.plan.profile.ActivationProfile``) with the bytes it makes at a micro-batch, or a
function of the static bytes: a feature's planning is read in its own module, and
``plan_row`` is a sum of these names.
"""
