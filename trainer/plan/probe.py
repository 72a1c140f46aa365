"""The probe: a model run on CPU to measure what one training forward saves for backward.

A probe forward pass (the model at full width and sequence length, one and two samples, with
fake tensors by default: shapes, no data) counts every tensor autograd saves for backward
through ``saved_tensors_hooks``, deduplicated by storage, excluding parameters, and adds the
inputs that activation checkpointing keeps alive for recomputation. Two probe sizes separate
the per-sample bytes from the fixed ones (autocast's low-precision weight copies). A
checkpointed model is probed again without checkpointing: the difference is what recomputation
holds (``trainer.plan.terms.checkpointing``). The same forward records how the first block and
the first tiled MLP were called, from which a block's backward is measured
(``trainer.plan.terms.blocks``).

Under ``parallel.sequence: N`` a rank is probed as the run splits it: its ``seq_len / N``
tokens of every row, attention over whole rows for ``heads / N`` heads with the whole rows'
mask, the all-to-alls stood in for by local reshuffles of the same shapes
(``trainer.plan.terms.sequence``).

What the probe measures is an ``ActivationProfile`` (``trainer.plan.profile``); the peak it
makes is ``trainer.plan.peak``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from collections.abc import Iterable, Iterator
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
)
from trainer.errors import first_line
from trainer.memory.loss import LossShape, observe_chunked_losses, summed_loss
from trainer.memory.offload import offload_of
from trainer.memory.precision import precision_policy
from trainer.memory.tiled_mlp import (
    TOKEN_DIM,
    TiledMLPMixin,
    block_mlps,
    tile_sizes,
    untiled_forward,
)
from trainer.models.build import MemoryTransforms, ModelFactory, build_model, checkpointed_blocks
from trainer.parallel.sequence import SequenceShapes, check_divisible, split_model
from trainer.plan.emulation import BlockCall, emulated_bf16_workspace
from trainer.plan.profile import ActivationProfile
from trainer.plan.static import nbytes, parameter_bytes
from trainer.plan.terms.blocks import BlockBackward
from trainer.plan.terms.checkpointing import Recompute
from trainer.plan.terms.offload import HostActivations
from trainer.plan.terms.sequence import AllToAlls
from trainer.plan.terms.tiled_mlp import MlpTile
from trainer.plan.work import record_work
from trainer.tensors import storage_key, tensor_bytes

log = logging.getLogger("memtrain.planner")
AC_MODES = ("none", "selective", "full")


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
    num_blocks = len(getattr(model, "blocks", nn.ModuleList()))
    model.train()
    measured: list[tuple[int, list[int], list[LossShape], int]] = []  # at batch 1, then 2
    first = _FirstCalls(model)  # batch 1's
    for batch in (1, 2):
        with first.recording() if batch == 1 else contextlib.nullcontext():
            measured.append(_probe(
                model, probe_batch(batch, seq_len, vocab_size, device, packed), precision))
        _collect_cycles(model)
    (saved_1, sizes_1, _, host_1), (saved_2, sizes_2, loss_shapes, host_2) = measured
    per_sample, fixed = _fit(saved_1, saved_2)
    host_per_sample, host_fixed = _fit(host_1, host_2)
    plain = None  # the same model without checkpointing, where it has any
    if chosen:
        plain, _ = _profile(factory, transforms.replace(activation_checkpointing="none",
                                                        activation_offload="none"),
                            seq_len, vocab_size, precision, device, packed, sequence)
    block = BlockBackward(
        largest_tensor_per_sample_bytes=_largest_growth(sizes_1, sizes_2) if plain is None
        else plain.block.largest_tensor_per_sample_bytes,  # inside a recomputed block
        output_grad_per_sample_bytes=first.output_grad_bytes(precision),
        first_block_per_sample_bytes=_first_block(chosen, num_blocks, per_sample, plain),
        mlp_tile=first.tile_bytes(precision))
    profile = ActivationProfile(
        precision=precision, activation_checkpointing=transforms.activation_checkpointing,
        per_sample_bytes=per_sample, fixed_bytes=fixed, seq_len=seq_len,
        loss_shape=loss_shapes[0] if loss_shapes else None, parameters=parameter_bytes(model),
        block=block, recompute=_recompute(chosen, num_blocks, per_sample, fixed, plain),
        offload=HostActivations(per_sample_bytes=host_per_sample, fixed_bytes=host_fixed),
        all_to_alls=AllToAlls.of(split))
    return profile, first.block


def _recompute(chosen: list[int], num_blocks: int, per_sample: int, fixed: int,
               plain: ActivationProfile | None) -> Recompute:
    """Checkpointing's recomputation of the ``chosen`` blocks, from a probe's saved bytes
    (``per_sample``, ``fixed``) against the probe of the same model without checkpointing
    (``plain``; None without checkpointing)."""
    # Recomputation repeats the forward of the wrapped blocks: their share of the forward FLOPs
    # is about their share of the blocks, and a forward is about a third of forward+backward.
    fraction = (len(chosen) / num_blocks) / 3 if num_blocks else 0.0
    if plain is None:
        return Recompute(fraction=fraction)
    autocast_cache = max(0, plain.fixed_bytes - fixed)
    if num_blocks - 1 not in chosen:  # an unchecked last block frees more than a recomputed
        return Recompute(fraction=fraction, autocast_cache_bytes=autocast_cache)  # one takes
    return Recompute(  # the recomputed block saves its autocast weight copies again
        fraction=fraction,
        block_per_sample_bytes=(plain.per_sample_bytes - per_sample) // len(chosen),
        block_fixed_bytes=autocast_cache // len(chosen), autocast_cache_bytes=autocast_cache)


def _first_block(chosen: list[int], num_blocks: int, per_sample: int,
                 plain: ActivationProfile | None) -> int:
    """What the first block saves for its own backward, per sample: about one block's share of
    the saved bytes, recomputed where it is checkpointed (against ``plain``, the probe
    without checkpointing)."""
    if plain is None:
        return per_sample // num_blocks if num_blocks else 0
    if 0 in chosen:
        return (plain.per_sample_bytes - per_sample) // len(chosen)
    return plain.per_sample_bytes // num_blocks


class _FirstCalls:
    """How a probe's forward called ``model``'s first block (``BlockCall``, and one sample of
    its input) and its first tiled MLP (one sample of its input): what a block's backward is
    planned from beside its saved activations (``trainer.plan.terms.blocks``)."""

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

    def tile_bytes(self, precision: str) -> MlpTile:
        """``_tile_bytes`` of the first tiled MLP (none without one)."""
        if self.tiled is None or self.mlp_input is None:
            return MlpTile()
        return _tile_bytes(self.tiled, self.mlp_input, precision)


def _output_grad_bytes(sample: torch.Tensor, precision: str) -> int:
    """The gradient flowing into a block's backward from the block after it, per sample: the
    shape and dtype of one sample of the block's input (``sample``: the residual stream's),
    and under autocast its copy in the autocast dtype, which the block's last matrix product
    takes."""
    low = 2 if precision in ("bf16", "fp16") and sample.element_size() > 2 else 0
    return tensor_bytes(sample) + sample.numel() * low


def _tile_bytes(mlp: TiledMLPMixin, sample: torch.Tensor, precision: str) -> MlpTile:
    """What the tiled ``mlp``'s backward holds while it runs its largest tile, per sample and
    fixed (``trainer.memory.tiled_mlp.TiledMLPFunction.backward``): the tile's forward,
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
    parameter_grads = nbytes(p for p in mlp.parameters() if p.requires_grad)
    return MlpTile(
        per_sample_bytes=counts["bytes"] + max(counts["sizes"], default=0) + input_grad,
        fixed_bytes=parameter_grads)


def _split_for_probe(model: nn.Module, sequence: int) -> SequenceShapes | None:
    """``model`` split as one rank of ``sequence`` ranks holds it, and the split (None: one
    rank holds whole rows)."""
    if sequence == 1:
        return None
    split = SequenceShapes(sequence)
    split_model(model, split)
    return split


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
