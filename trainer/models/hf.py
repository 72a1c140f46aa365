"""Hugging Face causal language models as memtrain models.

``model.name: hf:<directory or its config.json>`` builds the model from its own config with
``AutoModelForCausalLM.from_config`` (nothing is downloaded) and, where the directory holds
weights (safetensors), loads them. A ``module:function`` entry point that returns a
``transformers`` causal LM is taken the same way (``trainer.models.registry.create_model``). Either
is wrapped in ``HFCausalLM``, which answers what the memory transforms ask of a model:

- ``blocks``: its decoder layers (the ``nn.ModuleList`` of the modules its class names in
  ``_no_split_modules``), so activation checkpointing and FSDP apply per layer;
- ``model(idx, targets)``: the summed loss through the model's own final hidden states (its
  base model applies the final norm) and output embedding, chunked
  (``trainer.memory.loss.linear_cross_entropy_sum``), tied embeddings included; ``model(idx)``:
  the logits, as the model computes them;
- ``vocab_size``: its config's, which sizes ``memory.loss_chunk_tokens: auto``.

The model's own config is the truth: memtrain's ``model.n_layer``, ``n_head`` and ``n_embd`` are
ignored, with a warning where they differ from it. ``model.seq_len`` must fit it; the dataset's
vocabulary is checked against it before any worker starts (``model.vocab_size``, which sizes
memtrain's GPT, is not used).
``transformers`` comes with the ``hf`` extra (``pip install 'memtrain[hf]'``) and is imported
only when such a model is built.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from trainer.compat import (
    hf_checkpoint_renamer,
    hf_fusions,
    hf_positions_read_as_unpacked,
    is_fake,
)
from trainer.memory.loss import linear_cross_entropy_sum
from trainer.models.sequence_split import HF_SEQUENCE_KWARG, SequenceSplit

PREFIX = "hf:"
# memtrain's GPT fields and the Hugging Face config attributes they would mean.
_IGNORED_FIELDS = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                   "n_embd": "hidden_size"}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def is_hf_causal_lm(model: nn.Module) -> bool:
    """A ``transformers`` model with an output embedding (by its classes' names: checking needs
    no import of ``transformers``)."""
    names = {cls.__name__ for cls in type(model).__mro__}
    return "PreTrainedModel" in names and hasattr(model, "get_output_embeddings")


def decoder_layers_path(model: nn.Module) -> str:
    """The dotted name of the ``nn.ModuleList`` holding a transformers model's decoder layers:
    the one whose modules' class its ``_no_split_modules`` names (``model.layers`` in Llama,
    ``transformer.h`` in GPT-2)."""
    wanted = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and \
                all(type(layer).__name__ in wanted for layer in module):
            return name
    raise ValueError(f"{type(model).__name__}: no list of decoder layers found (none of its "
                     f"module lists holds only {sorted(wanted) or 'the _no_split_modules'})")


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM behind memtrain's model contract (the module docstring)."""

    computes_loss = True
    hf: Any  # the transformers model (a PreTrainedModel: typed loosely, imported lazily)
    # Set by trainer.parallel.sequence.apply_sequence_parallel, which also switches the model's
    # attention function: the forward takes this rank's slice of each row (None: whole rows).
    sequence: SequenceSplit | None = None
    # How the tokens become the first hidden states, when not through the input embedding module
    # itself: set by FSDP where it splits a frozen embedding by vocabulary
    # (trainer.parallel.vocab_loss.split_lookup), so that the embedding is never gathered.
    input_lookup: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, model: Any):
        super().__init__()
        output = model.get_output_embeddings()
        config = model.config
        if getattr(output, "bias", None) is not None:
            raise ValueError(f"{type(model).__name__}: its output layer has a bias, which "
                             "memtrain's chunked loss does not take")
        for attribute in ("final_logit_softcapping", "logit_scale"):
            if getattr(config, attribute, None):
                raise ValueError(f"{type(model).__name__}: config.{attribute} changes the logits "
                                 "before the loss, which memtrain's chunked loss does not do")
        self.hf = model
        output.summed_loss = types.MethodType(_summed_loss, output)
        self.loss_chunk_tokens = 0  # set by trainer.memory.loss.set_loss_chunking
        self._layers = "hf." + decoder_layers_path(model)

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers (not registered twice: they stay the transformers model's)."""
        layers = self.get_submodule(self._layers)
        assert isinstance(layers, nn.ModuleList)
        return layers

    @property
    def vocab_size(self) -> int:
        return int(self.hf.config.vocab_size)

    @property
    def input_unit(self) -> nn.Module | None:
        """The input embedding, which FSDP shards as a unit of its own; None where the output
        layer shares its weight (then both stay in the root)."""
        return None if self._tied() else self.hf.get_input_embeddings()

    @property
    def loss_unit(self) -> nn.Module | None:
        """The output layer, where FSDP may shard it as a unit of its own: the loss reads its
        weight in its ``summed_loss`` method (``_summed_loss``), which FSDP then runs as it runs
        a forward (``register_fsdp_forward_method``), or, the layer frozen, replaces with a loss
        split by vocabulary (``trainer.parallel.vocab_loss``); None where the embedding shares
        it."""
        return None if self._tied() else self.hf.get_output_embeddings()

    def _tied(self) -> bool:
        return self.hf.get_output_embeddings().weight is self.hf.get_input_embeddings().weight

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)``, or with ``targets_BT`` the summed token loss (fp32 scalar).

        ``position_ids``: packed documents' positions (``trainer.batches``); with no attention
        mask, transformers finds the documents from them and keeps attention within each. Under
        sequence parallelism (``sequence``) the inputs, targets and positions are this rank's
        slice of each row, and the result is that slice's: the model is given its tokens'
        positions in their rows, the whole rows' mask (a 4-D mask reaches the attention function
        as it is) and the split, which its attention function attends with."""
        split: dict[str, Any] = {}
        if self.sequence is not None:
            position_ids, mask = self.sequence.positions(position_ids, idx_BT.shape[1],
                                                         idx_BT.device)
            split = {"attention_mask": mask, HF_SEQUENCE_KWARG: self.sequence}
        # The planner's probe runs on fake tensors: unpacked, it takes the real forward's path.
        with hf_positions_read_as_unpacked() if position_ids is None and is_fake(idx_BT) \
                else contextlib.nullcontext():
            inputs = {"input_ids": idx_BT} if self.input_lookup is None else \
                {"inputs_embeds": self.input_lookup(idx_BT)}
            if targets_BT is None:
                return self.hf(**inputs, position_ids=position_ids, use_cache=False,
                               **split).logits
            hidden_BTC = self.hf.base_model(**inputs, position_ids=position_ids,
                                            use_cache=False, **split).last_hidden_state
        return self.hf.get_output_embeddings().summed_loss(
            hidden_BTC.flatten(0, 1), targets_BT.flatten(), self.loss_chunk_tokens)


def _summed_loss(output: nn.Module, hidden_NC: torch.Tensor, targets_N: torch.Tensor,
                 chunk_tokens: int) -> torch.Tensor:
    """The summed token loss of ``hidden_NC`` through the output layer ``output`` (chunked:
    ``linear_cross_entropy_sum``), bound to the layer as its method ``summed_loss``, so that
    FSDP gathers the layer's weight around it where the layer is a unit of its own."""
    return linear_cross_entropy_sum(hidden_NC, cast(torch.Tensor, output.weight), targets_N,
                                    chunk_tokens)


