"""One plan's predicted step peak per rank: the largest of a few moments of the step, each a sum
of named terms, on top of the parameters and AdamW's state (``PlanRow.peak_moment`` names it).

- the end of the forward pass: the saved activations, the loss's temporaries and, with
  activation checkpointing under autocast, autocast's cache of low-precision weight copies for
  the checkpointed blocks, kept until autocast exits but not saved;
- with the plain loss (``memory.loss_chunk_tokens: 0``), the loss's own backward, first: the
  saved activations (the fp32 log-probabilities among them) and the fp32 gradients of the
  log-probabilities and of the logits;
- the start of backward (the last block's): the saved activations, the gradients of the
  parameters outside the repeated blocks (the output head's come first), what the block's
  backward holds beside its activations (its incoming gradient and largest temporary) and,
  when the last block is checkpointed, that block's recomputed activations. What the head
  saved (the final norm's, the output layer's, the loss's) is counted though backward has
  freed it by then: for an ``hf:`` Llama it stands in for what a block's backward holds beyond
  the terms above (without it the planner was 8-9% under the allocator's record with full
  checkpointing), for memtrain's GPT on long rows with full checkpointing it over-counts, most
  where the plain loss saves its log-probabilities. Further down, each block frees at least
  as much activation memory as its parameters' gradients take;
- the end of backward (``backward end``): every gradient but the first block's, beside that
  block's activations (recomputed where checkpointed), its incoming gradient and its largest
  temporary; with the optimizer step in backward, a block's gradients, and the last step (a
  tied embedding's) alone;
- the optimizer step: every gradient, and AdamW's temporaries.

Beside these: what FSDP holds whole while it runs, a dequantized NF4 weight wherever a block
runs, ``parallel.sequence``'s all-to-all buffers while a block's backward runs, and on a CPU
whose bf16 is emulated its matrix products' buffers. Activation offload's saved bytes and FSDP's
CPU offload are the row's host bytes, not the device's. Each term is its feature's, in
``trainer.plan.terms``; the figures come from the model (``trainer.plan.static``) and the probe
(``trainer.plan.probe``). Gradients are not held during the forward pass: the loop zeroes them
with ``set_to_none=True``.

On CPU the whole formula is checked against the allocator's record of real steps
(``trainer.telemetry.diagnostics.cpu_peak_bytes``, ``tests/unit/test_planner.py``). The planner
does not model the CUDA allocator's rounding and caching, nor kernel workspaces; ``make
gpu-check`` measures how far the prediction is from the real CUDA peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from trainer.plan.profile import ActivationProfile
from trainer.plan.speed import SpeedModel, strategy_seconds
from trainer.plan.static import StaticBytes
from trainer.plan.terms.fsdp import FsdpHeld, fsdp_host_bytes, fsdp_in_flight, under_fsdp
from trainer.plan.terms.in_backward import backward_end_grads, last_step_bytes
from trainer.plan.terms.loss import LossBytes, loss_bytes
from trainer.plan.terms.nf4 import nf4_dequantized_bytes
from trainer.plan.terms.optimizer import optimizer_step_bytes


@dataclass(frozen=True)
class PlanRow:
    precision: str
    activation_checkpointing: str
    micro_batch_size: int
    accumulation_steps: int
    static_bytes: int
    activation_bytes: int
    transient_bytes: int  # the peak less parameters, AdamW state and saved activations
    predicted_peak_bytes: int
    recompute_cost: float  # extra step time from recomputation, as a share of forward+backward
    # forward end | loss backward | backward start | backward end | optimizer step | last step
    # in backward
    peak_moment: str = "forward end"
    # Predicted by the time model (``trainer.plan.speed``); 0: not predicted.
    step_seconds: float = 0.0
    tokens_per_s: float = 0.0  # all ranks together
    loss_chunk_tokens: int = 0  # the chunked loss's chunk (0: a plain loss)
    host_bytes: int = 0  # host memory the plan holds (FSDP's CPU offload), beside the device's
    all_to_all_bytes: int = 0  # parallel.sequence: what a rank sends in a step's all-to-alls

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class RowTerms:
    """One row's terms at its micro-batch, each its feature's (``trainer.plan.terms``)."""

    activations: int  # saved for backward on the device (activation offload's are the host's)
    loss: LossBytes
    fsdp: FsdpHeld
    outside_grads: int  # the gradients outside the blocks, at the start of backward
    backward_end_grads: int  # the gradients held at the end of backward
    autocast_cache: int  # checkpointing's autocast weight copies, to the end of forward
    emulation: int  # a CPU's emulated bf16 matrix products' buffers
    dequantized: int  # an NF4 weight dequantized, wherever a block runs
    all_to_all: int  # parallel.sequence's buffers while a block's backward runs
    block_backward: int  # the last block's incoming gradient and largest temporary
    recomputed_block: int  # the last block's recomputed activations, where it is checkpointed
    first_block: int  # the first block's backward at the end of backward
    optimizer_step: int
    last_step: int  # the last step in backward, alone

    def moments(self) -> dict[str, int]:
        """Each moment's bytes beside the parameters and AdamW's state on the device, in the
        order a tie is named in."""
        found = {
            "forward end": self.activations + self.loss.forward + self.autocast_cache
            + self.fsdp.forward + self.emulation + self.dequantized,
            "backward start": self.activations - self.loss.weight_grad + self.outside_grads
            + self.fsdp.backward + self.emulation + self.dequantized + self.all_to_all
            + self.block_backward + self.recomputed_block,
            "optimizer step": self.optimizer_step,
        }
        if self.loss.backward:  # the plain loss: its backward runs first, before any block's
            found["loss backward"] = self.activations + self.loss.backward + self.fsdp.forward \
                + self.emulation
        found["backward end"] = self.backward_end_grads + self.fsdp.backward_end \
            + self.dequantized + self.all_to_all + self.first_block
        if self.last_step:
            found["last step in backward"] = self.last_step
        return found


def row_terms(static: StaticBytes, profile: ActivationProfile, micro_batch_size: int,
              loss_chunk_tokens: int | None) -> RowTerms:
    """The terms of one row (``static`` and ``profile`` as ``under_fsdp`` leaves them)."""
    batch = micro_batch_size
    # Under FSDP the output head's gradients are sharded like the rest.
    outside_grads = 0 if static.offloaded \
        else min(profile.parameters.outside_blocks_grad_bytes, static.grads)
    emulation = profile.emulation_workspace_per_sample_bytes * batch
    block_backward = profile.block.held_bytes(batch)
    # Under FSDP the end of backward is what it holds in flight (``trainer.plan.terms.fsdp``).
    first_block = 0 if static.sharded else emulation + block_backward \
        + profile.recompute.block_fixed_bytes + profile.block.first_block_bytes(batch)
    return RowTerms(
        activations=profile.saved_bytes(batch) - profile.offload.host_bytes(batch),
        loss=loss_bytes(profile.loss_shape, batch * profile.seq_len, loss_chunk_tokens,
                        outside_grads),
        fsdp=fsdp_in_flight(static, profile.parameters), outside_grads=outside_grads,
        backward_end_grads=backward_end_grads(static, profile.parameters, outside_grads),
        autocast_cache=profile.recompute.autocast_cache_bytes, emulation=emulation,
        dequantized=nf4_dequantized_bytes(profile.parameters.largest_nf4_weights),
        all_to_all=profile.all_to_alls.held_bytes(batch), block_backward=block_backward,
        recomputed_block=profile.recompute.last_block_bytes(batch), first_block=first_block,
        optimizer_step=optimizer_step_bytes(static), last_step=last_step_bytes(static))


def plan_row(static: StaticBytes, profile: ActivationProfile, micro_batch_size: int,
             accumulation_steps: int, speed: SpeedModel | None = None,
             loss_chunk_tokens: int | None = None) -> PlanRow:
    """The predicted peak of one plan and, with a ``speed`` model and the profile's recorded
    work, its predicted step time and tokens/s. ``loss_chunk_tokens``: the chunked loss in
    chunks of that many tokens instead of the probed ones (a chunk changes only the loss's
    temporaries and operators: what it saves for backward is the same)."""
    static, profile = under_fsdp(static, profile)
    terms = row_terms(static, profile, micro_batch_size, loss_chunk_tokens)
    moments = terms.moments()
    moment = max(moments, key=lambda name: moments[name])
    peak = static.device_static + moments[moment]
    offloaded = profile.offload.host_bytes(micro_batch_size)  # activation offload's
    seconds, tokens_per_s = _timing(static, profile, speed, micro_batch_size,
                                    accumulation_steps, terms.loss.chunk_tokens, offloaded)
    return PlanRow(
        precision=profile.precision, activation_checkpointing=profile.activation_checkpointing,
        micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps,
        static_bytes=static.total, activation_bytes=terms.activations,
        transient_bytes=peak - static.device_static - terms.activations,
        predicted_peak_bytes=peak, recompute_cost=profile.recompute.fraction,
        peak_moment=moment, step_seconds=seconds, tokens_per_s=tokens_per_s,
        loss_chunk_tokens=terms.loss.chunk_tokens,
        host_bytes=fsdp_host_bytes(static) + offloaded,
        all_to_all_bytes=profile.all_to_alls.sent_bytes(
            micro_batch_size, accumulation_steps, profile.recompute.recomputed_share))


def _timing(static: StaticBytes, profile: ActivationProfile, speed: SpeedModel | None,
            micro_batch_size: int, accumulation_steps: int, chunk: int, offloaded: int
            ) -> tuple[float, float]:
    """(step seconds, tokens/s) of a row by the time model; (0, 0) without one."""
    if speed is None or profile.work is None:
        return 0.0, 0.0
    if static.fsdp is not None:  # the row's own FSDP settings
        speed = dataclasses.replace(speed, fsdp=static.fsdp)
    timing = speed.predict(profile.work, micro_batch_size, accumulation_steps, chunk or None)
    seconds = timing.seconds + strategy_seconds(
        speed.step_device, offloaded * accumulation_steps,
        static.grads // 4, static.optimizer_states)  # this rank's (fp32) trained values
    seconds += profile.all_to_alls.seconds(micro_batch_size, accumulation_steps,
                                           speed.step_device, profile.recompute.recomputed_share)
    return seconds, timing.tokens_per_s * timing.seconds / seconds
