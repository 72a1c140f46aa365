"""Predict training memory before a run: static bytes by dtype and sharding, activations by probe.

Static bytes are counted from the model: parameters, gradients (same dtype as the parameters) and
AdamW's two fp32 moments, each divided by the world size under FSDP. Activation bytes are measured,
not guessed: a probe forward pass on CPU (the model at full width and sequence length, one and two
samples) counts every tensor autograd saves for backward through ``saved_tensors_hooks``,
deduplicated by storage, excluding parameters, and adds the inputs that activation checkpointing
keeps alive for recomputation. Two probe sizes separate the per-sample bytes from the fixed ones
(autocast's low-precision weight copies).

The predicted step peak is the largest of these moments (``PlanRow.peak_moment``), each on top
of the parameters and AdamW's state:
- the end of the forward pass: the saved activations, the chunked loss's temporaries
  (``trainer.memory.loss.ChunkedLossShape.transient_bytes``: one chunk's logits in the compute
  dtype and a slice of them in fp32, the weight's copy in the autocast dtype; the probe records
  the loss's shapes) and,
  with activation checkpointing under autocast, autocast's cache of low-precision weight copies
  for the checkpointed blocks, kept until autocast exits but not saved (measured as the fixed saved
  bytes a probe without checkpointing has in excess);
- with the plain loss (``memory.loss_chunk_tokens: 0``), the loss's own backward, first: the
  saved activations (the fp32 log-probabilities among them) and the fp32 gradients of the
  log-probabilities and of the logits (``trainer.memory.loss.PlainLossShape``);
- the start of backward (the last block's): the saved activations, the gradients of the
  parameters outside the repeated blocks (the output head's come first), the gradient flowing
  into the block (the residual stream's, and under autocast its low-precision copy), the
  block's largest backward temporary (the gradient of the largest tensor it saves, or, where
  larger, a tiled MLP's one tile recomputed with its gradients: ``_tile_bytes``) and, when the
  last block is checkpointed, that block's recomputed activations (measured as the difference
  to a probe without checkpointing) and its autocast weight copies. What the head saved (the
  final norm's, the output layer's, the loss's) is counted though backward has freed it by
  then: for an ``hf:`` Llama it stands in for what a block's backward holds beyond the terms
  above (without it the planner was 8-9% under the allocator's record with full
  checkpointing), for memtrain's GPT on long rows with full checkpointing it over-counts, most
  where the plain loss saves its log-probabilities. Further down, each block frees at least
  as much activation memory as its parameters' gradients take;
- the end of backward (``backward end``): every gradient but the first block's, beside that
  block's activations (recomputed where checkpointed), its incoming gradient and its largest
  temporary; with the optimizer step in backward, a block's gradients, and the last step (a
  tied embedding's) alone;
- the optimizer step: every gradient, and AdamW's temporaries (``step_temporaries``: one
  moment's size on CUDA's foreach path; on CPU, and for torchao's low-bit states, a multiple of
  the largest parameter). AdamW's state is counted by its dtype (``memory.optimizer_states``),
  and only for the parameters that train (a LoRA model's adapters); activation offload's saved
  bytes are the row's host bytes, not the device's.
Under FSDP the static bytes are one rank's shards (in host memory under CPU offload: the row's
``host_bytes``), and the other moments add what FSDP holds whole while it runs, by its settings
(``fsdp_in_flight``; calibrated on CPU), with a fourth moment at the end of backward.
Under ``parallel.sequence: N`` a rank is probed as the run splits it: its ``seq_len / N``
tokens of every row, attention over whole rows for ``heads / N`` heads with the whole rows'
mask (the all-to-alls stood in for by local reshuffles of the same shapes), and while a block's
backward runs, one all-to-all's send and receive buffers beside it.
Gradients are not held during the forward pass: the loop zeroes them with ``set_to_none=True``.
On CPU the whole formula is checked against the allocator's record of real steps
(``trainer.telemetry.diagnostics.cpu_peak_bytes``, ``tests/unit/test_planner.py``). The planner does
not model the CUDA allocator's rounding and caching, nor kernel workspaces; ``make gpu-check``
measures how far the prediction is from the real CUDA peak.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from trainer.batches import TokenBatch, as_batch
from trainer.compat import (
    cpu_bf16_support,
    fake_tensor_mode,
    is_checkpoint_wrapper,
    is_fake,
    modules_kept_in_place,
    quiet_native_logs,
)
from trainer.errors import first_line
from trainer.memory.loss import (
    ChunkedLossShape,
    LossShape,
    observe_chunked_losses,
    summed_loss,
)
from trainer.memory.nf4 import Nf4Linear, is_nf4, to_nf4
from trainer.memory.offload import offload_of
from trainer.memory.optimizers import state_bytes, trainable
from trainer.memory.precision import precision_policy
from trainer.memory.tiled_mlp import (
    TOKEN_DIM,
    TiledMLPMixin,
    block_mlps,
    tile_sizes,
    untiled_forward,
)
from trainer.models.build import MemoryTransforms, ModelFactory, build_model, checkpointed_blocks
from trainer.parallel.fsdp import FsdpSettings
from trainer.parallel.sequence import SequenceShapes, check_divisible, split_model
from trainer.plan.speed import (
    SpeedModel,
    all_to_all_seconds,
    all_to_all_sent_bytes,
    strategy_seconds,
)
from trainer.plan.work import StepWork, record_work
from trainer.tensors import storage_key, tensor_bytes

log = logging.getLogger("memtrain.planner")
ADAMW_STATE_BYTES_PER_PARAM = 8  # exp_avg and exp_avg_sq in fp32
AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class StaticBytes:
    params: int
    grads: int
    optimizer: int
    world_size: int = 1
    sharded: bool = False  # FSDP: the bytes above are one rank's shards
    # FSDP (``parallel.fsdp``, ``trainer.parallel.fsdp.FsdpSettings``): how it shards.
    fsdp: FsdpSettings | None = None
    full_param_bytes: int = 0  # the whole model's parameters, unsharded
    # memory.optimizer_in_backward: each gradient is stepped and dropped as it completes, so
    # only the largest one (``largest_grad``, with its step's temporaries) is held at a time.
    in_backward: bool = False
    largest_grad: int = 0
    optimizer_states: str = "fp32"  # memory.optimizer_states
    # Where the optimizer steps: torch's AdamW runs its multi-tensor path on CUDA, a loop over
    # the parameters on CPU (``step_temporaries``).
    step_device: str = "cuda"
    # DDP on more than one rank: gradients are reduced in buckets, so the step in backward
    # holds a bucket's (about a block's) at once; one process steps each as it completes.
    bucketed: bool = False
    # Bytes of one trained weight: 2 under ``model.dtype: bf16``, whose step still computes in
    # fp32 (torchao): its temporaries are fp32 copies, twice the gradient's bytes.
    weight_itemsize: int = 4

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def offloaded(self) -> bool:
        """FSDP's CPU offload: the shards, gradients and AdamW state live in host memory."""
        return self.fsdp is not None and self.fsdp.offload == "cpu"

    @property
    def device_static(self) -> int:
        """Parameters and AdamW state held on the device through the step."""
        return 0 if self.offloaded else self.params + self.optimizer


