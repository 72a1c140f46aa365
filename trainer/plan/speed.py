"""Predict a plan's step time before a run: the step's operators over the device's speed.

The work is counted, not guessed. ``record_work`` runs one training micro-batch's forward and
backward on fake tensors (shapes, no data: ``trainer.compat.fake_tensor_mode``) under a
dispatch mode that sees every ATen operator the step runs: recomputation by activation
checkpointing (with torch's early stop), autocast's casts, bf16 norm copies and the chunked
loss included. Each operator is of one kind:
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

The speed is measured on this machine's CPU (``calibrate_cpu``, cached per machine by
``cpu_speed``): each kind's rate in fp32 and bf16, an operator's fixed cost and what a
checkpointed block's wrapper adds; then the fixed costs (autocast's too) and each dtype's
rates are fitted to a small GPT's real steps at two sizes. A GPU is its datasheet peaks times
the share eager PyTorch reaches (``gpu_speed``; ``make gpu-check`` measures that share against
its rows).

A step of ``a`` micro-batches of ``m`` samples takes ``a * t(m) + t(optimizer) + the exposed
all-reduce + a * loader(m)``, each ``t`` the operators' fixed costs plus their FLOPs or bytes
over the rates; on a GPU, which launches while it computes, the larger of the two. DDP's
all-reduce hides behind the last micro-batch's backward, except under OOM recovery, which
reduces after it. ``loader(m)`` is the data loader's cost of one batch of ``m`` samples,
measured on the dataset itself (``measure_loader``): the loader gathers each batch on the
training thread (``datapipe.loader``), so on CPU it adds to the step; on a GPU the host
gathers while the device computes, and the step takes the larger of the two.

Left out, and why the figures rank plans better than they promise a number: a kernel's speed
at shapes far from the calibrated ones; page faults on CPU (the trainer and the calibration keep
freed memory in glibc's heap, ``keep_freed_host_memory``, so large tensors reuse pages; under
another allocator a larger micro-batch pays faults the model does not see); torch.compile's
fusion on CPU, and on a GPU beyond one factor (``compiled_speed``), and the time it compiles;
the kernels a GPU picks per shape; and several workers sharing one host's cores (a plan is
timed at the planning process's thread count).
``memtrain plan --measure`` and ``make bench-plan`` measure the error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from monitoring.host import cpu_info
from trainer.build import MemoryTransforms, ModelFactory, build_model, checkpointed_blocks
from trainer.compat import fake_tensor_mode
from trainer.memory.allocator import keep_freed_host_memory
from trainer.memory.loss import (
    ChunkedLossShape,
    in_chunked_loss,
    observe_chunked_losses,
    summed_loss,
)
from trainer.memory.precision import precision_policy

log = logging.getLogger("memtrain.planner")
CALIBRATION_VERSION = 17
# A calibration is stable when the small GPT's steps it times take, at the median of their
# repeats, at most this much longer than at their fastest (``repeat_spread``): 1-4% on an idle
# 2-core EPYC, 10-40% beside a test suite's other process. An unstable one is used by the call
# that took it, and taken again by the next process that finds it in the cache.
CALIBRATION_SPREAD_BOUND = 0.10
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Operator kinds: which are counted in FLOPs (the rest in bytes read and written).
FLOP_KINDS = ("matmul", "attention")
BYTE_KINDS = ("memory", "math", "convert")
# Matrix products by their contraction dimension: the calibrated ones, the nearest taken.
MATMUL_K = (64, 256, 1024)
# Elements of the tensors the byte-counted kinds are calibrated on: 32 MiB in fp32, beyond a
# core's cache, as a step's activations are.
BYTE_ELEMENTS = 1 << 23
# Datasheet peaks of the GPUs a plan can name (dense, no sparsity): FLOP/s per dtype (fp32
# without TF32: torch's default for matrix products) and memory bandwidth in bytes/s.
GPU_PEAKS: dict[str, dict[str, float]] = {
    "h200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "bandwidth": 4.8e12},
    "h100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "bandwidth": 3.35e12},
    "a100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "bandwidth": 2.0e12},
}
# The share of those peaks an eager PyTorch step reaches: FLOPs by dtype, and bandwidth. Fitted
# to ``make gpu-check``'s H200 rows of 2026-11-30 (GPT-2 124M, micro-batch 16, fp32 and bf16 x
# no, selective and full checkpointing; measured 774 TFLOP/s for a bf16 8192^3 product): the
# model then predicts those rows' tokens/s within -8% to +4%, in the measured order.
GPU_EFFICIENCY = {"fp32": 0.75, "bf16": 0.7, "fp16": 0.7, "memory": 0.6}
GPU_LAUNCH_SECONDS = 6e-6
# torch.compile (Inductor) fuses a step's elementwise, normalising and conversion operators into
# fewer kernels that read and write less; matrix products and attention stay as they are. On a
# GPU the model counts those operators' bytes and launches at this share
# (``compiled_speed``), fitted to ``make gpu-check``'s compiled row of 2026-11-30 (H200, GPT-2
# 124M, bf16, no checkpointing, micro-batch 16: 452,726 tokens/s compiled, 335,620 eager; the
# model then predicts 1.35x). One row of one model: the fusion of other models is a guess.
GPU_COMPILED_SHARE = 0.57
# Collective bandwidth for DDP's all-reduce (bus bytes/s): NVLink between the GPUs of a node
# (H100/H200 class, about a third of its 900 GB/s after NCCL's protocol); gloo over loopback
# on CPU, an estimate of the order bench/trainer.py sees with 2 ranks.
ALLREDUCE_BYTES_PER_S = {"cuda": 300e9, "cpu": 1.5e9}
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
                vocab_size: int, precision: str) -> StepWork:
    """Count the operators of a training step of the model built with ``transforms``: on fake
    tensors, or on real ones for a model whose forward cannot run on fake tensors."""
    try:
        with fake_tensor_mode():
            return _record_work(factory, transforms, seq_len, vocab_size, precision)
    except Exception as err:  # noqa: BLE001 - any failure of a model on fake tensors
        log.info("planner: counting the step's operators on real tensors (%s)",
                 type(err).__name__)
        return _record_work(factory, transforms, seq_len, vocab_size, precision)


def _record_work(factory: ModelFactory, transforms: MemoryTransforms, seq_len: int,
                 vocab_size: int, precision: str) -> StepWork:
    policy = precision_policy(precision, torch.device("cpu"), warn=False)
    model = build_model(factory, transforms)
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
    from trainer.step import build_optimizer

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


@dataclass(frozen=True)
class DeviceSpeed:
    """How fast a device runs each kind of work: ``rates`` in FLOP/s (matmul, attention) or
    bytes/s (memory, math, convert) by key ``kind:dtype[:kK]``, the fixed seconds of one
    operator by kind, and whether operators overlap their launches (a GPU)."""

    name: str
    rates: dict[str, float]
    op_seconds: dict[str, float]  # by kind
    allreduce_bytes_per_s: float
    asynchronous: bool = False  # a GPU: the host launches while the device computes
    source: str = ""
    # A CPU's calibration: when it was taken (Unix seconds) and how far its repeats spread
    # (``CALIBRATION_SPREAD_BOUND``); 0 for a GPU's datasheet figures.
    calibrated_at: float = 0.0
    spread: float = 0.0

    @property
    def stable(self) -> bool:
        return self.spread <= CALIBRATION_SPREAD_BOUND

    def describe(self, now: float | None = None) -> str:
        """Where the figures come from, and for a calibration its age and stability."""
        if not self.calibrated_at:
            return self.source
        age = max(0.0, (time.time() if now is None else now) - self.calibrated_at)
        ago = (f"{age / 86400:.0f} days" if age >= 2 * 86400 else
               f"{age / 3600:.0f} h" if age >= 2 * 3600 else f"{age / 60:.0f} min")
        verdict = "stable" if self.stable else \
            f"over {CALIBRATION_SPREAD_BOUND:.0%}: unstable, measured again at the next plan"
        return f"{self.source}, {ago} ago, repeats within {self.spread:.0%} ({verdict})"

    def rate(self, key: str) -> float:
        """The rate of ``key``, else of a less specific key (no size, then fp32)."""
        parts = key.split(":")
        for candidate in (key, ":".join(parts[:2]), f"{parts[0]}:fp32"):
            if candidate in self.rates:
                return self.rates[candidate]
        fallback = "matmul:fp32:k256" if parts[0] in FLOP_KINDS else "memory:fp32"
        return self.rates[fallback]

    def seconds(self, work: Work, autocast: bool = False) -> float:
        """Seconds of ``work``; ``autocast``: run under a low precision's autocast, whose
        dispatch multiplies every operator's fixed cost by ``op_seconds["autocast"]``."""
        launch = compute = 0.0
        scale = self.op_seconds.get("autocast", 1.0) if autocast else 1.0
        for key in work.kinds():
            kind = key.split(":")[0]
            launch += work.ops.get(key, 0) * self.op_seconds.get(kind, 0.0) * scale
            if kind != "view":
                compute += work.amount.get(key, 0) / self.rate(key)
        return max(launch, compute) if self.asynchronous else launch + compute

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def gpu_speed(name: str, efficiency: dict[str, float] | None = None) -> DeviceSpeed:
    """A GPU from its datasheet peaks (``GPU_PEAKS``) times the share eager PyTorch reaches."""
    key = name.lower().replace("nvidia", "").replace(" ", "").split("-")[0]
    match = next((gpu for gpu in GPU_PEAKS if key.startswith(gpu)), None)
    if match is None:
        raise ValueError(f"GPU {name!r} has no peak figures; known: {', '.join(GPU_PEAKS)}")
    eff = {**GPU_EFFICIENCY, **(efficiency or {})}
    peaks = GPU_PEAKS[match]
    rates = {f"{kind}:{dtype}": peaks[dtype] * eff[dtype]
             for kind in FLOP_KINDS for dtype in DTYPES.values()}
    rates.update({f"{kind}:{dtype}": peaks["bandwidth"] * eff["memory"]
                  for kind in BYTE_KINDS for dtype in DTYPES.values()})
    launch = {kind: GPU_LAUNCH_SECONDS for kind in (*FLOP_KINDS, *BYTE_KINDS)}
    return DeviceSpeed(match.upper(), rates, {**launch, "view": 0.0},
                       ALLREDUCE_BYTES_PER_S["cuda"], asynchronous=True,
                       source=f"datasheet peaks x {eff['bf16']:.0%} (bf16), "
                              f"{eff['fp32']:.0%} (fp32), {eff['memory']:.0%} (bandwidth)")


