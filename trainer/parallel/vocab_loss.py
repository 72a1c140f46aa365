"""The chunked loss over an output layer split by vocabulary across FSDP's ranks, and the
lookup in an input embedding split so, so that a frozen output layer or embedding (LoRA's base)
is never gathered.

Under FSDP each rank holds a slice of the output layer's rows, the vocabulary's. Gathered for
the loss, the layer is held whole on every rank, and FSDP's all-gather holds it twice while it
is copied out: for a 32,000-token vocabulary and width 768 in bf16, 2 x 49 MB a rank, more
than the rank's own shards of a 100M-parameter model. Instead every rank's tokens are gathered
(``tokens x width``, a few hundred times smaller), each rank computes every token's logits over
its slice of the vocabulary, chunk by chunk, and the softmax's terms are met over the ranks:
each token's largest logit (an all-reduce of the maximum), then its sum of exponentials and
its target's logit (one all-reduce of both). Each rank then knows every token's loss, keeps
its own tokens', and computes the gradient of every token's hidden state through its slice of
the vocabulary; one reduce-scatter sums those slices' parts and hands each rank its own
tokens'. As Megatron-LM's vocabulary-parallel cross-entropy does for tensor parallelism.

The lookup (``split_lookup``) is the same exchange the other way: every rank's tokens are
gathered, each rank looks up those in its slice of the vocabulary (zeros for the others), and a
reduce-scatter sums the slices (one of them non-zero for each token, so the sum is exact) and
hands each rank its own tokens' rows.

Neither computes the layer's own gradient: they are taken only where the layer is frozen
(``splits_the_vocabulary``); a trained one is gathered as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.batches import IGNORE_INDEX
from trainer.memory.loss import NORMALISE_SLICES

# torch 2.13's names for the flat collectives, the older ones before it (they warn there).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def splits_the_vocabulary(layer: nn.Module, offloaded: bool) -> bool:
    """Whether the sharded output layer or input embedding ``layer`` takes the vocabulary-split
    loss or lookup: its weight frozen, a plain floating-point tensor (not NF4), sharded over a
    1-D mesh with no rank's slice empty, on the device it computes on (not offloaded), no bias;
    an embedding a plain ``nn.Embedding`` that does not renormalise rows (``max_norm``)."""
    from torch.distributed.tensor import DTensor

    weight = getattr(layer, "weight", None)
    if not isinstance(weight, DTensor) or weight.requires_grad or offloaded \
            or getattr(layer, "bias", None) is not None:
        return False
    if isinstance(layer, nn.Embedding) and (_unsharded_class(layer) is not nn.Embedding
                                            or layer.max_norm):
        return False  # a subclass may scale or shift what it looks up
    local = weight.to_local()
    if weight.device_mesh.ndim != 1 or type(local) is not torch.Tensor \
            or not local.is_floating_point():
        return False
    vocab, world = weight.shape[0], weight.device_mesh.size()
    return (world - 1) * -(-vocab // world) < vocab  # the last rank holds rows too


def _unsharded_class(layer: nn.Module) -> type:
    """``layer``'s class before ``fully_shard``, which gives it a class of its own, with
    ``FSDPModule`` before the original among its bases."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(layer)
    return cls.__bases__[-1] if issubclass(cls, FSDPModule) and len(cls.__bases__) == 2 else cls


def split_lookup(embedding: nn.Module, param_dtype: torch.dtype | None,
                 idx_BT: torch.Tensor) -> torch.Tensor:
    """The rows of ``embedding`` (an ``nn.Embedding`` whose weight is a DTensor split by rows,
    FSDP's shards) for this rank's tokens ``idx_BT``, ``(B, T, width)``, in ``param_dtype``
    (FSDP's parameter dtype) or the shard's, without gathering it. Every rank of the mesh calls
    it together."""
    local, offset, group = _slice_of(embedding)
    world = dist.get_world_size(group)
    ids = _gathered(idx_BT.flatten(), world, group, check=True) - offset
    here = (ids >= 0) & (ids < local.shape[0])
    rows = F.embedding(ids.clamp(0, local.shape[0] - 1), local.to(param_dtype or local.dtype))
    rows.mul_(here.unsqueeze(1))
    own = rows.new_empty((idx_BT.numel(), rows.shape[1]))
    _reduce_scatter(own, rows, group=group)
    return own.view(*idx_BT.shape, rows.shape[1])


