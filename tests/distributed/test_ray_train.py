"""A real Ray cluster on 127.0.0.1 with 2 Ray Train workers (gloo): AC and accumulation on, the
run directory on an S3-compatible store (moto on 127.0.0.1).

One run (``ray_run``, module scope) serves three tests, and a worker of it is killed: rank 1 is
SIGKILLed at step 9, three steps after the step-6 checkpoint, so Ray restarts the group and the
loop resumes from step 6, restored from the store. It must still learn and checkpoint, its
workers must export the metrics contract, and its final weights must equal, bit for bit, those
of an uninterrupted run of the same config under the local launcher (2 worker processes, gloo,
a local run directory): the loop is deterministic on CPU whichever launcher runs it. The run is
then continued from another working copy (another machine: nothing local), from the store. The
killed run logs to TensorBoard and MLflow, which must hold every step once. Each Ray Train run
costs its worker group's start; on a 2-core CI machine the module takes three group starts, not
five.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import running_s3_server, tiny_config
from tests.distributed.test_bind_addresses import ListeningSockets
from trainer.checkpoint.files import read_model_weights
from trainer.checkpoint.publish import stored_checkpoints
from trainer.checkpoint.store import RemoteRun
from trainer.launch.prepare import prepare_run

# One Ray cluster for the session: every test on it runs in one xdist worker.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("ray")]

# 12 steps, checkpoints at 6 and 12, a loss logged every step, one restart allowed.
SETTINGS = ("train.steps=12", "train.checkpoint_every=6", "train.eval_every=6",
            "train.log_every=1", "parallel.max_failures=1")
REMOTE = ("run.dir=s3://memtrain-runs/runs", "run.name=ray")
# The killed run logs to both trackers (MLflow: the run directory's own store) from Ray's rank 0
TRACKERS = "monitoring.trackers=[tensorboard, mlflow]"


@dataclass
class RayRun:
    run_dir: Path
    summary: dict[str, Any]
    final_weights: dict[str, torch.Tensor]  # checkpoint 12, read before any test resumes it
    losses: dict[int, float]  # the last logged loss of each step (after the restart: resumed)
    first_losses: dict[int, float]  # the first logged loss of each step (before the kill)
    sockets: ListeningSockets  # the listening sockets of the cluster's processes as it trained


def _losses(run_dir: Path, first: bool = False) -> dict[int, float]:
    rows = [json.loads(line) for line in
            (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    losses: dict[int, float] = {}
    for row in rows:
        if "loss" in row and not (first and row["step"] in losses):
            losses[row["step"]] = row["loss"]
    return losses


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return read_model_weights(run_dir / f"checkpoint-{step:08d}")


def _stored_weights(store: RemoteRun, step: int) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        name = f"checkpoint-{step:08d}"
        store.download_dir(name, Path(tmp) / name)
        return read_model_weights(Path(tmp) / name)


@pytest.fixture(scope="module")
def store():
    """The run directory's store: moto's S3 server on 127.0.0.1, a bucket, the AWS environment
    that points the driver at it (Ray's workers get the driver's filesystem object)."""
    with pytest.MonkeyPatch.context() as patch, running_s3_server(patch, "memtrain-runs"):
        yield RemoteRun("s3://memtrain-runs/runs/ray")


@pytest.fixture(scope="module")
def ray_run(ray_cluster, store: RemoteRun, corpus_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> RayRun:
    from trainer.launch.ray import launch_ray

    work = tmp_path_factory.mktemp("ray")
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, work, *SETTINGS, *REMOTE,
                                           f"run.work_dir={work / 'machine-a'}", TRACKERS))
    os.environ["MEMTRAIN_FAULTS"] = "kill@9:1"  # the launcher hands it to Ray's workers
    try:
        with ListeningSockets() as sockets:
            summary = launch_ray(cfg, run_dir)
    finally:
        del os.environ["MEMTRAIN_FAULTS"]
    return RayRun(run_dir, summary, _stored_weights(store, 12), _losses(run_dir),
                  _losses(run_dir, first=True), sockets)


def test_ray_trains_workers_listen_on_loopback_only(ray_run: RayRun) -> None:
    """Rank 0's rendezvous store (torch's own listens on every interface) and gloo's sockets,
    in both of the run's worker groups (before and after the kill)."""
    assert any(name.startswith("ray::") for name, _, _ in ray_run.sockets.new), \
        ray_run.sockets.new
    assert ray_run.sockets.beyond_loopback() == []


