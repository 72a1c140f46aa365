"""Ulysses sequence parallelism: the ranks of a sequence group each hold a slice of every row's
tokens, so a row longer than one rank's activations can hold is trained over several ranks.

Everything outside attention works token by token, so a rank runs it on its slice alone.
Attention needs the whole row: before it, an all-to-all turns the rank's slice of every head
into the whole row of ``heads / N`` heads (``seq_to_heads``); each rank runs SDPA over the whole
row for its heads, with the whole row's causal or document mask; an all-to-all back returns its
slice of every head (``heads_to_seq``). The backward of each all-to-all is the other. DeepSpeed's
Ulysses (and ALST's ``UlyssesSPAttentionHF``, its Hugging Face form) does the same; torch's own
ring attention (``context_parallel``) has no CPU path to test on gloo, and ``all_to_all_single``
runs on gloo and NCCL alike.

Grouped-query attention: where the key and value heads do not divide among the ranks, each is
repeated (``kv_repeats``) until they do, as ALST does; autograd sums the copies' gradients.

What the split would change is refused in one line rather than trained: an attention argument
``hf_attention`` does not implement (attention sinks, softcapping, a sliding window shorter than
the row), ``longrope`` factors chosen from a rank's positions, and decoder layers that mix tokens
outside attention (short convolutions, state-space, recurrent and linear-attention blocks),
which would see only a rank's slice.

- ``apply_sequence_parallel(model, group)``: memtrain's GPT or an ``hf:`` model made to hold
  slices of rows (transformers' models through its attention interface, ``hf_attention``);
- ``SequenceParallel``: the ``SequenceSplit`` the models ask (positions, masks, attention);
  ``SequenceShapes``: its shapes in one process, for the planner's probe (``split_model``);
- ``row_slice``: a rank's slice of a micro-batch's inputs, targets and positions.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.batches import RowSlice, TokenBatch
from trainer.models.gpt import GPT, CausalSelfAttention, document_mask
from trainer.models.hf import HFCausalLM
from trainer.models.sequence_split import HF_SEQUENCE_KWARG
from trainer.parallel.rendezvous import any_rank

HF_ATTENTION = "memtrain_ulysses"  # the name transformers' attention interface knows it by
# Keyword arguments transformers carries through a model's layers to its attention function
# that do not change what attention computes: the positions were applied by the rotary
# embedding before it, the rest are cache and output flags. Any other that carries a value is
# one ``hf_attention`` does not implement, and is refused rather than dropped.
_NOT_ATTENTION_KWARGS = frozenset({"position_ids", "cache_position", "use_cache",
                                   "output_attentions", "output_hidden_states",
                                   "output_router_logits", "return_dict"})
# Decoder-layer modules that mix tokens outside attention (state-space, recurrent, short
# convolution and linear-attention blocks), by their class names' parts as transformers spells
# them: run on a rank's slice they would see only its tokens.
_TOKEN_MIXER_NAMES = re.compile(r"Mamba|Conv|Recurrent|Rglru|SSM|Ssm|DeltaNet|LinearAttention|"
                                r"Lightning|Mixer|Rwkv")
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


class PeerOutOfMemory(torch.OutOfMemoryError):
    """A peer in this rank's sequence group ran out of memory in this micro-batch: this rank
    stopped where the group met (``GroupOOMWatch``), as the peer did."""


_HOST = torch.device("cpu")  # the watch's flag: no device sync


class GroupOOMWatch:
    """The meetings of one group's ranks inside a micro-batch, made to agree on an OOM first.

    While ``armed`` (a step with OOM agreement: ``watching``), ``ready()`` runs before each of
    the group's collectives: one all-reduce (MAX) of a one-element host tensor over the group,
    through gloo (beside NCCL on GPUs: ``trainer.parallel.rendezvous``), so no device sync. Each
    rank calls it the same number of times until one returns a failure: a rank that ran out of
    memory between two meetings calls it once more with 1 (``watching``'s exit), at the meeting
    where its peers wait, and then every rank stops. The cost: one small host all-reduce per
    collective of the group, and none when not armed (``memory.oom_recovery`` off).
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.armed = False

    def ready(self) -> None:
        """Before one of the group's collectives: raise ``PeerOutOfMemory`` where a peer ran
        out of memory since the last meeting (then the watch disarms: this was the last one)."""
        if self.armed and any_rank(False, _HOST, self.group):
            self.armed = False
            raise PeerOutOfMemory("a peer rank of this sequence group ran out of memory in this "
                                  "step")

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Around one micro-batch's forward and backward: armed inside; an OOM of this rank is
        sent to the peers at their meeting, and the micro-batch ends with one more meeting (a
        peer may have run out after the last collective)."""
        self.armed = True
        try:
            yield
            self.ready()
        except torch.OutOfMemoryError as err:
            if self.armed and not isinstance(err, PeerOutOfMemory):
                any_rank(True, _HOST, self.group)
            raise
        finally:
            self.armed = False


def check_divisible(field: str, value: int, size: int) -> None:
    """ValueError where ``value`` (named ``field``) does not divide among ``size`` ranks."""
    if value % size:
        raise ValueError(f"{field} {value} is not divisible by the sequence-parallel size {size}")


def kv_repeats(num_heads: int, num_kv_heads: int, size: int) -> int:
    """How many copies of each key and value head the ranks need: the fewest that make the
    ``num_kv_heads`` heads divide among ``size`` ranks with each rank's query heads' keys on the
    rank (``size / gcd``: the copies number ``lcm(num_kv_heads, size)``, which divides
    ``num_heads`` wherever ``size`` and ``num_kv_heads`` both do)."""
    check_divisible("num_heads", num_heads, size)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return size // math.gcd(num_kv_heads, size)


def sequence_slice(tensor: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of ``size`` equal slices of ``tensor`` along ``dim`` (a view);
    ValueError where they are not equal."""
    check_divisible("seq_len", tensor.shape[dim], size)
    return tensor.chunk(size, dim=dim)[rank]


def row_slice(batch: TokenBatch, rank: int, size: int) -> RowSlice:
    """Rank ``rank``'s slice of ``batch``: targets and positions are found over the whole rows
    (a document may start on another rank's slice), then sliced."""
    position_ids = batch.position_ids
    return RowSlice(sequence_slice(batch.inputs, rank, size),
                    sequence_slice(batch.targets, rank, size),
                    None if position_ids is None else sequence_slice(position_ids, rank, size),
                    batch.masked)


def _seq_to_heads(x_BTHD: torch.Tensor, group: dist.ProcessGroup,
                  watch: GroupOOMWatch | None) -> torch.Tensor:
    size = dist.get_world_size(group)
    B, T, H, D = x_BTHD.shape
    check_divisible("num_heads", H, size)
    # send[j]: this rank's tokens of rank j's heads; received[j]: rank j's tokens of ours
    send = x_BTHD.reshape(B, T, size, H // size, D).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    _all_to_all(received, send, group, watch)
    return received.permute(1, 0, 2, 3, 4).reshape(B, size * T, H // size, D)


def _heads_to_seq(y_BShD: torch.Tensor, group: dist.ProcessGroup,
                  watch: GroupOOMWatch | None) -> torch.Tensor:
    size = dist.get_world_size(group)
    B, S, h, D = y_BShD.shape
    # send[j]: rank j's tokens of this rank's heads; received[j]: our tokens of rank j's heads
    send = y_BShD.reshape(B, size, S // size, h, D).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    _all_to_all(received, send, group, watch)
    return received.permute(1, 2, 0, 3, 4).reshape(B, S // size, size * h, D)


def _all_to_all(received: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup,
                watch: GroupOOMWatch | None) -> None:
    if watch is not None:  # both buffers allocated: the group meets, then moves them
        watch.ready()
    dist.all_to_all_single(received, send, group=group)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_BTHD: torch.Tensor, group: dist.ProcessGroup,
                watch: GroupOOMWatch | None) -> torch.Tensor:
        ctx.group, ctx.watch = group, watch
        return _seq_to_heads(x_BTHD, group, watch)

    @staticmethod
    def backward(ctx: Any, grad_BShD: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _heads_to_seq(grad_BShD, ctx.group, ctx.watch), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_BShD: torch.Tensor, group: dist.ProcessGroup,
                watch: GroupOOMWatch | None) -> torch.Tensor:
        ctx.group, ctx.watch = group, watch
        return _heads_to_seq(y_BShD, group, watch)

    @staticmethod
    def backward(ctx: Any, grad_BTHD: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _seq_to_heads(grad_BTHD, ctx.group, ctx.watch), None, None


def seq_to_heads(x_BTHD: torch.Tensor, group: dist.ProcessGroup,
                 watch: GroupOOMWatch | None = None) -> torch.Tensor:
    """This rank's slice of the tokens ``(B, T, H, D)`` of every head, as the whole row's tokens
    of its ``H / N`` heads ``(B, N * T, H / N, D)`` (rank ``r``: heads ``r * H / N`` on), ``N``
    the size of ``group``; differentiable, its backward ``heads_to_seq``. ``watch``: the group's
    meetings on an OOM, before each all-to-all, forward and backward. ValueError where the heads
    do not divide among the ranks."""
    return _SeqToHeads.apply(x_BTHD, group, watch)


def heads_to_seq(y_BShD: torch.Tensor, group: dist.ProcessGroup,
                 watch: GroupOOMWatch | None = None) -> torch.Tensor:
    """``seq_to_heads``' inverse: the whole row of this rank's heads ``(B, S, h, D)`` as its slice
    of the tokens of every head ``(B, S / N, N * h, D)``; differentiable."""
    return _HeadsToSeq.apply(y_BShD, group, watch)


def gather_sequence(tensor_BT: torch.Tensor, group: dist.ProcessGroup,
                    watch: GroupOOMWatch | None = None) -> torch.Tensor:
    """The whole rows ``(B, N * T)`` of the ranks' slices ``(B, T)`` (not differentiable: for
    positions)."""
    parts = [torch.empty_like(tensor_BT) for _ in range(dist.get_world_size(group))]
    if watch is not None:
        watch.ready()
    dist.all_gather(parts, tensor_BT.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class SequenceParallel:
    """Rows split over the ranks of ``group``, this rank holding slice ``rank`` of each: the
    ``SequenceSplit`` memtrain's models ask for positions, masks and attention."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # the group's meetings agree on an OOM first, in steps that recover from one
        self.watch = GroupOOMWatch(group)

    def positions(self, position_ids_BT: torch.Tensor | None, local_len: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The positions of this rank's tokens in their rows, and the whole rows' attention mask
        (None: causal). Packed documents' positions are gathered from every rank (a document
        may begin on another's slice) for the mask, which is ``document_mask``'s over whole
        rows: ``B x S x S`` bytes on each rank, as on one."""
        if position_ids_BT is None:
            start = self.rank * local_len
            return torch.arange(start, start + local_len, device=device).unsqueeze(0), None
        return position_ids_BT, document_mask(self.whole_rows(position_ids_BT))

    def whole_rows(self, tensor_BT: torch.Tensor) -> torch.Tensor:
        """The whole rows of every rank's slice (``gather_sequence``)."""
        return gather_sequence(tensor_BT, self.group, self.watch)

    def to_heads(self, x_BTHD: torch.Tensor) -> torch.Tensor:
        """``seq_to_heads`` over this split's group."""
        return seq_to_heads(x_BTHD, self.group, self.watch)

    def to_sequence(self, y_BShD: torch.Tensor) -> torch.Tensor:
        """``heads_to_seq`` over this split's group."""
        return heads_to_seq(y_BShD, self.group, self.watch)

    def attend(self, q_BTHD: torch.Tensor, k_BTKD: torch.Tensor, v_BTKD: torch.Tensor,
               mask_B1SS: torch.Tensor | None, dropout_p: float = 0.0,
               scale: float | None = None) -> torch.Tensor:
        """SDPA of this rank's queries over the whole row, for ``H / N`` heads on each rank:
        ``(B, T, H, D)`` in, ``(B, T, H, D)`` out (the module docstring)."""
        repeats = kv_repeats(q_BTHD.shape[2], k_BTKD.shape[2], self.size)
        if repeats > 1:  # each copy's gradient is summed back by repeat_interleave's backward
            k_BTKD, v_BTKD = (t.repeat_interleave(repeats, dim=2) for t in (k_BTKD, v_BTKD))
        q, k, v = (self.to_heads(t).transpose(1, 2) for t in (q_BTHD, k_BTKD, v_BTKD))
        y_BhSD = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SS,
                                                is_causal=mask_B1SS is None, dropout_p=dropout_p,
                                                scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        return self.to_sequence(y_BhSD.transpose(1, 2))


class SequenceShapes(SequenceParallel):
    """One rank's shapes under a split over ``size`` ranks, in one process with no group: for
    the planner's probe, which counts what a rank saves for backward and what its all-to-alls
    move. Each all-to-all is a local reshuffle of this rank's tensor into the shape the real
    one returns (its values are not the other ranks', which a probe never reads), and each
    records its input's bytes: ``moved_bytes``, one list per attention call."""

    def __init__(self, size: int):  # no group: none of SequenceParallel.__init__
        self.size, self.rank = size, 0
        self.moved_bytes: list[list[int]] = []

    def attend(self, q_BTHD: torch.Tensor, k_BTKD: torch.Tensor, v_BTKD: torch.Tensor,
               mask_B1SS: torch.Tensor | None, dropout_p: float = 0.0,
               scale: float | None = None) -> torch.Tensor:
        self.moved_bytes.append([])
        return super().attend(q_BTHD, k_BTKD, v_BTKD, mask_B1SS, dropout_p, scale)

    def whole_rows(self, tensor_BT: torch.Tensor) -> torch.Tensor:
        return tensor_BT.repeat(1, self.size)

    def to_heads(self, x_BTHD: torch.Tensor) -> torch.Tensor:
        B, T, H, D = x_BTHD.shape
        check_divisible("num_heads", H, self.size)
        self.moved_bytes[-1].append(x_BTHD.numel() * x_BTHD.element_size())
        return x_BTHD.reshape(B, T, self.size, H // self.size, D).transpose(1, 2) \
            .reshape(B, self.size * T, H // self.size, D)

    def to_sequence(self, y_BShD: torch.Tensor) -> torch.Tensor:
        B, S, h, D = y_BShD.shape
        self.moved_bytes[-1].append(y_BShD.numel() * y_BShD.element_size())
        return y_BShD.reshape(B, self.size, S // self.size, h, D).transpose(1, 2) \
            .reshape(B, S // self.size, self.size * h, D)


def hf_attention(module: nn.Module, query_BHTD: torch.Tensor, key_BKTD: torch.Tensor,
                 value_BKTD: torch.Tensor, attention_mask: torch.Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function (``HF_ATTENTION``) of a model split by
    ``apply_sequence_parallel``: queries, keys and values after the model's rotary embedding
    (of the global positions ``HFCausalLM`` passes), attended over whole rows by the
    ``SequenceSplit`` its forward carries; ``(B, T, H, D)`` out, as transformers' SDPA gives.
    ``attention_mask``: the whole rows' mask (None: causal).

    Raises:
        ValueError: an argument it does not implement (``softcap``, attention sinks' ``s_aux``,
            a sliding window shorter than the row), attention that is not causal, or rotary
            factors that depend on the positions a rank holds (``longrope``).
    """
    sequence = kwargs.pop(HF_SEQUENCE_KWARG, None)
    name = type(module).__name__
    if sequence is None:
        raise ValueError(f"{name}: attention '{HF_ATTENTION}' was called without "
                         "its sequence split (HFCausalLM's forward passes it)")
    seq_len = query_BHTD.shape[2] * sequence.size
    if softcap is not None:
        raise ValueError(f"{name}: attention with softcap is not supported under sequence "
                         "parallelism")
    # transformers' window: a token attends to the last ``sliding_window`` tokens, itself
    # included, so a window of at least the row's length masks nothing
    if sliding_window is not None and sliding_window < seq_len:
        raise ValueError(f"{name}: sliding_window {sliding_window} is shorter than seq_len "
                         f"{seq_len}, which sequence parallelism attends whole (a window of "
                         "at least seq_len is taken)")
    if not getattr(module, "is_causal", True) or kwargs.pop("is_causal", True) is False:
        raise ValueError(f"{name}: attention that is not causal is not supported under "
                         "sequence parallelism")
    for key, value in kwargs.items():
        if key not in _NOT_ATTENTION_KWARGS and value is not None and value is not False:
            raise ValueError(f"{name}: attention argument {key} ({type(value).__name__}) is "
                             "not supported under sequence parallelism")
    _check_rope(name, getattr(module, "config", None), seq_len)
    output_BTHD = sequence.attend(query_BHTD.transpose(1, 2), key_BKTD.transpose(1, 2),
                                  value_BKTD.transpose(1, 2), attention_mask, dropout, scaling)
    return output_BTHD, None


def _check_rope(name: str, config: Any, seq_len: int) -> None:
    """ValueError where the rotary embedding of a model's ``config`` depends on which tokens a
    rank holds: ``longrope`` takes its long factors where the largest position it is given
    reaches past ``original_max_position_embeddings``, which a whole row of ``seq_len`` tokens
    may do and a rank's slice not. (``dynamic`` rope grows only past
    ``max_position_embeddings``, which ``model.seq_len`` may not exceed.)"""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(parameters, dict):
        return
    # one set of parameters, or one per layer type (Gemma 3's full and sliding attention)
    for rope in [parameters] if "rope_type" in parameters or "type" in parameters \
            else [p for p in parameters.values() if isinstance(p, dict)]:
        if rope.get("rope_type", rope.get("type")) != "longrope":
            continue
        original = rope.get("original_max_position_embeddings") or \
            getattr(config, "original_max_position_embeddings", None)
        if original is not None and seq_len > original:
            raise ValueError(f"{name}: rope_type 'longrope' under sequence parallelism needs "
                             f"seq_len {seq_len} at most original_max_position_embeddings "
                             f"{original} (each rank picks its factors from its own positions)")


def apply_sequence_parallel(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make ``model`` (memtrain's GPT, or an ``hf:`` model whose attention goes through
    transformers' attention interface) hold ``1 / N`` of every row's tokens, ``N`` the size of
    ``group``: its forward then takes this rank's slice (``row_slice``) and gives that slice's
    logits or summed loss. A no-op without a group or with one rank.

    Raises:
        ValueError: the model is neither, or its heads do not divide among the ranks.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    split_model(model, SequenceParallel(group))


def split_model(model: nn.Module, sequence: SequenceParallel) -> None:
    """``apply_sequence_parallel`` with the split given (``SequenceShapes`` for a probe).

    Raises:
        ValueError: the model is neither memtrain's GPT nor an ``hf:`` model, or its heads do
            not divide among the ranks.
    """
    if isinstance(model, GPT):
        check_divisible("model.n_head", model.cfg.n_head, sequence.size)
        for module in model.modules():
            if isinstance(module, CausalSelfAttention):
                module.sequence = sequence
    elif isinstance(model, HFCausalLM):
        _split_hf(model, sequence.size)
    else:
        raise ValueError(f"{type(model).__name__}: sequence parallelism needs memtrain's GPT or "
                         "an hf: model whose attention goes through transformers' interface")
    model.sequence = sequence


def _split_hf(model: HFCausalLM, size: int) -> None:
    """Switch ``model``'s attention to ``hf_attention`` (registered with transformers once)."""
    from transformers import AttentionInterface

    hf = model.hf
    if not type(hf).is_backend_compatible():
        raise ValueError(f"{type(hf).__name__}: its attention does not go through transformers' "
                         "attention interface, which sequence parallelism replaces")
    config = hf.config.get_text_config()
    mixer = _token_mixer(model)
    if mixer is not None:
        raise ValueError(f"{type(hf).__name__}: {mixer} mixes tokens outside attention, which "
                         "sequence parallelism would run on each rank's slice alone")
    check_divisible("num_attention_heads", config.num_attention_heads, size)
    AttentionInterface.register(HF_ATTENTION, hf_attention)
    hf.set_attn_implementation(HF_ATTENTION)


def _token_mixer(model: HFCausalLM) -> str | None:
    """The first of ``model``'s decoder layers' modules that mixes tokens other than by
    attention (named, with its class), or a layer type of its config that is not attention;
    None where there is none."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layer, named as a convolution

    # named as in the transformers model (``model.layers.0...``); the layers may be wrapped by
    # now (activation checkpointing, the tiled MLP), so their path is the one found at build
    for name, module in model.blocks.named_modules(prefix=model._layers.removeprefix("hf.")):
        cls = type(module).__name__
        if isinstance(module, nn.Conv1d) or \
                (_TOKEN_MIXER_NAMES.search(cls) and not isinstance(module, Conv1D)):
            return f"{name} ({cls})"
    layer_types = getattr(model.hf.config.get_text_config(), "layer_types", None) or ()
    for index, layer_type in enumerate(layer_types):
        if layer_type not in _ATTENTION_LAYER_TYPES:
            return f"config.layer_types[{index}] '{layer_type}'"
    return None
