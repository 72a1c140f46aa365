"""One optimizer step in plain torch, and what it steps with.

- ``forward_backward``: one micro-batch under autocast, loss scaled for accumulation, backward.
- ``train_step``: one optimizer step over its micro-batches, gradients reduced once per step
  (the way of splitting, ``trainer.parallel``, says how: DDP's ``no_sync()`` on all but the
  last), then unscale, clip, non-finite check, step, ``zero_grad(set_to_none=True)``.
- ``evaluate``: the mean token loss over validation batches, under ``no_grad``.
- ``StepResult``: what one step gives back; ``step_seed``: the RNG seed of one rank's step.
  AdamW and its schedule are ``trainer.optim``.

Loss normalisation: each rank divides its summed token loss by the tokens it sees in the whole
optimizer step (micro-batch x accumulation x sequence length); DDP then averages over ranks, so
the gradient is that of the mean loss over the global batch, whatever the split into micro-batches
and ranks. Every rank sees the same number of tokens per step (fixed-length rows), which this
needs. Where a loss mask or packed documents leave targets out, the ranks' counts differ: the
divisor is then the global count over the world size (``step_tokens``), which keeps the same rule.
Under sequence parallelism a rank's tokens are its slice of each row (``Parallelism.local_rows``):
it counts those, and the same rule holds over the whole world (``trainer.parallel.mesh``).
The loss a step reports is the global batch's mean over its trained targets (``global_mean``),
the same at any number of ranks, not one rank's own.

Host syncs: one per optimizer step (the finite check of the grad norm, which GradScaler needs
anyway), and one more where the ranks agree on out-of-memory errors (``OOMAgreement.check``).
Nothing holds a graph across steps: the loss is accumulated detached.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from trainer import faults
from trainer.batches import Rows, TokenBatch, as_batch
from trainer.errors import NonFiniteError, first_line
from trainer.memory.loss import summed_loss
from trainer.memory.optimizers import BackwardSteps, state_tensors
from trainer.memory.precision import PrecisionPolicy
from trainer.oom import OOMAgreement, StepOutOfMemory
from trainer.parallel.choice import parallelism_of
from trainer.parallel.strategy import DeferredReduction, Parallelism
from trainer.telemetry.diagnostics import cpu_peak_bytes


@dataclass
class StepResult:
    """What one optimizer step gives back, on the device (no host sync until read)."""

    loss: torch.Tensor  # detached mean token loss over every rank's trained targets
    grad_norm: torch.Tensor
    skipped: bool  # non-finite gradients: the optimizer did not step
    # The targets trained over every rank, where a loss mask or packed documents leave some out
    # (None: every target of the global batch is trained).
    trained_tokens: torch.Tensor | None = None


def forward_backward(model: nn.Module, batch: Rows, policy: PrecisionPolicy,
                     scaler: torch.amp.GradScaler, tokens_per_step: int | torch.Tensor,
                     unwrapped: nn.Module) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its summed token loss, detached. A
    function of its own so that its graph (the saved activations) lives in its frame alone:
    after an OOM in its backward, the frame, and the graph, go with the traceback, before
    the step is retried."""
    loss_sum = summed_loss(model, batch, policy, unwrapped)
    scaler.scale(loss_sum / tokens_per_step).backward()
    return loss_sum.detach()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               micro_batches: list[TokenBatch] | list[torch.Tensor], splits: int,
               policy: PrecisionPolicy, grad_clip: float,
               agreement: OOMAgreement | None = None,
               parallel: Parallelism | None = None) -> StepResult:
    """One optimizer step over ``micro_batches``, each cut into ``splits`` chunks.

    ``splits`` > 1 after an OOM: the same samples in smaller pieces, so the update is the same.
    With an ``agreement``, an OOM on any rank raises ``StepOutOfMemory`` on every rank.
    ``parallel``: how the model is split (None: found from how it is wrapped), which says when
    gradients are reduced.
    """
    parallel = parallel or parallelism_of(model)
    # views; under sequence parallelism each is this rank's slice of the chunk's rows
    chunks = [parallel.local_rows(chunk) for mb in micro_batches
              for chunk in as_batch(mb).chunk(splits)]
    backward_steps = BackwardSteps.of(optimizer)
    if backward_steps is not None:
        backward_steps.begin()
    tokens = step_tokens(chunks)
    loss_sum = torch.zeros((), device=chunks[0].device)
    # With OOM agreement, no reduction inside backward (a peer may have failed): after the check
    deferred = parallel.defers_reduction(agreement)
    oom_message = None
    try:
        for i, batch in enumerate(chunks):
            # Gradients are reduced only on the last micro-batch of the step.
            with parallel.gradient_sync(model, i == len(chunks) - 1, deferred):
                faults.maybe_oom(i, len(chunks))  # MEMTRAIN_FAULTS=oom@STEP:RANK
                loss_sum += forward_backward(model, batch, policy, scaler, tokens.divisor,
                                             parallel.unwrap(model))
    except torch.OutOfMemoryError as err:
        if agreement is None:
            raise
        oom_message = first_line(err, "out of memory")
    # Outside the handler: the OOM's traceback, and the activations its frames hold, are gone.
    del chunks
    if agreement is not None:  # (an OOM without an agreement was re-raised above)
        try:
            agreement.check(local_oom=oom_message)
        except StepOutOfMemory:
            optimizer.zero_grad(set_to_none=True)  # drop the partial gradients
            raise
    if backward_steps is not None:  # every parameter has stepped already
        return _stepped_in_backward(backward_steps, global_mean(loss_sum, tokens.local),
                                    tokens.trained)
    if deferred:
        assert isinstance(parallel, DeferredReduction)  # (defers_reduction's condition)
        parallel.reduce_gradients(model)
    scaler.unscale_(optimizer)
    # grad_clip 0: no clipping (an infinite bound scales every gradient by exactly 1).
    grad_norm = parallel.total_norm(
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf))
    finite = bool(torch.isfinite(grad_norm))  # host sync: once per optimizer step
    if finite or scaler.is_enabled():
        scaler.step(optimizer)  # with fp16 the scaler itself skips non-finite steps
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(global_mean(loss_sum, tokens.local), grad_norm.detach(), not finite,
                      tokens.trained)


