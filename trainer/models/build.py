"""How a model is made and where it gets its memory transforms: the loop (through its
``Parallelism``), the planner, ``memtrain plan``, ``resolve_auto``, gpu-check and every bench
build their models here.

``start_model`` makes the configured model as a way of splitting asks (``Placement``): whole,
with its values, or on the meta device (``OnMeta``), to be filled after it is sharded; its
``finish`` then allocates and fills what the meta device only described. Between the two, the
way applies ``apply_transforms``, in this order: the tiled MLP (each block's MLP), activation
checkpointing (``model.blocks``), loss chunking (a model that computes its own loss), bf16 norm
inputs (LayerNorms under bf16 autocast) and activation offload (its hooks around the
checkpointed blocks or the whole forward). The whole order is ``Parallelism.build``.

``MemoryTransforms`` is a small frozen dataclass, not the pydantic ``MemoryConfig``, so
gpu-check and the benches (no pydantic there) build with exactly the same code;
``MemoryTransforms.of(cfg.memory)`` takes the config's slice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from trainer.compat import is_checkpoint_wrapper
from trainer.errors import first_line
from trainer.memory.activation_checkpointing import apply_activation_checkpointing
from trainer.memory.lora import (
    LoraSettings,
    draw_adapters,
    initial_adapter,
    is_adapter,
    lora_of,
    with_adapters,
)
from trainer.memory.loss import set_loss_chunking
from trainer.memory.norms import bf16_norm_inputs
from trainer.memory.offload import install as install_offload
from trainer.memory.tiled_mlp import tile_mlps
from trainer.models import meta_init
from trainer.models.hf import PREFIX as HF_PREFIX
from trainer.models.hf import SafetensorsRows, initialise_on_meta, weights_of
from trainer.models.registry import create_model
from trainer.models.weights import Owner, fill_from_file, fill_owner, load_hf_weights, owners

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
    tiled_mlp: int = 1  # sequence tiles of each block's MLP; 1: off (trainer/memory/tiled_mlp.py)

    @classmethod
    def of(cls, memory: MemoryConfig) -> MemoryTransforms:
        # An "auto" not resolved (trainer.plan.auto.resolve_auto): on, which fits more.
        return cls(memory.activation_checkpointing, memory.activation_checkpointing_every,
                   memory.loss_chunk_tokens, memory.bf16_norm_inputs is not False,
                   memory.activation_offload, memory.tiled_mlp)

    def replace(self, **changes: Any) -> MemoryTransforms:
        return dataclasses.replace(self, **changes)


def model_factory(model: ModelConfig, load_weights: bool = True) -> ModelFactory:
    """The configured model (a registered name or ``module:function``), without transforms
    (``load_weights=False``: an ``hf:`` directory's weights are left to the sharded build)."""
    kwargs = model.model_dump(exclude={"name", "lora", "dtype"})
    plain = partial(create_model, model.name, load_weights=load_weights, **kwargs)
    if model.lora is not None:
        return with_adapters(plain, LoraSettings.of(model.lora))
    return Bf16Weights(plain) if model.dtype == "bf16" else plain


@runtime_checkable
class Converted(Protocol):
    """A model factory whose models it converts once built (their weights to bf16, a base to
    NF4). A meta build records ``factory`` alone and converts the meta model (``on_meta``:
    placeholders of the converted dtype), so that ``OnMeta.finish`` converts each tensor as
    it fills it and no rank holds the unconverted model whole."""

    factory: ModelFactory

    def __call__(self) -> nn.Module: ...

    def on_meta(self, model: nn.Module) -> None: ...

    def for_parts(self, parts: int) -> Converted:
        """The same factory for a model split into ``parts`` row shards."""
        ...

    def filled(self, model: nn.Module) -> None:
        """What is left to do once every tensor is filled (the run's log's records)."""
        ...


@dataclass(frozen=True)
class Bf16Weights:
    """A model factory whose model has its weights cast to bf16 once built (``model.dtype``).
    The sharded build records ``factory`` alone on meta and casts the meta model, so that no
    rank holds the whole fp32 model while its shards are filled: each shard takes its fp32
    values, rounded, as they are made."""

    factory: ModelFactory

    def __call__(self) -> nn.Module:
        return to_bf16(self.factory())

    def on_meta(self, model: nn.Module) -> None:
        _bf16_parameters(model)  # its shards are allocated in bf16

    def for_parts(self, parts: int) -> Bf16Weights:
        return self

    def filled(self, model: nn.Module) -> None:
        pass


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
    """A new model from ``factory`` with ``transforms`` applied, on ``device`` (``made`` then
    ``apply_transforms``). Raises ValueError naming the setting a model cannot take."""
    model = made(factory, device, seed)
    apply_transforms(model, transforms)
    return model


def made(factory: ModelFactory, device: torch.device | None = None,
         seed: int | None = 0) -> nn.Module:
    """A new model from ``factory`` on ``device``, its LoRA adapters drawn. ``seed`` (None:
    leave the RNG alone) makes the initial weights the same on every rank and in every
    probe."""
    if seed is not None:
        torch.manual_seed(seed)
    model = factory()
    if seed is not None and lora_of(model) is not None:
        draw_adapters(model, seed)  # the same at any way of building (trainer.memory.lora)
    if device is not None:
        model = model.to(device)
    return model


def apply_transforms(model: nn.Module, transforms: MemoryTransforms) -> None:
    tile_mlps(model, transforms.tiled_mlp)
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


@dataclass(frozen=True)
class Placement:
    """Where a way of splitting has a model's tensors made (``Parallelism.placement``).

    ``shards``: the way shards the model between ``start_model`` and ``finish`` (FSDP), so it
    is made on the meta device and each rank fills only its shards; ``parts``: the ranks an
    NF4 base's rows split over; ``on_host``: the shards live in host memory (FSDP's CPU
    offload), the buffers on the device."""

    shards: bool = False
    parts: int = 1
    on_host: bool = False


def start_model(model: ModelConfig, init_from: str | None, device: torch.device,
                seed: int | None, placement: Placement = Placement()) -> OnHost | OnMeta:
    """The model ``model`` names, made as ``placement`` asks, not yet transformed: with the
    weights of ``init_from`` where it is ``hf:DIR`` (over the seeded build's), else with the
    model's own. On the meta device where the way shards it, and for a bf16 or NF4 LoRA base
    (filled weight by weight, each converted as it is made or read, so that the fp32 base is
    never held whole); whole on ``device`` otherwise."""
    init_hf = init_from if (init_from or "").startswith(HF_PREFIX) else None
    if placement.shards or model.lean_base():
        return OnMeta.placed(model_factory(model, load_weights=False), device, seed, placement,
                             model_name=model.name, weights=weights_of(init_hf or model.name))
    built = made(model_factory(model, load_weights=init_hf is None), device, seed)
    if init_hf is not None:
        load_hf_weights(built, weights_of(init_hf))
    return OnHost(built)


@dataclass
class OnHost:
    """A model made whole, with its values: ``finish`` has nothing left to do."""

    model: nn.Module

    def finish(self) -> nn.Module:
        return self.model


@dataclass
class OnMeta:
    """A model made on the meta device, its construction recorded (``trainer.models.meta_init``):
    transformed, split and sharded as it is, then each tensor (each rank's shard of it)
    allocated and filled by ``finish``, one at a time, so that no process holds it whole: with
    the seeded host build's values, or with ``weights``' rows where the directory has them. A
    ``Converted`` factory's tensors are converted as they are filled. A model that cannot be
    built on meta is built whole on the host (``recording`` None), with one warning naming the
    reason."""

    model: nn.Module
    recording: meta_init.MetaRecording | None
    tensors: dict[int, list[Owner]]  # by the storages the record made (fp32 or bf16, not NF4)
    hf_model: Any  # its files' names are matched as transformers matches them
    device: torch.device
    seed: int | None
    weights: SafetensorsRows | None
    converted: Converted | None
    on_host: bool  # the tensors in host memory, the buffers on ``device``
    tie: bool  # tie again what ``to_empty`` untied (not after a shard: FSDP keeps its ties)

    @classmethod
    def start(cls, factory: ModelFactory, device: torch.device, seed: int | None, *,
              model_name: str = "", weights: SafetensorsRows | None = None,
              on_host: bool = False, tie: bool = True) -> OnMeta:
        converted = factory if isinstance(factory, Converted) else None
        recorded = converted.factory if converted is not None else factory
        try:
            model, recording = _meta_build(recorded, hf_init=":" in model_name)
        except Exception as err:  # the factory needed real values (an .item(), a data branch);
            # an error of the model's own is raised again by the host build below.
            log.warning("model.name %r cannot be built on the meta device (%s); building it "
                        "whole on the host", model_name, first_line(err, type(err).__name__))
            model, recording = made(factory, device, seed), None
        tensors = owners(model)
        if recording is not None and converted is not None:
            converted.on_meta(model)  # placeholders of the converted dtype, filled by ``finish``
        return cls(model, recording, tensors, getattr(model, "hf", None), device, seed,
                   weights, converted, on_host, tie)

    @classmethod
    def placed(cls, factory: ModelFactory, device: torch.device, seed: int | None,
               placement: Placement, *, model_name: str = "",
               weights: SafetensorsRows | None = None) -> OnMeta:
        """``start`` as ``placement`` asks: a converted model converted for its ``parts``
        (an NF4 base's blocks), the tensors on the host where ``on_host``, tied again unless
        the way shards."""
        if isinstance(factory, Converted):
            factory = factory.for_parts(placement.parts)
        return cls.start(factory, device, seed, model_name=model_name, weights=weights,
                         on_host=placement.on_host, tie=not placement.shards)

    def finish(self) -> nn.Module:
        model, tensors, host = self.model, self.tensors, torch.device("cpu")
        if self.recording is not None:
            model.to_empty(device=host if self.on_host else self.device)
            if self.tie:
                _tie_again(tensors)
        filled = fill_from_file(tensors, self.weights, self.hf_model)
        if self.recording is not None:
            def take(key: int, real: Callable[[torch.Tensor], torch.Tensor]) -> None:
                for owner in tensors[key]:
                    fill_owner(owner, real(owner.meta))

            adapters = _fill_adapters(tensors, self.seed)  # not replayed: their own generators'
            meta_init.replay(self.recording, set(tensors) - filled - adapters, self.seed, take)
            if self.on_host and self.device != host:  # the buffers stay with the compute
                for module in model.modules():
                    module._buffers.update({k: b.to(self.device)
                                            for k, b in module._buffers.items() if b is not None})
        if self.converted is not None:
            self.converted.filled(model)
        return model


def build_whole(model: ModelConfig, init_from: str | None, transforms: MemoryTransforms,
                device: torch.device | None = None, seed: int | None = 0) -> nn.Module:
    """The whole model ``model`` names, with ``transforms``, made as one process makes it
    (``start_model``): how export builds a LoRA run's base."""
    started = start_model(model, init_from, device or torch.device("cpu"), seed)
    apply_transforms(started.model, transforms)
    return started.finish()


def _meta_build(factory: ModelFactory, hf_init: bool) -> tuple[nn.Module, meta_init.MetaRecording]:
    """The model on meta with its record; ValueError naming a tensor whose values the record
    cannot make again (the replay would leave it uninitialised memory)."""
    with initialise_on_meta() if hf_init else contextlib.nullcontext():
        model, recording = meta_init.record(factory)
    unmade = meta_init.unrecorded(recording, dict(meta_init.module_tensors(model)))
    if unmade:
        raise ValueError(f"{', '.join(unmade[:3])}: made without a tensor operation the meta "
                         "device records (torch.from_numpy, load_state_dict(assign=True))")
    return model, recording


def _fill_adapters(tensors: dict[int, list[Owner]], seed: int | None) -> set[int]:
    """Each rank's part of LoRA's adapters' first values (``initial_adapter``); returns their
    storages, which the replay then leaves out. Drawn from generators of their own, the
    adapters need no random draw replayed before them: a base read from files then replays
    none at all (each would be made on a scratch tensor of its weight's size only to advance
    the stream: a whole embedding's fp32 bytes on every rank, three times for a Llama)."""
    if seed is None:  # the replay's own draws, unseeded
        return set()
    adapters = {key for key, found in tensors.items() if any(is_adapter(o.fqn) for o in found)}
    for key in adapters:
        for owner in tensors[key]:
            fill_owner(owner, initial_adapter(owner.fqn, owner.meta.shape, seed))
    return adapters


def _tie_again(tensors: dict[int, list[Owner]]) -> None:
    """``to_empty`` gives each module a tensor of its own: the ones the model ties (one tensor
    under several names, an embedding and its output layer) are made one again. Tied means the
    same view of the storage; different views of one storage (``cos`` and ``sin`` as rows of
    one cache) stay tensors of their own, each filled with its own values."""
    for found in tensors.values():
        for index, owner in enumerate(found):
            same = next(first for first in found[:index + 1]
                        if _same_view(first.meta, owner.meta))
            if same is owner:
                continue
            module = owner.module
            kept = module._parameters if owner.name in module._parameters else module._buffers
            kept[owner.name] = getattr(same.module, same.name)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.storage_offset(), a.shape, a.stride()) == (b.storage_offset(), b.shape, b.stride())


def _bf16_parameters(model: nn.Module) -> None:
    """New bf16 parameters in place of a meta model's floating ones (tied ones stay tied).
    New objects, not ``.data``: the record's operations hold the old ones, and the replay finds
    each by its storage."""
    swapped: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_floating_point():
                continue
            if id(param) not in swapped:
                swapped[id(param)] = nn.Parameter(param.detach().to(torch.bfloat16),
                                                  requires_grad=param.requires_grad)
            module._parameters[name] = swapped[id(param)]
