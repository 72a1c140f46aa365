"""Experiment trackers against the real things: an ``mlflow server`` on 127.0.0.1 with a sqlite
store, read back with ``MlflowClient``; TensorBoard's own event reader (``EventAccumulator``);
the run directory's own MLflow store; and a server that does not answer.

The runs are the tiny config under the local launcher with one worker, in this process (rank 0
is the process that logs, whichever launcher started it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_config, wait_for_http
from trainer.launch.local import free_port, launch_local
from trainer.launch.prepare import prepare_run

pytestmark = pytest.mark.e2e

RUN = ("parallel.launcher=local", "parallel.workers=1", "train.steps=6", "train.log_every=1",
       "train.eval_every=3", "train.checkpoint_every=3")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``mlflow server`` on 127.0.0.1: runs in sqlite, artifacts served from a folder."""
    work = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = work / "server.log"
    # Its own session: the server starts uvicorn as a child, and its job runner (off here:
    # seven more processes, for MLflow's GenAI jobs) would start more; the group ends together.
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
         "--artifacts-destination", str(work / "artifacts"), "--workers", "1"],
        cwd=work, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", "mlflow server", 90, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def _last_losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """Rank 0's logged values by step, the last one of each (after a restart: the resumed)."""
    records = map(json.loads, (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines())
    return {r["step"]: r[key] for r in records if key in r}


def test_a_restarted_run_is_one_tracked_run_with_every_step_once(
        mlflow_server: str, corpus_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The step-6 checkpoint write fails, so steps 4-6 ran and were logged; the run is started
    again and resumes from step 3, redoing them. MLflow holds one run (reopened, finished) with
    every step's metrics once, the parameters and the artifacts; TensorBoard's reader sees
    every step once."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = (*RUN, "run.name=tracked", "monitoring.trackers=[tensorboard, mlflow]",
                 f"monitoring.mlflow_tracking_uri={mlflow_server}",
                 "monitoring.mlflow_experiment=restarts")
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *overrides))
    monkeypatch.setenv("MEMTRAIN_FAULTS", "checkpoint@6")
    with pytest.raises(OSError, match="checkpoint write failed at step 6"):
        launch_local(cfg, run_dir)
    client = MlflowClient(mlflow_server)
    [failed] = client.search_runs([client.get_experiment_by_name("restarts").experiment_id])
    assert failed.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(failed.info.run_id, "loss")] == \
        [1, 2, 3, 4, 5, 6]

    monkeypatch.delenv("MEMTRAIN_FAULTS")
    summary = launch_local(*prepare_run(tiny_config(corpus_dir, tmp_path, *overrides)))
    assert (summary["resumed_from_step"], summary["final_step"]) == (3, 6)
    [run] = client.search_runs([client.get_experiment_by_name("restarts").experiment_id])
    assert run.info.run_id == failed.info.run_id and run.info.status == "FINISHED"
    assert run.info.run_name == "tracked"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == [1, 2, 3, 4, 5, 6]  # steps 4-6 not logged twice
    # An exact resume: the redone steps' losses are those logged before the restart.
    assert {m.step: m.value for m in losses} == _last_losses(run_dir)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [3, 6]
    for name in ("tokens_per_second", "data_wait_share", "peak_memory_bytes",
                 "oom_recoveries", "micro_batch_size"):
        assert len(client.get_metric_history(run.info.run_id, name)) == 6, name
    # The ranks' peaks, logged at the end from their metrics logs: every step, though the first
    # attempt failed before its end.
    assert [m.step for m in client.get_metric_history(
        run.info.run_id, "peak_memory_bytes/rank_0")] == [1, 2, 3, 4, 5, 6]
    params = run.data.params
    assert params["train.lr"] == "0.005" and params["memory.precision"] == "fp32"
    assert params["model.n_layer"] == "2" and params["monitoring.trackers"] == \
        '["tensorboard", "mlflow"]'
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "config.yaml", "report.png"} <= artifacts, artifacts
    summary_copy = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(summary_copy).read_text())["final_step"] == 6

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("loss")
    assert [s.step for s in scalars] == [1, 2, 3, 4, 5, 6]  # the purge dropped the first 4-6
    assert {s.step: s.value for s in scalars} == pytest.approx(_last_losses(run_dir))
    assert [s.step for s in events.Scalars("eval_loss")] == [3, 6]
    # TensorBoard's ranks' peaks: this attempt's steps (its writer purged the later ones)
    assert [s.step for s in events.Scalars("peak_memory_bytes/rank_0")] == [4, 5, 6]


def test_a_tracker_that_cannot_be_reached_costs_one_warning(
        corpus_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listens at the URI: MLflow is dropped with one warning line, the run trains to
    the end, and TensorBoard (the other tracker) is unaffected."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    nowhere = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level("WARNING", logger="memtrain"):
        summary = launch_local(*prepare_run(tiny_config(
            corpus_dir, tmp_path, *RUN, "train.steps=2", "run.name=unreachable",
            "monitoring.trackers=[mlflow, tensorboard]",
            f"monitoring.mlflow_tracking_uri={nowhere}")))
    assert summary["final_step"] == 2
    warnings = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert warnings == [f"tracker mlflow dropped (starting): TrackerError: the MLflow "
                        f"server at {nowhere} did not answer ([Errno 111] Connection refused)"]
    events = EventAccumulator(str(tmp_path / "unreachable" / "tensorboard"))
    events.Reload()
    assert [s.step for s in events.Scalars("loss")] == [1, 2]


def test_without_a_uri_mlflow_writes_a_store_in_the_run_directory(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two worker processes (rank 0 logs from its own process): the run in ``mlflow.db`` and
    its artifacts in ``mlflow-artifacts/``, nothing written outside the run directory; both
    ranks' peaks."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    launch_local(*prepare_run(tiny_config(corpus_dir, tmp_path / "runs", *RUN, "train.steps=2",
                                          "parallel.workers=2", "train.eval_every=0",
                                          "run.name=own", "monitoring.trackers=[mlflow]")))
    run_dir = tmp_path / "runs" / "own"
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("memtrain").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]
    for rank in (0, 1):
        peaks = client.get_metric_history(run.info.run_id, f"peak_memory_bytes/rank_{rank}")
        assert [m.step for m in peaks] == [1, 2] and all(m.value > 0 for m in peaks), rank
    assert json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"] == \
        run.info.run_id
    artifacts = sorted(p.name for p in (run_dir / "mlflow-artifacts").rglob("*") if p.is_file())
    assert artifacts == ["config.yaml", "report.png", "summary.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing in the cwd


def test_the_drivers_mlflow_uri_reaches_the_workers_through_the_config(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's workers do not see the driver's environment: the URI travels in the config."""
    from trainer.config import ConfigError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    cfg, _ = prepare_run(tiny_config(corpus_dir, tmp_path, "monitoring.trackers=[mlflow]"))
    assert cfg.monitoring.mlflow_tracking_uri == "http://127.0.0.1:5000"
    cfg, _ = prepare_run(tiny_config(corpus_dir, tmp_path))  # no tracker: left alone
    assert cfg.monitoring.mlflow_tracking_uri is None
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as where it is not installed
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"monitoring.trackers: 'mlflow' needs the mlflow "
                                          r"package: pip install 'memtrain\[tracking\]'"):
        prepare_run(tiny_config(corpus_dir, tmp_path, "monitoring.trackers=[mlflow]"))
