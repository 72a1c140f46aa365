"""The one place a model gets its memory transforms: the loop, the planner, ``memtrain plan``,
``resolve_auto``, gpu-check and every bench build their models here.

``build_model(factory, transforms)`` seeds, builds, moves to the device and then applies, in
this order: activation checkpointing (``model.blocks``), loss chunking (a model that computes
its own loss), bf16 norm inputs (LayerNorms under bf16 autocast) and activation offload (its
hooks around the checkpointed blocks or the whole forward). ``MemoryTransforms`` is a
small frozen dataclass, not the pydantic ``MemoryConfig``, so gpu-check and the benches (no
pydantic there) build with exactly the same code; ``MemoryTransforms.of(cfg.memory)`` takes the
config's slice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.compat import is_checkpoint_wrapper
from trainer.memory.activation_checkpointing import apply_activation_checkpointing
from trainer.memory.lora import LoraSettings, apply_lora, lora_of, quantize_base
from trainer.memory.loss import set_loss_chunking
from trainer.memory.norms import bf16_norm_inputs
from trainer.memory.offload import install as install_offload
from trainer.models.hf import PREFIX as HF_PREFIX
from trainer.models.hf import weights_of
from trainer.models.registry import create_model
from trainer.models.weights import load_hf_weights

if TYPE_CHECKING:
    from trainer.config import MemoryConfig, ModelConfig

log = logging.getLogger(__name__)
ModelFactory = Callable[[], nn.Module]


@dataclass(frozen=True)
class MemoryTransforms:
    """Which memory transforms a model gets (the fields of ``MemoryConfig`` that shape it)."""

    activation_checkpointing: str = "none"  # none | selective | full
    activation_checkpointing_every: int = 2
    loss_chunk_tokens: int | str = 0  # 0: the plain loss; "auto": chunked if the model can
    bf16_norm_inputs: bool = True
    activation_offload: str = "none"  # none | checkpointed | all (trainer/memory/offload.py)

    @classmethod
    def of(cls, memory: MemoryConfig) -> MemoryTransforms:
        # An "auto" not resolved (trainer.plan.auto.resolve_auto): on, which fits more.
        return cls(memory.activation_checkpointing, memory.activation_checkpointing_every,
                   memory.loss_chunk_tokens, memory.bf16_norm_inputs is not False,
                   memory.activation_offload)

    def replace(self, **changes: Any) -> MemoryTransforms:
        return dataclasses.replace(self, **changes)


def model_factory(model: ModelConfig, load_weights: bool = True) -> ModelFactory:
    """The configured model (a registered name or ``module:function``), without transforms
    (``load_weights=False``: an ``hf:`` directory's weights are left to the sharded build)."""
    kwargs = model.model_dump(exclude={"name", "lora", "dtype"})
    if model.lora is None:
        plain = partial(create_model, model.name, load_weights=load_weights, **kwargs)
        return Bf16Weights(plain) if model.dtype == "bf16" else plain
    lora = LoraSettings(model.lora.rank, model.lora.alpha, model.lora.dropout,
                        tuple(model.lora.targets), model.lora.base_dtype)
    return lambda: apply_lora(create_model(model.name, load_weights=load_weights, **kwargs),
                              lora)


@dataclass(frozen=True)
class Bf16Weights:
    """A model factory whose model has its weights cast to bf16 once built (``model.dtype``).
    The sharded build records ``factory`` alone on meta and casts the meta model, so that no
    rank holds the whole fp32 model while its shards are filled: each shard takes its fp32
    values, rounded, as they are made."""

    factory: ModelFactory

    def __call__(self) -> nn.Module:
        return to_bf16(self.factory())


def to_bf16(model: nn.Module) -> nn.Module:
    """``model`` with every floating-point parameter cast to bf16 (``model.dtype: bf16``),
    rounded to nearest; buffers keep their dtype. Through ``.data``, not ``module.to``, which
    swaps tensors (impossible for a tied fake one), so a meta build records the casts too."""
    for param in {id(p): p for p in model.parameters()}.values():
        if param.is_floating_point():
            param.data = param.data.to(torch.bfloat16)
    return model


def build_model(factory: ModelFactory, transforms: MemoryTransforms,
                device: torch.device | None = None, seed: int | None = 0) -> nn.Module:
    """A new model from ``factory`` with ``transforms`` applied, on ``device``.

    ``seed`` (None: leave the RNG alone) makes the initial weights the same on every rank and
    in every probe. Raises ValueError naming the setting a model cannot take.
    """
    if seed is not None:
        torch.manual_seed(seed)
    model = factory()
    if device is not None:
        model = model.to(device)
    apply_transforms(model, transforms)
    return model


def apply_transforms(model: nn.Module, transforms: MemoryTransforms) -> None:
    apply_activation_checkpointing(model, transforms.activation_checkpointing,
                                   transforms.activation_checkpointing_every)
    set_loss_chunking(model, transforms.loss_chunk_tokens)
    bf16_norm_inputs(model, transforms.bf16_norm_inputs)
    install_offload(model, transforms.activation_offload)


def checkpointed_blocks(model: nn.Module) -> list[int]:
    """Indices of the blocks in ``model.blocks`` that activation checkpointing wrapped."""
    blocks = getattr(model, "blocks", [])
    return [i for i, block in enumerate(blocks) if is_checkpoint_wrapper(block)]


def compile_model(model: nn.Module) -> str:
    """torch.compile ``model`` in place, block by block where it has ``blocks`` (as torchtitan
    does: identical blocks share one compiled graph, the loss and embeddings stay eager, and
    FSDP2 can wrap each compiled block); the whole model otherwise. In place
    (``nn.Module.compile``), so parameter names and checkpoints are unchanged. Returns what was
    compiled, for the log."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        for block in blocks:
            block.compile()
        return f"each of the {len(blocks)} blocks"
    model.compile()
    return "the whole model"


def build_whole(model: ModelConfig, init_from: str | None, transforms: MemoryTransforms,
                device: torch.device | None = None, seed: int | None = 0) -> nn.Module:
    """The whole model ``model`` names, with ``transforms`` (``build_model``): with the weights
    of ``init_from`` where it is ``hf:DIR`` (``load_hf_weights``, over the seeded build's), else
    with the model's own. How the loop builds it without FSDP, and export a LoRA run's base."""
    init_hf = init_from if (init_from or "").startswith(HF_PREFIX) else None
    nf4 = init_hf is not None and model.lora is not None and model.lora.base_dtype == "nf4"
    if nf4:  # the base quantized once, from the directory's weights (and its error said of them)
        model = model.model_copy(update={"lora": model.lora.model_copy(  # type: ignore[union-attr]
            update={"base_dtype": "bf16"})})
    built = build_model(model_factory(model, load_weights=init_hf is None), transforms, device,
                        seed)
    if init_hf is not None:
        load_hf_weights(built, weights_of(init_hf))
    if nf4:
        quantize_base(built)
        settings = lora_of(built)
        assert settings is not None
        built.lora_settings = dataclasses.replace(  # type: ignore[assignment]
            settings, base_dtype="nf4")
    return built


