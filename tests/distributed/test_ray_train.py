"""A real Ray cluster on 127.0.0.1 with 2 Ray Train workers (gloo): AMP, AC, accumulation on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from trainer.launch import prepare_run

# One Ray cluster for the session: every test on it runs in one xdist worker.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("ray")]


def test_ray_train_two_workers_learn_checkpoint_and_resume(ray_cluster, corpus_dir: Path,
                                                           tmp_path: Path) -> None:
    from trainer.launch.ray import launch_ray

    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "run.name=ray",
                                           "memory.precision=bf16"))
    assert (cfg.memory.precision, cfg.memory.activation_checkpointing) == ("bf16", "full")
    summary = launch_ray(cfg, run_dir)
    assert summary["workers"] == 2 and summary["accumulation_steps"] == 2
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-00000006", "checkpoint-00000012"]
    assert (run_dir / "checkpoint-00000012" / "state.pt").is_file()

    more, _ = prepare_run(tiny_config(corpus_dir, tmp_path, "run.name=ray", "train.steps=15",
                                      "memory.precision=bf16"))
    resumed = launch_ray(more, run_dir)
    assert resumed["resumed_from_step"] == 12
    assert resumed["final_step"] == 15 and resumed["steps_this_run"] == 3
    ranks = {json.loads(line)["step"] for line in
             (run_dir / "metrics" / "rank-1.jsonl").read_text().splitlines()}
    assert 15 in ranks


def test_ray_workers_export_the_contract_on_the_nodes_metrics_endpoint(
        ray_cluster, corpus_dir: Path, tmp_path: Path) -> None:
    """Both ranks' series appear on Ray's endpoint under the contract's final names."""
    import re
    import time
    import urllib.request

    from trainer.launch.ray import launch_ray

    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "run.name=raymetrics",
                                           "train.steps=6", "train.eval_every=0"))
    launch_ray(cfg, run_dir)
    url = f"http://127.0.0.1:{ray_cluster.metrics_port}/metrics"
    deadline, text = time.monotonic() + 30, ""
    while time.monotonic() < deadline:  # the endpoint refreshes every second here
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        tokens = re.findall(r'ray_memtrain_train_tokens_total\{[^}]*run="raymetrics"[^}]*\}', text)
        if len(tokens) >= 2:
            break
        time.sleep(1)
    for rank in ("0", "1"):
        assert re.search(rf'ray_memtrain_train_tokens_total\{{[^}}]*rank="{rank}"[^}}]*'
                         rf'run="raymetrics"[^}}]*\}} [1-9]', text), f"rank {rank} missing"
        assert re.search(rf'ray_memtrain_host_rss_bytes\{{[^}}]*rank="{rank}"', text)
    assert "ray_memtrain_gpu_memory_allocated_bytes{" not in text  # absent on CPU


def _final_weights(run_dir: Path, step: int) -> dict:
    import torch

    state = torch.load(run_dir / f"checkpoint-{step:08d}" / "state.pt", weights_only=True)
    return state["model"]


def test_a_killed_worker_is_restarted_and_the_run_ends_bit_exact(
        ray_cluster, corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL rank 1 at step 5, two steps after the step-3 checkpoint: Ray restarts the group,
    training resumes from step 3 and the final weights equal those of an uninterrupted run, bit
    for bit (the loop is deterministic on CPU: seeded init, per-step reseeding, the loader's
    position and the optimizer state in the checkpoint, gloo's fixed reduction order)."""
    import torch

    from trainer.launch.ray import launch_ray

    common = ("train.steps=6", "train.checkpoint_every=3", "train.eval_every=0",
              "train.log_every=1", "parallel.max_failures=1")
    straight_cfg, straight_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common,
                                                         "run.name=straight"))
    launch_ray(straight_cfg, straight_dir)
    killed_cfg, killed_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common,
                                                     "run.name=killed"))
    monkeypatch.setenv("MEMTRAIN_FAULTS", "kill@5:1")
    summary = launch_ray(killed_cfg, killed_dir)
    assert (killed_dir / ".faults-fired" / "kill@5-1").exists()  # the kill happened
    assert summary["resumed_from_step"] == 3 and summary["final_step"] == 6
    straight, killed = _final_weights(straight_dir, 6), _final_weights(killed_dir, 6)
    assert straight.keys() == killed.keys()
    for name in straight:
        assert torch.equal(straight[name], killed[name]), name
    # Every step's loss after the resume is the uninterrupted run's loss.
    def losses(run_dir: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in
                (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert {s: v for s, v in losses(killed_dir).items() if s > 3} == \
        {s: v for s, v in losses(straight_dir).items() if s > 3}
