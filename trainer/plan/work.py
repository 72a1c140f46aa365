"""A training step's work, counted operator by operator, not guessed.

``record_work`` runs one training micro-batch's forward and backward on fake tensors (shapes,
no data: ``trainer.compat.fake_tensor_mode``) under a dispatch mode that sees every ATen
operator the step runs: recomputation by activation checkpointing (with torch's early stop),
autocast's casts, bf16 norm copies and the chunked loss included. Each operator is of one kind:
- ``matmul`` and ``attention``: counted in FLOPs (torch's own formulas,
  ``torch.utils.flop_counter``), by the dtype they run in; products also by their contraction
  dimension (``MATMUL_K``);
- ``memory`` (elementwise and copies), ``math`` (transcendentals, normalisations, softmax:
  ``MATH_OPS``) and ``convert`` (dtype casts): counted in bytes read and written (an indexing
  operator by the rows it touches, ``INDEXING_OPS``);
- ``view``: a new view of the same data, no bytes.
The micro-batch is recorded at 1 and 2 samples and drawn to any other (every count is linear
in it), but for two things: a matrix product that contracts over the batch's tokens (a weight's
gradient) is sized for the batch predicted (``TOKENS_K``), and the chunked loss, which runs
whole chunks, is recorded apart and counted for the batch's tokens at any chunk size
(``loss_work``). The optimizer step (gradient clipping and AdamW, as
``trainer.step.train_step`` runs them) is recorded on small real stand-ins of the parameters
and scaled to their sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer.compat import fake_tensor_mode, modules_kept_in_place
from trainer.memory.loss import (
    ChunkedLossShape,
    in_chunked_loss,
    observe_chunked_losses,
    summed_loss,
)
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, ModelFactory, build_model, checkpointed_blocks
from trainer.optim import build_optimizer
from trainer.parallel.sequence import SequenceShapes, split_model

log = logging.getLogger("memtrain.planner")

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Operator kinds: which are counted in FLOPs (the rest in bytes read and written).
FLOP_KINDS = ("matmul", "attention")
BYTE_KINDS = ("memory", "math", "convert")
# Matrix products by their contraction dimension: the calibrated ones, the nearest taken.
MATMUL_K = (64, 256, 1024)
VIEW_OPS = frozenset({"aten.view", "aten._unsafe_view", "aten.t", "aten.transpose",
                      "aten.permute", "aten.expand", "aten.detach", "aten.alias", "aten.slice",
                      "aten.split", "aten.split_with_sizes", "aten.unsqueeze", "aten.squeeze",
                      "aten.select", "aten.as_strided", "aten.unbind", "aten.chunk",
                      "aten.reshape", "aten.lift_fresh", "aten.unflatten", "aten._reshape_alias",
                      "aten.empty_like", "aten.empty", "aten.new_empty", "aten.empty_strided"})
# Operators that compute more than they move (transcendentals, normalisations, softmax):
# calibrated with GELU, not with a product.
MATH_OPS = frozenset({"aten.gelu", "aten.gelu_backward", "aten.silu", "aten.silu_backward",
                      "aten.native_layer_norm", "aten.native_layer_norm_backward",
                      "aten._softmax", "aten._softmax_backward_data", "aten._log_softmax",
                      "aten._log_softmax_backward_data", "aten.exp", "aten.tanh", "aten.erf",
                      "aten.sigmoid", "aten.rsqrt", "aten.pow", "aten.mean", "aten.sum",
                      "aten._fused_rms_norm", "aten._fused_rms_norm_backward", "aten.cos",
                      "aten.sin", "aten.sqrt", "aten.var_mean", "aten.nll_loss_forward",
                      "aten.nll_loss_backward", "aten.linalg_vector_norm"})
CONVERT_OPS = frozenset({"aten._to_copy", "aten.copy_", "aten.to", "aten.clone"})
# Operators that read or write a few rows of their largest tensor, not all of it: counted by
# their other tensors, read and written.
INDEXING_OPS = frozenset({"aten.index", "aten.index_put_", "aten.index_put",
                          "aten._index_put_impl_", "aten.gather", "aten.scatter",
                          "aten.scatter_add", "aten.index_select", "aten.embedding",
                          "aten.nll_loss_forward"})
# Attention kernels, with the argument index where query, key and value start.
SDPA_OPS = {"aten._scaled_dot_product_flash_attention_for_cpu": ("forward", 0),
            "aten._scaled_dot_product_flash_attention_for_cpu_backward": ("backward", 1),
            "aten._scaled_dot_product_flash_attention": ("forward", 0),
            "aten._scaled_dot_product_flash_attention_backward": ("backward", 1),
            "aten._scaled_dot_product_efficient_attention": ("forward", 0),
            "aten._scaled_dot_product_efficient_attention_backward": ("backward", 1),
            "aten._scaled_dot_product_cudnn_attention": ("forward", 0),
            "aten._scaled_dot_product_cudnn_attention_backward": ("backward", 1)}
MATMUL_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"})




@dataclass
class Work:
    """Operators and their FLOPs or bytes, by key ``kind:dtype`` (``matmul:dtype:kK`` for a
    matrix product with contraction dimension near K)."""

    ops: dict[str, float] = field(default_factory=dict)
    amount: dict[str, float] = field(default_factory=dict)  # FLOPs or bytes, by key

    def add(self, key: str, amount: float = 0.0) -> None:
        self.ops[key] = self.ops.get(key, 0) + 1
        self.amount[key] = self.amount.get(key, 0) + amount

    def kinds(self) -> set[str]:
        return set(self.ops) | set(self.amount)

    def at_batch(self, at_two: Work, batch: int) -> Work:
        """This work (recorded at batch 1) and ``at_two`` (the same step at batch 2), drawn to
        ``batch``: every count is linear in the batch."""
        a, b = 2 - batch, batch - 1
        keys = self.kinds() | at_two.kinds()
        return Work({k: a * self.ops.get(k, 0) + b * at_two.ops.get(k, 0) for k in keys},
                    {k: a * self.amount.get(k, 0) + b * at_two.amount.get(k, 0) for k in keys})

    def scaled(self, factor: float) -> Work:
        """The same operators on tensors ``factor`` times as large."""
        return Work(dict(self.ops), {k: v * factor for k, v in self.amount.items()})

    def plus(self, other: Work, factor: float = 1.0) -> Work:
        """This work and ``factor`` times ``other`` (a negative factor takes it out)."""
        keys = self.kinds() | other.kinds()
        return Work({k: self.ops.get(k, 0) + factor * other.ops.get(k, 0) for k in keys},
                    {k: self.amount.get(k, 0) + factor * other.amount.get(k, 0) for k in keys})

    def only(self, dtype: str) -> Work:
        """The operators that ran in ``dtype``."""
        return Work({k: v for k, v in self.ops.items() if k.split(":")[1] == dtype},
                    {k: v for k, v in self.amount.items() if k.split(":")[1] == dtype})


def _dtype_name(tensors: list[torch.Tensor]) -> str:
    for tensor in tensors:
        if tensor.is_floating_point():
            return DTYPES.get(tensor.dtype, "fp32")
    return "fp32"


def matmul_bucket(k: int) -> int:
    """The calibrated contraction dimension nearest ``k`` (in ratio)."""
    return min(MATMUL_K, key=lambda bucket: abs(math.log2(max(k, 1) / bucket)))


def _contraction(name: str, args: Any) -> int:
    """The contraction dimension of a matrix product's arguments."""
    first = args[1] if name in ("aten.addmm", "aten.baddbmm") else args[0]
    return int(first.shape[-1])