def _has_weights(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _WEIGHT_FILES)


def has_weights(spec: str) -> bool:
    """Whether an ``hf:`` spec's directory (or its config.json's) holds weights of its own."""
    return _has_weights(_config_json(spec).parent)


def _config_json(spec: str) -> Path:
    path = Path(spec).expanduser()
    return path if path.is_file() else path / "config.json"


def _config_field(model_name: str, key: str) -> Any:
    """``key`` of an ``hf:`` model's ``config.json``, read without ``transformers``; None for
    other models, or where the file does not say (building the model then says what is
    wrong)."""
    if not model_name.startswith(PREFIX):
        return None
    try:
        return json.loads(_config_json(model_name.removeprefix(PREFIX)).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def config_vocab_size(model_name: str) -> int | None:
    """The vocabulary in an ``hf:`` model's ``config.json`` (``prepare_run`` checks the
    dataset's against it); None for other models, or where the file does not say."""
    vocab_size = _config_field(model_name, "vocab_size")
    return vocab_size if isinstance(vocab_size, int) else None


def config_model_type(model_name: str) -> str | None:
    """An ``hf:`` model's architecture as its ``config.json`` names it (``model_type``:
    "llama", "gpt_neox"); None for other models, or where the file does not say."""
    model_type = _config_field(model_name, "model_type")
    return model_type if isinstance(model_type, str) else None


def model_vocab_size(model_name: str, configured: int) -> int:
    """The vocabulary a model embeds: an ``hf:`` model's config's, else ``configured``
    (``model.vocab_size``, memtrain's GPT's); what a probe's random tokens are drawn under."""
    return config_vocab_size(model_name) or configured


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ValueError("a Hugging Face model needs the transformers package: pip install "
                         "'memtrain[hf]' (or '.[hf]' in memtrain's checkout)") from err
    return transformers


def build_hf_model(spec: str, vocab_size: int, seq_len: int, load_weights: bool = True,
                   **fields: Any) -> HFCausalLM:
    """``hf:<spec>``: the model of a directory (or its ``config.json``), with its weights where
    the directory has them (and ``load_weights``: the sharded build reads them per rank,
    ``SafetensorsRows``). ``seq_len`` must fit the model's config. ``vocab_size`` (memtrain's
    GPT's) is not used: the data's vocabulary is checked against the model's own before any
    worker starts (``trainer.launch.prepare``). The other GPT ``fields`` are ignored, with a
    warning where they differ."""
    directory = _config_json(spec).parent
    if not (directory / "config.json").is_file():
        raise ValueError(f"model.name 'hf:{spec}': no config.json in {directory}")
    transformers = _transformers()
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and seq_len > positions:
        raise ValueError(f"model.seq_len {seq_len} is longer than hf:{spec} takes "
                         f"(max_position_embeddings {positions})")
    differing = [f"model.{field} {fields[field]} (its {attribute} is "
                 f"{getattr(config, attribute, None)})"
                 for field, attribute in _IGNORED_FIELDS.items()
                 if field in fields and fields[field] != getattr(config, attribute, None)]
    if differing:
        warnings.warn(f"hf:{spec}: its own config is the truth; ignored: {', '.join(differing)}",
                      stacklevel=2)
    auto = transformers.AutoModelForCausalLM
    if load_weights and _has_weights(directory):
        model = auto.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    else:
        model = auto.from_config(config, dtype=torch.float32)
    return HFCausalLM(model)


@contextlib.contextmanager
def initialise_on_meta() -> Iterator[None]:
    """Let ``transformers`` run its weight initialisation while a model is built on the meta
    device. It skips it there (``init_weights`` asks for the context's device), and the
    meta-device build (``trainer.models.meta_init``) must record the same random draws as the host
    build makes; a test holds the replayed weights to ``from_config``'s bit for bit."""
    if importlib.util.find_spec("transformers") is None:
        yield
        return
    from transformers import modeling_utils

    original = modeling_utils.get_torch_context_manager_or_global_device
    modeling_utils.get_torch_context_manager_or_global_device = lambda: None
    try:
        yield
    finally:
        modeling_utils.get_torch_context_manager_or_global_device = original


@dataclass(frozen=True)
class Fused:
    """A model tensor ``from_pretrained`` makes of several of the files' tensors: experts
    stored one by one, ``sources[p][e]`` the file's name of pattern ``p``'s tensor of expert
    ``e``, stacked on a new first dimension (transformers' ``MergeModulelist(dim=0)``), the
    patterns' stacks then joined on ``join_dim`` (its ``Concatenate``: gate and up into
    ``gate_up_proj``). A rank's rows of it are its experts': it reads those experts alone."""

    patterns: tuple[str, ...]  # transformers' source patterns (``hf_fusions``)
    sources: tuple[tuple[str, ...], ...]
    join_dim: int | None


def _expert_index(pattern: str, file_name: str) -> int | None:
    """The expert's number in ``file_name`` where ``pattern`` (transformers' source pattern,
    its ``*`` the number; escaped as a regular expression in some families) has one."""
    prefix, star, suffix = pattern.replace("\\", "").partition("*")
    found = re.search(re.escape(prefix) + r"(\d+)" + re.escape(suffix) + "$", file_name)
    return int(found[1]) if star and found else None


class SafetensorsRows:
    """The safetensors weights of an ``hf:`` directory, read a tensor's rows at a time: a rank
    reads its own shard's bytes and never the whole state dict. Each file is opened (its
    header parsed, the file mapped) once, when its first tensor is read. Experts the files
    store one by one are read as the model's fused tensor (``Fused``)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._handles: dict[Path, Any] = {}
        self.fused: dict[str, Fused] = {}  # by the model's name (``names_for`` finds them)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / file for name, file in weight_map.items()}
        else:
            self.files = dict.fromkeys(self._handle(directory / "model.safetensors").keys(),
                                       directory / "model.safetensors")

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole shape of tensor ``name`` (from the files' headers: nothing is read)."""
        fused = self.fused.get(name)
        if fused is None:
            return tuple(self._handle(self.files[name]).get_slice(name).get_shape())
        shapes = [[len(names), *self.shape(names[0])] for names in fused.sources]
        if fused.join_dim is not None:
            shapes[0][fused.join_dim] = sum(shape[fused.join_dim] for shape in shapes)
        return tuple(shapes[0])

    def names_for(self, model_names: set[str], hf_model: Any | None) -> dict[str, str]:
        """The file's name of each of ``model_names`` (the model's own) that the files hold,
        matched as ``from_pretrained`` matches them for ``hf_model``: transformers' renames of
        its class (GPT-NeoX's ``embed_out`` is ``lm_head``) and its base model's prefix, added
        or taken off (GPT-2's files, saved from the base model, name ``h.0...``), and experts
        stored one by one as the model's fused tensor (``Fused``, its name the model's). A
        file's tensor that is none of the model's is left out, as ``from_pretrained`` leaves
        out an unexpected key. Without a transformers model the names are the file's.
        ValueError where transformers converts a tensor of the model's otherwise as it loads:
        its rows as stored are not the model's."""
        if hf_model is None:
            return {name: name for name in model_names if name in self.files}
        rename = hf_checkpoint_renamer(hf_model, model_names)
        found = {}
        converted: dict[str, dict[str, list[str]]] = {}  # name, pattern: the files' names
        for file_name in self.files:
            name, pattern = rename(file_name)
            if name in model_names and pattern is not None:
                converted.setdefault(name, {}).setdefault(pattern, []).append(file_name)
            elif name in model_names:
                found[name] = file_name
        fusions = hf_fusions(hf_model) if converted else {}
        for name, by_pattern in converted.items():
            self.fused[name] = self._fused(name, by_pattern, fusions)
            found[name] = name
        return found

    def _fused(self, name: str, by_pattern: dict[str, list[str]],
               fusions: dict[str, tuple[tuple[str, ...], list[tuple[str, int]]]]) -> Fused:
        """How the model's ``name`` is made of the files' tensors ``by_pattern``, as
        transformers' conversion (``hf_fusions``) says; ValueError naming a file's tensor where
        the conversion is not experts stacked (then joined), which a read of rows cannot do,
        and naming ``name`` where an expert's tensor is missing."""
        pattern, [file_name, *_] = next(iter(by_pattern.items()))
        patterns, steps = fusions.get(pattern, ((pattern,), [("", -1)]))
        joins = [dim for op, dim in steps[1:] if op == "Concatenate"]
        indices = {p: [_expert_index(p, f) for f in files] for p, files in by_pattern.items()}
        if steps[0] != ("MergeModulelist", 0) or len(steps) - 1 != len(joins) or \
                len(joins) > 1 or None in sum(indices.values(), []):
            raise ValueError(f"{self.directory}: {file_name} is converted as transformers "
                             f"loads it ({pattern!r}: {', '.join(op for op, _ in steps)}), "
                             "which a read of its rows cannot do")
        by_expert = {p: {i: f for i, f in zip(indices[p], files, strict=True) if i is not None}
                     for p, files in by_pattern.items()}
        count = 1 + max(max(found) for found in by_expert.values())
        sources = tuple(tuple(by_expert.get(p, {}).get(e, "") for e in range(count))
                        for p in patterns)
        if not all(all(names) for names in sources):
            raise ValueError(f"{self.directory}: {name}'s experts are not all in its "
                             f"safetensors ({', '.join(patterns)}: expected experts 0 to "
                             f"{count - 1} of each)")
        return Fused(patterns, sources, joins[0] if joins else None)

    def stored_as(self, name: str) -> str:
        """How the files hold tensor ``name``, for a message: its name, or for experts stored
        one by one, how many and under which patterns."""
        fused = self.fused.get(name)
        if fused is None:
            return name
        return (f"{name}, {len(fused.sources[0])} experts stored as "
                f"{' and '.join(fused.patterns)},")

    def read(self, name: str, rows: slice | None, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``rows`` (None: all) of tensor ``name``, as ``dtype``."""
        fused = self.fused.get(name)
        if fused is not None:
            return self._read_experts(fused, rows, dtype)
        part = self._handle(self.files[name]).get_slice(name)
        return (part[rows] if rows is not None else part[:]).to(dtype)

    def _read_experts(self, fused: Fused, rows: slice | None, dtype: torch.dtype
                      ) -> torch.Tensor:
        """The experts ``rows`` of a fused tensor: each of their files' tensors read whole,
        stacked, joined."""
        stacks = []
        for names in fused.sources:
            chosen = names[rows] if rows is not None else names
            stacks.append(torch.stack([self.read(n, None, dtype) for n in chosen]) if chosen
                          else torch.empty(0, *self.shape(names[0]), dtype=dtype))
        return stacks[0] if fused.join_dim is None else torch.cat(stacks, dim=fused.join_dim)


def weights_of(model_name: str) -> SafetensorsRows | None:
    """The safetensors an ``hf:`` model's directory holds, or None (another model, or a
    directory without weights)."""
    if not model_name.startswith(PREFIX):
        return None
    directory = _config_json(model_name.removeprefix(PREFIX)).parent
    return SafetensorsRows(directory) if _has_weights(directory) else None
