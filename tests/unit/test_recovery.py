"""Restarts as the run records them (``trainer.telemetry.restarts``): which start is a restart, its
cause, what it cost, and the run's totals for the metrics contract.

Each attempt here is what a worker's loop does at its start and after each step; the cluster's
node list is the one thing given (``lost_nodes``), as Ray would answer it."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from monitoring.run_files import ATTEMPTS
from monitoring.sinks import PrometheusSink
from trainer.telemetry.restarts import Restarts
from trainer.telemetry.worker_errors import (
    clear_worker_errors,
    record_controller_error,
    record_worker_error,
    record_worker_exit,
)

NODES = ["127.0.0.1", "127.0.0.2"]


def _nothing_lost(addresses: list[str]) -> list[str]:
    return []


def attempt(run_dir: Path, launch: str, resumed_from: int | None, steps: range,
            finish: bool = False, lost: list[str] | None = None) -> Restarts:
    """One attempt of rank 0: begin, the steps, and (when ``finish``) the end of the run."""
    recovery = Restarts.begin(run_dir, True, launch, resumed_from, NODES,
                              lambda previous: [n for n in previous if n in (lost or [])])
    for step in steps:
        recovery.step_done(step)
    if finish:
        recovery.finish(steps[-1])
    recovery.close()
    return recovery


def test_a_finished_run_started_again_is_a_resume_not_a_restart(tmp_path: Path) -> None:
    first = attempt(tmp_path, "launch-1", None, range(1, 5), finish=True)
    assert first.restart is None and first.metrics() == {
        "memtrain_train_restarts_total": {}, "memtrain_train_recovery_seconds_total": 0.0}
    again = attempt(tmp_path, "launch-2", 4, range(5, 9), finish=True)
    assert again.restart is None and again.attempt == 2
    assert again.summary() == {"attempt": 2, "restarts": {}, "recovery_seconds": 0.0}


def test_a_killed_attempt_is_a_restart_with_its_line_steps_redone_and_time_lost(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    attempt(tmp_path, "launch-1", None, range(1, 7))  # killed after step 6: no end
    time.sleep(0.2)
    with caplog.at_level(logging.WARNING, logger="memtrain"):
        second = attempt(tmp_path, "launch-1", 4, range(5, 9), finish=True)
    restart = second.restart
    assert restart is not None
    assert (restart.cause, restart.last_step, restart.resumed_from, restart.steps_redone) == \
        ("worker_exit", 6, 4, 2)
    (line,) = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
    seconds = second.recovery_seconds
    assert 0.2 <= seconds < 5.0
    assert line == ("restarted after a worker exited without an error of its own (a signal or "
                    f"the kernel's OOM killer): resumed from step 4 ({seconds:.1f} s, "
                    "2 steps redone)")
    records = [json.loads(x) for x in (tmp_path / ATTEMPTS).read_text().splitlines()]
    assert [r.get("cause") for r in records if "start" in r] == [None, "worker_exit"]
    assert second.metrics() == {"memtrain_train_restarts_total": {"worker_exit": 1},
                                "memtrain_train_recovery_seconds_total": seconds}


def test_the_cause_is_a_workers_own_error_before_its_peers_echoes(tmp_path: Path) -> None:
    """Rank 0 failed in its all-reduce because rank 1 died of its own error first: rank 1's
    error is the cause. An error older than the previous attempt is not."""
    stale = tmp_path / "errors" / "rank-2.json"
    record_worker_error(tmp_path, 2, ValueError("an old attempt's error"))
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    attempt(tmp_path, "launch-1", None, range(1, 4))
    record_worker_error(tmp_path, 0, RuntimeError("[gloo] Connection closed by peer"))
    record_worker_error(tmp_path, 1, OSError("checkpoint write failed at step 4"))
    restart = attempt(tmp_path, "launch-1", 2, range(3, 5)).restart
    assert restart is not None and restart.cause == "worker_error"
    assert restart.detail == "rank 1: OSError: checkpoint write failed at step 4"


def test_a_peers_echo_alone_means_a_worker_exited_in_the_same_launch_and_else_a_relaunch(
        tmp_path: Path) -> None:
    """Within a launch an echo means a worker died without a word; a new launch after one
    means the driver stopped (its workers were ended, one echoing the other)."""
    attempt(tmp_path, "launch-1", None, range(1, 4))
    record_worker_error(tmp_path, 0, RuntimeError("[gloo] Connection closed by peer"))
    same = attempt(tmp_path, "launch-1", 2, range(3, 5)).restart
    assert same is not None and same.cause == "worker_exit"
    record_worker_error(tmp_path, 1, RuntimeError("[gloo] Connection reset by peer"))
    clear_worker_errors(tmp_path)  # what the next launch does first
    other = attempt(tmp_path, "launch-2", 4, range(5, 6)).restart
    assert other is not None and other.cause == "relaunch"


def test_a_workers_exit_as_the_launcher_saw_it_is_named(tmp_path: Path) -> None:
    attempt(tmp_path, "launch-1", None, range(1, 4))
    record_worker_exit(tmp_path, 1, "exited with code -9 (signal SIGKILL)")
    clear_worker_errors(tmp_path)
    restart = attempt(tmp_path, "launch-2", 2, range(3, 5)).restart
    assert restart is not None
    assert (restart.cause, restart.detail) == ("worker_exit",
                                               "rank 1 exited with code -9 (signal SIGKILL)")


def test_an_elastic_resize_in_the_same_launch_is_named(tmp_path: Path) -> None:
    attempt(tmp_path, "launch-1", None, range(1, 4))  # 2 ranks
    grown = Restarts.begin(tmp_path, True, "launch-1", 3, ["127.0.0.1"] * 3, _nothing_lost)
    grown.close()
    assert grown.restart is not None and (grown.restart.cause, grown.restart.detail) == (
        "resize", "the group was resized from 2 to 3 workers")


def test_a_controller_failure_the_driver_survived_is_named(tmp_path: Path) -> None:
    """Ray Train's controller failed on the store; the driver fitted again, same launch."""
    attempt(tmp_path, "launch-1", None, range(1, 4))
    record_worker_error(tmp_path, 0, RuntimeError("[gloo] Connection closed by peer"))
    record_controller_error(tmp_path, "OSError: AWS Error NETWORK_CONNECTION")
    restart = attempt(tmp_path, "launch-1", 3, range(4, 5)).restart
    assert restart is not None and (restart.cause, restart.detail) == (
        "controller_error", "Ray Train's controller failed: OSError: AWS Error NETWORK_CONNECTION")