# The size key of a matrix product that contracts over the micro-batch's tokens (a weight's
# gradient, ``x.T @ dy``): its calibrated size is chosen for the batch it is predicted at
# (``StepWork.forward_backward``), not the batch it was recorded at.
TOKENS_K = "kT"


class _WorkRecorder(TorchDispatchMode):
    """Counts every ATen operator run inside it into a ``Work``; ``tokens``: the micro-batch's
    tokens, to tell the products that contract over them."""

    def __init__(self, tokens: int = 0) -> None:
        super().__init__()
        self.work = Work()
        self.tokens = tokens

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        from torch.utils.flop_counter import (
            flop_registry,
            sdpa_backward_flop_count,
            sdpa_flop_count,
        )

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = str(packet)
        if not name.startswith("aten."):
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        dtype = _dtype_name(inputs or outputs)
        if name in SDPA_OPS:
            direction, first = SDPA_OPS[name]
            q, k, v = (args[first + i].shape for i in range(3))
            flops = sdpa_flop_count(q, k, v) if direction == "forward" \
                else sdpa_backward_flop_count(args[0].shape, q, k, v)
            self.work.add(f"attention:{dtype}", flops)
        elif name in MATMUL_OPS:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            k = _contraction(name, args)
            size = TOKENS_K if k == self.tokens and not in_chunked_loss() \
                else f"k{matmul_bucket(k)}"
            self.work.add(f"matmul:{dtype}:{size}", flops)
        elif packet in flop_registry:  # convolutions and the like: a matrix product's rate
            self.work.add(f"matmul:{dtype}", flop_registry[packet](*args, **kwargs,
                                                                   out_val=out))
        elif name in VIEW_OPS or func.is_view:
            self.work.add(f"view:{dtype}")
        else:
            kind = "math" if name in MATH_OPS else "convert" if name in CONVERT_OPS \
                else "memory"
            sizes = [t.numel() * t.element_size() for t in inputs + outputs]
            if name in INDEXING_OPS:
                nbytes = 2 * (sum(sizes) - max(sizes, default=0))
            else:
                nbytes = sum(sizes)
            self.work.add(f"{kind}:{dtype}", nbytes)
        return out