def step_tokens(chunks: list[Rows]) -> StepTokens:
    """What each rank divides its summed loss by, and the trained tokens (the module
    docstring's loss normalisation).

    Every target trained: the rank's own target count, the same on every rank (fixed-length
    rows), so DDP's average over ranks gives the mean over the global batch. With a loss mask
    or packed documents the ranks train different numbers of tokens: their counts are summed
    (one all-reduce of a scalar, no host sync) and each rank divides by the global count over
    the world size, so the average over ranks is again the global mean."""
    if not any(chunk.masked for chunk in chunks):
        count = sum(int(chunk.trained_tokens()) for chunk in chunks)
        return StepTokens(count, count, None)
    device = chunks[0].device
    local = torch.zeros((), dtype=torch.float32, device=device)
    for chunk in chunks:
        local += chunk.trained_tokens()
    total, world = local.clone(), 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
        world = dist.get_world_size()
    return StepTokens(total.clamp(min=1) / world, local, total)


class StepTokens(NamedTuple):
    divisor: int | torch.Tensor  # of each rank's summed loss, for the gradient
    local: int | torch.Tensor  # this rank's trained targets (``global_mean``)
    trained: torch.Tensor | None  # over every rank, where some targets are left out


def global_mean(loss_sum: torch.Tensor, trained: int | torch.Tensor) -> torch.Tensor:
    """The step's mean token loss over every rank: the ranks' summed losses over their
    trained targets (one all-reduce of two numbers, no host sync), so the loss a run reports
    is the global batch's whatever the number of ranks (a rank's rows, or its slice of them
    under sequence parallelism, may hold few or no trained targets)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return loss_sum / (trained.clamp(min=1) if isinstance(trained, torch.Tensor) else trained)
    total = torch.stack([loss_sum.detach().double(),
                         torch.as_tensor(trained, dtype=torch.float64, device=loss_sum.device)])
    dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).to(loss_sum.dtype)


def _stepped_in_backward(steps: BackwardSteps, loss: torch.Tensor,
                         trained: torch.Tensor | None) -> StepResult:
    """The result of a step whose parameters stepped in backward: its gradient norm, summed
    before each parameter's step. A non-finite one has been applied already (no step can be
    skipped), so it stops the run; the last checkpoint stays the latest good one."""
    grad_norm = steps.grad_norm()
    if not bool(torch.isfinite(grad_norm)):  # host sync: once per optimizer step
        raise NonFiniteError(
            "non-finite gradient norm with memory.optimizer_in_backward: each parameter "
            "stepped as its gradient arrived, so the step cannot be skipped; resume from the "
            "last checkpoint (a lower train.lr, or bf16 in place of fp16, may avoid it)")
    return StepResult(loss, grad_norm.detach(), False, trained)


def step_seed(seed: int, rank: int, step: int) -> int:
    """The RNG seed of ``rank``'s step ``step`` (0-based): dropout's masks depend on the run's
    seed, the rank and the step only, so a resumed or retried step draws the same ones."""
    return (seed * 1_000_003 + rank * 7919 + step) % (2**63)


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter the state a first optimizer step creates (AdamW's moments) without a
    forward or backward: a step on zero gradients, whose Adam update is zero (weight decay alone
    moves the weights). ``step_peak_bytes`` counts that state as held before the step it
    measures; this readies it at none of a training step's cost."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, tokens_BT: torch.Tensor | TokenBatch,
                    policy: PrecisionPolicy, grad_clip: float = 1.0,
                    parallel: Parallelism | None = None) -> int:
    """CPU: the allocator's peak over one ``train_step`` on ``tokens_BT``, counting the
    parameters, optimizer state and batch alive before it (``diagnostics.cpu_peak_bytes``);
    ``parallel``: ``train_step``'s."""
    batch = as_batch(tokens_BT)
    return cpu_peak_bytes(
        lambda: train_step(model, optimizer, scaler, [batch], 1, policy, grad_clip,
                           parallel=parallel),
        held=step_held(model, optimizer, batch))


