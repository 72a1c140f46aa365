"""Two Ray nodes on loopback, 2 workers each, and one node lost mid-run: the scenario of
``test_multinode.py``, run in a fresh interpreter so its cluster never meets the test session's.

``python -m tests.distributed.multinode CORPUS_DIR WORK_DIR PROMETHEUS``: starts a head node on
127.0.0.1 and a worker node on 127.0.0.2 (``ray.cluster_utils.Cluster``, every port chosen here,
so it coexists with the session's cluster; token authentication on, and a driver with another
token refused), trains the tiny config on 4 workers through
memtrain's Ray launcher, scrapes both nodes' metrics endpoints while it runs (and a real
Prometheus scrapes every node's), SIGKILLs the worker node (its raylet and its workers) one step
past a checkpoint, adds a replacement node on 127.0.0.3, runs every dashboard panel that selects
by node for each node after training, lists every listening socket of the cluster's processes,
then trains an elastic group of [2, 4] workers on the head and the replacement node and kills
the replacement (none joins: the group goes on with 2), and writes what it saw to
``WORK_DIR/result.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

NODES = ("127.0.0.1", "127.0.0.2")
REPLACEMENT = "127.0.0.3"
# Global batch 24 of micro-batches of 2 on 4 workers: 3 micro-batches per step. OOM recovery on
# (the default on CUDA) makes memtrain reduce gradients in its own fixed buckets: DDP's own
# reduction rebuilds its buckets after a process group's first step, so with more than two ranks
# a resumed group's first step would sum in another order (differences of an ulp).
SETTINGS = ("run.name=multinode", "parallel.workers=4", "parallel.max_failures=1",
            "train.steps=8", "train.checkpoint_every=4", "train.global_batch_size=24",
            "train.micro_batch_size=2", "train.eval_every=0", "train.log_every=1",
            "memory.oom_recovery=true", "data.record_rows=true")


# Worker processes listen on ports of their node's range; the session's cluster uses Ray's
# default range (10002-19999), so each node here gets its own range above it.
WORKER_PORTS = {NODES[0]: 20000, NODES[1]: 20500, REPLACEMENT: 21000}


def prepare_environment() -> str:
    """This process's environment for its cluster, before ray is imported (Ray reads it then
    and when each node starts); returns the cluster's own temporary directory. Only the
    scenario's process: the tests import this module for its constants."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # Token authentication on, with a token of this cluster's own, as KubeRay configures it
    # (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN on every node): every node started here, the driver
    # and the replacement node read it from this environment.
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    # Its own temporary directory (short: unix socket paths live there): Ray writes the
    # session_latest link there, which the session's cluster and its jobs read in /tmp/ray.
    temp_dir = tempfile.mkdtemp(prefix="mtray-", dir="/tmp")
    # ray.cluster_utils.Cluster also records its address as the machine's current cluster in
    # the default temporary directory (<RAY_TMPDIR>/ray/ray_current_cluster), where a job
    # supervisor of the session's cluster, or a ray.init() starting one, would read it.
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"))
    return temp_dir


def node_args(ip: str, temp_dir: str) -> dict:
    from trainer.launch.local import free_port

    return {"num_cpus": 2, "node_ip_address": ip, "include_dashboard": False,
            "temp_dir": temp_dir,
            "metrics_export_port": free_port(), "dashboard_agent_listen_port": free_port(),
            "runtime_env_agent_port": free_port(), "metrics_agent_port": free_port(),
            "min_worker_port": WORKER_PORTS[ip], "max_worker_port": WORKER_PORTS[ip] + 499}


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return ""


def start_prometheus(binary: str, work: Path, targets: list[int]) -> tuple[subprocess.Popen, int]:
    """Prometheus on 127.0.0.1 scraping the nodes' metrics endpoints every second."""
    from trainer.launch.local import free_port

    port = free_port()
    listed = ", ".join(f"'127.0.0.1:{p}'" for p in targets)
    config = work / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: ray\n"
                      f"    static_configs: [{{targets: [{listed}]}}]\n")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, port


def query(port: int, promql: str, at: float) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(
        {"query": promql, "time": at})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["data"]["result"]