@contextlib.contextmanager
def recording(tokens: int = 0) -> Iterator[Work]:
    recorder = _WorkRecorder(tokens)
    with recorder:
        yield recorder.work


@dataclass(frozen=True)
class StepWork:
    """One rank's work in a step: forward+backward of one micro-batch at 1 and 2 samples, the
    optimizer step, and the gradient bytes DDP all-reduces.

    With a chunked loss (``loss``), the two forward+backward passes are recorded without it:
    the loss runs whole chunks, so its operators are not linear in the batch, and its chunk
    size is a choice of the plan. ``forward_backward`` adds it back for the batch's tokens
    (``loss_work``), at the recorded chunk size or another."""

    forward_backward_1: Work
    forward_backward_2: Work
    optimizer: Work
    grad_bytes: int
    seq_len: int
    autocast: bool = False  # recorded under bf16 or fp16 autocast
    checkpointed_blocks: int = 0  # blocks activation checkpointing wrapped
    loss: ChunkedLossShape | None = None
    loss_dtype: str = "fp32"  # the loss's autocast dtype (its matrix products')

    def forward_backward(self, batch: int, loss_chunk_tokens: int | None = None) -> Work:
        drawn = self.forward_backward_1.at_batch(self.forward_backward_2, batch)
        size = f"k{matmul_bucket(batch * self.seq_len)}"
        body = Work()
        for key in drawn.kinds():  # products over the batch's tokens: at this batch's size
            sized = key.replace(TOKENS_K, size)
            body.ops[sized] = body.ops.get(sized, 0) + drawn.ops.get(key, 0)
            body.amount[sized] = body.amount.get(sized, 0) + drawn.amount.get(key, 0)
        if self.loss is None:
            return body
        shape = self.loss if loss_chunk_tokens is None else \
            dataclasses.replace(self.loss, chunk_tokens=loss_chunk_tokens)
        return body.plus(loss_work(shape, batch * self.seq_len, self.loss_dtype))


@functools.cache
def _record_loss(shape: ChunkedLossShape, tokens: int, dtype: str) -> Work:
    """The chunked loss's forward and backward over ``tokens`` tokens, on fake tensors (kept:
    the planner asks for the same few shapes for every plan row)."""
    from trainer.memory.loss import linear_cross_entropy_sum

    by_size = {2: torch.bfloat16 if dtype == "bf16" else torch.float16, 4: torch.float32}
    with fake_tensor_mode():
        hidden_NC = torch.empty(tokens, shape.width, dtype=by_size[shape.hidden_itemsize],
                                requires_grad=True)
        weight_VC = torch.empty(shape.vocab_size, shape.width,
                                dtype=by_size[shape.weight_itemsize], requires_grad=True)
        targets_N = torch.zeros(tokens, dtype=torch.long)
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
        with recording() as work:
            with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
                loss = linear_cross_entropy_sum(hidden_NC, weight_VC, targets_N,
                                                shape.chunk_tokens)
            loss.backward()
    return work