def compiled_speed(device: DeviceSpeed, share: float = GPU_COMPILED_SHARE) -> DeviceSpeed:
    """``device`` (a GPU) running a ``torch.compile``'d step: the byte-counted operators'
    bytes and launches at ``share`` of the eager step's (``GPU_COMPILED_SHARE``)."""
    if not device.asynchronous:
        raise ValueError(f"{device.name}: the compiled step is modelled on GPUs only")
    rates = {key: rate / share if key.split(":")[0] in BYTE_KINDS else rate
             for key, rate in device.rates.items()}
    op_seconds = {kind: seconds * share if kind in BYTE_KINDS else seconds
                  for kind, seconds in device.op_seconds.items()}
    return dataclasses.replace(device, rates=rates, op_seconds=op_seconds,
                               source=f"{device.source}; compiled: element-wise work x {share}")


def named_gpu_speed(name: str | None) -> DeviceSpeed:
    """``gpu_speed(name)``, or an H200's where no GPU is named or the name has no figures
    (said in the log)."""
    if name is None:
        log.info("planner: no GPU to plan for here; planning speed with an H200's figures")
    else:
        try:
            return gpu_speed(name)
        except ValueError as err:
            log.info("planner: %s; planning speed with an H200's", err)
    return gpu_speed("h200")


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """``fn``'s fastest time over ``repeats`` calls, after a warm-up."""
    return _interleaved_best({0: fn}, repeats)[0]


