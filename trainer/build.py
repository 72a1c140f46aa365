"""The one place a model gets its memory transforms: the loop, the planner, ``memtrain plan``,
``resolve_auto``, gpu-check and every bench build their models here.

``build_model(factory, transforms)`` seeds, builds, moves to the device and then applies, in
this order: activation checkpointing (``model.blocks``), loss chunking (a model that computes
its own loss) and bf16 norm inputs (LayerNorms under bf16 autocast). ``MemoryTransforms`` is a
small frozen dataclass, not the pydantic ``MemoryConfig``, so gpu-check and the benches (no
pydantic there) build with exactly the same code; ``MemoryTransforms.of(cfg.memory)`` takes the
config's slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.compat import is_checkpoint_wrapper
from trainer.memory.activation_checkpointing import apply_activation_checkpointing
from trainer.memory.loss import set_loss_chunking
from trainer.memory.norms import bf16_norm_inputs
from trainer.model import create_model

if TYPE_CHECKING:
    from trainer.config import MemoryConfig, ModelConfig

ModelFactory = Callable[[], nn.Module]


@dataclass(frozen=True)
class MemoryTransforms:
    """Which memory transforms a model gets (the fields of ``MemoryConfig`` that shape it)."""

    activation_checkpointing: str = "none"  # none | selective | full
    checkpoint_every_k: int = 2
    loss_chunk_tokens: int | str = 0  # 0: the plain loss; "auto": chunked if the model can
    bf16_norm_inputs: bool = True

    @classmethod
    def of(cls, memory: MemoryConfig) -> MemoryTransforms:
        # An "auto" not resolved by trainer.plan.choose.resolve_auto: on, the choice that fits more.
        return cls(memory.activation_checkpointing, memory.checkpoint_every_k,
                   memory.loss_chunk_tokens, memory.bf16_norm_inputs is not False)

    def replace(self, **changes: Any) -> MemoryTransforms:
        return dataclasses.replace(self, **changes)


def model_factory(model: ModelConfig) -> ModelFactory:
    """The configured model (a registered name or ``module:function``), without transforms."""
    kwargs = model.model_dump(exclude={"name"})
    return lambda: create_model(model.name, **kwargs)


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
    apply_activation_checkpointing(model, transforms.activation_checkpointing,
                                   transforms.checkpoint_every_k)
    set_loss_chunking(model, transforms.loss_chunk_tokens)
    bf16_norm_inputs(model, transforms.bf16_norm_inputs)
    return model


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
