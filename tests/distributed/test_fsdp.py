"""FSDP2 with real gloo process groups: same losses as DDP, half the parameter bytes per rank,
and sharded checkpoints that resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import tiny_config
from trainer.config import ConfigError, load_config
from trainer.launch import prepare_run
from trainer.launch.local import free_port, launch_local
from trainer.model import GPT, GPTConfig
from trainer.sharding import local_parameter_bytes, shard_model

pytestmark = pytest.mark.distributed


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_fsdp_and_ddp_losses_agree_and_sharded_checkpoints_resume(corpus_dir: Path,
                                                                  tmp_path: Path) -> None:
    common = ("parallel.launcher=local", "memory.precision=fp32", "train.steps=8",
              "train.log_every=1", "train.eval_every=4", "train.checkpoint_every=4")
    ddp_cfg, ddp_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "run.name=ddp"))
    launch_local(ddp_cfg, ddp_dir)
    fsdp_cfg, fsdp_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common,
                                                 "parallel.strategy=fsdp", "run.name=fsdp"))
    fsdp = launch_local(fsdp_cfg, fsdp_dir, until_step=4)  # stop at the step-4 checkpoint
    assert fsdp["final_step"] == 4
    shard_files = sorted(p.name for p in (fsdp_dir / "checkpoint-00000004").iterdir())
    assert "__0_0.distcp" in shard_files and "__1_0.distcp" in shard_files  # one per rank
    resumed = launch_local(fsdp_cfg, fsdp_dir)
    assert resumed["resumed_from_step"] == 4 and resumed["final_step"] == 8
    assert _losses(fsdp_dir) == pytest.approx(_losses(ddp_dir), rel=1e-4)


def _count_bytes(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(seq_len=32, n_layer=4, n_head=2, n_embd=64))
        full = local_parameter_bytes(model)
        shard_model(model)
        if rank == 0:
            torch.save({"full": full, "sharded": local_parameter_bytes(model)}, out)
    finally:
        dist.destroy_process_group()


def test_parameter_bytes_per_rank_halve_at_world_size_2(tmp_path: Path) -> None:
    out = tmp_path / "bytes.pt"
    mp.start_processes(_count_bytes, args=(free_port(), str(out)), nprocs=2,
                       start_method="spawn")
    result = torch.load(out, weights_only=True)
    assert result["sharded"] == pytest.approx(result["full"] / 2, rel=0.01)


def test_fsdp_with_fp16_is_refused() -> None:
    with pytest.raises(ConfigError, match="fsdp' with memory.precision 'fp16'"):
        load_config(None, ["parallel.strategy=fsdp", "memory.precision=fp16"])


def test_resuming_a_ddp_checkpoint_under_fsdp_names_both(corpus_dir: Path,
                                                          tmp_path: Path) -> None:
    common = ("parallel.launcher=local", "memory.precision=fp32", "train.steps=2",
              "train.eval_every=0", "train.checkpoint_every=2", "run.name=switch")
    ddp_cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common))
    launch_local(ddp_cfg, run_dir)
    fsdp_cfg, _ = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "train.steps=4",
                                          "parallel.strategy=fsdp"))
    with pytest.raises(mp.ProcessRaisedException,
                       match=r"checkpoint-00000002 was written without FSDP sharding; this run "
                             r"has parallel.strategy 'fsdp' on 2 workers"):
        launch_local(fsdp_cfg, run_dir)


def test_fsdp_in_bf16_with_bf16_norm_inputs_tracks_ddp(corpus_dir: Path, tmp_path: Path) -> None:
    """bf16 autocast with the bf16-saving LayerNorm (a custom autograd Function) under FSDP2:
    parameters are all-gathered for forward and again for backward, where the Function reads
    the norm weights it saved; the losses follow DDP's."""
    common = ("parallel.launcher=local", "memory.precision=bf16", "train.steps=6",
              "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0")
    ddp_cfg, ddp_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "run.name=d16"))
    launch_local(ddp_cfg, ddp_dir)
    fsdp_cfg, fsdp_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common,
                                                 "parallel.strategy=fsdp", "run.name=f16"))
    launch_local(fsdp_cfg, fsdp_dir)
    assert _losses(fsdp_dir) == pytest.approx(_losses(ddp_dir), rel=1e-3)  # seen: 1e-5
