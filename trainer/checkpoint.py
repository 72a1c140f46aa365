"""What a checkpoint holds and how it is written and read back safely.

One ``state.pt`` per checkpoint directory with the model, optimizer, GradScaler and LR-schedule
state, the step, the data loader's position and the RNG state, plus a small ``meta.json``.
Everything in it is tensors and plain containers, so it loads with ``torch.load(...,
weights_only=True)``: a checkpoint can never run code. A checkpoint whose shapes do not fit the
model raises a ``CheckpointError`` naming the parameter, not an error deep inside torch.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.errors import first_line

STATE_FILE = "state.pt"
META_FILE = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (``trainer.state.TrainState.state_dict``) into ``directory``; returns the
    state file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / STATE_FILE
    torch.save(state, path)
    (directory / META_FILE).write_text(json.dumps({"step": state["step"]}, sort_keys=True))
    return path


def load_checkpoint(directory: Path) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``; raises CheckpointError when unusable."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # refused objects land here under weights_only
        raise CheckpointError(f"checkpoint {path} was refused: {first_line(err)}") from err
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"checkpoint {path} is corrupted or truncated ({err})") from err


def load_model_state(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """``model.load_state_dict`` with shape and key mismatches reported as one clear line."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {source} does not fit the model: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    for name, tensor in state_dict.items():
        if tensor.shape != own[name].shape:
            raise CheckpointError(
                f"checkpoint {source} does not fit the model: {name} has shape "
                f"{list(tensor.shape)} in the checkpoint, {list(own[name].shape)} in the model")
    model.load_state_dict(state_dict)