def loss_work(shape: ChunkedLossShape, tokens: int, dtype: str) -> Work:
    """The chunked loss's operators over ``tokens`` tokens in chunks of
    ``shape.chunk_tokens``: one chunk's and two chunks' recordings, the second's extra chunk
    repeated for every further whole chunk, and a last, shorter chunk recorded as itself
    (each recording holds at most two chunks, so a long micro-batch costs no more to count)."""
    chunk = shape.chunk_tokens

    def recorded(n: int) -> Work:
        return _record_loss(shape, n, dtype)

    if tokens <= 2 * chunk:
        return recorded(tokens)
    whole, rest = divmod(tokens, chunk)
    one = recorded(chunk)
    work = one.plus(recorded(2 * chunk).plus(one, -1.0), whole - 1)
    return work.plus(recorded(chunk + rest).plus(one, -1.0)) if rest else work


def record_work(factory: ModelFactory, transforms: MemoryTransforms, seq_len: int,
                vocab_size: int, precision: str, sequence: int = 1) -> StepWork:
    """Count the operators of a training step of the model built with ``transforms``: on fake
    tensors, or on real ones for a model whose forward cannot run on fake tensors.
    ``sequence``: one rank's step under ``parallel.sequence`` (``seq_len``: its tokens of a
    row; attention over whole rows for its share of the heads, the all-to-alls left out)."""
    try:
        with fake_tensor_mode(), modules_kept_in_place():
            return _record_work(factory, transforms, seq_len, vocab_size, precision, sequence)
    except Exception as err:  # noqa: BLE001 - any failure of a model on fake tensors
        log.info("planner: counting the step's operators on real tensors (%s)",
                 type(err).__name__)
        return _record_work(factory, transforms, seq_len, vocab_size, precision, sequence)


def _record_work(factory: ModelFactory, transforms: MemoryTransforms, seq_len: int,
                 vocab_size: int, precision: str, sequence: int = 1) -> StepWork:
    policy = precision_policy(precision, torch.device("cpu"), warn=False)
    model = build_model(factory, transforms)
    if sequence > 1:
        split_model(model, SequenceShapes(sequence))
    model.train()
    passes = []
    for batch in (1, 2):
        tokens_BT = torch.randint(0, vocab_size, (batch, seq_len + 1))
        with observe_chunked_losses() as losses, recording(batch * seq_len) as work:
            summed_loss(model, tokens_BT, policy).backward()
        model.zero_grad(set_to_none=True)
        passes.append(work)
    chunked = [shape for shape in losses if isinstance(shape, ChunkedLossShape)]
    loss = chunked[0] if len(chunked) == 1 else None
    dtype = DTYPES.get(policy.autocast_dtype, "fp32") if policy.autocast_dtype else "fp32"
    if loss is not None:  # the loss is counted apart (StepWork), for its whole chunks
        passes = [work.plus(loss_work(loss, batch * seq_len, dtype), -1.0)
                  for batch, work in zip((1, 2), passes, strict=True)]
    params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    shapes = [(p.dim(), p.numel(), p.element_size()) for p in params]
    return StepWork(passes[0], passes[1], optimizer_work(shapes),
                    sum(numel * size for _dim, numel, size in shapes), seq_len,
                    policy.autocast_dtype is not None, len(checkpointed_blocks(model)),
                    loss, dtype)


STAND_IN_NUMEL = 256


def optimizer_work(shapes: list[tuple[int, int, int]]) -> Work:
    """Gradient clipping and AdamW as ``trainer.step`` runs them on CPU, recorded on a real
    stand-in of each parameter (``STAND_IN_NUMEL`` elements, a matrix where the parameter is
    one: weight decay follows dimensions) and scaled to the parameters' sizes."""

    stand_ins = nn.ParameterList(
        nn.Parameter(torch.zeros(16, 16) if dim >= 2 else torch.zeros(STAND_IN_NUMEL))
        for dim, _numel, _size in shapes)
    for p in stand_ins:
        p.grad = torch.zeros_like(p)
    optimizer = build_optimizer(stand_ins, lr=1e-3, fused=False)
    with recording() as work:
        torch.nn.utils.clip_grad_norm_(stand_ins.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    numel = sum(numel for _dim, numel, _size in shapes)
    return work.scaled(numel / max(1, STAND_IN_NUMEL * len(shapes)))
