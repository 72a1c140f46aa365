"""The chaos campaign's slice in the suite: one seed, one fault of each of the three kinds no
other test makes (the object store failing an upload, a checkpoint write failing, the upload
race, whose driver kill and relaunch stand for ``driver_kill``), the same invariants as
``make chaos`` (``tests/chaos/campaign.py``). A killed worker is ``test_ray_train``'s, a killed
node ``test_multinode``'s; ``make chaos`` draws every kind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# Its cluster uses the multi-node test's addresses and worker port ranges: never beside it.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("multinode")]
KINDS = "store_upload,checkpoint_fail,upload_race"


def test_a_short_campaign_loses_nothing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.chaos.campaign", "--seed", "1",
                           "--faults", "3", "--kinds", KINDS, "--no-elastic", "--out",
                           str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    result_file = tmp_path / "chaos-1.json"
    assert result_file.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(result_file.read_text())
    assert result["weights_exact"]
    assert result["rows"]["lost"] == 0 and result["rows"]["duplicated"] == 0
    assert result["rows"]["steps_recorded"] == result["steps"]
    assert result["checkpoints"]["resumed_from_unpublished"] == []
    assert result["faults"]["injected"] == 3 and result["faults"]["survived"] == 3
    # the partial checkpoint the race left (meta.json landed, a shard held back) was not listed
    [race] = result["races"]
    assert race["shard_held"] and not race["listed_whole"] and result["races_skipped"]
    restarts = result["restarts"]
    # Each fault that restarted the run is a counted restart, and at least two of the three
    # do: the failed checkpoint write may come while the fault before it recovers, its
    # restart then that fault's (the campaign expects none of it). The upload race's killed
    # driver is a relaunch.
    restarted = sum(event["restarted"] for event in result["events"])
    assert restarts["total"] >= restarted >= 2
    assert restarts["by_cause"].get("relaunch", 0) >= 1
    assert restarts["by_cause"].get("worker_error", 0) >= 1  # the failed checkpoint write
    assert restarts["summary_agrees"] and restarts["lines"] >= restarts["total"]
    assert done.returncode == 0 and result["passed"], done.stdout[-3000:]