def _op_overhead_seconds() -> float:
    """The fixed cost of one operator in a real training forward and backward: a small
    network's step timed, over the operators it runs (dispatch, autograd, module calls)."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU())
                          for _ in range(16)))
    x_BC = torch.randn(2, 8)

    def step() -> None:
        net(x_BC).sum().backward()

    with recording() as work:
        step()
    return _best_seconds(step, 20) / sum(work.ops.values())


def _checkpoint_seconds(op_seconds: float) -> float:
    """The fixed cost of one checkpointed block in a forward and backward beyond its
    operators' (the wrapper's Python: saved-tensor hooks, RNG state, the recomputation's
    bookkeeping), from 16 narrow blocks timed with and without it."""
    from trainer.memory.activation_checkpointing import apply_activation_checkpointing

    def timed(wrap: bool) -> tuple[float, float]:
        torch.manual_seed(0)
        net = nn.Module()
        blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(16))
        net.blocks = blocks
        if wrap:
            apply_activation_checkpointing(net, "full")
        x_BC = torch.randn(2, 8, requires_grad=True)

        def step() -> None:
            y_BC = x_BC
            for block in blocks:
                y_BC = block(y_BC)
            y_BC.sum().backward()

        with recording() as work:
            step()
        return _best_seconds(step, 20), sum(work.ops.values())

    (plain, plain_ops), (wrapped, wrapped_ops) = timed(False), timed(True)
    return max(0.0, (wrapped - plain - (wrapped_ops - plain_ops) * op_seconds) / 16)


def _matmul_seconds(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    a_MK, b_KN = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return _best_seconds(lambda: a_MK @ b_KN, repeats)


def _attention_seconds(dtype: torch.dtype) -> tuple[float, float]:
    """(FLOPs, seconds) of a causal attention's forward and backward (8 heads of 64, 512
    positions), with the FLOPs the recorder counts for it."""
    from torch.nn.functional import scaled_dot_product_attention
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = (1, 8, 512, 64)
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))

    def run() -> None:
        scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape,
                                                                            shape, shape)
    return flops, _best_seconds(run, 3)


def _bytes_per_second(fn: Callable[[torch.Tensor, torch.Tensor], object], dtype: torch.dtype,
                      out_dtype: torch.dtype, bytes_per_element: int) -> float:
    """Bytes read and written per second by ``fn(x, out)`` on ``BYTE_ELEMENTS`` elements
    (``bytes_per_element`` of its input and output together), less its time on 64. The output
    is allocated once: what a fresh large output costs in page faults is left out (the module's
    docstring)."""
    def seconds(elements: int, repeats: int) -> float:
        x, out = torch.randn(elements, dtype=dtype), torch.empty(elements, dtype=out_dtype)
        return _best_seconds(lambda: fn(x, out), repeats)

    spent = max(seconds(BYTE_ELEMENTS, 3) - seconds(64, 20), 1e-9)
    return BYTE_ELEMENTS * bytes_per_element / spent


def calibrate_cpu() -> DeviceSpeed:
    """Measure this CPU at torch's thread count, in fp32 and bf16: matrix products at three
    contraction dimensions, attention, elementwise products, GELU and dtype conversions, and an
    operator's fixed cost. Takes a few seconds."""
    keep_freed_host_memory()  # as the trainer's CPU workers run
    rates: dict[str, float] = {}
    matmul_fixed = float("inf")
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        size = torch.finfo(dtype).bits // 8
        other = torch.bfloat16 if dtype == torch.float32 else torch.float32
        fixed = _matmul_seconds(32, 32, 32, dtype, 20)
        matmul_fixed = min(matmul_fixed, fixed)
        for k in MATMUL_K:
            m, n = 2048, 1024
            seconds = max(_matmul_seconds(m, k, n, dtype, 3) - fixed, 1e-9)
            rates[f"matmul:{name}:k{k}"] = 2 * m * k * n / seconds
        flops, seconds = _attention_seconds(dtype)
        rates[f"attention:{name}"] = flops / seconds
        other_size = torch.finfo(other).bits // 8
        rates[f"memory:{name}"] = _bytes_per_second(
            lambda x, out: torch.mul(x, x, out=out), dtype, dtype, 3 * size)
        rates[f"math:{name}"] = _bytes_per_second(
            lambda x, out: torch.ops.aten.gelu.out(x, out=out), dtype, dtype, 2 * size)
        rates[f"convert:{name}"] = _bytes_per_second(
            lambda x, out: out.copy_(x), dtype, other, size + other_size)
    overhead = _op_overhead_seconds()
    op_seconds = {kind: overhead for kind in BYTE_KINDS}
    op_seconds.update({kind: overhead + matmul_fixed for kind in FLOP_KINDS}, view=overhead / 2,
                      checkpoint=_checkpoint_seconds(overhead))
    threads = torch.get_num_threads()
    speed = DeviceSpeed(cpu_name(), rates, op_seconds, ALLREDUCE_BYTES_PER_S["cpu"],
                        source=f"measured on this CPU, {threads} thread{'s' * (threads > 1)}",
                        calibrated_at=time.time())
    speed = _in_model(speed)
    speed.rates.update({key.replace("bf16", "fp16"): rate for key, rate in
                        list(speed.rates.items()) if ":bf16" in key})  # CPU fp16 is rare
    return speed


