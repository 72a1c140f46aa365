"""The chunked loss over an output layer split by vocabulary across FSDP's ranks, and the
lookup in an input embedding split so, so that a frozen output layer or embedding (LoRA's base)
is never gathered.

Under FSDP each rank holds a slice of the output layer's rows, the vocabulary's. Gathered for
the loss, the layer is held whole on every rank, and FSDP's all-gather holds it twice while it
is copied out: for a 32,000-token vocabulary and width 768 in bf16, 2 x 49 MB a rank, more
than the rank's own shards of a 100M-parameter model. Instead the loss goes in rounds: in each,
every rank's next tokens are gathered (a loss chunk's worth over all the ranks), each rank
computes those tokens' logits over its slice of the vocabulary, and the softmax's terms are met
over the ranks: each token's largest logit (an all-reduce of the maximum), then its sum of
exponentials and its target's logit (one all-reduce of both). Each rank then knows every
token's loss, keeps its own tokens', and computes the gradient of every token's hidden state
through its slice of the vocabulary; a reduce-scatter sums those slices' parts and hands each
rank its own tokens'. As Megatron-LM's vocabulary-parallel cross-entropy does for tensor
parallelism. What a round holds beyond the gathered path's chunk is its tokens' hidden states
and their fp32 gradient (``round tokens x width x (itemsize + 4)``), which
``splits_the_vocabulary`` asks to be at most one gathered copy of the layer.

The lookup (``split_lookup``) is the same exchange the other way, in rounds of
``LOOKUP_ROUND_TOKENS``: every rank's next token ids are gathered, each rank looks up those in
its slice of the vocabulary (zeros for the others), and a reduce-scatter sums the slices (one of
them non-zero for each token, so the sum is exact) and hands each rank its own tokens' rows.

Neither computes the layer's own gradient: they are taken only where the layer is frozen; a
trained one is gathered as before. Token ids and targets are not checked against the
vocabulary here (an id outside it looks up zeros, where the gathered lookup raises): the
launcher refuses data whose recorded vocabulary is larger than the model's
(``trainer.launch.prepare``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.batches import IGNORE_INDEX
from trainer.memory.loss import slice_rows

# torch 2.13's names for the flat collectives, the older ones before it (they warn there).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The lookup's round: this many tokens over all the ranks (their ids and rows) at a time.
LOOKUP_ROUND_TOKENS = 4096


def splits_the_vocabulary(layer: nn.Module, world: int, offloaded: bool,
                          round_tokens: int) -> bool:
    """Whether FSDP's output layer or input embedding ``layer``, not yet sharded, takes the
    vocabulary-split loss or lookup over ``world`` ranks, a round of ``round_tokens`` tokens
    over them (``LOOKUP_ROUND_TOKENS`` for an embedding, the loss's chunk for an output layer;
    0: unbounded, refused): its weight frozen, a plain floating-point tensor (not NF4), no rank's
    slice empty, on the device it computes on (not offloaded), no bias; an embedding a plain
    ``nn.Embedding`` that does not renormalise rows (``max_norm``); and a round's rows (and for
    the loss their fp32 gradient) no more than one gathered copy of the layer (the planner
    counts the layer gathered; gathered, FSDP holds two copies while it copies one out)."""
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.requires_grad or offloaded \
            or getattr(layer, "bias", None) is not None or weight.ndim != 2 or round_tokens <= 0:
        return False
    if isinstance(layer, nn.Embedding) and (type(layer) is not nn.Embedding or layer.max_norm):
        return False  # a subclass may scale or shift what it looks up
    if type(weight.data) is not torch.Tensor or not weight.is_floating_point():
        return False  # NF4 and other tensor subclasses gather their own way
    vocab, width = weight.shape
    if (world - 1) * -(-vocab // world) >= vocab:
        return False  # the last rank would hold no rows
    itemsize = weight.element_size()  # a round's rows, and for the loss their fp32 gradient
    per_token = width * (itemsize + (0 if isinstance(layer, nn.Embedding) else 4))
    return round_tokens * per_token <= vocab * width * itemsize


def split_lookup(embedding: nn.Module, param_dtype: torch.dtype | None,
                 idx_BT: torch.Tensor) -> torch.Tensor:
    """The rows of ``embedding`` (an ``nn.Embedding`` whose weight is a DTensor split by rows,
    FSDP's shards) for this rank's tokens ``idx_BT``, ``(B, T, width)``, in ``param_dtype``
    (FSDP's parameter dtype) or the shard's, without gathering it. Every rank of the mesh calls
    it together."""
    local, offset, group = _slice_of(embedding)
    world = dist.get_world_size(group)
    ids_N = idx_BT.flatten()
    _check_counts(ids_N.shape[0], world, group, ids_N.device)
    weight = local.to(param_dtype or local.dtype)
    out = weight.new_empty((ids_N.shape[0], weight.shape[1]))
    step = max(1, LOOKUP_ROUND_TOKENS // world)
    for start in range(0, ids_N.shape[0], step):
        rows = slice(start, start + step)
        ids = _gathered(ids_N[rows], world, group) - offset
        here = (ids >= 0) & (ids < weight.shape[0])
        found = F.embedding(ids.clamp(0, weight.shape[0] - 1), weight).mul_(here.unsqueeze(1))
        _reduce_scatter(out[rows], found, group=group)
    return out.view(*idx_BT.shape, weight.shape[1])


def split_summed_loss(output: nn.Module, param_dtype: torch.dtype | None, hidden_NC: torch.Tensor,
                      targets_N: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The summed token loss of this rank's ``hidden_NC`` through ``output``, whose weight is a
    DTensor split by rows (FSDP's shards), without gathering it; fp32, a target of
    ``IGNORE_INDEX`` adding nothing. The matrix products run in autocast's dtype when it is on,
    else in ``param_dtype`` (FSDP's parameter dtype) or the shard's. A round is
    ``chunk_tokens`` tokens over all the ranks. Every rank of the mesh calls it together."""
    local, offset, group = _slice_of(output)
    device_type = hidden_NC.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
        else param_dtype or local.dtype
    return _SplitVocabularyCrossEntropy.apply(hidden_NC, local, targets_N, offset, chunk_tokens,
                                              dtype, group)


def _slice_of(layer: nn.Module) -> tuple[torch.Tensor, int, Any]:
    """This rank's rows of ``layer``'s weight (a DTensor split by rows, as ``torch.chunk``
    splits them), the first one's index, and the mesh's process group."""
    from torch.distributed.tensor import Shard

    weight: Any = layer.weight
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"a vocabulary-split layer is sharded by rows over one mesh "
                         f"dimension, not {weight.placements} over {mesh.ndim}")
    offset = min(weight.shape[0], mesh.get_local_rank() * -(-weight.shape[0] // mesh.size()))
    return weight.to_local(), offset, mesh.get_group()


class _SplitVocabularyCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden_NC: torch.Tensor, weight_VC: torch.Tensor,
                targets_N: torch.Tensor, offset: int, chunk_tokens: int, dtype: torch.dtype,
                group: Any) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        n, width = hidden_NC.shape
        _check_counts(n, world, group, hidden_NC.device)
        needs_grad = hidden_NC.requires_grad
        loss = torch.zeros((), dtype=torch.float32, device=hidden_NC.device)
        own_grad = torch.empty(n, width, dtype=torch.float32, device=hidden_NC.device) \
            if needs_grad else None
        step = max(1, chunk_tokens // world) if chunk_tokens > 0 else max(n, 1)
        with torch.autocast(device_type=hidden_NC.device.type, enabled=False):
            weight = weight_VC.to(dtype)
            for start in range(0, n, step):  # every rank as many rounds: as many tokens
                rows = slice(start, start + step)
                hidden = _gathered(hidden_NC[rows].detach(), world, group)
                targets = _gathered(targets_N[rows], world, group)
                logits = hidden.to(dtype) @ weight.t()
                del hidden
                losses = _split_normalise_(logits, targets - offset, targets != IGNORE_INDEX,
                                           group, gradient=own_grad is not None)
                loss += losses.view(world, -1)[rank].sum()
                if own_grad is not None:  # this slice of the vocabulary's part of each token's
                    part = (logits @ weight).float()
                    del logits
                    _reduce_scatter(own_grad[rows], part, group=group)
                    del part
        ctx.hidden_dtype = hidden_NC.dtype
        if own_grad is not None:
            ctx.save_for_backward(own_grad)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        (grad_hidden,) = ctx.saved_tensors
        return ((grad_hidden * grad_loss).to(ctx.hidden_dtype),) + (None,) * 6


def _check_counts(n: int, world: int, group: Any, device: torch.device) -> None:
    """Every rank must hold ``n`` tokens: the rounds are met rank by rank."""
    counts = torch.empty(world, dtype=torch.int64, device=device)
    _all_gather(counts, torch.tensor([n], device=device), group=group)
    if (counts != n).any():
        raise RuntimeError("a vocabulary-split layer needs as many tokens on every rank; the "
                           f"ranks hold {counts.tolist()}")


def _gathered(tensor: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    """Every rank's ``tensor``, rank by rank along dim 0."""
    out = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
    _all_gather(out, tensor.contiguous(), group=group)
    return out


def _split_normalise_(logits_NV: torch.Tensor, local_targets_N: torch.Tensor,
                      trained_N: torch.Tensor, group: Any, gradient: bool) -> torch.Tensor:
    """Each token's loss (fp32, zero where not trained) from this rank's slice of its logits,
    the softmax's terms met over ``group``; with ``gradient``, the slice's gradient written over
    the logits (in their dtype), as ``trainer.memory.loss._normalise_rows_`` does, a slice of
    rows at a time (what is alive beyond the logits is one slice's fp32 copy and its
    exponentials). ``local_targets_N``: the targets less this slice's first row."""
    n, vocab = logits_NV.shape
    step = slice_rows(n)
    slices = [slice(start, start + step) for start in range(0, n, step)]
    here = (local_targets_N >= 0) & (local_targets_N < vocab) & trained_N
    index = local_targets_N.clamp(0, vocab - 1).unsqueeze(1)
    maxima = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
    for rows in slices:
        maxima[rows] = logits_NV[rows].float().amax(dim=-1)
    dist.all_reduce(maxima, dist.ReduceOp.MAX, group=group)
    terms = torch.empty(2, n, dtype=torch.float32, device=logits_NV.device)  # sums, targets
    for rows in slices:
        x = logits_NV[rows].float()
        terms[1, rows] = x.gather(1, index[rows]).squeeze(1) * here[rows]
        terms[0, rows] = (x - maxima[rows].unsqueeze(1)).exp_().sum(dim=-1)
        del x
    dist.all_reduce(terms, group=group)
    sums, target_logits = terms
    losses = (sums.log() + maxima - target_logits) * trained_N
    if gradient:
        for rows in slices:
            grad = (logits_NV[rows].float() - maxima[rows].unsqueeze(1)).exp_()
            grad.div_(sums[rows].unsqueeze(1))
            grad.scatter_add_(1, index[rows], -here[rows].unsqueeze(1).float())
            grad.mul_(trained_N[rows].unsqueeze(1))
            logits_NV[rows] = grad
            del grad
    return losses
