"""``memtrain export RUN --hf OUT``: a run's trained weights back in the model's own format.

For a run of a Hugging Face model (``model.name: hf:<dir>``), the checkpoint's weights (a plain
``state.pt`` or FSDP's DCP shards, at any world size) are loaded into the model built from its
config and written with ``save_pretrained``: ``AutoModelForCausalLM.from_pretrained(OUT)`` then
gives the trained model. The tokenizer the run's dataset was written with (the dataset's copy,
checked against its manifest) is written beside it, so ``AutoTokenizer.from_pretrained(OUT)``
works too. The run directory must be local (a run on object storage: its working copy,
``run.work_dir``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

from datapipe.manifest import DatasetError
from datapipe.tokenize import TOKENIZER_FILE, dataset_tokenizer
from monitoring.run_files import CONFIG
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

log = logging.getLogger(__name__)


class Exported(NamedTuple):
    out: Path
    step: int  # the checkpoint's
    tokenizer: bool  # whether the dataset's tokenizer.json was written beside the model


def export_hf(run_dir: Path, out: Path, step: int | None = None) -> Exported:
    """Write checkpoint ``step`` (default: the latest) of ``run_dir`` as a ``save_pretrained``
    directory ``out``, with the dataset's tokenizer where it kept one."""
    config_path = run_dir / CONFIG
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
    try:
        tokenizer = dataset_tokenizer(cfg.data.path)
    except DatasetError as err:  # the weights are written; say why the tokenizer is not
        log.warning("no tokenizer written: %s", err)
        tokenizer = None
    if tokenizer is not None:
        from tokenizers import Tokenizer

        raw, eot_id = tokenizer
        (out / TOKENIZER_FILE).write_bytes(raw)
        # The special token ``AutoTokenizer`` cannot know from tokenizer.json alone.
        eos = Tokenizer.from_str(raw.decode("utf-8")).id_to_token(eot_id)
        (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}, indent=2))
    return Exported(out, step, tokenizer is not None)
