"""The chunked loss: cross-entropy over a large vocabulary without materialising the logits.

For GPT-2's vocabulary (50,304) the logits of a 16 x 1024 micro-batch take 1.6 GB in bf16, and
the fp32 copy that the loss needs, the softmax and their gradients take several times that: on an
H200 this, not the transformer's activations, set the step's peak (see docs/benchmarks.md). So the
output projection and the loss are fused and computed in chunks of tokens: for each chunk the
forward pass computes the logits, the summed loss and, right away, the gradients with respect to
the hidden states and the output weight; only those gradients (tokens x width, and vocabulary x
width) are kept for backward, which just scales them by the incoming gradient. Nothing is
recomputed, and the largest temporary is one chunk's logits.

The matrix products run in the autocast dtype when autocast is on (as ``nn.Linear`` would), the
softmax and the loss in fp32.

``transient_bytes`` is the peak of the temporaries of one call, for the memory planner; the
planner learns the loss's shapes by running its probe under ``observe_chunked_losses``.
``tests/unit/test_loss.py`` checks the formula against the CPU allocator's record.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.batches import IGNORE_INDEX, Rows, RowSlice, as_batch
from trainer.compat import cpu_bf16_support

if TYPE_CHECKING:
    from trainer.memory.precision import PrecisionPolicy


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


# A chunk's logits are normalised in this many slices of rows (``_normalise_rows_``): beside the
# logits, one slice's fp32 temporaries are alive, a sixteenth of the chunk's rows.
NORMALISE_SLICES = 16


def slice_rows(rows: int) -> int:
    """The rows of one of ``NORMALISE_SLICES`` slices of a chunk of ``rows`` (at least 1)."""
    return max(1, -(-rows // NORMALISE_SLICES))


@dataclass(frozen=True)
class ChunkedLossShape:
    """What sets one chunked loss call's temporaries, apart from the number of tokens."""

    vocab_size: int
    width: int
    chunk_tokens: int
    compute_itemsize: int  # the matmuls' dtype (autocast's, or the weight's)
    weight_itemsize: int
    hidden_itemsize: int
    weight_trains: bool = True  # False: a frozen output layer (LoRA's base), no gradient
    # oneDNN's emulated bf16 (a CPU with AVX-512 but no bf16 instructions) writes the logits'
    # product in fp32 before its bf16 result: 4 bytes a logit beside them while it runs.
    fp32_product: bool = False

    def transient_bytes(self, tokens: int) -> int:
        """Peak bytes of the forward's temporaries for ``tokens`` tokens (not the saved ones).

        Alive throughout: the weight cast to the compute dtype (when it differs). Per chunk of
        ``n`` tokens, its logits in the compute dtype (overwritten by their gradient), beside the
        largest of four moments: the logits' product's fp32 result (``fp32_product`` only); one
        slice's fp32 copy and its (log-)softmax (``_normalise_rows_``; the copy is the slice
        itself in fp32), with the chunk's picked log-probabilities; the hidden states' chunk
        gradient in the compute dtype; or the output weight's chunk gradient (in the compute
        dtype, and its fp32 copy when that differs).
        """
        V, C, s = self.vocab_size, self.width, self.compute_itemsize
        n = min(self.chunk_tokens, tokens)
        rows = slice_rows(n)
        weight_copy = V * C * s if s != self.weight_itemsize else 0
        hidden_copy = n * C * s if s != self.hidden_itemsize else 0
        weight_grad = V * C * (s + (4 if s != 4 else 0)) if self.weight_trains else 0
        normalise = rows * V * (4 + (4 if s != 4 else 0)) + 4 * n
        product = 4 * n * V if self.fp32_product else 0
        return weight_copy + hidden_copy + s * n * V + max(product, normalise, n * C * s,
                                                            weight_grad)

    def backward_bytes(self, tokens: int) -> int:
        """Bytes the loss adds at the start of backward: none, its gradients were computed in
        the forward pass and are saved (counted with the activations)."""
        return 0


