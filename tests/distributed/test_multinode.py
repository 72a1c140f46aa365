"""Two Ray nodes on their own loopback addresses, 2 workers each, and the worker node killed
one step past a checkpoint; a replacement node joins and the run ends bit-exact.

The cluster runs in a subprocess (``tests/distributed/multinode.py``) with every port and its
temporary directory its own, so it never meets the session's single-node cluster. Nodes at
distinct addresses (127.0.0.1, 127.0.0.2, then 127.0.0.3) are what make Ray Train see two
nodes: nodes that all share 127.0.0.1 are reported as one node (every worker node rank 0).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, prepared_local_run, require_tool, tiny_config
from tests.distributed.multinode import NODES, REPLACEMENT, SETTINGS
from tests.distributed.rows import recorded_rows, rows_trained, stored_fingerprints

# Its own xdist group, so it runs beside the session cluster's tests: its cluster has its own
# ports, temporary directory and "current cluster" record (multinode.py), and the session
# cluster records its own address for its job supervisor (tests/conftest.py's ray_cluster).
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("multinode")]


def _series(text: str, name: str, run: str) -> list[dict[str, str]]:
    """The label sets of ``name``'s series of ``run`` in a scrape."""
    found = []
    for labels in re.findall(rf"^{name}\{{([^}}]*)\}}", text, re.MULTILINE):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if pairs.get("run") == run:
            found.append(pairs)
    return found