def per_node_panels(port: int, nodes: dict[str, str], at: float) -> dict[str, list[str]]:
    """For each node, the dashboard panels that select ``node`` (CUDA's aside) and returned
    nothing with that node chosen, queried at ``at`` (while every node was up: a killed node's
    series are stale afterwards, as Prometheus marks a target that stops answering)."""
    from monitoring.dashboards import CUDA_PANELS, DASHBOARDS, render
    from tests.conftest import panel_queries

    empty: dict[str, list[str]] = {}
    for ip, node in nodes.items():
        empty[ip] = [f"{name}: {title}" for name in DASHBOARDS
                     for title, expr in panel_queries(render(name))
                     if "$node" in expr and title not in CUDA_PANELS and not query(
                         port, expr.replace("$run", "multinode").replace("$rank", ".*")
                         .replace("$node", node).replace("$__rate_interval", "1m"), at)]
    return empty


def wait_for_no_process(name: str, timeout: float) -> None:
    """Until no descendant of this process is called ``name`` (at most ``timeout`` s)."""
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        names = []
        for process in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                names.append(process.name())
        if name not in names:
            return
        time.sleep(0.25)


def listening_sockets() -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket in LISTEN state owned by this process
    or its descendants: the cluster's GCS, raylets, agents and workers."""
    import psutil

    me = psutil.Process()
    found = []
    for process in [me, *me.children(recursive=True)]:
        try:
            found += [(process.name(), c.laddr.ip, c.laddr.port)
                      for c in process.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def connect_with_another_token(address: str, log: Path) -> subprocess.Popen:
    """A driver with the wrong token joining the cluster: Ray's GCS refuses it (after its
    connection retries, about 20 s: it runs beside the training)."""
    return subprocess.Popen([sys.executable, "-c", f"import ray; ray.init(address={address!r})"],
                            env={**os.environ, "RAY_AUTH_TOKEN": "not-the-clusters-token"},
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))


def start_training(ray_launch: Any, cfg: Any, run_dir: Path, address: str,
                   into: dict) -> threading.Thread:
    """``launch_ray`` on a thread (Ray starts a node, the replacement, from the main thread
    only); its summary, or its error, goes into ``into``."""
    def train() -> None:
        try:
            into["summary"] = ray_launch.launch_ray(cfg, run_dir, address=address)
        except BaseException as err:  # reported in result.json
            into["error"] = f"{type(err).__name__}: {err}"

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    return trainer


def wait_past_step(trainer: threading.Thread, run_dir: Path, step: int) -> None:
    """Until rank 0 has logged ``step`` (the stall fault holds it there, the other ranks wait in
    the next all-reduce), then a random moment more: a kill not right after a checkpoint."""
    log = run_dir / "metrics" / "rank-0.jsonl"
    while trainer.is_alive() and not (log.exists() and f'"step": {step},' in log.read_text()):
        time.sleep(0.1)
    time.sleep(random.uniform(0.5, 2.0))


# The elastic run: workers [2, 4] over the head and the replacement node; the replacement is
# killed one step past the step-4 checkpoint and none joins, so the group restarts at 2.
ELASTIC_SETTINGS = (*(s for s in SETTINGS if not s.startswith(("run.name", "parallel.workers"))),
                    "run.name=elastic", "parallel.workers=[2, 4]")


def shrink(cluster: Any, node: Any, ray_launch: Any, corpus_dir: Path, work: Path) -> dict:
    """Train ``ELASTIC_SETTINGS`` on the cluster, kill ``node`` once step 5 is logged (rank 0
    stalled there), add nothing; returns the run's summary (or its error) and run directory.

    Ray Train first retries the group at its old size until its worker-group start timeout
    (60 s by default, 10 s here), then starts it with what the cluster holds."""
    from tests.conftest import tiny_config
    from trainer.launch.prepare import prepare_run

    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "10"  # read by this run's controller
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, work, *ELASTIC_SETTINGS))
    outcome: dict = {"run_dir": str(run_dir)}
    trainer = start_training(ray_launch, cfg, run_dir, cluster.address, outcome)
    wait_past_step(trainer, run_dir, 5)
    if trainer.is_alive():
        cluster.remove_node(node, allow_graceful=False)
        outcome["killed"] = True
    trainer.join(timeout=300)
    return outcome