def test_ray_train_two_workers_learn_checkpoint_and_resume(ray_run: RayRun, store: RemoteRun,
                                                           corpus_dir: Path) -> None:
    from trainer.launch.ray import launch_ray

    summary = ray_run.summary
    assert summary["workers"] == 2 and summary["accumulation_steps"] == 2
    assert summary["activation_checkpointing"] == "full"
    assert ray_run.losses[12] < ray_run.first_losses[1] - 0.5
    assert [name for _, name in stored_checkpoints(store)] == ["checkpoint-00000006",
                                                         "checkpoint-00000012"]
    assert json.loads(store.read_text("summary.json"))["final_step"] == 12
    assert not list(ray_run.run_dir.glob("checkpoint-*"))  # in the store only

    # The resume runs from another working copy, as on another machine, and as an elastic
    # group, workers [1, 2] (Train V2's ScalingConfig(num_workers=(1, 2))): it starts with as
    # many as the cluster holds, both here; its checkpoints upload in the background
    # (train.checkpoint_async: Ray Train's CheckpointUploadMode.ASYNC), whole on the store by
    # the time the run ends.
    work = ray_run.run_dir.parent.parent / "machine-b"
    more, run_dir = prepare_run(tiny_config(corpus_dir, work, *SETTINGS, *REMOTE,
                                            f"run.work_dir={work}", "train.steps=15",
                                            "parallel.workers=[1, 2]",
                                            "train.checkpoint_async=true"))
    resumed = launch_ray(more, run_dir)
    assert resumed["resumed_from_step"] == 12 and resumed["workers"] == 2
    assert resumed["final_step"] == 15 and resumed["steps_this_run"] == 3
    assert [name for _, name in stored_checkpoints(store)][-1] == "checkpoint-00000015"
    steps = [json.loads(line)["step"] for line in
             store.read_text("metrics/rank-1.jsonl").splitlines()]
    assert steps[0] == 1 and steps[-1] == 15  # the store's log continued, not restarted


def test_ray_workers_export_the_contract_on_the_nodes_metrics_endpoint(
        ray_cluster, ray_run: RayRun) -> None:
    """Both ranks' series appear on Ray's endpoint under the contract's final names."""
    url = f"http://127.0.0.1:{ray_cluster.metrics_port}/metrics"
    deadline, text = time.monotonic() + 30, ""
    while time.monotonic() < deadline:  # the endpoint refreshes every second here
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        tokens = re.findall(r'ray_memtrain_train_tokens_total\{[^}]*run="ray"[^}]*\}', text)
        if len(tokens) >= 2:
            break
        time.sleep(1)
    for rank in ("0", "1"):
        assert re.search(rf'ray_memtrain_train_tokens_total\{{[^}}]*rank="{rank}"[^}}]*'
                         rf'run="ray"[^}}]*\}} [1-9]', text), f"rank {rank} missing"
        assert re.search(rf'ray_memtrain_host_rss_bytes\{{[^}}]*rank="{rank}"', text)
    assert "ray_memtrain_gpu_memory_allocated_bytes{" not in text  # absent on CPU


def test_a_killed_worker_is_restarted_and_the_run_ends_bit_exact(
        ray_run: RayRun, corpus_dir: Path, tmp_path: Path) -> None:
    """The kill at step 9 happened, Ray restarted the group, training resumed from step 6, and
    the final weights equal those of an uninterrupted local run, bit for bit (seeded init,
    per-step reseeding, the loader's position and the optimizer state in the checkpoint, gloo's
    fixed reduction order)."""
    from trainer.launch.local import launch_local
    from trainer.launch.ray import RESTORE_DIR

    assert (ray_run.run_dir / ".faults-fired" / "kill@9-1").exists()  # the kill happened
    assert ray_run.summary["resumed_from_step"] == 6 and ray_run.summary["final_step"] == 12
    # The restore came from the store through the node's one copy, removed once read.
    restore = ray_run.run_dir / RESTORE_DIR
    assert restore.is_dir() and not any(restore.iterdir())
    cfg, local_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *SETTINGS,
                                             "run.name=uninterrupted",
                                             "parallel.launcher=local"))
    launch_local(cfg, local_dir)
    uninterrupted = _weights(local_dir, 12)
    assert ray_run.final_weights.keys() == uninterrupted.keys()
    for name in uninterrupted:
        assert torch.equal(ray_run.final_weights[name], uninterrupted[name]), name
    # Every step's loss, before the kill and after the resume, is the uninterrupted run's.
    reference = _losses(local_dir)
    assert ray_run.losses == reference
    assert {s: v for s, v in ray_run.first_losses.items() if s <= 8} == \
        {s: reference[s] for s in range(1, 9)}


def test_the_killed_runs_trackers_hold_every_step_once(ray_run: RayRun) -> None:
    """Under Ray, across the restart: one MLflow run, finished, every step's loss once (the
    steps 7-9 that the restart redid not logged twice) and both ranks' peaks; TensorBoard's
    reader sees every step once (its writer purged the redone ones)."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    client = MlflowClient(f"sqlite:///{ray_run.run_dir / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("memtrain").experiment_id])
    assert run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, 13))
    assert {m.step: m.value for m in losses} == ray_run.losses  # the exact resume's values
    for rank in (0, 1):
        peaks = client.get_metric_history(run.info.run_id, f"peak_memory_bytes/rank_{rank}")
        assert [m.step for m in peaks] == list(range(1, 13)), rank
    events = EventAccumulator(str(ray_run.run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 13))
