"""LoRA adapters through PEFT (``model.lora``): the base model frozen, low-rank adapters trained.

``apply_lora`` freezes every parameter of the model, casts the frozen ones to ``base_dtype``
where asked (bf16 halves the base's bytes; it then computes under bf16 autocast; nf4, QLoRA's
base, stores the blocks' linear weights as torchao's ``NF4Tensor``, dequantized to bf16 in each
matmul: ``trainer.memory.nf4``, and the rest in bf16), and injects
PEFT's LoRA layers into the target linear layers in place (``peft.inject_adapter_in_model``:
no ``PeftModel`` wrapper, so the model keeps memtrain's contract: ``blocks``, its own loss).
Each target's weight becomes ``<target>.base_layer.weight`` beside ``<target>.lora_A.default``
and ``lora_B.default``; only those adapters have gradients, optimizer state and a place in
checkpoints (``trainable_state_dict``). ``lora_A`` starts as PEFT draws it (Kaiming-uniform,
``lora_B`` zero), but from a generator of its own seeded by the run's seed and the adapter's
name (``initial_adapter``): the values do not depend on how many random draws the base's
construction made before it, which differs between a model read with ``from_pretrained``
(none), one built on meta for FSDP (its initialisation recorded), and one with more layers.
The output layer cannot be a target: the loss reads its weight directly (chunked), so an
adapter there would be skipped.

Targets by default: memtrain's GPT ``qkv``, ``proj`` (attention's and the MLP's) and ``fc``; a
Hugging Face model, every linear layer of its decoder layers (a Llama's ``q_proj`` ...
``down_proj``; GPT-2's ``c_attn``, ``c_proj`` and ``c_fc``, transformers' ``Conv1D``), as PEFT's
``all-linear``. A ``Conv1D`` stores its weight transposed (``in x out``): its adapters are
PEFT's with ``fan_in_fan_out``.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.compat import is_fake
from trainer.memory.nf4 import (
    Nf4Base,
    dequantize_base,
    describe_nf4_base,
    quantize_base,
)
from trainer.memory.optimizers import MissingExtraError, quiet_torchao_import

ADAPTER = "default"  # PEFT's adapter name: the one adapter memtrain trains


@dataclass(frozen=True)
class LoraSettings:
    """``model.lora`` without pydantic (the benches and gpu-check build with it)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # () : the model's defaults (the module docstring)
    base_dtype: str = "fp32"  # fp32 | bf16 | nf4: the frozen base's dtype

    @classmethod
    def of(cls, lora: Any) -> LoraSettings:
        """The settings of ``model.lora`` (``trainer.config.LoraConfig``)."""
        return cls(lora.rank, lora.alpha, lora.dropout, tuple(lora.targets), lora.base_dtype)


def _peft() -> Any:
    try:
        with quiet_torchao_import():
            import peft
    except ImportError as err:
        raise MissingExtraError("model.lora needs peft: pip install 'memtrain[strategies]'") \
            from err
    return peft


def default_targets(model: nn.Module) -> list[str]:
    """The linear layers LoRA adapts when ``model.lora.targets`` is empty."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or not len(blocks):
        raise ValueError(f"model.lora: {type(model).__name__} has no blocks; name the linear "
                         "layers to adapt in model.lora.targets")
    names = {name.rsplit(".", 1)[-1] for name, module in blocks[0].named_modules()
             if isinstance(module, _linear_classes(model))}
    return sorted(names)


def _linear_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The layer classes PEFT's ``all-linear`` takes: ``nn.Linear``, and in a Hugging Face
    model transformers' ``Conv1D`` (GPT-2's)."""
    if getattr(model, "hf", None) is None:
        return (nn.Linear,)
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def _fan_in_fan_out(model: nn.Module, targets: list[str]) -> bool:
    """Whether the targets are ``Conv1D`` layers (weights stored ``in x out``), which PEFT's
    adapters must then be told (``fan_in_fan_out``); ValueError where they mix both kinds."""
    linear = _linear_classes(model)
    layers = [getattr(module, "get_base_layer", lambda m=module: m)()  # PEFT's: the base's
              for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in targets]
    kinds = {type(layer).__name__ == "Conv1D" for layer in layers if isinstance(layer, linear)}
    if len(kinds) > 1:
        raise ValueError(f"model.lora.targets {targets}: they name both nn.Linear and Conv1D "
                         "layers, whose weights are stored the other way round; name one kind")
    return kinds == {True}