@dataclass(frozen=True)
class ActivationProfile:
    """Saved-for-backward bytes of one forward: ``fixed + per_sample * batch``."""

    precision: str
    activation_checkpointing: str
    per_sample_bytes: int
    fixed_bytes: int
    # The biggest single tensor a block saves, per sample (from a probe without checkpointing):
    # its gradient is the largest temporary of backward.
    largest_tensor_per_sample_bytes: int
    recompute_fraction: float  # forward FLOPs recomputed in backward, as a share of the forward
    # What one checkpointed block saves while backward recomputes it, per sample; counted at the
    # start of backward only when the last block is checkpointed (0 otherwise).
    recompute_block_per_sample_bytes: int = 0
    # Autocast's low-precision weight copies of the checkpointed blocks: cached until the end of
    # the forward pass but not saved for backward (0 without AC or without autocast).
    autocast_cache_bytes: int = 0
    # The chunked loss's shapes (None: the model has no chunked loss) and the tokens per sample.
    loss_shape: LossShape | None = None
    seq_len: int = 0
    # Gradients of the parameters outside ``model.blocks`` (all of them for a model without).
    outside_blocks_grad_bytes: int = 0
    # Parameter bytes outside the blocks and of the largest block: what FSDP all-gathers.
    outside_blocks_param_bytes: int = 0
    block_param_bytes: int = 0
    # The recomputed last block's fixed saved bytes (its autocast weight copies), 0 otherwise.
    recompute_block_fixed_bytes: int = 0
    # CPU without native bf16: what its emulated matrix products allocate beyond the fp32
    # kernels' own workspace, per sample (``emulated_bf16_workspace``; 0 elsewhere).
    emulation_workspace_per_sample_bytes: int = 0
    # memory.activation_offload: the saved bytes above that go to host memory
    # (``trainer.memory.offload``), as ``host_fixed + host_per_sample * batch``.
    host_per_sample_bytes: int = 0
    host_fixed_bytes: int = 0
    # What the first block holds for its own backward, per sample, at the end of backward
    # (recomputed where it is checkpointed), when every other gradient exists already.
    first_block_per_sample_bytes: int = 0
    largest_block_param_bytes: int = 0  # the largest parameter inside the blocks
    # An NF4 base (QLoRA): the weights of its largest NF4 layer, whose matmul holds them
    # dequantized (``nf4_dequantized_bytes``); 0 without one.
    largest_nf4_weights: int = 0
    # parallel.sequence: the ranks each row is split over (``seq_len`` above is one rank's
    # slice), what one forward's all-to-alls take in, per sample (queries, keys, values and
    # attention's output, every layer), and the largest single all-to-all's input.
    sequence: int = 1
    all_to_all_per_sample_bytes: int = 0
    all_to_all_largest_per_sample_bytes: int = 0
    # memory.tiled_mlp: what a tiled MLP's backward holds while it runs its largest tile, as
    # ``fixed + per_sample * batch`` (``_tile_bytes``); 0 without tiling.
    mlp_tile_per_sample_bytes: int = 0
    mlp_tile_fixed_bytes: int = 0
    # The gradient of a block's output, alive through its backward, per sample
    # (``_output_grad_bytes``; 0 for a model without blocks).
    block_output_grad_per_sample_bytes: int = 0
    # The step's operators, for the time model (``trainer.plan.speed``; None: not recorded).
    work: StepWork | None = dataclasses.field(default=None, compare=False, repr=False)

    def saved_bytes(self, batch: int) -> int:
        """Everything the forward saves for backward, on the device or offloaded."""
        return self.fixed_bytes + self.per_sample_bytes * batch

    def host_bytes(self, batch: int) -> int:
        """What activation offload holds in host memory of ``saved_bytes``."""
        return self.host_fixed_bytes + self.host_per_sample_bytes * batch


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


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(tensor_bytes(t) for t in tensors)  # an NF4 base by its codes and scales