def main(corpus_dir: Path, work: Path, prometheus_binary: str) -> None:
    temp_dir = prepare_environment()
    from ray.cluster_utils import Cluster

    from tests.conftest import tiny_config
    from trainer.launch import ray as ray_launch
    from trainer.launch.prepare import prepare_run

    ray = ray_launch.ray
    head_args, worker_args, spare_args = (node_args(ip, temp_dir)
                                          for ip in (*NODES, REPLACEMENT))
    prometheus, prometheus_port = start_prometheus(prometheus_binary, work, [
        args["metrics_export_port"] for args in (head_args, worker_args, spare_args)])
    # A dead node is declared after 3 missed 0.5 s health checks (Ray's default: about 15 s).
    # (With no replacement, a fixed-size group would wait for one; an elastic one restarts
    # smaller after Train's worker-group start timeout: ``shrink`` below.)
    cluster = Cluster(initialize_head=True, head_node_args={**head_args, "_system_config": {
        "metrics_report_interval_ms": 1000, "health_check_period_ms": 500,
        "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}})
    worker_node = cluster.add_node(**worker_args)
    ray.init(address=cluster.address)
    intruder = connect_with_another_token(cluster.address, work / "wrong-token.log")
    result: dict = {"nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
                    "address": cluster.address,
                    "node_ids": {NODES[0]: cluster.head_node.node_id[:12],
                                 NODES[1]: worker_node.node_id[:12]}}
    os.environ["RAY_ADDRESS"] = cluster.address  # the driver joins; CPUs are the cluster's
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, work, *SETTINGS))
    ports = {NODES[0]: head_args["metrics_export_port"],
             NODES[1]: worker_args["metrics_export_port"]}
    scrapes: dict[str, str] = {}
    os.environ["MEMTRAIN_FAULTS"] = "stall@5:0"  # the launcher hands it to the workers

    started = time.time()
    trainer = start_training(ray_launch, cfg, run_dir, cluster.address, result)
    replacement = None
    try:
        # Scrape both nodes until each shows its two ranks' token counters.
        while trainer.is_alive() and len(scrapes) < 2:
            for ip, port in ports.items():
                text = scrape(port)
                if len(re.findall(r'ray_memtrain_train_tokens_total\{[^}]*run="multinode"',
                                  text)) >= 2:
                    scrapes[ip] = text
            time.sleep(0.5)
        # Once step 5 is logged (rank 0 is held there by the stall fault, the others wait in
        # the next all-reduce), a random moment later: kill the worker node, one step past the
        # checkpoint of step 4, and add a replacement.
        killed_at = time.time()  # (when training ended before the kill: panels as they are)
        wait_past_step(trainer, run_dir, 5)
        # Within the stall (6 s), until Prometheus holds two samples of each node's checkpoint
        # counter: its series first appears at the step-4 checkpoint (Ray exports a counter from
        # its first increment), and the checkpoint-time panel's increase() needs two.
        deadline = time.time() + 2.5
        while time.time() < deadline and len(query(prometheus_port, (
                'min by (node) (count_over_time(ray_memtrain_checkpoint_seconds_total'
                '{run="multinode"}[1m])) >= 2'), time.time())) < 2:
            time.sleep(0.25)
        if trainer.is_alive():
            result["killed_after_checkpoints"] = sorted(
                p.name for p in run_dir.glob("checkpoint-*"))
            killed_at = time.time()
            cluster.remove_node(worker_node, allow_graceful=False)  # SIGKILL raylet + workers
            replacement = cluster.add_node(**spare_args)
            result["node_ids"][REPLACEMENT] = replacement.node_id[:12]
        trainer.join(timeout=400)
        nodes = {ip: result["node_ids"][ip] for ip in NODES}
        result["node_variable"] = sorted(r["metric"]["node"] for r in query(
            prometheus_port, 'count by (node) (ray_memtrain_train_tokens_total{run="multinode"})',
            killed_at))
        result["empty_panels"] = per_node_panels(prometheus_port, nodes, killed_at)
        # After training: its process groups (torch's rendezvous store, the documented
        # exception in docs/architecture.md) are gone once Ray has ended the group's worker
        # processes (seen: one still listening just after the run returned); the three nodes
        # are still up.
        wait_for_no_process("ray::RayTrainWo", timeout=30)  # (15 characters: the kernel's)
        result["listening"] = listening_sockets()
        result["wrong_token"] = {"returncode": intruder.wait(timeout=120),
                                 "stderr": (work / "wrong-token.log").read_text()[-3000:]}
        if replacement is not None:
            result["elastic"] = shrink(cluster, replacement, ray_launch, corpus_dir, work)
    finally:
        result["seconds"] = time.time() - started
        result["scrapes"] = scrapes
        result["ports"] = ports
        (work / "result.json").write_text(json.dumps(result))
        prometheus.terminate()
        prometheus.wait(timeout=30)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
