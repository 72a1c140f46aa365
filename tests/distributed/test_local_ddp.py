"""The local launcher with 2 real gloo processes: DDP, AMP, activation ckpt, accumulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from trainer.context import complete_checkpoints
from trainer.launch import prepare_run
from trainer.launch.local import launch_local

pytestmark = pytest.mark.distributed


def test_two_process_ddp_trains_checkpoints_and_resumes(corpus_dir: Path,
                                                        tmp_path: Path) -> None:
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.launcher=local",
                                           "run.name=ddp"))
    summary = launch_local(cfg, run_dir)
    assert summary["workers"] == 2 and summary["accumulation_steps"] == 2
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    assert [step for step, _ in complete_checkpoints(run_dir)] == [6, 12]
    ranks = sorted(p.name for p in (run_dir / "metrics").iterdir())
    assert ranks == ["rank-0.jsonl", "rank-1.jsonl"]

    more, _ = prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.launcher=local",
                                      "run.name=ddp", "train.steps=16"))
    resumed = launch_local(more, run_dir)
    assert resumed["resumed_from_step"] == 12
    assert resumed["steps_this_run"] == 4 and resumed["final_step"] == 16
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    assert steps[-1] == 16


def test_resume_is_exact_for_a_single_worker(corpus_dir: Path, tmp_path: Path) -> None:
    """12 steps in one go give the same loss as 6 steps, a stop, and 6 more."""
    straight_cfg, straight_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "run.name=straight", "train.eval_every=0"))
    straight = launch_local(straight_cfg, straight_dir)
    first_cfg, split_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "run.name=split", "train.eval_every=0"))
    launch_local(first_cfg, split_dir, until_step=6)  # same 12-step schedule, stopped at 6
    resumed = launch_local(first_cfg, split_dir)
    assert resumed["resumed_from_step"] == 6
    assert resumed["final_loss"] == straight["final_loss"]