@dataclass(frozen=True)
class PlainLossShape:
    """The unchunked loss: the full ``(tokens, vocab)`` logits in the compute dtype, an fp32
    copy for the softmax, and in backward the fp32 gradients of the log-probabilities and of the
    logits. Counted as the planner counts the chunked loss; the log-probabilities themselves are
    saved for backward, so the probe counts them with the activations."""

    vocab_size: int
    compute_itemsize: int  # the logits' dtype (autocast's, or the weight's)

    def transient_bytes(self, tokens: int) -> int:
        """The forward's temporaries beside the saved log-probabilities: the logits and, when
        they are not fp32, their fp32 copy."""
        s = self.compute_itemsize
        return tokens * self.vocab_size * (s + (4 if s != 4 else 0))

    def backward_bytes(self, tokens: int) -> int:
        """The loss's backward, the first of the step: cross-entropy's gradient of the
        log-probabilities and log-softmax's of the logits, both fp32 and alive together (with
        the saved log-probabilities, counted with the activations). The model's gradients come
        after these are freed."""
        return 8 * tokens * self.vocab_size


LossShape = ChunkedLossShape | PlainLossShape
_observed: list[LossShape] | None = None
# Set while a chunked loss's forward runs: its products contract over a chunk's tokens, which
# the time model counts apart from the rest of the step (trainer.plan.work.loss_work).
_in_chunked_loss = False


def in_chunked_loss() -> bool:
    return _in_chunked_loss


@contextlib.contextmanager
def observe_chunked_losses() -> Iterator[list[LossShape]]:
    """Record the shape of every loss computed inside the block (the planner's probe), chunked
    or plain."""
    global _observed
    outer, _observed = _observed, []
    try:
        yield _observed
    finally:
        _observed = outer


def _normalise_rows_(logits_NV: torch.Tensor, targets_N: torch.Tensor, gradient: bool
                     ) -> torch.Tensor:
    """The summed cross-entropy of ``logits_NV`` (any float dtype; computed in fp32), and with
    ``gradient`` its gradient with respect to the logits written over them, in their dtype.

    The same numbers, bit for bit, as ``F.cross_entropy(logits.float(), targets,
    reduction="sum")`` and ``(softmax(logits.float()) - one_hot) * trained`` cast back, but a
    slice of rows at a time: log-softmax and softmax are computed row by row, so a slice's rows
    are the whole tensor's, and the loss is summed by ``nll_loss`` over the same values in the
    same order. What is alive beyond the logits is one slice's fp32 copy and its (log-)softmax,
    not two fp32 copies of the whole chunk (8 bytes a logit, which set the chunk's peak).
    A target of ``IGNORE_INDEX`` adds nothing to the loss and gets a zero gradient row.
    """
    n = logits_NV.shape[0]
    rows = slice_rows(n)
    picked_N1 = torch.empty((n, 1), dtype=torch.float32, device=logits_NV.device)
    for start in range(0, n, rows):
        x = logits_NV[start: start + rows].float()  # the slice itself when already fp32
        t = targets_N[start: start + rows]
        index = t.clamp(min=0).unsqueeze(1)
        picked_N1[start: start + rows] = x.log_softmax(dim=-1).gather(1, index)
        if gradient:
            # d(sum of losses)/d(logits) = softmax - one_hot; zero for a target that is not
            # trained, without a host sync to find them.
            grad = x.softmax(dim=-1)
            del x
            keep = (t != IGNORE_INDEX).unsqueeze(1)
            grad.mul_(keep)
            grad.scatter_add_(1, index, -keep.float())
            logits_NV[start: start + rows] = grad  # cast as .to() casts
            del grad
        else:
            del x
    # nll_loss of the picked log-probabilities: the sum cross_entropy's own nll_loss takes.
    slot = torch.where(targets_N == IGNORE_INDEX, targets_N, torch.zeros_like(targets_N))
    return F.nll_loss(picked_N1, slot, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NC: torch.Tensor, weight_VC: torch.Tensor, targets_N: torch.Tensor,
                chunk_tokens: int) -> torch.Tensor:
        global _in_chunked_loss
        outer, _in_chunked_loss = _in_chunked_loss, True
        try:
            return _ChunkedLinearCrossEntropy._forward(ctx, hidden_NC, weight_VC, targets_N,
                                                       chunk_tokens)
        finally:
            _in_chunked_loss = outer

    @staticmethod
    def _forward(ctx: Any, hidden_NC: torch.Tensor, weight_VC: torch.Tensor,
                 targets_N: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        dtype = _compute_dtype(weight_VC)
        if _observed is not None:
            fp32_product = dtype == torch.bfloat16 and weight_VC.device.type == "cpu" and \
                cpu_bf16_support() == "onednn-emulated"
            _observed.append(ChunkedLossShape(
                weight_VC.shape[0], weight_VC.shape[1], chunk_tokens, dtype.itemsize,
                weight_VC.element_size(), hidden_NC.element_size(), weight_VC.requires_grad,
                fp32_product))
        needs_grad = hidden_NC.requires_grad or weight_VC.requires_grad
        with torch.autocast(weight_VC.device.type, enabled=False):
            weight = weight_VC.to(dtype)
            loss_sum = torch.zeros((), dtype=torch.float32, device=hidden_NC.device)
            grad_hidden = torch.empty_like(hidden_NC, dtype=torch.float32) if needs_grad else None
            # A frozen output layer (LoRA's base) gets no gradient: none is computed or kept.
            grad_weight = torch.zeros_like(weight_VC, dtype=torch.float32) \
                if needs_grad and weight_VC.requires_grad else None
            for start in range(0, hidden_NC.shape[0], chunk_tokens):
                h = hidden_NC[start: start + chunk_tokens].to(dtype)
                t = targets_N[start: start + chunk_tokens]
                logits = h @ weight.t()  # the compute dtype, like nn.Linear's
                loss_sum += _normalise_rows_(logits, t, gradient=grad_hidden is not None)
                if grad_hidden is None:
                    continue  # no gradient wanted (evaluation)
                grad_logits_lp = logits  # now d(sum of losses)/d(logits), in the compute dtype
                del logits
                grad_hidden[start: start + chunk_tokens] = grad_logits_lp @ weight
                if grad_weight is not None:
                    grad_weight += (grad_logits_lp.t() @ h).float()
                # Free this chunk's gradient before the next chunk's logits exist: kept to the
                # next iteration, it held a second chunk (0.77 GiB for GPT-2 in fp32) at the peak.
                del grad_logits_lp
        ctx.input_dtypes = (hidden_NC.dtype, weight_VC.dtype)
        if needs_grad:
            ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight) if g is not None))
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, *grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.input_dtypes
        return ((grad_hidden * grad_loss).to(hidden_dtype),
                (grad_weight[0] * grad_loss).to(weight_dtype) if grad_weight else None,
                None, None)


