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

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from trainer import meta_init
from trainer.compat import is_checkpoint_wrapper
from trainer.errors import first_line
from trainer.hf import PREFIX as HF_PREFIX
from trainer.hf import SafetensorsRows, initialise_on_meta, weights_of
from trainer.memory.activation_checkpointing import apply_activation_checkpointing
from trainer.memory.lora import LoraSettings, apply_lora, base_name, is_adapter
from trainer.memory.loss import set_loss_chunking
from trainer.memory.norms import bf16_norm_inputs
from trainer.memory.offload import install as install_offload
from trainer.model import create_model
from trainer.sharding import FsdpSettings, fill_local, shard_model, shard_rows

if TYPE_CHECKING:
    from trainer.config import MemoryConfig, ModelConfig

log = logging.getLogger(__name__)
ModelFactory = Callable[[], nn.Module]


@dataclass(frozen=True)
class MemoryTransforms:
    """Which memory transforms a model gets (the fields of ``MemoryConfig`` that shape it)."""

    activation_checkpointing: str = "none"  # none | selective | full
    checkpoint_every_k: int = 2
    loss_chunk_tokens: int | str = 0  # 0: the plain loss; "auto": chunked if the model can
    bf16_norm_inputs: bool = True
    activation_offload: str = "none"  # none | checkpointed | all (trainer/memory/offload.py)

    @classmethod
    def of(cls, memory: MemoryConfig) -> MemoryTransforms:
        # An "auto" not resolved (trainer.plan.strategy.resolve_auto): on, which fits more.
        return cls(memory.activation_checkpointing, memory.checkpoint_every_k,
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
                                   transforms.checkpoint_every_k)
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


@dataclass
class _Owner:
    """Where a parameter or buffer of the meta-built model lives: its module and name."""

    module: nn.Module
    name: str
    fqn: str
    meta: torch.Tensor


