"""QLoRA's frozen base (``model.lora.base_dtype: nf4``), in one place: which layers are stored
as torchao's ``NF4Tensor`` (``nf4_layers``, ``quantize_base``), how a rank quantizes its rows of
one as they are read (``fill_nf4``), the checks (a layer kept in bf16, a split FSDP's ranks
cannot take), the model factory that quantizes a LoRA model's base as it is built or filled
(``Nf4Base``) and the bf16 base a merge needs back (``dequantize_base``).

An NF4 weight is 4-bit codes (two to a byte, the nearest of NormalFloat's 16 levels to each
weight over its block's absolute maximum), one absmax scale per block of 64 weights, and those
scales double-quantized: int8 offsets from the scales' mean, one factor per 256 scales (QLoRA's
layout; about 0.52 bytes a weight in all). torchao's ``to_nf4`` quantizes a whole weight.

A weight is quantized as it is filled (``fill_nf4``), never held whole in bf16 beside the NF4
model: one process reads the whole layer, a rank of FSDP only its rows. The codes and the scales
depend only on the rows' own blocks, but the scales' mean is the whole weight's: the ranks agree
on it in one all-reduce, so that each rank's codes, scales and mean are exactly its rows' part of
the whole weight's quantization, and FSDP's all-gather (``NF4Tensor.fsdp_post_all_gather``, which
keeps one mean for the gathered weight) gives back the weight one process quantizes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from trainer.compat import is_fake
from trainer.memory.optimizers import MissingExtraError, quiet_torchao_import
from trainer.tensors import shard_rows

# torchao's NF4 as QLoRA uses it: 64 weights a block share one scale, 256 of those scales one
# factor of their own; a weight (each rank's rows of it, under FSDP) must fill whole blocks of
# both, so its size must be a multiple of GRAIN.
BLOCK = 64
SCALER_BLOCK = 256
GRAIN = BLOCK * SCALER_BLOCK
# The parts of an NF4 weight that its ``empty_like`` allocates (and FSDP shards by rows).
_ALLOCATED = ("quantized_data", "quantized_scalers", "quantization_factor")


def _torchao() -> Any:
    """torchao's NF4 (``NF4Tensor``, ``to_nf4``, ``SubclassTensorArgs``), or
    ``MissingExtraError`` naming the extra that installs it."""
    try:
        with quiet_torchao_import():
            from torchao.quantization import NF4Tensor, to_nf4
            from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as err:
        raise MissingExtraError("model.lora.base_dtype nf4 needs torchao: pip install "
                                "'memtrain[strategies]'") from err
    return SimpleNamespace(NF4Tensor=NF4Tensor, to_nf4=to_nf4,
                           SubclassTensorArgs=nf4_tensor.SubclassTensorArgs)


def fits(shape: torch.Size | tuple[int, ...], parts: int = 1) -> bool:
    """Whether a weight of ``shape`` split by rows into ``parts`` equal shards (FSDP's over
    ``parts`` ranks) fills NF4's blocks in every shard."""
    rows = shape[0] if len(shape) else 0
    return len(shape) == 2 and rows % parts == 0 and (math.prod(shape) // parts) % GRAIN == 0


def to_nf4(weight: torch.Tensor) -> Any:
    """``weight`` as torchao's ``NF4Tensor``: ``to_nf4``'s result, made in slices
    (``quantize_rows``); a meta or fake weight (the planner's, the sharded build's placeholder)
    through ``to_nf4`` itself."""
    weight = weight.detach().to(torch.bfloat16)
    if weight.device.type == "meta" or is_fake(weight):
        return _torchao().to_nf4(weight, BLOCK, SCALER_BLOCK)
    return quantize_rows(weight, split=False)


def is_nf4(tensor: Any) -> bool:
    """Whether ``tensor`` (or the local shard of a DTensor) is an ``NF4Tensor``."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return hasattr(local, "get_original_weight")


def double_quantize(absmax: torch.Tensor, mean: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' scales ``absmax`` as int8 offsets from ``mean`` with one factor per 256 of
    them: ``NF4Tensor.double_quantize_scalers``' arithmetic, with the mean given (the whole
    weight's, where ``absmax`` are one rank's rows)."""
    offsets = (absmax - mean).view(-1, SCALER_BLOCK)
    factor = 256 / (2 * offsets.abs().amax(dim=1, keepdim=True).expand_as(offsets))
    codes = (offsets * factor).round().clamp(-128, 127)
    return codes.flatten().to(torch.int8), factor[:, 0].contiguous()


# Weights coded at a time: torchao's nearest-level search holds 16 bf16 differences and an
# int64 index per weight (about 40 bytes), 10 MiB at this size rather than 40 at its own 1M.
_SLICE = 1 << 18


@functools.cache
def _levels(device: torch.device) -> torch.Tensor:
    """NF4's 16 levels as torchao's ``NF4Tensor`` holds them (``nf4``), in bf16."""
    return _torchao().to_nf4(torch.zeros(GRAIN, dtype=torch.bfloat16, device=device), BLOCK,
                             SCALER_BLOCK).nf4


def quantize_rows(rows: torch.Tensor, split: bool) -> Any:
    """``rows`` (bf16, a multiple of ``GRAIN`` weights) as an ``NF4Tensor`` equal to torchao's
    ``to_nf4(rows)``, coded ``_SLICE`` weights at a time (a block's codes depend on its own
    weights alone); where they are this rank's part of a weight ``split`` over the ranks, with
    the whole weight's
    scale mean, agreed over the process group."""
    torchao = _torchao()
    NF4Tensor = torchao.NF4Tensor  # noqa: N806 - torchao's class
    flat = rows.detach().to(torch.bfloat16).flatten()
    levels = _levels(flat.device)
    absmax = flat.view(-1, BLOCK).abs().amax(dim=1)
    if split:
        import torch.distributed as dist

        total = torch.stack([absmax.float().sum(),
                             torch.tensor(float(absmax.numel()), device=absmax.device)])
        dist.all_reduce(total)
        mean = (total[0] / total[1]).to(torch.bfloat16)
    else:
        mean = absmax.mean()  # torchao's, as its double quantization takes it
    codes = torch.cat([NF4Tensor.convert_to_norm_float_weight(part, part.numel() // BLOCK,
                                                              BLOCK, levels)
                       for part in flat.split(_SLICE)])
    scalers, factor = double_quantize(absmax, mean)
    meta = torchao.SubclassTensorArgs(rows.shape, rows.stride(), 0, torch.bfloat16, rows.device,
                                      False)
    return NF4Tensor(meta, BLOCK, absmax.numel(), SCALER_BLOCK, scalers, factor, mean, codes,
                     levels)


def fill_nf4(target: torch.Tensor, read: Callable[[slice | None], torch.Tensor],
             shape: torch.Size) -> float:
    """Quantize this rank's part of a whole weight of ``shape`` into ``target``, an NF4
    parameter or a DTensor whose shard is one: its rows under FSDP, all of it otherwise.
    ``read(rows)`` gives those rows of the whole weight (``None``: all of it). Returns the whole
    weight's quantization error, ||dequantized - weight|| / ||weight|| (summed over the ranks)."""
    split = hasattr(target, "to_local")  # a DTensor: this rank holds some of the rows
    # The DTensor's own shard object, whose attributes FSDP's all-gather reads (``to_local``
    # gives a view); an NF4 parameter is its NF4Tensor itself.
    local: Any = getattr(target, "_local_tensor", target)
    rows = None
    if split:
        import torch.distributed as dist

        rows = shard_rows(shape[0], dist.get_rank(), dist.get_world_size())
    with torch.no_grad():
        value = read(rows).to(device=local.quantized_data.device, dtype=torch.bfloat16)
        nf4 = quantize_rows(value, split)
        for name in _ALLOCATED:
            getattr(local, name).copy_(getattr(nf4, name))
        # ``empty_like`` (``to_empty``) allocates only the three above and leaves the mean and
        # the 16 levels where they were (on meta, after a meta build)
        local.scaler_mean, local.nf4 = nf4.scaler_mean, nf4.nf4
        squares = _squares(value, nf4)
    if split:
        import torch.distributed as dist

        dist.all_reduce(squares)
    return float((squares[0] / squares[1].clamp(min=1e-24)).sqrt())


def relative_error(weight: torch.Tensor, nf4: Any) -> float:
    """||dequantized - weight|| / ||weight||."""
    squares = _squares(weight, nf4)
    return float((squares[0] / squares[1].clamp(min=1e-24)).sqrt())


def _squares(weight: torch.Tensor, nf4: Any) -> torch.Tensor:
    """The summed squares of ``nf4``'s error and of ``weight``, in fp32, a slice at a time
    (``_dequantized``). Summed squares, not ``Tensor.norm``, whose fp32 result is off by about
    1e-4 at a million weights."""
    exact = weight.detach().flatten().view(-1, BLOCK)
    total = torch.zeros(2, device=exact.device)
    for start, values in _dequantized(nf4):
        part = exact[start:start + values.shape[0]].float()
        total += torch.stack([(values.float() - part).square().sum(), part.square().sum()])
    return total


def _dequantized(nf4: Any) -> Iterator[tuple[int, torch.Tensor]]:
    """``nf4``'s weights in bf16, ``_SLICE`` of them at a time as (first block, [blocks, 64]),
    by ``NF4Tensor.get_original_weight``'s arithmetic, which for the whole weight at once holds
    two int64 indices and three bf16 copies a weight (14 bytes a weight, measured)."""
    scales = nf4.dequantize_scalers(nf4.quantized_scalers, nf4.quantization_factor,
                                    nf4.scaler_block_size)  # one a block, in bf16
    blocks = _SLICE // BLOCK
    for start in range(0, scales.shape[0], blocks):
        codes = nf4.quantized_data[start * BLOCK // 2:(start + blocks) * BLOCK // 2]
        levels = torch.stack([codes >> 4, codes & 0b1111], dim=-1).flatten().long()
        yield start, nf4.nf4[levels].view(-1, BLOCK) * scales[start:start + blocks, None]


def dequantize(nf4: Any, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``nf4.get_original_weight().to(dtype)``, value for value, made a slice at a time into
    the result: 2 bytes a weight (bf16) and one slice's indices, not torchao's 14."""
    out = torch.empty(nf4.shape, dtype=dtype, device=nf4.quantized_data.device)
    flat = out.view(-1, BLOCK)
    for start, values in _dequantized(nf4):
        flat[start:start + values.shape[0]] = values
    return out


class _Nf4Matmul(torch.autograd.Function):
    """``x @ W.T`` for an NF4 ``W``, as torchao's ``linear_nf4`` computes it (the weight
    dequantized in forward and again in backward, never saved), with the weight dequantized
    by ``dequantize``, to the dtype the matmul runs in."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any) -> torch.Tensor:
        ctx.weight = weight
        # Under autocast straight to its dtype: torchao dequantizes to the input's (fp32) and
        # autocast then casts that copy, the same values through a weight's bytes twice more.
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
            else x.dtype
        return torch.nn.functional.linear(x, dequantize(weight, dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad @ dequantize(ctx.weight, grad.dtype), None


class Nf4Linear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight is NF4 (``quantize_base`` gives a quantized layer
    this class): its matmul dequantizes the weight a slice at a time (``_Nf4Matmul``); the
    same result as torchao's ``linear_nf4`` to the bit, in a seventh of its transient bytes. A
    bf16 weight (``dequantize_base`` before a merge) runs as ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_nf4(self.weight):
            return super().forward(x)
        out = _Nf4Matmul.apply(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def nf4_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The frozen linear layers of ``model.blocks`` (the adapters' base layers among them), by
    their names under the model: what ``base_dtype: nf4`` stores in NF4."""
    return [(f"blocks.{i}.{name}".replace("_checkpoint_wrapped_module.", ""), module)
            for i, block in enumerate(getattr(model, "blocks", []))
            for name, module in block.named_modules()
            if isinstance(module, nn.Linear) and not module.weight.requires_grad]


def quantize_base(model: nn.Module, parts: int = 1) -> dict[str, float]:
    """The frozen weights of every linear layer in ``model.blocks`` (``nf4_layers``) as NF4
    (``base_dtype: nf4``), in place; a weight whose size does not fill NF4's blocks stays bf16,
    listed on the model as ``nf4_kept`` (the run warns once: ``nf4_kept_in_bf16``); one that
    does but whose ``parts`` row shards (FSDP's ranks) would not is refused (ValueError), so
    that a base is the same at every world size. Each quantized
    layer's error (the relative Frobenius norm of its dequantized weight's difference from the
    bf16 weight) is kept on the model as ``nf4_errors``, for the run's log, and returned. A
    meta or fake model gets NF4 placeholders and no errors: the sharded build fills them
    (``trainer.memory.nf4.fill_nf4``)."""
    quantized: dict[str, float] = {}
    kept = []
    layers = nf4_layers(model)
    if not layers:
        raise ValueError(f"model.lora.base_dtype nf4: {type(model).__name__}'s blocks hold no "
                         "nn.Linear layer to store in NF4 (GPT-2's are Conv1D); use base_dtype "
                         "bf16")
    refusal = nf4_split_refusal(model, parts)
    if refusal is not None:
        raise ValueError(refusal)
    for name, module in layers:
        if not fits(module.weight.shape):
            kept.append(f"{name} {list(module.weight.shape)}")
            continue
        weight = module.weight.detach().to(torch.bfloat16)
        module.weight = nn.Parameter(to_nf4(weight), requires_grad=False)
        if type(module) is nn.Linear:  # its matmul dequantizes a slice at a time
            module.__class__ = Nf4Linear
        if weight.device.type != "meta" and not is_fake(weight):
            quantized[name] = relative_error(weight, module.weight)
    model.nf4_kept = kept  # type: ignore[assignment]
    model.nf4_errors = quantized  # type: ignore[assignment]
    return quantized


def nf4_split_refusal(model: nn.Module, parts: int) -> str | None:
    """The line refusing an NF4 base whose first layer (``nf4_layers``) that one process
    quantizes would not fill NF4's blocks in its ``parts`` row shards (FSDP's ranks); None
    where every such layer splits."""
    unsplit = next(((name, module.weight.shape) for name, module in nf4_layers(model)
                    if fits(module.weight.shape) and not fits(module.weight.shape, parts)), None)
    if unsplit is None:
        return None
    name, shape = unsplit
    return (f"model.lora.base_dtype nf4 under FSDP on {parts} ranks: {name} {list(shape)} does "
            f"not split into whole NF4 blocks (its rows must divide by {parts} and each rank's "
            f"share fill blocks of {GRAIN}); one process quantizes it, so its base would change "
            "with the world size: use parallel.strategy ddp or another number of workers")


def nf4_kept_in_bf16(model: nn.Module) -> str | None:
    """The run's warning naming the linear layers an NF4 base kept in bf16 (``quantize_base``),
    said once, by the run; None where every one is in NF4."""
    kept: list[str] = getattr(model, "nf4_kept", [])
    if not kept:
        return None
    return (f"model.lora.base_dtype nf4: {len(kept)} linear layer(s) kept in bf16, their size "
            f"not a multiple of {GRAIN} (NF4's blocks of {BLOCK} and its scales' of "
            f"{SCALER_BLOCK}): {', '.join(kept[:3]) + (', ...' if len(kept) > 3 else '')}")


@dataclass(frozen=True)
class Nf4Base:
    """A LoRA model factory whose frozen base stores its blocks' linear weights in NF4
    (``model.lora.base_dtype: nf4``): ``factory`` builds the model with a bf16 base, which is
    then quantized (``quantize_base``; ``parts``: FSDP's ranks, whose row shards must each fill
    NF4's blocks). A meta build (``trainer.models.build.OnMeta``) records ``factory`` alone and
    quantizes each weight as it is filled, so that the bf16 base is never held whole."""

    factory: Callable[[], nn.Module]
    parts: int = 1

    def __call__(self) -> nn.Module:
        return self.quantize(self.factory())

    def quantize(self, model: nn.Module) -> nn.Module:
        quantize_base(model, self.parts)
        settings: Any = model.lora_settings  # ``trainer.memory.lora.LoraSettings``
        model.lora_settings = dataclasses.replace(settings, base_dtype="nf4")
        return model

    def on_meta(self, model: nn.Module) -> None:
        self.quantize(model)  # NF4 placeholders

    def for_parts(self, parts: int) -> Nf4Base:
        return dataclasses.replace(self, parts=parts)

    def filled(self, model: nn.Module) -> None:
        """Each NF4 weight's quantization error (``fill_nf4``'s), for the run's log."""
        model.nf4_errors = {name: module.nf4_error  # type: ignore[assignment]
                            for name, module in nf4_layers(model)
                            if hasattr(module, "nf4_error")}


def describe_nf4_base(model: nn.Module) -> list[str]:
    """The run's log phrase on an NF4 base's quantization error (the relative norm of each
    weight's error, recorded as it was quantized); none for another base."""
    errors: dict[str, float] = getattr(model, "nf4_errors", {})
    if not errors:
        return []
    worst = max(errors, key=errors.__getitem__)
    return [f"NF4 base: {len(errors)} linear layers, quantization error (relative norm) "
            f"{sum(errors.values()) / len(errors):.2%} on average, at most {errors[worst]:.2%} "
            f"({worst})"]


def dequantize_base(model: nn.Module) -> None:
    """Every NF4 weight of ``model`` back to bf16, in place (before a merge)."""
    for module in model.modules():
        weight = module._parameters.get("weight")  # its own (PEFT's layers show their base's)
        if weight is not None and hasattr(weight, "get_original_weight"):
            module.weight = nn.Parameter(weight.get_original_weight().to(torch.bfloat16),
                                         requires_grad=False)