def test_a_lost_node_and_a_new_launch_are_named(tmp_path: Path) -> None:
    attempt(tmp_path, "launch-1", None, range(1, 4))
    lost = attempt(tmp_path, "launch-1", 2, range(3, 6), lost=["127.0.0.2"]).restart
    assert lost is not None and (lost.cause, lost.detail) == ("node_lost",
                                                              "node 127.0.0.2 was lost")
    # the driver killed: the job is submitted again under a new launch, no error anywhere
    relaunched = attempt(tmp_path, "launch-2", 4, range(5, 7))
    assert relaunched.restart is not None and relaunched.restart.cause == "relaunch"
    # the run's totals, every attempt before this one counted
    assert relaunched.metrics()["memtrain_train_restarts_total"] == {"node_lost": 1,
                                                                     "relaunch": 1}
    assert relaunched.attempt == 3


def test_an_attempt_killed_before_its_first_step_dates_the_failure_from_its_start(
        tmp_path: Path) -> None:
    attempt(tmp_path, "launch-1", None, range(1, 5))
    attempt(tmp_path, "launch-1", 2, range(0))  # restarted, then killed while restoring
    third = attempt(tmp_path, "launch-1", 2, range(3, 4))
    assert third.restart is not None
    assert (third.restart.last_step, third.restart.steps_redone) == (2, 0)
    assert third.metrics()["memtrain_train_restarts_total"] == {"worker_exit": 2}


def test_other_ranks_keep_no_records(tmp_path: Path) -> None:
    other = Restarts.begin(tmp_path, False, "launch-1", None, NODES, _nothing_lost)
    other.step_done(1)
    other.finish(1)
    assert other.metrics() == {} and not (tmp_path / ATTEMPTS).exists()


def test_the_restart_counter_is_published_by_cause() -> None:
    labels = {"run": "r", "rank": "0", "local_rank": "0", "node": "n", "device": "cpu",
              "gpu_uuid": "", "hostname": "h"}
    sink = PrometheusSink(labels, CollectorRegistry())
    sink.set({"memtrain_train_restarts_total": {"node_lost": 1, "worker_exit": 2},
              "memtrain_train_recovery_seconds_total": 12.5})
    sink.set({"memtrain_train_restarts_total": {"node_lost": 2, "worker_exit": 2}})

    def value(name: str, **extra: str) -> float | None:
        return sink.registry.get_sample_value(name, {**labels, **extra})

    assert value("ray_memtrain_train_restarts_total", cause="node_lost") == 2
    assert value("ray_memtrain_train_restarts_total", cause="worker_exit") == 2
    assert value("ray_memtrain_train_recovery_seconds_total") == 12.5
    with pytest.raises(ValueError, match="takes the extra labels"):
        sink.set_total("memtrain_train_restarts_total", 1)


def test_a_held_step_waits_for_its_release_once(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``hold@STEP``: rank 0 waits at the step's end until the release file appears, once per
    run directory; another rank, or another step, does not wait."""
    import threading

    from trainer import faults

    monkeypatch.setenv(faults.ENV, "hold@3:0")
    start = time.monotonic()
    faults.at_step_end(tmp_path, 3, 1)
    faults.at_step_end(tmp_path, 2, 0)
    assert time.monotonic() - start < 1.0
    threading.Timer(1.0, (tmp_path / faults.RELEASE_FILE).touch).start()
    faults.at_step_end(tmp_path, 3, 0)
    held = time.monotonic() - start
    assert 1.0 <= held < 10.0
    faults.at_step_end(tmp_path, 3, 0)  # once per run directory: a restart passes it
    assert time.monotonic() - start - held < 1.0