# The small GPT's steps the calibration times, (samples, positions): the fixed costs dominate
# the first (a step of 8 tokens is mostly dispatch), the compute the last. Without the first,
# the fixed costs were 5% of the smallest fp32 step, and their fitted scale ranged 1.0-3.4
# between idle calibrations on a 2-core EPYC.
IN_MODEL_STEPS = ((1, 8), (1, 256), (4, 256), (16, 256))
IN_MODEL_ROUNDS = 5


def _interleaved_times(steps: dict[Any, Callable[[], object]],
                       rounds: int) -> dict[Any, list[float]]:
    """Each step's times over ``rounds`` passes that take every step in turn: a machine whose
    speed drifts (a shared VM's, by 15-30% within minutes) slows all of them alike, rather than
    the ones timed during a slow spell."""
    for fn in steps.values():
        fn()  # warm-up: first-call allocation and kernel selection
    times: dict[Any, list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return times


def _interleaved_best(steps: dict[Any, Callable[[], object]], rounds: int) -> dict[Any, float]:
    """Each step's fastest time over ``rounds`` interleaved passes (``_interleaved_times``)."""
    return {key: min(times) for key, times in _interleaved_times(steps, rounds).items()}


def repeat_spread(times: dict[Any, list[float]]) -> float:
    """How far repeated timings disagree: the steps' medians added up, over their fastest
    times added up, less 1 (0.08: a pass at the median took 8% longer than the fastest). Summed,
    the longer steps weigh most: a step of a few milliseconds is mostly dispatch, and its
    repeats spread 5-15% on an idle machine."""
    best = sum(min(t) for t in times.values() if t)
    return sum(statistics.median(t) for t in times.values() if t) / best - 1 if best else 0.0


def _fit_scales(rows: list[tuple[float, float, float, float]],
                b_bounds: tuple[float, float] = (1.0, 4.0),
                a_bounds: tuple[float, float] = (0.5, 8.0)) -> tuple[float, float]:
    """(a, b) minimising the relative error of ``a x fixed + b x own + other`` against
    ``measured`` over ``rows`` (least squares, each row divided by its measured time), within
    bounds: where one scale is held at a bound, the other is fitted again with it held there
    (the unconstrained pair, clipped apart, over-predicts every step). The bounds keep a noisy
    measurement in check: rates never faster in a model than alone, nor over 4x slower; fixed
    costs 0.5-8x the isolated figure."""
    sff = sfc = scc = sfy = scy = 0.0
    for fixed, own, other, measured in rows:
        f, c, y = fixed / measured, own / measured, (measured - other) / measured
        sff, sfc, scc = sff + f * f, sfc + f * c, scc + c * c
        sfy, scy = sfy + f * y, scy + c * y
    det = sff * scc - sfc * sfc
    if det <= 0:  # (det > 0 implies sff > 0 and scc > 0, the divisors below)
        return 1.0, 1.0

    def clip(value: float, bounds: tuple[float, float]) -> float:
        return min(max(value, bounds[0]), bounds[1])

    a, b = (sfy * scc - scy * sfc) / det, (sff * scy - sfc * sfy) / det
    if not a_bounds[0] <= a <= a_bounds[1]:
        a = clip(a, a_bounds)
        b = (scy - a * sfc) / scc
    if not b_bounds[0] <= b <= b_bounds[1]:
        b = clip(b, b_bounds)
        a = clip((sfy - b * sfc) / sff, a_bounds)
    return a, b


def _in_model(speed: DeviceSpeed) -> DeviceSpeed:
    """The rates and fixed costs as a model reaches them: operators back to back on operands
    that come from memory, not from the cache of a repeated call (bf16's fast kernels lose the
    most), and autocast's dispatch on every operator.

    A small GPT's real forward and backward (2 blocks of width 128) is timed at each of
    ``IN_MODEL_STEPS`` in fp32 and in bf16, all interleaved (``_interleaved_best``), against
    what the isolated figures predict for the operators it ran. Its fixed costs are the same at
    every size and its compute grows with it, so two scales are fitted to each dtype's steps
    (``_fit_scales``): the operators' fixed cost and the dtype's rates. fp32 first:
    a bf16 step runs fp32 operators too, and its fixed-cost scale is autocast's
    (``op_seconds["autocast"]``, a factor)."""
    from trainer.model import GPT, GPTConfig

    cfg = GPTConfig(seq_len=256, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.train()
    steps: dict[Any, Callable[[], object]] = {}
    works: dict[tuple[str, int, int], Work] = {}
    for name in ("fp32", "bf16"):
        policy = precision_policy(name, torch.device("cpu"), warn=False)
        for batch, positions in IN_MODEL_STEPS:
            tokens_BT = torch.randint(0, cfg.vocab_size, (batch, positions + 1))

            def step(policy: Any = policy, tokens_BT: torch.Tensor = tokens_BT) -> None:
                summed_loss(model, tokens_BT, policy).backward()
                model.zero_grad(set_to_none=True)

            with recording() as work:
                step()
            steps[name, batch, positions], works[name, batch, positions] = step, work
    times = _interleaved_times(steps, rounds=IN_MODEL_ROUNDS)
    measured = {key: min(t) for key, t in times.items()}
    current = dataclasses.replace(speed, spread=repeat_spread(times))
    for name in ("fp32", "bf16"):
        rows = []  # (fixed, own compute, other compute, measured) seconds at each size
        for shape in IN_MODEL_STEPS:
            work = works[(name, *shape)]
            fixed = current.seconds(work.scaled(0.0))
            own = current.seconds(work.only(name)) - current.seconds(work.only(name).scaled(0.0))
            rows.append((fixed, own, current.seconds(work) - fixed - own,
                         measured[(name, *shape)]))
        fixed_scale, rate_scale = _fit_scales(rows)
        rates = {k: v / rate_scale if k.split(":")[1] == name else v
                 for k, v in current.rates.items()}
        log.debug("planner: %s in a model: fixed costs x %.2f, rates / %.2f", name, fixed_scale,
                  rate_scale)
        if name == "fp32":  # every operator's fixed cost (the checkpoint wrapper's is its own)
            op_seconds = {k: v if k == "checkpoint" else v * fixed_scale
                          for k, v in current.op_seconds.items()}
        else:
            op_seconds = {**current.op_seconds, "autocast": max(1.0, fixed_scale)}
        current = dataclasses.replace(current, rates=rates, op_seconds=op_seconds)
    return current


def cpu_name() -> str:
    return cpu_info().name


def cache_dir() -> Path:
    """Where calibrations are kept: ``$MEMTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/memtrain``,
    else ``~/.cache/memtrain``."""
    if os.environ.get("MEMTRAIN_CACHE_DIR"):
        return Path(os.environ["MEMTRAIN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "memtrain"


# The calibrations this process took, by cache file: an unstable one is measured again once
# per process, not at every call.
_TAKEN: dict[Path, DeviceSpeed] = {}


def cpu_speed(refresh: bool = False) -> DeviceSpeed:
    """This CPU's calibration, measured once per machine, torch version and thread count, and
    kept in ``cache_dir()``. A stable one is kept until ``refresh``; an unstable one
    (``CALIBRATION_SPREAD_BOUND``) is measured again by the next process that reads it, and the
    steadier of the two is kept."""
    from trainer.compat import cpu_bf16_support, cpu_capability

    key = json.dumps([CALIBRATION_VERSION, cpu_name(), cpu_capability(), cpu_bf16_support(),
                      torch.__version__, torch.get_num_threads()])
    path = cache_dir() / f"cpu-speed-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    cached = None
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        cached = DeviceSpeed(**json.loads(path.read_text()))
    if not refresh and cached is not None and (cached.stable or path in _TAKEN):
        return cached
    start = time.perf_counter()
    speed = calibrate_cpu()
    _TAKEN[path] = speed
    log.info("planner: calibrated this CPU in %.1f s, repeats within %.0f%% (%s)",
             time.perf_counter() - start, 100 * speed.spread, path)
    if not speed.stable:
        log.warning("planner: this CPU's calibration is unstable (its repeats spread %.0f%%, "
                    "over %.0f%%: the machine is busy); it is used now and measured again at "
                    "the next plan", 100 * speed.spread, 100 * CALIBRATION_SPREAD_BOUND)
    if cached is not None and not refresh and cached.spread < speed.spread:
        return cached  # the steadier of the two
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(speed.as_dict(), indent=1))
        tmp.replace(path)
    return speed


@dataclass(frozen=True)
class LoaderCost:
    """The data loader's cost of one batch of ``m`` samples: ``per_batch + m * per_sample``
    seconds on the training thread, and how it was measured."""

    per_batch: float
    per_sample: float
    source: str = ""

    def seconds(self, batch: int) -> float:
        return self.per_batch + batch * self.per_sample


def measure_loader(path: str, column: str, world_size: int, batch_size: int, seed: int = 0,
                   shuffle: bool = True, shuffle_window: int = 8192,
                   budget_seconds: float = 1.0) -> LoaderCost:
    """Time rank 0's loader of the dataset at ``path`` as a run reads it: batches of 1 and of
    ``batch_size`` samples, each loader's first batch (which opens the first window) left out,
    then as many as ``budget_seconds`` allow (at least 4 of each). Raises what the loader
    raises for a dataset it cannot read (``datapipe.manifest.DatasetError``, ``OSError``)."""
    from datapipe.loader import BatchLoader

    def per_batch(size: int) -> float:
        with BatchLoader(path, column, rank=0, world_size=world_size, batch_size=size,
                         seed=seed, shuffle=shuffle, shuffle_window=shuffle_window) as loader:
            next(loader)
            count, start, limit = 0, time.perf_counter(), len(loader) - 1  # within the epoch
            while count < limit and (count < 4
                                     or time.perf_counter() - start < budget_seconds / 2):
                next(loader)
                count += 1
            return (time.perf_counter() - start) / max(1, count)

    one = per_batch(1)
    if batch_size <= 1:
        return LoaderCost(one, 0.0, f"{one * 1e6:,.0f} us a batch of 1")
    many = per_batch(batch_size)
    sample = max(0.0, (many - one) / (batch_size - 1))
    return LoaderCost(max(0.0, one - sample), sample,
                      f"{one * 1e6:,.0f} us a batch of 1, {many * 1e6:,.0f} us of {batch_size}")


@dataclass(frozen=True)
class StepTime:
    """A plan's predicted step, its parts in seconds, and tokens/s over all ranks."""

    seconds: float
    forward_backward: float
    optimizer: float
    allreduce: float
    data: float
    tokens_per_s: float


def step_time(work: StepWork, speed: DeviceSpeed, micro_batch: int, accumulation: int,
              world_size: int = 1, overlap_allreduce: bool = True,
              loader: LoaderCost | None = None, loss_chunk_tokens: int | None = None
              ) -> StepTime:
    """The predicted time of one optimizer step of ``accumulation`` micro-batches (``loader``:
    the data loader's measured cost, none where not given; ``loss_chunk_tokens``: the chunked
    loss's chunk, else the recorded one)."""
    fb = speed.seconds(work.forward_backward(micro_batch, loss_chunk_tokens), work.autocast) \
        + work.checkpointed_blocks * speed.op_seconds.get("checkpoint", 0.0)
    optimizer = speed.seconds(work.optimizer)
    allreduce = 0.0
    if world_size > 1:
        ring = 2 * (world_size - 1) / world_size * work.grad_bytes
        allreduce = ring / speed.allreduce_bytes_per_s
        if overlap_allreduce:  # behind the last micro-batch's backward, about 2/3 of it
            allreduce = max(0.0, allreduce - fb * 2 / 3)
    compute = accumulation * fb + optimizer + allreduce
    data = accumulation * loader.seconds(micro_batch) if loader else 0.0
    # On a GPU the host gathers batches while the device computes: only what is left over
    # counts. On CPU both run on the training thread.
    if speed.asynchronous:
        data = max(0.0, data - compute)
    seconds = compute + data
    tokens = micro_batch * accumulation * work.seq_len * world_size
    return StepTime(seconds, accumulation * fb, optimizer, allreduce, data, tokens / seconds)


@dataclass(frozen=True)
class SpeedModel:
    """What the planner predicts step times with: the device's speed and the run's shape."""

    device: DeviceSpeed
    world_size: int = 1
    overlap_allreduce: bool = True  # DDP's overlap with backward (off under OOM recovery)
    loader: LoaderCost | None = None  # the data loader's measured cost (measure_loader)
    compiled: bool = False  # torch.compile on a GPU (compiled_speed)

    @functools.cached_property
    def step_device(self) -> DeviceSpeed:
        """The speed steps are predicted at: ``device``, compiled where ``compiled``."""
        return compiled_speed(self.device) if self.compiled else self.device

    def predict(self, work: StepWork, micro_batch: int, accumulation: int,
                loss_chunk_tokens: int | None = None) -> StepTime:
        return step_time(work, self.step_device, micro_batch, accumulation, self.world_size,
                         self.overlap_allreduce, self.loader, loss_chunk_tokens)


@dataclass(frozen=True)
class Measured:
    """A plan run for real on this CPU: median step seconds and tokens/s, the fastest step's
    seconds, and the allocator's peak."""

    step_seconds: float
    tokens_per_s: float
    peak_bytes: int
    best_step_seconds: float = 0.0


class PlanRun:
    """A plan built once to be trained for real on this CPU, one rank: its model, optimizer and
    random micro-batches, each ``step`` one optimizer step of the trainer's own ``train_step``
    (``measure_plan`` times a few; ``make bench-plan`` alternates two plans' steps)."""

    def __init__(self, factory: ModelFactory, transforms: MemoryTransforms, seq_len: int,
                 vocab_size: int, precision: str, micro_batch: int, accumulation: int) -> None:
        from trainer.step import build_optimizer

        device = torch.device("cpu")
        keep_freed_host_memory()  # as the trainer's CPU workers run
        self.model = build_model(factory, transforms)
        self.model.train()
        self.policy = precision_policy(precision, device, warn=False)
        self.scaler = self.policy.grad_scaler(device)
        self.optimizer = build_optimizer(self.model, lr=1e-4)
        generator = torch.Generator().manual_seed(0)
        self.micro_batches = [torch.randint(0, vocab_size, (micro_batch, seq_len + 1),
                                            generator=generator) for _ in range(accumulation)]
        self.tokens = micro_batch * accumulation * seq_len

    def step(self) -> float:
        """Train one optimizer step; its seconds."""
        from trainer.step import train_step

        start = time.perf_counter()
        train_step(self.model, self.optimizer, self.scaler, self.micro_batches, 1, self.policy,
                   1.0)
        return time.perf_counter() - start

    def peak_bytes(self) -> int:
        """One more step under the CPU allocator's record (``trainer.step.step_peak_bytes``)."""
        from trainer.step import step_peak_bytes

        return step_peak_bytes(self.model, self.optimizer, self.scaler, self.micro_batches[0],
                               self.policy)


def measure_plan(factory: ModelFactory, transforms: MemoryTransforms, seq_len: int,
                 vocab_size: int, precision: str, micro_batch: int, accumulation: int,
                 steps: int = 3, warmup: int = 1, peak: bool = True) -> Measured:
    """Train ``steps`` optimizer steps (after ``warmup``) of the plan with the trainer's own
    ``train_step`` on random tokens, one rank on this CPU; then, with ``peak``, one more step
    under the CPU allocator's record (``trainer.step.step_peak_bytes``)."""
    run = PlanRun(factory, transforms, seq_len, vocab_size, precision, micro_batch,
                  accumulation)
    times = [run.step() for _ in range(warmup + steps)][warmup:]
    seconds = statistics.median(times)
    return Measured(seconds, run.tokens / seconds, run.peak_bytes() if peak else 0, min(times))


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0