def _slice_of(layer: nn.Module) -> tuple[torch.Tensor, int, Any]:
    """This rank's rows of ``layer``'s weight (a DTensor split by rows, as ``torch.chunk``
    splits them), the first one's index, and the mesh's process group."""
    weight: Any = layer.weight
    mesh = weight.device_mesh
    offset = min(weight.shape[0], mesh.get_local_rank() * -(-weight.shape[0] // mesh.size()))
    return weight.to_local(), offset, mesh.get_group()


def split_summed_loss(output: nn.Module, param_dtype: torch.dtype | None, hidden_NC: torch.Tensor,
                      targets_N: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The summed token loss of this rank's ``hidden_NC`` through ``output``, whose weight is a
    DTensor split by rows (FSDP's shards), without gathering it; fp32, a target of
    ``IGNORE_INDEX`` adding nothing. The matrix products run in autocast's dtype when it is on,
    else in ``param_dtype`` (FSDP's parameter dtype) or the shard's; ``chunk_tokens`` <= 0: all
    the ranks' tokens in one chunk. Every rank of the mesh calls it together."""
    local, offset, group = _slice_of(output)
    device_type = hidden_NC.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
        else param_dtype or local.dtype
    return _SplitVocabularyCrossEntropy.apply(hidden_NC, local, targets_N, offset, chunk_tokens,
                                              dtype, group)


class _SplitVocabularyCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden_NC: torch.Tensor, weight_VC: torch.Tensor,
                targets_N: torch.Tensor, offset: int, chunk_tokens: int, dtype: torch.dtype,
                group: Any) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        n = hidden_NC.shape[0]
        hidden = _gathered(hidden_NC.detach(), world, group, check=True)
        targets = _gathered(targets_N, world, group)
        needs_grad = hidden_NC.requires_grad
        losses = torch.empty(world * n, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty(world * n, hidden.shape[1], dtype=torch.float32,
                                  device=hidden.device) if needs_grad else None
        chunk = chunk_tokens if chunk_tokens > 0 else world * n
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            weight = weight_VC.to(dtype)
            for start in range(0, world * n, chunk):
                rows = slice(start, start + chunk)
                logits = hidden[rows].to(dtype) @ weight.t()
                losses[rows] = _split_normalise_(logits, targets[rows] - offset,
                                                 targets[rows] != IGNORE_INDEX, group,
                                                 gradient=needs_grad)
                if grad_hidden is not None:  # this slice of the vocabulary's part
                    grad_hidden[rows] = logits @ weight
                del logits
        ctx.hidden_dtype = hidden_NC.dtype
        if grad_hidden is not None:
            own = torch.empty(n, hidden.shape[1], dtype=torch.float32, device=hidden.device)
            _reduce_scatter(own, grad_hidden, group=group)
            ctx.save_for_backward(own)
        return losses[rank * n: (rank + 1) * n].sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        (grad_hidden,) = ctx.saved_tensors
        return ((grad_hidden * grad_loss).to(ctx.hidden_dtype),) + (None,) * 6


def _gathered(tensor: torch.Tensor, world: int, group: Any, check: bool = False
              ) -> torch.Tensor:
    """Every rank's ``tensor``, rank by rank along dim 0; ``check``: first that every rank has
    as many rows (the vocabulary-split layers need every rank's tokens alike in number)."""
    if check:
        counts = torch.empty(world, dtype=torch.int64, device=tensor.device)
        _all_gather(counts, torch.tensor([tensor.shape[0]], device=tensor.device),
                                    group=group)
        if (counts != tensor.shape[0]).any():
            raise RuntimeError("a vocabulary-split layer needs as many tokens on every rank; "
                               f"the ranks hold {counts.tolist()}")
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
    step = max(1, -(-n // NORMALISE_SLICES))
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