def _observe_plain(logits: torch.Tensor) -> None:
    if _observed is not None:
        _observed.append(PlainLossShape(logits.shape[-1], logits.element_size()))


def linear_cross_entropy_sum(hidden_NC: torch.Tensor, weight_VC: torch.Tensor,
                             targets_N: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, targets, reduction="sum")`` in chunks, fp32 result; a
    target of ``IGNORE_INDEX`` (-100) adds nothing, to the loss or to a gradient.

    ``chunk_tokens`` <= 0 computes the plain, unchunked loss (the full logits are materialised).
    """
    if chunk_tokens <= 0:
        logits = F.linear(hidden_NC, weight_VC)
        _observe_plain(logits)
        return F.cross_entropy(logits.float(), targets_N, ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return _ChunkedLinearCrossEntropy.apply(hidden_NC, weight_VC, targets_N, chunk_tokens)


def summed_loss(model: nn.Module, batch: Rows | torch.Tensor, policy: PrecisionPolicy,
                unwrapped: nn.Module | None = None) -> torch.Tensor:
    """Summed next-token loss of one micro-batch of rows ``(B, T + 1)`` (a ``TokenBatch``, or a
    tensor of tokens, all trained), or of a rank's slice of them (a ``RowSlice``, under
    sequence parallelism), fp32, under autocast; targets that are not trained (a loss mask, a
    document boundary) add nothing.

    A model with ``computes_loss`` computes it itself (chunked, no ``(B, T, V)`` logits); for
    any other model the logits are materialised and the loss taken in fp32. Packed documents'
    ``position_ids`` go to a model that takes them (``takes_position_ids``). ``unwrapped``: the
    model inside ``model``'s wrapper (DDP's), whose attributes say which (None: ``model``).
    """
    rows = batch if isinstance(batch, RowSlice) else as_batch(batch)
    inputs_BT, targets_BT = rows.inputs, rows.targets
    unwrapped = model if unwrapped is None else unwrapped
    kwargs = {}
    if rows.masked and takes_position_ids(unwrapped):
        position_ids = rows.position_ids
        if position_ids is not None:  # packed documents
            kwargs["position_ids"] = position_ids
    with policy.autocast(inputs_BT.device):
        if getattr(unwrapped, "computes_loss", False):
            return model(inputs_BT, targets_BT, **kwargs).float()
        logits_BTV = model(inputs_BT, **kwargs)
    _observe_plain(logits_BTV)
    return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def takes_position_ids(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``position_ids`` (by name, or any keyword): then packed
    documents keep to themselves in attention (trainer.batches). Asked every micro-batch: the
    signature is read once per forward function."""
    forward = getattr(model, "_orig_mod", model).forward
    return _takes_position_ids(getattr(forward, "__func__", forward))