@pytest.fixture(scope="module")
def scenario(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("multinode")
    prometheus = require_tool("prometheus", " (Debian's prometheus package; `make test` "
                              "installs it)")
    done = subprocess.run([sys.executable, "-m", "tests.distributed.multinode", str(corpus_dir),
                           str(work), prometheus], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert (work / "result.json").exists(), done.stderr[-3000:]
    result = json.loads((work / "result.json").read_text())
    assert done.returncode == 0 and "error" not in result, (result.get("error"),
                                                            done.stderr[-3000:])
    result["run_dir"] = str(work / "multinode")
    return result


def test_workers_spread_over_two_loopback_nodes_and_each_node_exports_its_own(
        scenario: dict) -> None:
    assert scenario["nodes"] == sorted(NODES)  # every node, and the GCS, on loopback
    assert scenario["address"].startswith("127.0.0.1:")
    ranks: dict[str, str] = {}
    for ip in NODES:
        # Each node's own metrics endpoint carries the ranks that run there, labelled with that
        # node: Ray Train gave each node local ranks 0 and 1.
        series = _series(scenario["scrapes"][ip], "ray_memtrain_train_tokens_total", "multinode")
        assert {s["node"] for s in series} == {scenario["node_ids"][ip]}, ip
        assert sorted(s["local_rank"] for s in series) == ["0", "1"], ip
        ranks.update({s["rank"]: ip for s in series})
    assert sorted(ranks) == ["0", "1", "2", "3"]  # world ranks across the two nodes


def test_a_prometheus_scraping_every_node_fills_each_nodes_dashboard_panels(
        scenario: dict) -> None:
    """Prometheus scraped each node's own endpoint: the dashboards' node variable lists both
    nodes, and every panel that selects by node (CUDA's aside) returns data for each, queried
    while both were up."""
    assert scenario["node_variable"] == sorted(scenario["node_ids"][ip] for ip in NODES)
    assert scenario["empty_panels"] == {ip: [] for ip in NODES}


def test_no_socket_listens_beyond_loopback_but_rays_own_on_the_other_nodes(
        scenario: dict) -> None:
    """Every listening socket of the nodes' processes (GCS, raylets, agents, workers) is on a
    loopback address, with one exception, Ray's and not memtrain's: on a node whose address is
    not 127.0.0.1, Ray 2.60's raylet and dashboard agent bind every interface (:: or 0.0.0.0),
    and nothing in Ray's options narrows them (docs/deploy.md: a multi-node cluster needs a
    firewall or NetworkPolicy in front of its nodes). Nothing else binds beyond loopback."""
    listening = [tuple(entry) for entry in scenario["listening"]]
    names = {name for name, _, _ in listening}
    assert {"gcs_server", "raylet"} <= names, names
    loopback = {*NODES, REPLACEMENT} | {f"::ffff:{ip}" for ip in (*NODES, REPLACEMENT)}
    wildcard = {"::", "0.0.0.0"}
    assert [entry for entry in listening if entry[1] not in loopback | wildcard] == []
    exposed = {name for name, ip, _ in listening if ip in wildcard}
    assert exposed <= {"raylet", "ray::DashboardAgent"}, exposed
    head = {name for name, ip, _ in listening if ip.removeprefix("::ffff:") == NODES[0]}
    assert {"gcs_server", "raylet"} <= head  # the head's own on 127.0.0.1


def test_the_cluster_runs_with_token_auth_and_refuses_another_token(scenario: dict) -> None:
    """Every node, the driver, Ray Train's workers and the replacement node ran with the
    cluster's token (the run finished on them); a driver with another token was refused by the
    GCS, naming the token as the reason."""
    assert scenario["summary"]["final_step"] == 8
    refused = scenario["wrong_token"]
    assert refused["returncode"] != 0
    assert "InvalidAuthToken: Authentication token is missing or incorrect" in refused["stderr"]


def test_a_killed_node_is_replaced_and_the_run_ends_bit_exact(
        scenario: dict, corpus_dir: Path, tmp_path: Path) -> None:
    """The worker node died one step past the step-4 checkpoint; Ray Train restarted the group
    of 4 on the head and the replacement node, it resumed from step 4, the final weights equal
    an uninterrupted 4-process run's under the local launcher, bit for bit, and every row was
    trained on once."""
    from trainer.launch.local import launch_local

    summary = scenario["summary"]
    assert scenario["killed_after_checkpoints"] == ["checkpoint-00000004"]
    assert REPLACEMENT in scenario["node_ids"]
    assert (summary["workers"], summary["resumed_from_step"], summary["final_step"]) == (4, 4, 8)
    assert summary["accumulation_steps"] == 3  # global batch 24 = 2 x 3 x 4

    cfg, run_dir = prepared_local_run(tiny_config(corpus_dir, tmp_path, *SETTINGS,
                                                  "parallel.launcher=local",
                                                  "parallel.workers=2"), 4)
    launch_local(cfg, run_dir)
    from trainer.checkpoint.files import read_model_weights

    ray_weights = read_model_weights(Path(scenario["run_dir"]) / "checkpoint-00000008")
    local_weights = read_model_weights(run_dir / "checkpoint-00000008")
    assert ray_weights.keys() == local_weights.keys()
    different = [k for k in ray_weights if not torch.equal(ray_weights[k], local_weights[k])]
    assert not different, different

    # The rows each rank recorded training on (data.record_rows; steps 5-8 again after the
    # restart, whose records are the ones kept): 24 a step, and exactly the rows the split
    # plans for 4 ranks reading 8 x 3 micro-batches of 2, none twice.
    recorded = recorded_rows(Path(scenario["run_dir"]))
    assert sorted(recorded) == list(range(1, 9))
    assert all(len(rows) == 24 for rows in recorded.values())
    ray_state = Path(scenario["run_dir"]) / "checkpoint-00000008" / "state.pt"
    loader = torch.load(ray_state, weights_only=True)["loader"]
    planned = rows_trained(corpus_dir / "train", [(4, 2, 24)], loader["seed"],
                           loader["shuffle_window"])
    assert len(set(planned)) == 8 * 24
    assert Counter(row for rows in recorded.values() for row in rows) == \
        Counter(stored_fingerprints(corpus_dir / "train", planned))


def test_an_elastic_group_that_loses_a_node_goes_on_smaller_and_trains_every_row_once(
        scenario: dict, corpus_dir: Path) -> None:
    """Workers [2, 4] (Train V2's ``ScalingConfig(num_workers=(2, 4))``) on the head and the
    replacement node; the replacement killed one step past the step-4 checkpoint and none
    joining: Ray Train restarted the group with the 2 workers the head holds, the loop resumed
    from step 4 with twice the accumulation steps (the global batch of 24 kept) and went on to
    step 8, and the rows the ranks recorded training on are the split's plan for 4 ranks, then
    2 reading the rest of the epoch, none twice."""
    elastic = scenario["elastic"]
    assert elastic.get("killed") and "error" not in elastic, elastic.get("error")
    summary = elastic["summary"]
    assert (summary["workers"], summary["accumulation_steps"]) == (2, 6)
    assert (summary["resumed_from_step"], summary["final_step"]) == (4, 8)
    run_dir = Path(elastic["run_dir"])
    loader = torch.load(run_dir / "checkpoint-00000008" / "state.pt", weights_only=True)["loader"]
    assert loader["segments"] == [[4, 2, 12]]  # 4 ranks read 12 micro-batches each, then 2
    recorded = recorded_rows(run_dir)
    assert sorted(recorded) == list(range(1, 9))
    assert all(len(rows) == 24 for rows in recorded.values())
    planned = rows_trained(corpus_dir / "train", [(4, 2, 12), (2, 2, 24)], loader["seed"],
                           loader["shuffle_window"])
    assert len(set(planned)) == 8 * 24
    assert Counter(row for rows in recorded.values() for row in rows) == \
        Counter(stored_fingerprints(corpus_dir / "train", planned))
