"""A checkpoint on disk: what one holds, its name, how a rank writes its part, how the latest
whole one is found, and how it is read back. Where the parts go once written is
``trainer.checkpoint.publish``.

A checkpoint is a directory ``checkpoint-<step:08d>`` in the run directory. It holds the model
and optimizer as DCP files (``torch.distributed.checkpoint``, under DDP and FSDP alike: each rank
writes its part, FSDP's shards or a share of DDP's replicated tensors, and rank 0 the metadata;
loading reshards to the current strategy and world, whatever wrote them), ``state.pt`` (GradScaler
and LR-schedule state, the step, the data loader's position and the RNG state:
``trainer.state.TrainState.state_dict``) and ``meta.json``, the manifest of every file.

- **Writing**: into a staging directory (``write_states``), which the worker context
  publishes (``trainer.checkpoint.publish``: an atomic rename in the run directory, an upload
  to a run store with ``meta.json`` last; Ray Train through ``ray.train.report``).
- **Finding**: the latest whole checkpoint of a run directory (``latest_whole``; of a run
  store: ``trainer.checkpoint.publish.fetch_latest``): ``meta.json`` is a manifest of every file
  with its size and SHA-256 (``trainer.checkpoint.integrity``), checked before a checkpoint is
  trusted; one that is not whole is skipped with a line naming what is missing, and the one before
  it is used. Staging and download directories never match a checkpoint's name.
- **Reading**: ``torch.load(..., weights_only=True)``: everything in ``state.pt`` is tensors and
  plain containers, so a checkpoint can never run code. A checkpoint that cannot be used raises
  ``CheckpointReadError`` (exit 2) naming the file and the problem, not an error deep inside
  torch; storage that refuses a checkpoint raises ``CheckpointWriteError`` (exit 1), and the
  previous checkpoint stays the latest.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from monitoring.run_files import CHECKPOINT_PREFIX
from trainer.checkpoint.integrity import (
    MANIFEST,
    STATE,
    describe,
    local_problem,
    write_manifest,
)
from trainer.errors import first_line
from trainer.memory.lora import is_adapter, lora_of

STATE_FILE = STATE
META_FILE = MANIFEST
log = logging.getLogger("memtrain")
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


class CheckpointError(Exception):
    """A checkpoint could not be read or written; the message names it and the problem."""


class CheckpointReadError(CheckpointError, ValueError):
    """A checkpoint that cannot be used (missing, corrupted, refused, not this model's)."""


class CheckpointWriteError(CheckpointError, OSError):
    """Storage refused a checkpoint; nothing was published."""


# -- names ---------------------------------------------------------------------------------------

def checkpoint_dir_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a published checkpoint directory's name; None for any other name (staging
    and download directories never match)."""
    match = _CHECKPOINT_RE.match(name)
    return int(match.group(1)) if match else None


def published_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoint directories in ``run_dir`` by their names, oldest first, whole or not."""
    if not run_dir.is_dir():
        return []
    return sorted((step, child) for child in run_dir.iterdir()
                  if (step := checkpoint_step(child.name)) is not None and child.is_dir())


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoints in ``run_dir`` that hold every file their manifest lists, at its size;
    oldest first."""
    return [(step, path) for step, path in published_checkpoints(run_dir)
            if local_problem(path, hashes=False) is None]


def latest_whole(candidates: list[tuple[int, Path]], hashes: bool) -> Path | None:
    """The newest of ``candidates`` (local checkpoints, oldest first) that is whole (sizes
    and, with ``hashes``, bytes); each newer one that is not is skipped with one line."""
    for _, path in reversed(candidates):
        problem = local_problem(path, hashes)
        if problem is None:
            return path
        log.warning("checkpoint %s is not whole (%s): skipped, the one before it is used",
                    path, problem)
    return None


def verified(directory: Path, hashes: bool) -> Path:
    """``directory`` when it is a whole checkpoint; else CheckpointReadError naming why (a
    checkpoint chosen by someone else: Ray's latest, a step asked for by number)."""
    problem = local_problem(directory, hashes)
    if problem is not None:
        raise CheckpointReadError(f"checkpoint {directory} is not whole: {problem}")
    return directory


# -- writing -------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_states(directory: Path, state: dict[str, Any] | None,
                 states: tuple[dict[str, Any], dict[str, Any]], group: Any = None) -> Path:
    """One rank's part of a checkpoint, into ``directory``: the model's and optimizer's DCP
    files from their state dicts (DCP's, as ``model_and_optimizer_states`` gives them, or
    staged copies of them; every rank, a collective on ``group``, None: the default one), and
    ``state.pt`` where ``state`` is given (rank 0). Returns ``directory``.

    The manifest (``meta.json``, rank 0's) lists every rank's files: each rank hashes its own
    and rank 0 gathers the lists (a collective)."""
    # DCP is imported here: it brings in DTensor (about 1.5 s of CPU per process), which a CLI
    # call that never checkpoints would otherwise pay for nothing.
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.save({"model": states[0], "optimizer": states[1]}, checkpoint_id=str(directory),
                 process_group=group)
    if state is not None:
        torch.save(state, directory / STATE_FILE)
    files: dict[str, Any] = {}
    for part in _gathered(describe(directory), group):
        files.update(part)
    if state is not None:
        write_manifest(directory, state["step"], files)
    return directory


