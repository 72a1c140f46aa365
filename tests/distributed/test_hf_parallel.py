"""A Hugging Face model on 2 gloo ranks: DDP resumes bit for bit, and FSDP (sharded per
decoder layer, DCP checkpoints) follows DDP's losses. In the "hf" xdist group with the other
tests that import transformers, so that one test process pays for its import."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import logged_losses, tiny_config
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run


def _transformers():
    """Imported when a test runs, not when the tests are collected: both test processes
    collect every module, and importing transformers costs seconds of CPU."""
    import transformers

    return transformers


pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("hf")]


def test_a_hf_model_on_two_ranks_resumes_exactly_under_ddp_and_follows_it_under_fsdp(
        corpus_dir: Path, tmp_path: Path) -> None:
    _transformers().LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    ).save_pretrained(tmp_path / "llama")
    common = (f"model.name=hf:{tmp_path / 'llama'}", "parallel.launcher=local",
              "parallel.workers=2", "memory.precision=fp32", "train.steps=4",
              "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=2",
              "memory.activation_checkpointing=selective", "memory.loss_chunk_tokens=64")

    def run(name: str, until: int | None, *overrides: str) -> tuple[dict, Path]:
        cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common, *overrides,
                                               f"run.name={name}"))
        return launch_local(cfg, run_dir, until_step=until), run_dir

    _, straight = run("straight", None)
    first, _ = run("ddp", 2)
    resumed, _ = run("ddp", None)
    assert (first["final_step"], resumed["resumed_from_step"], resumed["final_step"]) == (2, 2, 4)
    assert logged_losses(tmp_path / "ddp") == logged_losses(straight)  # to the bit
    # FSDP's own resume (DCP, resharded) is tests/distributed/test_fsdp.py's, model-independent.
    run("fsdp", None, "parallel.strategy=fsdp")
    assert logged_losses(tmp_path / "fsdp") == pytest.approx(logged_losses(straight), rel=1e-4)
    checkpoint = tmp_path / "fsdp" / "checkpoint-00000004"
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in checkpoint.iterdir()}
    _exports_a_file_at_a_time(tmp_path, tmp_path / "fsdp")


def _exports_a_file_at_a_time(tmp_path: Path, run_dir: Path) -> None:
    """The FSDP run's export: one file, or files of at most 40 kB (a larger tensor alone), read
    from the DCP shards a file at a time; ``from_pretrained`` loads both to the same weights
    (that they are the trained ones: ``tests/unit/test_hf.py``'s export test)."""
    from trainer.checkpoint.export import export_hf

    transformers = _transformers()
    export_hf(run_dir, tmp_path / "whole")
    export_hf(run_dir, tmp_path / "files", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "files" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "files").glob("model-*.safetensors"))
    assert len(files) >= 3 and set(index["weight_map"].values()) == set(files)
    assert all((tmp_path / "files" / f).stat().st_size < 40_000 + 4_096 for f in files)
    whole, split = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name)
                    for name in ("whole", "files"))
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, split.state_dict()[name]), name
