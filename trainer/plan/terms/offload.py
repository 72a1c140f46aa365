"""Activation offload (``memory.activation_offload``): the saved activations it moves to host
memory (``trainer.memory.offload``), counted by the probe through the offload's own hooks.

They are part of what the forward saves, so the device's activations are the saved bytes less
these; they are the row's host bytes instead, and the time model copies each of them over the
host link and back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostActivations:
    """What activation offload holds in host memory, as ``fixed + per_sample * batch`` (0 each
    without offload)."""

    per_sample_bytes: int = 0
    fixed_bytes: int = 0

    def host_bytes(self, batch: int) -> int:
        return self.fixed_bytes + self.per_sample_bytes * batch