def step_held(model: nn.Module, optimizer: torch.optim.Optimizer,
              batch: TokenBatch) -> list[torch.Tensor]:
    """What a step's peak counts as alive before it (``step_peak_bytes``): the parameters, the
    optimizer state (a quantized moment by its parts) and the batch's columns."""
    columns = [t for t in (batch.tokens, batch.loss_mask, batch.document_ids) if t is not None]
    return [*model.parameters(), *state_tensors(optimizer), *columns]


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterator[TokenBatch | torch.Tensor],
             num_batches: int, policy: PrecisionPolicy,
             parallel: Parallelism | None = None) -> float:
    """Mean loss over the trained targets of ``num_batches`` batches on every rank, under
    ``no_grad`` (a loss mask and document boundaries leave targets out, as in training);
    ``parallel`` as ``train_step`` takes it."""
    parallel = parallel or parallelism_of(model)
    unwrapped = parallel.unwrap(model)
    was_training = model.training
    model.eval()
    total = None  # [summed loss, token count], on the device so NCCL can reduce it
    for _ in range(num_batches):
        batch = parallel.local_rows(as_batch(next(batches)))
        loss = summed_loss(model, batch, policy, unwrapped)
        count = torch.as_tensor(batch.trained_tokens(), dtype=torch.float64, device=loss.device)
        batch_total = torch.stack([loss.double(), count])
        total = batch_total if total is None else total + batch_total
    assert total is not None, "evaluate needs num_batches >= 1"
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1].clamp(min=1))