@functools.lru_cache(maxsize=64)
def _takes_position_ids(forward: Any) -> bool:
    parameters = inspect.signature(forward).parameters.values()
    return any(p.name == "position_ids" or p.kind is p.VAR_KEYWORD for p in parameters)


# "auto": one chunk's fp32 logits within this many bytes. The chunk's other temporaries (the
# softmax, the logits in the compute dtype) are of the same order, so a chunk costs a few times
# this at the loss's moment, whatever the vocabulary.
AUTO_LOSS_CHUNK_BYTES = 256 << 20
MIN_AUTO_LOSS_CHUNK_TOKENS = 128  # below it the matrix products get too thin to run well


def auto_loss_chunk_tokens(vocab_size: int, budget_bytes: int = AUTO_LOSS_CHUNK_BYTES) -> int:
    """``memory.loss_chunk_tokens: auto``: the largest power of two of tokens whose fp32 logits
    (tokens x ``vocab_size`` x 4 bytes) fit ``budget_bytes``, at least
    ``MIN_AUTO_LOSS_CHUNK_TOKENS``. GPT-2's 50,304 tokens: 1,024 (0.19 GiB); Llama 3's
    128,256: 512 (0.24 GiB); a 256-token vocabulary: 262,144 (a micro-batch is one chunk)."""
    tokens = max(1, budget_bytes // (4 * vocab_size))
    return max(MIN_AUTO_LOSS_CHUNK_TOKENS, 1 << (tokens.bit_length() - 1))


def computes_own_loss(model: nn.Module) -> bool:
    """Whether ``model(idx, targets)`` returns its summed loss, so the loss can be chunked."""
    return hasattr(model, "loss_chunk_tokens")


def set_loss_chunking(model: nn.Module, chunk_tokens: int | str) -> int:
    """Compute the loss in chunks of ``chunk_tokens`` tokens (0: the plain loss; "auto": sized
    by the vocabulary, ``auto_loss_chunk_tokens``, for a model that computes its own loss and
    says its ``vocab_size``; else the plain loss). Returns the chunk size set."""
    if chunk_tokens == "auto":
        chunk_tokens = 0
        if computes_own_loss(model):
            vocab_size = getattr(model, "vocab_size", None)
            if not isinstance(vocab_size, int):
                raise ValueError(f"memory.loss_chunk_tokens 'auto' needs {type(model).__name__} "
                                 "to say its vocabulary (a `vocab_size` attribute); set a number "
                                 "of tokens instead")
            chunk_tokens = auto_loss_chunk_tokens(vocab_size)
    assert isinstance(chunk_tokens, int), chunk_tokens
    if chunk_tokens and not computes_own_loss(model):
        raise ValueError(f"memory.loss_chunk_tokens {chunk_tokens} needs a model that computes "
                         f"its own loss (`loss_chunk_tokens` attribute); {type(model).__name__} "
                         "does not; set it to 0")
    if computes_own_loss(model):
        setattr(model, "loss_chunk_tokens", chunk_tokens)  # noqa: B010 - any model class
    return chunk_tokens
