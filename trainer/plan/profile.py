"""What the probe measured of one (precision, checkpointing) choice: the bytes a forward saves
for backward, as ``fixed + per_sample * batch``, and each feature's figures, grouped by the
feature whose term plans them (``trainer.plan.terms``).

The probe (``trainer.plan.probe``) fills it; the peak formula (``trainer.plan.peak``) reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.memory.loss import LossShape
from trainer.plan.static import ParameterBytes
from trainer.plan.terms.blocks import BlockBackward
from trainer.plan.terms.checkpointing import Recompute
from trainer.plan.terms.offload import HostActivations
from trainer.plan.terms.sequence import AllToAlls
from trainer.plan.work import StepWork


@dataclass(frozen=True, kw_only=True)
class ActivationProfile:
    """Saved-for-backward bytes of one forward, ``fixed + per_sample * batch``, with what each
    feature adds beside them."""

    precision: str
    activation_checkpointing: str
    per_sample_bytes: int
    fixed_bytes: int
    seq_len: int = 0  # one rank's tokens of a row
    # The loss's shapes, as the probe recorded them (None: the model has no recorded loss).
    loss_shape: LossShape | None = None
    parameters: ParameterBytes = dataclasses.field(default_factory=ParameterBytes)
    block: BlockBackward = dataclasses.field(default_factory=BlockBackward)
    recompute: Recompute = dataclasses.field(default_factory=Recompute)
    # memory.activation_offload: the saved bytes above that go to host memory.
    offload: HostActivations = dataclasses.field(default_factory=HostActivations)
    all_to_alls: AllToAlls = dataclasses.field(default_factory=AllToAlls)  # parallel.sequence
    # CPU without native bf16: what its emulated matrix products allocate beyond the fp32
    # kernels' own workspace, per sample (``trainer.plan.emulation``; 0 elsewhere).
    emulation_workspace_per_sample_bytes: int = 0
    # The step's operators, for the time model (``trainer.plan.speed``; None: not recorded).
    work: StepWork | None = dataclasses.field(default=None, compare=False, repr=False)

    def saved_bytes(self, batch: int) -> int:
        """Everything the forward saves for backward, on the device or offloaded."""
        return self.fixed_bytes + self.per_sample_bytes * batch