def _output_layer(model: nn.Module) -> str | None:
    """The module name of the output layer, whose weight the loss reads directly."""
    hf = getattr(model, "hf", None)
    output = hf.get_output_embeddings() if hf is not None else getattr(model, "lm_head", None)
    for name, module in model.named_modules():
        if module is output:
            return name
    return None


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Freeze ``model``, inject the adapters in place, and return it (the module docstring)."""
    peft = _peft()
    targets = list(settings.targets) or default_targets(model)
    output = _output_layer(model)
    if output is not None and output.rsplit(".", 1)[-1] in targets:
        raise ValueError(f"model.lora.targets: {output.rsplit('.', 1)[-1]!r} names the output "
                         "layer, whose weight the loss reads directly; adapt the blocks' layers")
    for param in model.parameters():
        param.requires_grad_(False)
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                             lora_dropout=settings.dropout, target_modules=targets,
                             fan_in_fan_out=_fan_in_fan_out(model, targets))
    try:
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as err:  # PEFT: a target that matches no module
        raise ValueError(f"model.lora.targets {targets}: {err}") from None
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    if settings.base_dtype != "fp32":  # the frozen base only: the adapters stay fp32
        for param in {id(p): p for p in model.parameters()}.values():
            if not param.requires_grad:  # ``.data``, not ``module.to``: that swaps tensors,
                param.data = param.data.to(torch.bfloat16)  # impossible for a tied fake one
    if settings.base_dtype == "nf4":
        quantize_base(model)
    # The targets as resolved: once injected, the blocks' linear layers include the adapters.
    model.lora_settings = dataclasses.replace(settings, targets=tuple(targets))  # type: ignore[assignment]
    return model


def with_adapters(factory: Callable[[], nn.Module], settings: LoraSettings
                  ) -> Callable[[], nn.Module]:
    """A model factory whose model is ``factory``'s with LoRA adapters (``apply_lora``). An NF4
    base is built in bf16, then quantized by ``Nf4Base`` (which a sharded build quantizes as it
    fills each rank's rows)."""
    if settings.base_dtype == "nf4":
        bf16 = dataclasses.replace(settings, base_dtype="bf16")
        return Nf4Base(lambda: apply_lora(factory(), bf16))
    return lambda: apply_lora(factory(), settings)


def initial_adapter(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The first value of the adapter parameter ``name`` (a ``lora_A`` weight: PEFT's
    Kaiming-uniform draw; a ``lora_B``, zero) at ``seed``, from a generator of its own, in
    fp32; ``name`` as the model's state dict has it."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    value = torch.empty(shape)
    nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
    return value


def draw_adapters(model: nn.Module, seed: int) -> None:
    """Every adapter of a LoRA model built whole (not sharded) set to ``initial_adapter``,
    in place; a fake or meta model is left as it is."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name) and not param.is_meta and not is_fake(param):
                param.copy_(initial_adapter(name, param.shape, seed))


def is_adapter(name: str) -> bool:
    """Whether a parameter (or state-dict key) is one of LoRA's adapters."""
    return ".lora_A." in name or ".lora_B." in name


def lora_of(model: nn.Module) -> LoraSettings | None:
    settings = getattr(model, "lora_settings", None)
    return settings if isinstance(settings, LoraSettings) else None


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of ``model``: its state dict, or only the adapters of a LoRA
    model (the base comes back from its weights or its seed)."""
    state = model.state_dict()
    if lora_of(model) is None:
        return state
    return {name: tensor for name, tensor in state.items() if is_adapter(name)}


def base_name(name: str) -> str:
    """A base weight's name as the model had it before the adapters (and as its files do)."""
    return name.replace(".base_layer.", ".")


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold each adapter into its base weight and put the base layer back in its place: the
    model as it was before ``apply_lora``, with the trained weights."""
    from peft.tuners.lora import LoraLayer

    dequantize_base(model)  # an NF4 base is merged into in bf16
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(adapter_names=[ADAPTER])
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def peft_adapter_state(model: nn.Module, prefix: str = "hf.") -> dict[str, torch.Tensor]:
    """The adapters by the names ``PeftModel.from_pretrained`` reads
    (``base_model.model.<the Hugging Face model's name>.lora_A.weight``)."""
    out = {}
    for name, tensor in trainable_state_dict(model).items():
        inner = name.removeprefix(prefix).replace(f".{ADAPTER}.", ".")
        out[f"base_model.model.{inner}"] = tensor.detach().float().contiguous()
    return out


def peft_config(settings: LoraSettings, model: nn.Module, base: str) -> Any:
    """PEFT's ``LoraConfig`` of ``settings`` for a causal LM whose base is ``base``."""
    return _peft().LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.targets),
        fan_in_fan_out=_fan_in_fan_out(model, list(settings.targets)),
        task_type="CAUSAL_LM", base_model_name_or_path=base)


def describe_adapters(model: nn.Module) -> list[str]:
    """The run's log phrases on a LoRA model's adapters and its frozen base (what trains, the
    base's dtype, an NF4 base's quantization error); none for a model without adapters."""
    settings = lora_of(model)
    if settings is None:
        return []
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return [f"LoRA rank {settings.rank}, alpha {settings.alpha:g}: {trained:,} of {total:,} "
            f"parameters train ({trained / total:.2%}), the base frozen in "
            f"{settings.base_dtype}"] + describe_nf4_base(model)

