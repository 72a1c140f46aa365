"""``memtrain export RUN --hf OUT``: a run's trained weights back in the model's own format.

For a run of a Hugging Face model (``model.name: hf:<dir>``), the checkpoint's weights (a plain
``state.pt`` or FSDP's DCP shards, at any world size) are loaded into the model built from its
config and written with ``save_pretrained``: ``AutoModelForCausalLM.from_pretrained(OUT)`` then
gives the trained model. The run directory must be local (a run on object storage: its working
copy, ``run.work_dir``).
"""

from __future__ import annotations

from pathlib import Path

from trainer.build import MemoryTransforms, build_model, model_factory
from trainer.checkpoint import (
    CheckpointReadError,
    complete_checkpoints,
    load_checkpoint,
    load_model_state,
    load_sharded_model,
)
from trainer.config import ConfigError, load_config
from trainer.hf import PREFIX, HFCausalLM


def export_hf(run_dir: Path, out: Path, step: int | None = None) -> tuple[Path, int]:
    """Write checkpoint ``step`` (default: the latest) of ``run_dir`` as a ``save_pretrained``
    directory ``out``; returns ``out`` and the step exported."""
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml (not a memtrain run directory)")
    cfg = load_config(config_path)
    if not cfg.model.name.startswith(PREFIX):
        raise ConfigError(f"--hf needs a run of a Hugging Face model (model.name hf:...); "
                          f"{run_dir}'s is {cfg.model.name!r}")
    checkpoints = dict(complete_checkpoints(run_dir))
    if not checkpoints:
        raise CheckpointReadError(f"{run_dir}: no complete checkpoint to export")
    step = max(checkpoints) if step is None else step
    if step not in checkpoints:
        raise CheckpointReadError(f"{run_dir}: no checkpoint of step {step} (there are "
                                  f"{sorted(checkpoints)})")
    model = build_model(model_factory(cfg.model), MemoryTransforms(), seed=None)
    assert isinstance(model, HFCausalLM), type(model)
    directory = checkpoints[step]
    state = load_checkpoint(directory)
    if state.get("sharded"):
        load_sharded_model(directory, model)
    else:
        load_model_state(model, state["model"], str(directory))
    model.hf.save_pretrained(out)
    return out, step
