"""Where an elastic Ray Train group starts, and how soon it grows, after a driver was killed.

``python -m bench.elastic_start [--tries 10] [--out bench/results]`` (``make bench-elastic``).

A two-node loopback cluster as the chaos campaign's (head 127.0.0.1, a worker node on
127.0.0.2, one CPU each, token authentication on). Each try:

1. a fixed 2-worker run trains a step, then its driver is SIGKILLed (a lost driver machine,
   ``kill -9``): Ray Train's controller dies without cancelling its resource request in the
   cluster's AutoscalingCoordinator (Ray 2.60 keeps it 180 s);
2. at once an elastic run (``parallel.workers: [1, 2]``) starts, either as **another run**
   (nothing releases the dead run's request) or as **the same run** again (memtrain's driver
   releases its predecessor's request first, ``trainer.launch.ray.release_orphaned_request``):
   its start size and the seconds to its first step;
3. as the same run, the worker node removed (the group shrinks to one) and a node added: the
   seconds until the group restarts at two.

Between tries every request is released and the worker node is back, so the tries are alike.
Writes ``OUT/elastic-start-<date>-<host>.json`` and prints the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.results import write_json

REPO = Path(__file__).resolve().parents[1]
LIMIT = 180.0  # seconds a start, a shrink or a growth may take before it counts as not seen


class Cluster:
    """The two-node loopback cluster and the drivers run on it."""

    def __init__(self, work: Path, corpus: Path):
        from tests.distributed.multinode import prepare_environment

        self.work, self.corpus = work, corpus
        self.temp_dir = prepare_environment()
        from ray.cluster_utils import Cluster as RayCluster

        from trainer.launch import ray as ray_launch

        self.ray = ray_launch.ray
        self.cluster = RayCluster(initialize_head=True,
                                  head_node_args=self._node_args("127.0.0.1"))
        self.node = self.cluster.add_node(**self._node_args("127.0.0.2"))
        self.ray.init(address=self.cluster.address)

    def _node_args(self, ip: str) -> dict[str, Any]:
        from tests.distributed.multinode import node_args

        return {**node_args(ip, self.temp_dir), "num_cpus": 1}

    def driver(self, run: str, *extra: str) -> subprocess.Popen:
        from tests.conftest import set_args, tiny_overrides

        overrides = tiny_overrides(self.corpus, self.work, f"run.name={run}",
                                   # never ends on its own: every driver is killed
                                   "parallel.launcher=ray", "train.steps=100000",
                                   "train.checkpoint_every=0", "train.eval_every=0",
                                   "train.log_every=1", *extra)
        env = {**os.environ, "RAY_ADDRESS": self.cluster.address, "OMP_NUM_THREADS": "1",
               # a lost node's group restarts smaller after 10 s (Ray's default: 60 s)
               "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}
        log = (self.work / f"{run}.log").open("a")
        return subprocess.Popen([sys.executable, "-m", "trainer.cli", "train", "-c",
                                 str(REPO / "configs" / "demo-cpu.yaml"), *set_args(overrides)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def attempts(self, run: str) -> list[dict[str, Any]]:
        path = self.work / run / "attempts.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        return [json.loads(line) for line in lines if line.strip() and "start" in line]

    def stepped(self, run: str, after: int = 0) -> bool:
        """Whether an attempt numbered above ``after`` has finished a step."""
        path = self.work / run / "progress"
        text = path.read_text().strip() if path.is_file() else ""
        record = json.loads(text) if text else {}
        return record.get("attempt", 0) > after and record.get("step", 0) >= 1

    def kill(self, driver: subprocess.Popen) -> None:
        """SIGKILL a driver's process group, and wait for Ray to end its job's workers and
        controller (processes of this one's cluster: its descendants)."""
        import psutil

        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()

        def train_processes() -> list[Any]:
            found = []
            for process in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    if process.name().startswith(("ray::RayTrainWo", "ray::TrainContr")):
                        found.append(process)
            return found

        wait(lambda: not train_processes(), 60)



def wait(until: Any, limit: float = LIMIT) -> float | None:
    """Seconds until ``until()`` holds, or None after ``limit``."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if until():
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def one_try(cluster: Cluster, index: int, same_run: bool) -> dict[str, Any]:
    """A killed fixed run, then an elastic run (see the module docstring)."""
    from trainer.launch.ray import release_orphaned_request

    fixed = f"try{index}-{'same' if same_run else 'other'}"
    elastic = fixed if same_run else f"{fixed}-elastic"
    driver = cluster.driver(fixed, "parallel.workers=2")
    wait(lambda: cluster.stepped(fixed))
    cluster.kill(driver)
    started = time.monotonic()
    before = len(cluster.attempts(elastic))  # the same run: the killed driver's attempt

    def attempts() -> list[dict[str, Any]]:
        return cluster.attempts(elastic)[before:]

    driver = cluster.driver(elastic, "parallel.workers=[1, 2]",
                            "parallel.resize_check_seconds=5")
    first_step = wait(lambda: cluster.stepped(elastic, before) and bool(attempts()))
    sizes = [a.get("world_size") for a in attempts()]
    result = {"same_run": same_run, "start_size": sizes[0] if sizes else None,
              "seconds_to_first_step": first_step, "shrink_seconds": None, "grow_seconds": None}
    if same_run and sizes and sizes[0] == 2:  # growth: from one worker back to two
        gone = cluster.node
        cluster.cluster.remove_node(gone, allow_graceful=False)
        result["shrink_seconds"] = wait(lambda: len(attempts()) >= 2)
        cluster.node = cluster.cluster.add_node(**cluster._node_args(
            "127.0.0.3" if gone.node_ip_address == "127.0.0.2" else "127.0.0.2"))
        result["grow_seconds"] = wait(
            lambda: any(a.get("world_size") == 2 for a in attempts()[2:]))
    cluster.kill(driver)
    for run in {fixed, elastic}:  # no request of this try outlives it
        release_orphaned_request(cluster.work / run)
    result["seconds"] = time.monotonic() - started
    return result


def summarise(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: the start sizes seen, and the median and largest seconds."""
    summary: dict[str, Any] = {}
    for same in (True, False):
        runs = [t for t in tries if t["same_run"] is same]
        if not runs:
            continue

        def seconds(key: str, runs: list = runs) -> dict[str, float | None]:
            seen = [t[key] for t in runs if t[key] is not None]
            return {"median": statistics.median(seen) if seen else None,
                    "max": max(seen) if seen else None, "not_seen": len(runs) - len(seen)}

        summary["same run (released)" if same else "another run (request stands)"] = {
            "tries": len(runs), "start_sizes": [t["start_size"] for t in runs],
            "first_step": seconds("seconds_to_first_step"), "grow": seconds("grow_seconds")}
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=10, help="Tries as the same run.")
    parser.add_argument("--other-tries", type=int, default=2,
                        help="Tries as another run (each may wait for Ray's 180 s expiry).")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    from datapipe.corpus import build_stdlib_corpus
    from tests.conftest import SEQ_LEN

    work = Path(tempfile.mkdtemp(prefix="memtrain-elastic-"))
    build_stdlib_corpus(work / "corpus", seq_len=SEQ_LEN, max_bytes=400_000,
                        rows_per_shard=1000)
    cluster = Cluster(work, work / "corpus")
    tries = []
    try:
        for index in range(args.tries + args.other_tries):
            tries.append(one_try(cluster, index, same_run=index < args.tries))
            print(json.dumps(tries[-1]), flush=True)
    finally:
        cluster.ray.shutdown()
        cluster.cluster.shutdown()
    result = {"command": "make bench-elastic", "summary": summarise(tries), "tries": tries}
    path = write_json(args.out, "elastic-start", result)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