def _gathered(part: dict[str, Any], group: Any = None) -> list[dict[str, Any]]:
    """Every rank's ``part`` (a collective where there is a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [part]
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, part, group=group)
    return parts


def model_and_optimizer_states(model: nn.Module, optimizer: torch.optim.Optimizer
                               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimizer's state dicts as a checkpoint keeps them (DCP's: by the
    parameters' names, FSDP's shards as DTensors; a LoRA model's adapters alone)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(model))
    return _kept(model, model_state), optimizer_state


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """One worker, in-process, has no process group: DCP then reads and writes alone, and warns
    on every call that it assumed so (even when told). That is this case's intent: silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


# -- reading -------------------------------------------------------------------------------------

def load_checkpoint(directory: Path) -> dict[str, Any]:
    """Read a checkpoint's ``state.pt`` with ``weights_only=True``; raises CheckpointReadError
    when unusable."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointReadError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # refused objects land here under weights_only
        raise CheckpointReadError(f"checkpoint {path} was refused: {first_line(err)}") from err
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointReadError(f"checkpoint {path} is corrupted or truncated ({err})") from err
    if isinstance(state, dict) and "model" in state:
        raise CheckpointReadError(
            f"checkpoint {directory} holds the model in its state.pt (the single-file format); "
            "memtrain reads checkpoints whose model and optimizer are DCP files")
    return state


def load_tensors(directory: Path, tensors: dict[str, torch.Tensor]
                         ) -> dict[str, torch.Tensor]:
    """Some of the model's tensors from DCP files written by ``write_states``, by the names of
    its state dict, into ``tensors`` (sized to match; one process: export). Only the bytes of
    those tensors are read."""
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.load({"model": tensors}, checkpoint_id=str(directory))
    return tensors


def read_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every model tensor a checkpoint holds, whole, by name, with no model built (one
    process: tools and tests)."""
    load_checkpoint(directory)  # whole and of this format
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return load_tensors(directory, {
        name.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in saved.items()
        if name.startswith("model.") and isinstance(meta, TensorStorageMetadata)})


def load_weights(directory: Path, model: nn.Module) -> None:
    """The model's weights alone from the checkpoint ``directory`` (``train.init_from``), at
    any strategy and world size (a collective under a process group); CheckpointReadError
    naming the checkpoint when they do not fit the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    load_checkpoint(directory)  # whole and of this format
    options = _options(model)
    model_state = _kept(model, get_model_state_dict(model, options=options))
    try:
        with _quiet_single_process():
            dcp.load({"model": model_state}, checkpoint_id=str(directory))
    except CheckpointException as err:  # a BaseException: every rank's failure, one per rank
        raise _not_fitting(directory, err) from None
    set_model_state_dict(model, model_state, options=options)


def load_states(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer state written by ``write_states`` at any world size (a
    collective): each rank reads the parts of the files that its shards cover.
    CheckpointReadError naming the checkpoint when they do not fit the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _options(model)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    model_state = _kept(model, model_state)
    try:
        with _quiet_single_process():
            dcp.load({"model": model_state, "optimizer": optimizer_state},
                     checkpoint_id=str(directory))  # loads into the dicts in place
    except CheckpointException as err:  # a BaseException: every rank's failure, one per rank
        raise _not_fitting(directory, err) from None
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict=optimizer_state, options=options)


def _not_fitting(directory: Path, err: BaseException) -> CheckpointReadError:
    """DCP's failure to load ``directory`` into this model, as one line naming it."""
    failures = list(getattr(err, "failures", {}).values())
    reason = first_line(failures[0]) if failures else first_line(err)
    return CheckpointReadError(f"checkpoint {directory} does not fit the model: {reason}")


def _kept(model: nn.Module, model_state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint keeps of a model's state dict: all of it, or a LoRA model's adapters
    (``ignore_frozen_params`` leaves out the frozen parameters, but not a weight tied to one,
    such as an output layer tied to the embedding, which only the parameter owning it names)."""
    if lora_of(model) is None:
        return model_state
    return {name: tensor for name, tensor in model_state.items() if is_adapter(name)}


def _options(model: nn.Module) -> Any:
    """DCP's state-dict options: a LoRA model's frozen base is left out (its adapters only;
    loading them leaves the base as built, ``strict`` off for it: DCP's load itself fails on
    an adapter the files lack)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = lora_of(model) is not None
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)