def _owners(model: nn.Module) -> dict[int, list[_Owner]]:
    """Every parameter and buffer of ``model`` by its storage (tied weights share one), with
    the names they had before any wrapper was applied."""
    owners: dict[int, list[_Owner]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is not None:
                fqn = f"{prefix}.{name}" if prefix else name
                owners.setdefault(meta_init.storage_key(tensor), []).append(  # ``detach``: a
                    _Owner(module, name, fqn, tensor.detach()))  # later cast keeps this storage
    return owners


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


def build_sharded(factory: ModelFactory, transforms: MemoryTransforms, device: torch.device,
                  seed: int | None, settings: FsdpSettings, *, model_name: str = "",
                  before_shard: Callable[[nn.Module], None] = lambda model: None,
                  weights: SafetensorsRows | None = None) -> nn.Module:
    """The FSDP model, built so that no rank holds it whole (the module docstring of
    ``trainer.sharding``): on meta, transformed, ``before_shard`` (torch.compile), sharded, then
    each rank's shards allocated and filled with the seeded host build's values, or with
    ``weights``' rows where the directory has them (``factory`` then builds without them). A
    model that cannot be built on meta is built whole on the host and sharded, with one
    warning naming the reason."""
    cast = isinstance(factory, Bf16Weights)
    try:
        model, recording = _meta_build(factory.factory if cast else factory,  # type: ignore[attr-defined]
                                       hf_init=":" in model_name)
    except Exception as err:  # the factory needed real values (an .item(), a data branch);
        # an error of the model's own is raised again by the host build below.
        log.warning("model.name %r cannot be built on the meta device (%s); building it whole "
                    "on the host, then sharding", model_name, first_line(err, type(err).__name__))
        model, recording = build_model(factory, MemoryTransforms(), device, seed), None
    owners = _owners(model)  # by the storages the record made (fp32 ones where ``cast``)
    hf_model = getattr(model, "hf", None)  # its files' names are matched as transformers does
    if cast and recording is not None:
        _bf16_parameters(model)  # its shards are allocated in bf16
    apply_transforms(model, transforms)
    before_shard(model)
    shard_model(model, settings, device)
    if recording is None:
        _fill_from_file(owners, weights, hf_model)
        return model
    host = torch.device("cpu")
    model.to_empty(device=host if settings.offload == "cpu" else device)
    from_file = _fill_from_file(owners, weights, hf_model)

    def take(key: int, real: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for owner in owners[key]:
            _fill_owner(owner, real(owner.meta))

    meta_init.replay(recording, set(owners) - from_file, seed, take)
    if settings.offload == "cpu" and device != host:  # the buffers stay with the compute
        for module in model.modules():
            module._buffers.update({k: b.to(device) for k, b in module._buffers.items()
                                    if b is not None})
    return model


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


def build_whole(model: ModelConfig, init_from: str | None, transforms: MemoryTransforms,
                device: torch.device | None = None, seed: int | None = 0) -> nn.Module:
    """The whole model ``model`` names, with ``transforms`` (``build_model``): with the weights
    of ``init_from`` where it is ``hf:DIR`` (``load_hf_weights``, over the seeded build's), else
    with the model's own. How the loop builds it without FSDP, and export a LoRA run's base."""
    init_hf = init_from if (init_from or "").startswith(HF_PREFIX) else None
    built = build_model(model_factory(model, load_weights=init_hf is None), transforms, device,
                        seed)
    if init_hf is not None:
        load_hf_weights(built, weights_of(init_hf))
    return built


def load_hf_weights(model: nn.Module, weights: SafetensorsRows | None) -> None:
    """``train.init_from: hf:DIR`` into a whole model: every tensor the directory's safetensors
    hold, by the Hugging Face model's own names (a LoRA target's base weight included; the
    adapters keep their initialisation); ValueError naming the directory where a tensor does
    not fit or none is the model's."""
    _fill_from_file(_owners(model), weights, getattr(model, "hf", None))


def _fill_owner(owner: _Owner, value: torch.Tensor) -> None:
    fill_local(getattr(owner.module, owner.name),
               lambda rows: value if rows is None else value[rows], owner.meta.shape)


def _fill_from_file(owners: dict[int, list[_Owner]], weights: SafetensorsRows | None,
                    hf_model: Any = None) -> set[int]:
    """Each rank's rows of every tensor ``weights`` holds, matched to the model's names as
    ``from_pretrained`` matches them for ``hf_model`` (``SafetensorsRows.names_for``); returns
    the storages filled. ValueError naming the directory where a tensor does not fit
    (``_check_fits``) or where the files hold none of the model's tensors."""
    if weights is None:
        return set()
    names = weights.names_for({_file_key(o.fqn) for found in owners.values() for o in found},
                              hf_model)
    filled = set()
    missing = []
    for key, found in owners.items():
        matched = [(o, names[_file_key(o.fqn)]) for o in found if _file_key(o.fqn) in names]
        if not matched:
            missing += [_file_key(o.fqn) for o in found
                        if o.name in o.module._parameters and not is_adapter(o.fqn)]
            continue
        _check_fits(weights, matched)
        file_name = matched[0][1]
        for owner in found:
            target = getattr(owner.module, owner.name)
            fill_local(target, partial(weights.read, file_name, dtype=target.dtype),
                       owner.meta.shape)
        filled.add(key)
    if not filled:
        raise ValueError(f"{weights.directory}: none of the model's parameters is in its "
                         "safetensors (they load into a model of the same architecture)")
    if missing:  # as from_pretrained does: said, and left to the model's own initialisation
        log.warning("%d parameter(s) not in the model's safetensors, initialised as the model "
                    "initialises them: %s", len(missing), ", ".join(missing[:5])
                    + (", ..." if len(missing) > 5 else ""))
    return filled


def _file_key(fqn: str) -> str:
    """A model tensor's name as the files name it (a LoRA target's base weight is the file's)."""
    return base_name(fqn.removeprefix("hf."))


def _check_fits(weights: SafetensorsRows, matched: list[tuple[_Owner, str]]) -> None:
    """ValueError naming the directory where a file's tensor is of another shape than the
    model's (``from_pretrained`` refuses it too; a slice would cut it to fit), or where tensors
    the model ties (one storage) are two different tensors in the files: ``from_pretrained``
    then unties them, and a tied fill would train another model. The values are compared on
    each rank's rows, agreed over the process group."""
    for owner, file_name in matched:
        shape = weights.shape(file_name)
        if shape != tuple(owner.meta.shape):
            raise ValueError(f"{weights.directory}: {file_name} has shape {list(shape)} in its "
                             f"safetensors, the model's {_file_key(owner.fqn)} "
                             f"{list(owner.meta.shape)}")
    distinct = list(dict.fromkeys(file_name for _, file_name in matched))
    if len(distinct) < 2:
        return
    rows = None
    if dist.is_available() and dist.is_initialized():
        rows = shard_rows(matched[0][0].meta.shape[0], dist.get_rank(), dist.get_world_size())
    first = weights.read(distinct[0], rows, torch.float32)
    differ = torch.tensor([float(any(not torch.equal(first, weights.read(name, rows,
                                                                           torch.float32))
                                     for name in distinct[1:]))])
    if rows is not None:
        dist.all_reduce(differ, op=dist.ReduceOp.MAX)
    if differ.item():
        raise ValueError(f"{weights.directory}: {' and '.join(distinct)} are one tensor in the "
                         "model (its config ties them) but differ in its safetensors, where "
                         "from_pretrained unties them: set tie_word_embeddings false in its "
                         "config.json")
