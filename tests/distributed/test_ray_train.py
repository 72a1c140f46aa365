"""A real Ray cluster on 127.0.0.1 with 2 Ray Train workers (gloo): AMP, AC, accumulation on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from trainer.launch import prepare_run

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session, on loopback.

    ``trainer.launch.ray`` must be the first to import ray: it sets the environment that makes
    Ray use 127.0.0.1, so ray is reached through it here rather than imported directly.
    """
    from trainer.launch import ray as ray_launch

    ray_launch.init_ray(num_cpus=2)
    assert ray_launch.ray.util.get_node_ip_address() == "127.0.0.1"
    assert {n["NodeManagerAddress"] for n in ray_launch.ray.nodes()} == {"127.0.0.1"}
    yield ray_launch.ray
    ray_launch.ray.shutdown()


def test_ray_train_two_workers_learn_checkpoint_and_resume(ray_cluster, corpus_dir: Path,
                                                           tmp_path: Path) -> None:
    from trainer.launch.ray import launch_ray

    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "run.name=ray"))
    assert (cfg.memory.precision, cfg.memory.activation_checkpointing) == ("bf16", "full")
    summary = launch_ray(cfg, run_dir)
    assert summary["workers"] == 2 and summary["accumulation_steps"] == 2
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-00000006", "checkpoint-00000012"]
    assert (run_dir / "checkpoint-00000012" / "state.pt").is_file()

    more, _ = prepare_run(tiny_config(corpus_dir, tmp_path, "run.name=ray", "train.steps=15"))
    resumed = launch_ray(more, run_dir)
    assert resumed["resumed_from_step"] == 12
    assert resumed["final_step"] == 15 and resumed["steps_this_run"] == 3
    ranks = {json.loads(line)["step"] for line in
             (run_dir / "metrics" / "rank-1.jsonl").read_text().splitlines()}
    assert 15 in ranks