def static_bytes(model: nn.Module, parallel: str = "ddp", world_size: int = 1,
                 fsdp: FsdpSettings | None = None, states: str = "fp32",
                 in_backward: bool = False, step_device: str = "cuda") -> StaticBytes:
    """Bytes of parameters, gradients and AdamW state held by one rank (under FSDP, with
    ``fsdp``'s settings: the defaults where None). Only parameters that train have gradients
    and state (a LoRA model's adapters); ``states``: the moments' dtype
    (``memory.optimizer_states``, counted tensor by tensor as torchao keeps them);
    ``in_backward``: ``memory.optimizer_in_backward``; ``step_device``: where AdamW steps
    (``step_temporaries``)."""
    unique = list({id(p): p for p in model.parameters()}.values())  # tied weights count once
    trained = trainable(model)
    param_bytes = _nbytes(unique)
    grad_bytes = _nbytes(trained)
    sharded = parallel == "fsdp"
    if states == "fp32":  # the same bytes for every tensor: the shards' total, split evenly
        optimizer_bytes = -(-sum(p.numel() for p in trained) * ADAMW_STATE_BYTES_PER_PARAM
                            // (world_size if sharded else 1))
    else:  # torchao quantizes a shard by its own size
        optimizer_bytes = state_bytes(trained, states, shards=world_size if sharded else 1)
    largest = max((_nbytes([p]) for p in trained), default=0)
    itemsize = max((p.element_size() for p in trained), default=4)
    if sharded:
        params, grads = (-(-b // world_size) for b in (param_bytes, grad_bytes))
        return StaticBytes(params, grads, optimizer_bytes, world_size=world_size, sharded=True,
                           fsdp=fsdp or FsdpSettings(), full_param_bytes=param_bytes,
                           in_backward=in_backward, largest_grad=-(-largest // world_size),
                           optimizer_states=states, step_device=step_device,
                           weight_itemsize=itemsize)
    if parallel != "ddp":
        raise ValueError(f"parallel {parallel!r} is not ddp|fsdp")
    return StaticBytes(param_bytes, grad_bytes, optimizer_bytes, in_backward=in_backward,
                       largest_grad=largest, optimizer_states=states, step_device=step_device,
                       bucketed=world_size > 1, weight_itemsize=itemsize)


@contextlib.contextmanager
def count_saved_tensors(model: nn.Module, held: Iterable[torch.Tensor] = ()
                        ) -> Iterator[dict[str, Any]]:
    """Count bytes autograd saves inside the block (deduplicated by storage, no parameters nor
    the ``held`` tensors' storages)."""
    # Storages are told apart by ``storage_key``: fake tensors (``profile_activations``'s
    # default probe) have no data pointer.
    param_storages = {storage_key(p) for p in (*model.parameters(), *held)}
    seen: set[int] = set()
    counts: dict[str, Any] = {"bytes": 0, "sizes": []}  # sizes: each storage, in save order

    def record(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage_key(tensor)
        if key in param_storages or key in seen or storage.nbytes() == 0:
            return
        seen.add(key)
        counts["bytes"] += storage.nbytes()
        counts["sizes"].append(storage.nbytes())

    # The probe never runs backward, so the graph keeps only an index; the tensors themselves
    # stay alive in ``kept`` until the block ends (so no storage is reused and counted twice),
    # then go. Returning the tensor itself would make a saved output hold its own grad_fn: a
    # reference cycle through C++ that Python's gc cannot break, leaking every probe's
    # activations (seen: 2 GiB per GPT-2 probe on an H200, 24 GiB RSS on CPU).
    kept: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> int:
        record(tensor)
        kept.append(tensor)
        return len(kept) - 1

    def unpack(index: int) -> torch.Tensor:
        raise RuntimeError("a planner probe's graph cannot run backward")
    # Non-reentrant checkpointing saves nothing through hooks: the wrapped block's inputs are
    # what it keeps alive, so count those from a forward pre-hook on each wrapped block.
    def record_inputs(_module: nn.Module, args: tuple[object, ...]) -> None:
        for arg in args:
            if isinstance(arg, torch.Tensor):
                record(arg)

    # With activation offload those inputs go to the host, and its hooks count them.
    handles = [module.register_forward_pre_hook(record_inputs) for module in model.modules()
               if is_checkpoint_wrapper(module) and offload_of(model) is None]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield counts
    finally:
        kept.clear()
        for handle in handles:
            handle.remove()


def measure_saved_bytes(model: nn.Module, tokens_BT: torch.Tensor, precision: str
                        ) -> tuple[int, list[int]]:
    """(saved bytes, each saved storage's bytes in save order) of one training forward."""
    bytes_, sizes, _shapes, _host = _probe(model, tokens_BT, precision)
    return bytes_, sizes


def probe_batch(batch: int, seq_len: int, vocab_size: int, device: torch.device,
                packed: bool = False) -> TokenBatch:
    """The probe's micro-batch: random tokens; ``packed``, with a loss mask and two documents
    a row, as a fine-tuning dataset's rows have them (``trainer.batches``)."""
    tokens_BT = torch.randint(0, vocab_size, (batch, seq_len + 1), device=device)
    if not packed:
        return TokenBatch(tokens_BT)
    documents_BT = torch.zeros_like(tokens_BT, dtype=torch.int32)
    documents_BT[:, (seq_len + 1) // 2:] = 1
    return TokenBatch(tokens_BT, torch.ones_like(tokens_BT, dtype=torch.uint8), documents_BT)


def _probe(model: nn.Module, batch: torch.Tensor | TokenBatch, precision: str
           ) -> tuple[int, list[int], list[LossShape], int]:
    """(saved bytes, each saved storage's bytes, the loss's shapes, the offloaded bytes): the
    saved bytes count the offloaded ones too (the offload's hooks see those in place of
    ``count_saved_tensors``'s)."""
    batch = as_batch(batch)
    device = batch.tokens.device
    policy = precision_policy(precision, device, warn=False)
    with count_saved_tensors(model) as counts, observe_chunked_losses() as shapes:
        loss = summed_loss(model, batch, policy)  # the loop's own forward
    del loss
    offload = offload_of(model)
    host = offload.bytes_this_forward if offload is not None else 0
    return counts["bytes"] + host, counts["sizes"], shapes, host


MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor argument by shape and dtype: a probe's may be fake, a stand-in is made real."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _spec(value: Any) -> Any:
    """An argument with its tensors (also inside tuples, lists and dicts) as ``_TensorSpec``."""
    if isinstance(value, torch.Tensor):
        return _TensorSpec(tuple(value.shape), value.dtype)
    if isinstance(value, tuple | list):
        return type(value)(_spec(item) for item in value)
    if isinstance(value, dict):
        return {name: _spec(item) for name, item in value.items()}
    return value


def _stand_in(value: Any) -> Any:
    """``_spec``'s inverse with zeros: shapes, not values, decide a kernel's workspace."""
    if isinstance(value, _TensorSpec):
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, tuple | list):
        return type(value)(_stand_in(item) for item in value)
    if isinstance(value, dict):
        return {name: _stand_in(item) for name, item in value.items()}
    return value


@dataclass(frozen=True)
class BlockCall:
    """How the probe called the first block at batch 1: one sample's input shape and the
    other arguments (a Hugging Face decoder layer takes its rotary position embeddings and
    position ids), their tensors as ``_TensorSpec``."""

    sample_shape: tuple[int, ...]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def record(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BlockCall:
        return cls(tuple(args[0].shape[1:]), _spec(args[1:]), _spec(kwargs))


def emulated_bf16_workspace(block: nn.Module, sample_shape: tuple[int, ...],
                            call: BlockCall | None = None) -> int:
    """Per sample: how much more workspace a block's matrix products take in bf16 than in fp32
    on this CPU, in a forward and backward of one and two samples (``sample_shape``: one
    sample's input to the block, e.g. ``(T, C)``; ``call``: the block's other arguments, as
    the probe passed them).

    Where the CPU has no bf16 instructions, its kernels emulate bf16 with fp32 arithmetic and
    may convert operands into buffers of their own while they run; those buffers are alive
    at the step's peak when a matrix product runs there. The fp32 kernels' own workspace
    (transposed copies) is left out: the planner's fp32 prediction already holds without it.
    """
    from torch.profiler import ProfilerActivity, profile

    from trainer.compat import cpu_op_workspace_bytes

    args, kwargs = ((), {}) if call is None else (_stand_in(call.args), _stand_in(call.kwargs))

    # bf16 weights (``model.dtype``) run in bf16 only: fp32's workspace is a float copy's
    weights_bf16 = any(p.dtype == torch.bfloat16 for p in block.parameters())
    fp32_block = copy.deepcopy(block).float() if weights_bf16 else block

    def workspace(precision: str, batch: int) -> int:
        run = block if precision == "bf16" else fp32_block
        dtype = torch.bfloat16 if run is block and weights_bf16 else torch.float32
        x_BTC = torch.randn(batch, *sample_shape, dtype=dtype, requires_grad=True)
        policy = precision_policy(precision, x_BTC.device, warn=False)
        with quiet_native_logs(), profile(activities=[ProfilerActivity.CPU],
                                          profile_memory=True) as prof:
            with policy.autocast(x_BTC.device):
                y_BTC = run(x_BTC, *args, **kwargs)
            if isinstance(y_BTC, tuple | list):  # a decoder layer that returns more
                y_BTC = y_BTC[0]
            y_BTC.float().sum().backward()
        run.zero_grad(set_to_none=True)
        return cpu_op_workspace_bytes(prof, MATMUL_OPS)

    excess = [max(0, workspace("bf16", batch) - workspace("fp32", batch)) for batch in (1, 2)]
    return max(0, excess[1] - excess[0], excess[0])  # at least what one sample needs


def profile_activations(factory: ModelFactory, transforms: MemoryTransforms, seq_len: int,
                        vocab_size: int, precision: str, device: torch.device | None = None,
                        target: str | None = None, fake: bool | None = None,
                        work: bool = False, packed: bool = False, sequence: int = 1
                        ) -> ActivationProfile:
    """Probe a model built with ``transforms`` at batch 1 and 2 and fit
    ``fixed + per_sample * batch``.

    ``target`` is the device type the plan is for (default: the probe's device). For a CPU
    whose bf16 is emulated (``trainer.compat.cpu_bf16_support``) the emulated kernels'
    workspace is measured too (``emulated_bf16_workspace``, with real kernels: their buffers
    are what it measures).

    ``fake`` (default: on CPU) probes with fake tensors (``trainer.compat.fake_tensor_mode``):
    the same modules, autograd graph and saved tensors, with shapes and no data, so a GPT-2
    probe takes a fraction of a second instead of minutes of CPU arithmetic (bf16 emulated on
    most CPUs). The saved bytes are the real probe's to the byte
    (``tests/unit/test_planner.py``). A model whose forward cannot run on fake tensors (it
    reads a value, calls numpy) is probed for real, with a log line that says so.

    ``work``: also count the step's operators for the time model
    (``trainer.plan.work.record_work``; on fake tensors, or real ones where those fail).

    ``packed``: the dataset has a loss mask and packed documents (``trainer.batches``): the
    probe's batch has them too, so what they add is measured with the rest (the mask's bytes,
    memtrain's GPT's B x T x T attention mask and the masked attention's saved tensors).

    ``sequence``: one rank of that many, holding ``seq_len / sequence`` tokens of each row,
    split as the run splits it (``SequenceShapes``); ValueError where rows or heads do not
    divide.
    """
    device = device or torch.device("cpu")
    check_divisible("model.seq_len", seq_len, sequence)
    seq_len //= sequence
    target = target or device.type
    profile = block_call = None
    if device.type == "cpu" if fake is None else fake:
        try:
            with fake_tensor_mode(), modules_kept_in_place():
                profile, block_call = _profile(factory, transforms, seq_len, vocab_size,
                                               precision, device, packed, sequence)
        except ValueError:  # a setting the model refuses (memtrain's config errors): said once
            raise
        except Exception as err:  # noqa: BLE001 - any failure of a model on fake tensors
            log.info("planner: the model cannot be probed with fake tensors (%s: %s); probing "
                     "with real ones", type(err).__name__, first_line(err)[:200])
    if profile is None:
        profile, block_call = _profile(factory, transforms, seq_len, vocab_size, precision,
                                       device, packed, sequence)
    if (target == "cpu" and device.type == "cpu" and precision == "bf16"
            and block_call is not None and cpu_bf16_support() != "native"):
        plain = transforms.replace(activation_checkpointing="none", activation_offload="none")
        first_block = build_model(factory, plain).get_submodule("blocks.0")
        profile = dataclasses.replace(profile, emulation_workspace_per_sample_bytes=(
            emulated_bf16_workspace(first_block, block_call.sample_shape, block_call)))
    if work:
        profile = dataclasses.replace(profile, work=record_work(
            factory, transforms, seq_len, vocab_size, precision, sequence))
    return profile


def _collect_cycles(model: nn.Module) -> None:
    """A forward through non-reentrant checkpointing that never runs backward leaves reference
    cycles holding its activations: collected now, not at some later gc, where they are memory
    (fake tensors hold none, and a full collection takes 0.2 s in a process with torch loaded)."""
    if not is_fake(next(model.parameters(), None)):
        gc.collect()


def _profile(factory: ModelFactory, transforms: MemoryTransforms, seq_len: int,
             vocab_size: int, precision: str, device: torch.device, packed: bool = False,
             sequence: int = 1) -> tuple[ActivationProfile, BlockCall | None]:
    """``profile_activations`` without the emulation workspace, on real or fake tensors
    (whichever mode is active), and how the first block was called at batch 1 (None for a
    model without ``blocks``); ``seq_len``: one rank's tokens of a row."""
    # Factories build on the CPU; a fake module cannot be moved there again (tied weights
    # cannot be swapped), and a real one need not be.
    model = build_model(factory, transforms, None if device.type == "cpu" else device)
    split = _split_for_probe(model, sequence)
    chosen = checkpointed_blocks(model)
    blocks = getattr(model, "blocks", nn.ModuleList())
    num_blocks = len(blocks)
    model.train()
    measured = {}
    first = _FirstCalls(model)  # batch 1's
    for batch in (1, 2):
        with first.recording() if batch == 1 else contextlib.nullcontext():
            measured[batch] = _probe(
                model, probe_batch(batch, seq_len, vocab_size, device, packed), precision)
        _collect_cycles(model)
    per_sample, fixed = _fit(measured[1][0], measured[2][0])
    largest_per_sample = _largest_growth(measured[1][1], measured[2][1])
    recompute_block = recompute_block_fixed = autocast_cache = 0
    first_block = per_sample // num_blocks if num_blocks else 0  # about one block's share
    if chosen:
        plain, _ = _profile(factory, transforms.replace(activation_checkpointing="none",
                                                        activation_offload="none"),
                            seq_len, vocab_size, precision, device, packed, sequence)
        recompute_block = (plain.per_sample_bytes - per_sample) // len(chosen)
        first_block = recompute_block if 0 in chosen else plain.per_sample_bytes // num_blocks
        autocast_cache = max(0, plain.fixed_bytes - fixed)
        largest_per_sample = plain.largest_tensor_per_sample_bytes  # inside a recomputed block
        if num_blocks - 1 not in chosen:
            recompute_block = 0  # an unchecked last block frees more than a recomputed one takes
        else:  # the recomputed block saves its autocast weight copies again
            recompute_block_fixed = autocast_cache // len(chosen)
    # Recomputation repeats the forward of the wrapped blocks: their share of the forward FLOPs
    # is about their share of the blocks, and a forward is about a third of forward+backward.
    recompute = (len(chosen) / num_blocks) / 3 if num_blocks else 0.0
    loss_shapes = measured[2][2]
    host_per_sample, host_fixed = _fit(measured[1][3], measured[2][3])
    tile_per_sample, tile_fixed = first.tile_bytes(precision)
    profile = ActivationProfile(precision, transforms.activation_checkpointing, per_sample,
                                fixed, largest_per_sample, recompute, recompute_block,
                                autocast_cache, loss_shapes[0] if loss_shapes else None, seq_len,
                                *_parameter_bytes(model, blocks), recompute_block_fixed,
                                host_per_sample_bytes=host_per_sample,
                                host_fixed_bytes=host_fixed,
                                first_block_per_sample_bytes=first_block,
                                largest_block_param_bytes=max(
                                    (_nbytes([p]) for p in blocks.parameters()
                                     if p.requires_grad), default=0),
                                largest_nf4_weights=max((p.numel() for p in blocks.parameters()
                                                         if is_nf4(p)), default=0),
                                mlp_tile_per_sample_bytes=tile_per_sample,
                                mlp_tile_fixed_bytes=tile_fixed,
                                block_output_grad_per_sample_bytes=first.output_grad_bytes(
                                    precision))
    return _with_all_to_alls(profile, split), first.block


class _FirstCalls:
    """How a probe's forward called ``model``'s first block (``BlockCall``, and one sample of
    its input) and its first tiled MLP (one sample of its input): what a block's backward is
    planned from beside its saved activations (``block_backward_bytes``)."""

    def __init__(self, model: nn.Module):
        self.blocks = getattr(model, "blocks", None) or nn.ModuleList()
        self.tiled = next((mlp for mlp in block_mlps(model) if isinstance(mlp, TiledMLPMixin)),
                          None)
        self.block: BlockCall | None = None
        self.block_input: torch.Tensor | None = None
        self.mlp_input: torch.Tensor | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the first calls inside (the samples detached: no graph is kept)."""
        def on_block(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.block is None:
                self.block = BlockCall.record(args, kwargs)
                self.block_input = args[0][:1].detach()

        def on_mlp(_module: nn.Module, args: tuple[Any, ...]) -> None:
            if self.mlp_input is None:
                self.mlp_input = args[0][:1].detach()

        handles = [self.blocks[0].register_forward_pre_hook(on_block, with_kwargs=True)] \
            if len(self.blocks) else []
        if self.tiled is not None:
            handles.append(self.tiled.register_forward_pre_hook(on_mlp))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def output_grad_bytes(self, precision: str) -> int:
        """``_output_grad_bytes`` of the first block's input (0 without blocks)."""
        return 0 if self.block_input is None else _output_grad_bytes(self.block_input, precision)

    def tile_bytes(self, precision: str) -> tuple[int, int]:
        """``_tile_bytes`` of the first tiled MLP ((0, 0) without one)."""
        if self.tiled is None or self.mlp_input is None:
            return 0, 0
        return _tile_bytes(self.tiled, self.mlp_input, precision)


def _output_grad_bytes(sample: torch.Tensor, precision: str) -> int:
    """The gradient flowing into a block's backward from the block after it, per sample: the
    shape and dtype of one sample of the block's input (``sample``: the residual stream's),
    and under autocast its copy in the autocast dtype, which the block's last matrix product
    takes."""
    low = 2 if precision in ("bf16", "fp16") and sample.element_size() > 2 else 0
    return tensor_bytes(sample) + sample.numel() * low


def _tile_bytes(mlp: TiledMLPMixin, sample: torch.Tensor, precision: str
                ) -> tuple[int, int]:
    """What the tiled ``mlp``'s backward holds while it runs its largest tile, as (per sample,
    fixed) bytes (``trainer.memory.tiled_mlp.TiledMLPFunction.backward``): the tile's forward,
    recomputed with grad, saves its intermediates, and the gradient of the largest of them is
    the largest temporary of its backward; beside them, the gradient of the MLP's whole input,
    filled tile by tile, and the MLP's parameter gradients summed over the tiles (fixed).
    The tile is measured as the probe measures a block: the MLP's own forward on one tile of
    ``sample`` (one sample of the MLP's input: this rank's tokens) under the run's autocast, its
    saved tensors counted (the tile's input is a view of what the tiled MLP saved already, so
    not counted)."""
    tile = max(tile_sizes(sample.shape[TOKEN_DIM], mlp.mlp_tiles))
    x = sample.narrow(TOKEN_DIM, 0, tile).detach().clone().requires_grad_()
    policy = precision_policy(precision, x.device, warn=False)
    with torch.enable_grad(), policy.autocast(x.device), \
            count_saved_tensors(mlp, held=[x]) as counts:
        untiled_forward(mlp, x)
    input_grad = tensor_bytes(sample)
    parameter_grads = _nbytes(p for p in mlp.parameters() if p.requires_grad)
    return counts["bytes"] + max(counts["sizes"], default=0) + input_grad, parameter_grads


def _split_for_probe(model: nn.Module, sequence: int) -> SequenceShapes | None:
    """``model`` split as one rank of ``sequence`` ranks holds it, and the split (None: one
    rank holds whole rows)."""
    if sequence == 1:
        return None
    split = SequenceShapes(sequence)
    split_model(model, split)
    return split


def _with_all_to_alls(profile: ActivationProfile, split: SequenceShapes | None
                      ) -> ActivationProfile:
    """``profile`` with what its split rank's all-to-alls take in, one sample's (the probe's
    forward at batch 1, then at 2); unchanged without a split."""
    if split is None:
        return profile
    calls = split.moved_bytes[:len(split.moved_bytes) // 2]  # batch 1's
    moved = [size for call in calls for size in call]
    return dataclasses.replace(profile, sequence=split.size,
                               all_to_all_per_sample_bytes=sum(moved),
                               all_to_all_largest_per_sample_bytes=max(moved, default=0))


def nf4_dequantized_bytes(weights: int) -> int:
    """What an NF4 layer of ``weights`` weights holds while its matmul runs on its dequantized
    weight (``trainer.memory.nf4.Nf4Linear``), in forward, in backward and in recomputation
    alike: the allocator's record of one token's forward and backward through two real NF4
    layers of a few slices (``fixed + per weight``), drawn to ``weights``; 0 for none."""
    if not weights:
        return 0
    fixed, per_weight = _dequantize_cost()
    return int(fixed + per_weight * weights)


@functools.cache
def _dequantize_cost() -> tuple[float, float]:
    from trainer.telemetry.diagnostics import cpu_peak_bytes

    measured = []
    for rows in (2048, 4096):  # 8 and 16 slices of 2**18 weights
        layer = nn.Linear(256, rows, bias=False)
        layer.weight = nn.Parameter(to_nf4(torch.zeros(rows, 256)), requires_grad=False)
        layer.__class__ = Nf4Linear
        x = torch.zeros(1, 256, requires_grad=True)

        def step(layer: nn.Module = layer, x: torch.Tensor = x) -> None:
            with torch.autocast("cpu", torch.bfloat16):  # as an NF4 base runs
                out = layer(x)
            out.float().sum().backward()

        measured.append((rows * 256, cpu_peak_bytes(step)))
    (n1, b1), (n2, b2) = measured
    per_weight = (b2 - b1) / (n2 - n1)
    return b1 - per_weight * n1, per_weight


def _parameter_bytes(model: nn.Module, blocks: nn.ModuleList) -> tuple[int, int, int]:
    """(gradient bytes outside the blocks, parameter bytes outside them, the largest block's
    parameter bytes)."""
    in_blocks = {id(p) for p in blocks.parameters()}
    outside = [p for p in {id(p): p for p in model.parameters()}.values()
               if id(p) not in in_blocks]
    block_params = max((_nbytes(block.parameters()) for block in blocks), default=0)
    return _nbytes(p for p in outside if p.requires_grad), _nbytes(outside), block_params


def _largest_growth(sizes_1: list[int], sizes_2: list[int]) -> int:
    """The largest saved tensor that grows with the batch (a fixed one, such as a weight-sized
    gradient buffer, is in the fixed bytes already): the same save order in both probes."""
    growth = [b - a for a, b in zip(sizes_1, sizes_2, strict=False)] \
        if len(sizes_1) == len(sizes_2) else [max(sizes_2, default=0) - max(sizes_1, default=0)]
    return max(growth, default=0)


def _fit(at_one: int, at_two: int) -> tuple[int, int]:
    """(per sample, fixed) bytes from a probe's bytes at batch 1 and batch 2."""
    per_sample = at_two - at_one
    return per_sample, max(0, at_one - per_sample)


def plan_row(static: StaticBytes, profile: ActivationProfile, micro_batch_size: int,
             accumulation_steps: int, speed: SpeedModel | None = None,
             loss_chunk_tokens: int | None = None) -> PlanRow:
    """The predicted peak of one plan and, with a ``speed`` model and the profile's recorded
    work, its predicted step time and tokens/s. ``loss_chunk_tokens``: the chunked loss in
    chunks of that many tokens instead of the probed ones (a chunk changes only the loss's
    temporaries and operators: what it saves for backward is the same)."""
    static, profile = _under_fsdp(static, profile)
    offloaded = profile.host_bytes(micro_batch_size)  # activation offload's, on the host
    activations = profile.saved_bytes(micro_batch_size) - offloaded
    shape, loss, loss_backward = _loss_terms(
        profile, micro_batch_size * profile.seq_len, loss_chunk_tokens)
    # Under FSDP the output head's gradients are sharded like the rest.
    outside_grads = 0 if static.offloaded else min(profile.outside_blocks_grad_bytes,
                                                   static.grads)
    held_grads = static.grads  # every gradient, at the end of backward
    if static.in_backward and not static.offloaded:
        held_grads = in_backward_held(static, profile, outside_grads)
    forward_kept = in_flight = backward_grads = 0
    if static.sharded:
        in_flight, backward_grads, forward_kept = fsdp_in_flight(static, profile)
    # Emulated bf16 on CPU: a matrix product's conversion buffers at either moment.
    emulation = profile.emulation_workspace_per_sample_bytes * micro_batch_size
    dequantized = nf4_dequantized_bytes(profile.largest_nf4_weights)  # wherever a block runs
    exchanged, sent = _all_to_alls(profile, micro_batch_size, accumulation_steps)
    in_block = block_backward_bytes(profile, micro_batch_size)
    moments = {
        "forward end": activations + loss + profile.autocast_cache_bytes + in_flight
        + forward_kept + emulation + dequantized,
        "backward start": activations - _loss_weight_grad(shape, outside_grads)
        + outside_grads + in_flight + forward_kept
        + backward_grads + emulation + profile.recompute_block_fixed_bytes + dequantized
        + exchanged + in_block + profile.recompute_block_per_sample_bytes * micro_batch_size,
        "optimizer step": 0 if static.offloaded or static.in_backward
        else static.grads + step_temporaries(static),
    }
    if loss_backward:  # the plain loss: its backward runs first, before any block's
        moments["loss backward"] = activations + loss_backward + in_flight + forward_kept \
            + emulation
    if static.sharded:
        moments["backward end"] = (0 if static.offloaded else held_grads) + in_flight \
            + backward_grads + dequantized + exchanged
    else:  # the first block's backward: every other gradient exists, its activations too
        moments["backward end"] = held_grads + emulation + dequantized + exchanged \
            + profile.recompute_block_fixed_bytes + in_block \
            + profile.first_block_per_sample_bytes * micro_batch_size
    if static.in_backward and not static.offloaded:  # the last step: a tied embedding's,
        moments["last step in backward"] = in_backward_bytes(static)  # alone by then
    moment = max(moments, key=lambda name: moments[name])
    peak = static.device_static + moments[moment]
    # Offloaded: the shards, their gradients and AdamW's state (and its step's temporary).
    host = static.total + step_temporaries(static) if static.offloaded else 0
    host += offloaded
    chunk = shape.chunk_tokens if isinstance(shape, ChunkedLossShape) else 0
    seconds, tokens_per_s = _timing(static, profile, speed, micro_batch_size,
                                    accumulation_steps, chunk, offloaded)
    return PlanRow(profile.precision, profile.activation_checkpointing, micro_batch_size,
                   accumulation_steps, static.total, activations,
                   peak - static.device_static - activations, peak,
                   profile.recompute_fraction, moment, seconds, tokens_per_s, chunk, host, sent)


def block_backward_bytes(profile: ActivationProfile, micro_batch_size: int) -> int:
    """What a block's backward holds beside the activations it saved: the gradient flowing
    into it, and its largest temporary, the gradient of the largest tensor it saves or, where
    that is more, a tiled MLP's tile recomputed with its gradients (``_tile_bytes``)."""
    largest = max(
        profile.largest_tensor_per_sample_bytes * micro_batch_size,
        profile.mlp_tile_per_sample_bytes * micro_batch_size + profile.mlp_tile_fixed_bytes)
    return largest + profile.block_output_grad_per_sample_bytes * micro_batch_size


def _all_to_alls(profile: ActivationProfile, micro_batch_size: int, accumulation_steps: int
                 ) -> tuple[int, int]:
    """``parallel.sequence``'s all-to-alls: (the bytes they hold while a block's backward
    runs, the bytes a rank sends in a step). One all-to-all's send and receive buffers are
    held at once; its output takes the place of a tensor the unsplit block holds."""
    held = 2 * profile.all_to_all_largest_per_sample_bytes * micro_batch_size
    return held, accumulation_steps * all_to_all_sent_bytes(
        profile.all_to_all_per_sample_bytes * micro_batch_size, profile.sequence,
        recomputed_share(profile))


def recomputed_share(profile: ActivationProfile) -> float:
    """The share of the blocks checkpointing recomputes (a recomputed forward is a third of
    forward and backward: ``recompute_fraction``)."""
    return 3 * profile.recompute_fraction


def _loss_weight_grad(shape: LossShape | None, outside_grads: int) -> int:
    """The chunked loss's output-weight gradient, computed in the forward pass and saved with
    the activations: once the loss's backward has run it is that weight's gradient, counted
    with the gradients outside the blocks, not twice."""
    if not isinstance(shape, ChunkedLossShape) or not shape.weight_trains:
        return 0
    return min(shape.vocab_size * shape.width * shape.weight_itemsize, outside_grads)


def _loss_terms(profile: ActivationProfile, tokens: int, loss_chunk_tokens: int | None
                ) -> tuple[LossShape | None, int, int]:
    """The loss's shape (re-chunked where asked) and its bytes: the forward's temporaries and
    the plain loss's backward."""
    shape = profile.loss_shape
    if loss_chunk_tokens is not None and isinstance(shape, ChunkedLossShape):
        shape = dataclasses.replace(shape, chunk_tokens=loss_chunk_tokens)
    if shape is None:
        return None, 0, 0
    return shape, shape.transient_bytes(tokens), shape.backward_bytes(tokens)


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
    seconds += accumulation_steps * all_to_all_seconds(
        profile.all_to_all_per_sample_bytes * micro_batch_size, profile.sequence,
        speed.step_device, recomputed_share(profile))
    return seconds, timing.tokens_per_s * timing.seconds / seconds


def in_backward_held(static: StaticBytes, profile: ActivationProfile, outside_grads: int
                     ) -> int:
    """The step in backward at the first block's backward: the gradients outside the blocks
    (a tied embedding's completes last), that block's (FSDP reduce-scatters a block's at once,
    DDP a bucket's; in one process only the parameter stepping now holds one), and the step of
    its largest parameter with its temporaries."""
    largest = profile.largest_block_param_bytes // static.world_size
    block = profile.block_param_bytes // static.world_size \
        if static.sharded or static.bucketed else largest
    return min(static.grads, outside_grads + block) + one_step_temporaries(static, largest)


# What one parameter's AdamW step allocates, in fp32 copies of that parameter: torch's loop on
# CPU, torchao's compiled step per state dtype (measured on CPU with the allocator's record:
# tests/unit/test_strategies.py).
STEP_TEMPORARIES_PER_PARAM = {"fp32": 3.0, "bf16": 0.0, "8bit": 2.0, "4bit": 6.5}


def step_temporaries(static: StaticBytes) -> int:
    """What AdamW's step allocates beside its state: a moment's size over every parameter for
    fp32 AdamW on CUDA (torch's multi-tensor path); else a loop over the parameters, whose
    largest sets it (``STEP_TEMPORARIES_PER_PARAM``)."""
    if static.optimizer_states == "fp32" and static.step_device == "cuda" \
            and not static.in_backward:
        return static.optimizer // 2
    return one_step_temporaries(static, static.largest_grad)


def one_step_temporaries(static: StaticBytes, grad_bytes: int) -> int:
    """What one parameter's AdamW step allocates, given its gradient's bytes: fp32 copies of
    it (``STEP_TEMPORARIES_PER_PARAM``), twice the gradient's bytes over bf16 weights."""
    return int(STEP_TEMPORARIES_PER_PARAM[static.optimizer_states] * grad_bytes
               * 4 // static.weight_itemsize)


def in_backward_bytes(static: StaticBytes) -> int:
    """``memory.optimizer_in_backward``: the largest gradient while its parameter steps, with
    that step's temporaries (the largest is an embedding, tied to the output layer: its gradient
    completes last, when the activations are gone)."""
    return static.largest_grad + step_temporaries(static)


def _under_fsdp(static: StaticBytes, profile: ActivationProfile
                ) -> tuple[StaticBytes, ActivationProfile]:
    """The row's FSDP settings at its precision (bf16 parameters need bf16: an fp32 row keeps
    fp32 ones), and its profile without autocast's weight copies where bf16 parameters replace
    autocast (the gathered bf16 blocks are in ``fsdp_in_flight``)."""
    if static.fsdp is not None and profile.precision != "bf16":
        static = dataclasses.replace(static, fsdp=dataclasses.replace(
            static.fsdp, param_dtype="fp32", reduce_dtype="fp32"))
    if static.fsdp is not None and static.fsdp.param_dtype == "bf16":
        profile = dataclasses.replace(profile, fixed_bytes=0, autocast_cache_bytes=0,
                                      recompute_block_fixed_bytes=0)
    return static, profile


def fsdp_in_flight(static: StaticBytes, profile: ActivationProfile) -> tuple[int, int, int]:
    """What FSDP holds whole beside one rank's shards (``trainer.parallel.fsdp``), as (throughout
    forward and backward, backward's unsharded gradients, kept from forward to backward):

    - the root's parameters, gathered for the whole step (it is not resharded after forward),
      in the parameter dtype; without mixed precision its own shard is part of the gather;
    - two blocks' parameters all-gathered (the one running and the one prefetched), in the
      parameter dtype, and under CPU offload their shards copied to the device first;
    - in backward, a block's unsharded gradients (parameter dtype) and the reduce-scatter's
      input they are copied into (reduction dtype), the next block's not yet begun;
    - ``reshard_after_forward`` false: every block's gathered parameters from its forward to its
      backward; a group of N: every block's parameters sharded N ways, as long.
    Calibrated on CPU with gloo (2 ranks: fp32, bf16 autocast, bf16 parameters, kept after
    forward, offload; ``tests/distributed/test_fsdp.py``), not yet measured on CUDA."""
    fsdp = static.fsdp or FsdpSettings()
    param_share, reduce_share = fsdp.param_share, fsdp.reduce_share
    root, block, world = (profile.outside_blocks_param_bytes, profile.block_param_bytes,
                          static.world_size)
    root_gathered = int(root * param_share)
    if param_share == 1.0 and not static.offloaded:
        root_gathered -= root // world
    blocks = 2 * int(block * param_share)
    if static.offloaded:
        blocks += 2 * -(-block // world)
    grads = int(block * param_share) + int(block * reduce_share)
    all_blocks = int(max(static.full_param_bytes - root, 0) * param_share)
    reshard = fsdp.reshard_after_forward
    if reshard is True:
        kept = 0
    elif reshard is False:  # the two gathered blocks are among those kept whole
        kept = max(0, all_blocks - int(2 * block * param_share))
    else:  # a group's copies, apart from the gathered blocks
        kept = all_blocks // reshard
    return root_gathered + blocks, grads, kept


def profile_all(factory: ModelFactory, transforms: MemoryTransforms, seq_len: int,
                vocab_size: int, precisions: Iterable[str], ac_modes: Iterable[str],
                device: torch.device | None = None, target: str | None = None,
                work: bool = False, packed: bool = False, sequence: int = 1
                ) -> list[ActivationProfile]:
    """One activation profile per (precision, checkpointing) pair (``work``: with the step's
    operators recorded for the time model; ``packed`` and ``sequence``:
    ``profile_activations``')."""
    return [profile_activations(factory, transforms.replace(activation_checkpointing=mode),
                                seq_len, vocab_size, precision, device, target, work=work,
                                packed=packed, sequence=sequence)
            for precision in precisions for mode in ac_modes]
