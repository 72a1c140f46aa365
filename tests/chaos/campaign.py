"""A seeded chaos campaign: one long memtrain run on a two-node loopback Ray cluster, its run
directory on an S3-compatible server, and a schedule of faults at random moments.

``python -m tests.chaos.campaign --seed N [--faults K] [--out DIR]`` (``make chaos SEED=N``).
The seed is printed first; the same seed draws the same schedule (the moments within a step
depend on the machine's speed, the kinds, steps and order do not).

The cluster: a head on 127.0.0.1 and a worker node on 127.0.0.2, one CPU each, token
authentication on; memtrain trains 2 workers (one per node) through its Ray launcher, driven by
``memtrain train`` in a subprocess (so the driver can be killed), with ``run.dir`` on moto's S3
server behind a fault proxy (``tests/chaos/proxy.py``) and the working copy on a small tmpfs of
its own (so its disk can fill). The faults, each drawn at a step of the run:

- ``worker_kill``: a Ray Train worker process SIGKILLed;
- ``node_replace``: the worker node removed without grace (raylet and workers SIGKILLed) and a
  replacement started on the other free address (127.0.0.3, then 127.0.0.2 again);
- ``checkpoint_fail``: a checkpoint write fails on every rank (``MEMTRAIN_FAULTS``);
- ``store_upload``: the object store fails (connections reset) as a checkpoint is uploaded;
- ``store_restore``: a worker killed and the store failing while the restart restores;
- ``store_slow``: the store answers every chunk 0.2 s late for a few seconds;
- ``driver_kill``: the driver SIGKILLed (Ray ends the job's workers), then the same command run
  again, with the same run name;
- ``disk_full``: the working copy's disk filled for a few seconds;
- ``upload_race``: the store holds back one rank's DCP shard of the next checkpoint while the
  rest of it, ``meta.json`` included, lands; the driver is killed at that moment (the
  checkpoint stays partial on the store), then run again. memtrain's store listing must skip
  it, and no attempt may resume from it.

Checked after the run, each a line of the result: the final weights bit-exact against an
uninterrupted run of the same config (the local launcher, 2 processes: the world size never
changes here); every row of the epoch trained once (``data.record_rows``); every checkpoint the
store published readable, and every attempt resumed from one of them; a restart counted (by
cause, in the summary and ``attempts.jsonl``) and a ``restarted after ...`` line in the driver's
output for every restart. Figures: the faults by kind, restarts, recovery time p50 and max,
steps redone, rows lost or duplicated, wall time; written to ``OUT/chaos-SEED.json``.

Then an elastic run on the same cluster (``Campaign.elastic``, left out with ``--no-elastic``):
workers [1, 2], asynchronous checkpoints (``train.checkpoint_async``), started once both nodes
are up; two OOMs recovered in-process, the worker node removed with nothing to replace it (the
group goes on with one worker), later a node added while the group is held at that step
(``hold@STEP``: it grows back to two), and a worker
killed while an asynchronous save uploads (through the store, slowed). Those change the
arithmetic, so that run is checked for every row once across its world sizes, its start at two
workers, the OOMs recovered, the shrink, the growth and the kill each a restart, and its end;
not for exact weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HEAD, SPARES = "127.0.0.1", ("127.0.0.2", "127.0.0.3")
KINDS = ("worker_kill", "node_replace", "checkpoint_fail", "store_upload", "store_restore",
         "store_slow", "driver_kill", "disk_full", "upload_race")
RESTARTING = set(KINDS) - {"store_slow"}
CHECKPOINT_EVERY = 3
RUN = "chaos"
ELASTIC_RUN = "chaos-elastic"
BUCKET = "memtrain-chaos"
# Seconds a fault may take to show and recover before the campaign calls it lost.
RECOVERY_LIMIT = 120.0
# How long the elastic run waits for Ray Train to grow the group after a node joined.
GROW_LIMIT = 90.0


def schedule(seed: int, faults: int, kinds: tuple[str, ...] = KINDS) -> list[tuple[str, int]]:
    """(kind, step) for ``faults`` faults of ``kinds``: every kind at least once (when
    ``faults`` allows), the rest drawn, in a seeded order; each 2-4 steps past the previous
    one's (the step counts from where the run is when that fault may fire: restarts go back to
    a checkpoint)."""
    rng = random.Random(seed)
    kinds = list(kinds[:faults]) + [rng.choice(kinds) for _ in range(faults - len(kinds))]
    rng.shuffle(kinds)
    planned, step = [], 1
    for kind in kinds:
        step += rng.randint(2, 4)
        if kind == "checkpoint_fail":  # at a checkpoint step
            step += -step % CHECKPOINT_EVERY
        elif kind in ("store_upload", "upload_race"):  # the step before one: the store
            step += -(step + 1) % CHECKPOINT_EVERY  # fails or holds back before it uploads
        planned.append((kind, step))
    return planned


class Campaign:
    def __init__(self, seed: int, faults: int, work: Path, corpus: Path,
                 kinds: tuple[str, ...] = KINDS):
        self.seed, self.work, self.corpus = seed, work, corpus
        self.rng = random.Random(seed + 1)
        self.plan = schedule(seed, faults, kinds)
        self.steps = self.plan[-1][1] + 2 * CHECKPOINT_EVERY
        self.copy = work / "copy"  # the working copy's disk (run.work_dir)
        self.run_name = RUN
        self.run_copy = self.copy / RUN
        self.driver: subprocess.Popen | None = None
        self.driver_log = work / "driver.log"
        self.events: list[dict[str, Any]] = []
        self.races: list[dict[str, Any]] = []  # what each upload_race found
        # step -> whether its state.pt loaded (False: not yet; Ray Train uploads a checkpoint's
        # files in no fixed order, so meta.json may come before state.pt is whole)
        self.published: dict[int, bool] = {}

    # -- the cluster, the store and the working copy's disk ------------------------------------

    def start(self) -> None:
        from tests.distributed.multinode import prepare_environment

        self.temp_dir = prepare_environment()
        os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.5"
        self._start_store()
        self._mount_copy()
        from ray.cluster_utils import Cluster

        from trainer.launch import ray as ray_launch

        self.ray = ray_launch.ray
        self.cluster = Cluster(initialize_head=True, head_node_args={
            **self._node_args(HEAD), "_system_config": {
                "health_check_period_ms": 500, "health_check_timeout_ms": 500,
                "health_check_failure_threshold": 3}})
        self.spare = list(SPARES)
        self.worker_node = self.cluster.add_node(**self._node_args(self.spare.pop(0)))
        self.ray.init(address=self.cluster.address)

    def _node_args(self, ip: str) -> dict[str, Any]:
        from tests.distributed.multinode import node_args

        return {**node_args(ip, self.temp_dir), "num_cpus": 1}

    def _start_store(self) -> None:
        from pyarrow import fs

        from tests.chaos.proxy import FaultProxy
        from tests.conftest import wait_for_http
        from trainer.launch.local import free_port

        port = free_port()
        self.moto = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H",
                                      "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_http(f"http://127.0.0.1:{port}/", "moto's S3 server")
        self.proxy = FaultProxy(port)
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{self.proxy.port}",
                          AWS_ACCESS_KEY_ID="memtrain-test", AWS_SECRET_ACCESS_KEY="memtrain-test",
                          AWS_REGION="us-east-1")
        # The campaign's own view of the store, past the proxy: what is really published.
        self.store = fs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http",
                                     access_key="memtrain-test", secret_key="memtrain-test",
                                     region="us-east-1", allow_bucket_creation=True)
        self.store.create_dir(BUCKET)

    def _mount_copy(self) -> None:
        """A 64 MiB tmpfs for the working copy (root: CI is); else a plain directory, and the
        disk_full fault is left out (said in the result)."""
        self.copy.mkdir(parents=True)
        self.mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs",
                                       str(self.copy)], capture_output=True).returncode == 0
        if not self.mounted:
            self.plan = [(k, s) for k, s in self.plan if k != "disk_full"]

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if self.driver is not None and self.driver.poll() is None:
                self.driver.kill()
        with contextlib.suppress(Exception):
            self.ray.shutdown()
        with contextlib.suppress(Exception):
            self.cluster.shutdown()
        self.proxy.close()
        self.moto.terminate()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.copy)], capture_output=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    # -- the run -------------------------------------------------------------------------------

    def overrides(self, *extra: str) -> list[str]:
        from tests.conftest import tiny_overrides

        return tiny_overrides(
            self.corpus, self.work, f"run.name={RUN}", f"run.dir=s3://{BUCKET}/runs",
            f"run.work_dir={self.copy}", "parallel.launcher=ray", "parallel.workers=2",
            "parallel.max_failures=100", f"train.steps={self.steps}",
            f"train.checkpoint_every={CHECKPOINT_EVERY}", "train.eval_every=0",
            "train.log_every=1", "data.record_rows=true", "memory.oom_recovery=true", *extra)

    def start_driver(self, *extra: str, faults: str | None = None) -> None:
        from tests.conftest import set_args

        self._driver_args = (extra, faults)
        checkpoints = faults if faults is not None else ",".join(
            f"checkpoint@{s}" for k, s in self.plan if k == "checkpoint_fail")
        # (RAY_DEDUP_LOGS off: Ray would fold similar lines of different workers into one)
        env = {**os.environ, "RAY_ADDRESS": self.cluster.address, "OMP_NUM_THREADS": "1",
               "MEMTRAIN_FAULTS": checkpoints, "RAY_DEDUP_LOGS": "0"}
        with self.driver_log.open("a") as log:
            self.driver = subprocess.Popen(
                [sys.executable, "-m", "trainer.cli", "train", "-c",
                 str(REPO / "configs" / "demo-cpu.yaml"), *set_args(self.overrides(*extra))],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)

    def progress(self) -> tuple[int, int]:
        """(attempt, step) of the run's latest finished step (0, 0 before any)."""
        try:
            record = json.loads((self.run_copy / "progress").read_text().strip() or "{}")
        except (OSError, ValueError):
            return 0, 0
        return record.get("attempt", 0), record.get("step", 0)

    def started(self) -> int:
        """How many attempts the run has started."""
        return sum(1 for a in self.attempts() if "start" in a)

    def attempts(self) -> list[dict[str, Any]]:
        try:
            lines = (self.run_copy / "attempts.jsonl").read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def watch_store(self) -> None:
        """Read every checkpoint the store shows complete (``meta.json``, and every file it
        lists there at its size), once."""
        import io

        import torch
        from pyarrow import fs

        prefix = f"{BUCKET}/runs/{RUN}"
        try:
            entries = self.store.get_file_info(fs.FileSelector(prefix))
            whole = set(self.whole_on_store())
        except (OSError, ValueError):
            return
        for entry in entries:
            name = entry.path.rsplit("/", 1)[-1]
            if not name.startswith("checkpoint-") or entry.type != fs.FileType.Directory:
                continue
            step = int(name.removeprefix("checkpoint-"))
            if self.published.get(step) or \
                    self.store.get_file_info(f"{entry.path}/meta.json").type != fs.FileType.File:
                continue
            try:
                with self.store.open_input_file(f"{entry.path}/state.pt") as f:
                    data = io.BytesIO(f.read())
                torch.load(data, weights_only=True)
                self.published[step] = step in whole
            except Exception:  # noqa: BLE001 - still uploading, or partial: read again later
                self.published[step] = False

    def whole_on_store(self) -> list[int]:
        """The steps of the fixed run's checkpoints that memtrain's store listing counts whole
        (``stored_checkpoints``: every file the manifest lists, at its size), read past the
        proxy."""
        from trainer.checkpoint.publish import stored_checkpoints
        from trainer.checkpoint.store import RemoteRun

        remote = RemoteRun(f"s3://{BUCKET}/runs/{RUN}")
        remote.fs = self.store
        return [step for step, _ in stored_checkpoints(remote)]

    def wait(self, until: Any, limit: float) -> bool:
        deadline = time.time() + limit
        while time.time() < deadline:
            self.watch_store()
            self.restart_driver_if_needed()
            if until():
                return True
            time.sleep(0.2)
        return False

    def restart_driver_if_needed(self) -> None:
        """A driver that ended by itself before the run's end is a finding, not a fault: it is
        recorded, and the run is submitted again so the campaign can go on."""
        if self.driver is not None and self.driver.poll() not in (None, 0) and \
                not getattr(self, "_killing", False):
            self.events.append({"kind": "driver_failed", "returncode": self.driver.returncode,
                                "time": time.time()})
            extra, faults = self._driver_args
            self.start_driver(*extra, faults=faults)

    # -- the faults ----------------------------------------------------------------------------

    def workers(self) -> list[Any]:
        """This campaign's Ray Train workers: descendants of this process, whose cluster's
        nodes it started. Not every such process on the machine: under the test suite another
        cluster's workers run beside these, and killing one of those failed that run's test
        (and left this campaign's fault without its restart)."""
        import psutil

        found = []
        for process in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.name().startswith("ray::RayTrainWo"):
                    found.append(process)
        return found

    def recovered(self) -> bool:
        """The latest attempt has finished a step, and the driver has printed a restart line
        for every restart so far (so a fault next, a killed driver, cannot take a line Ray had
        not forwarded yet)."""
        attempts = [a for a in self.attempts() if "start" in a]
        attempt, step = self.progress()
        if attempt != len(attempts) or step <= 0:
            return False
        restarts = sum(1 for a in attempts if a.get("cause"))
        return self.driver_log.read_text(errors="replace").count("restarted after ") >= restarts

    def errors_since(self, since: float) -> bool:
        """Whether a rank (not a lost peer's echo) or the driver, for Ray Train's controller,
        recorded an error in the working copy after ``since``."""
        from trainer.telemetry.worker_errors import CONTROLLER_FILE, error_records, is_peer_echo

        with contextlib.suppress(OSError):
            if (self.run_copy / "errors" / CONTROLLER_FILE).stat().st_mtime > since:
                return True
        return any(mtime > since and not is_peer_echo(record)
                   for mtime, _, record in error_records(self.run_copy))

    def kill_a_worker(self) -> bool:
        workers = self.workers()
        if not workers:
            return False
        with contextlib.suppress(Exception):
            self.rng.choice(workers).send_signal(signal.SIGKILL)
        return True

    def inject(self, kind: str) -> None:
        if kind == "worker_kill":
            self.kill_a_worker()
        elif kind == "node_replace":
            gone = self.worker_node.node_ip_address
            self.cluster.remove_node(self.worker_node, allow_graceful=False)
            self.worker_node = self.cluster.add_node(**self._node_args(self.spare.pop(0)))
            self.spare.append(gone)
        elif kind == "store_upload":  # until the next checkpoint's upload has failed
            since = time.time()
            self.proxy.set("fail")
            self.wait(lambda: self.errors_since(since), 15.0)
            self.proxy.set("pass")
        elif kind == "store_restore":  # until the restarted workers' restore has failed
            since = time.time()
            self.proxy.set("fail")
            self.kill_a_worker()
            self.wait(lambda: self.errors_since(since), 30.0)
            self.proxy.set("pass")
        elif kind == "store_slow":
            self.proxy.set("slow", delay=0.2)
            time.sleep(4.0)
            self.proxy.set("pass")
        elif kind == "driver_kill":
            self.kill_driver()
            self.start_driver()
        elif kind == "upload_race":
            self.races.append(self.upload_race())
        elif kind == "disk_full":  # full while a restarted worker restores into the copy
            since = time.time()
            ballast = self.copy / "ballast"
            free = shutil.disk_usage(self.copy).free
            with contextlib.suppress(OSError), ballast.open("wb") as f:
                f.write(b"\0" * free)
            self.kill_a_worker()
            self.wait(lambda: self.errors_since(since), 30.0)
            ballast.unlink(missing_ok=True)
        # checkpoint_fail: MEMTRAIN_FAULTS fires it at its step, on every rank

    def kill_driver(self) -> None:
        """SIGKILL the driver's process group; Ray then ends the job's workers."""
        assert self.driver is not None
        self._killing = True
        os.killpg(self.driver.pid, signal.SIGKILL)
        self.driver.wait()
        self.wait(lambda: not self.workers(), 60)
        self._killing = False

    def upload_race(self) -> dict[str, Any]:
        """Hold back rank 1's shard of the next checkpoint uploaded, whichever step it is, while
        the rest of it lands; kill the driver then, and ask memtrain's store listing what it
        makes of the partial checkpoint; then run the driver again. (The step is read from the
        held request, not foretold from the run's progress: a run slowed by its neighbours, or
        still recovering, uploads a different checkpoint from the one its progress suggests.)"""
        self.proxy.set("hold", pattern=rb"PUT /[^ ]*/checkpoint-\d{8}/__1_0\.distcp")
        held_one = self.wait(lambda: bool(self.proxy.held), RECOVERY_LIMIT)
        found = re.search(rb"checkpoint-(\d{8})/", self.proxy.held[0]) if held_one else None
        step = int(found.group(1)) if found else None
        landed = step is not None and self.wait(lambda: self.store.get_file_info(
            f"{BUCKET}/runs/{RUN}/checkpoint-{step:08d}/meta.json").type.name == "File", 60.0)
        self.kill_driver()  # the workers die with it: the held upload never completes
        self.proxy.set("pass")
        listed = self.whole_on_store()
        self.start_driver()
        race = {"step": step, "shard_held": step is not None, "meta_landed": landed,
                "listed_whole": step in listed, "latest_listed": max(listed, default=None)}
        print(f"  upload_race: checkpoint {step} shard held {step is not None}, meta.json "
              f"landed {landed}, listed whole {step in listed}", flush=True)
        return race

    def run(self) -> dict[str, Any]:
        print(f"chaos campaign: seed {self.seed}, {len(self.plan)} faults over {self.steps} "
              f"steps: {', '.join(f'{k}@{s}' for k, s in self.plan)}", flush=True)
        started = time.time()
        self.start_driver()
        for kind, step in self.plan:
            reached = self.wait(lambda step=step: self.progress()[1] >= step, RECOVERY_LIMIT)
            attempts_before = self.started()
            at = time.time()
            fired = (self.run_copy / ".faults-fired" / f"checkpoint@{step}-0").exists()
            if kind == "checkpoint_fail":  # it fires with the checkpoint just after this step
                expect_restart = not fired  # else it met an earlier fault's recovery: counted
            else:
                expect_restart = kind in RESTARTING
                self.inject(kind)
            restarted = expect_restart and self.wait(
                lambda n=attempts_before: self.started() > n,
                RECOVERY_LIMIT)
            recovered = self.wait(self.recovered, RECOVERY_LIMIT)
            event = {"kind": kind, "step": step, "reached": reached, "time": at,
                     "restarted": restarted, "recovered": recovered,
                     "seconds": time.time() - at}
            self.events.append(event)
            print(f"  {kind} at step {step}: {'restart' if restarted else 'no restart'}, "
                  f"{'recovered' if recovered else 'NOT recovered'} "
                  f"({event['seconds']:.1f} s)", flush=True)
        finished = self.wait(lambda: self.driver is not None and self.driver.poll() == 0,
                             RECOVERY_LIMIT + self.steps * 5.0)
        self.watch_store()
        return {"seed": self.seed, "plan": self.plan, "steps": self.steps,
                "finished": finished, "events": self.events, "seconds": time.time() - started,
                "disk_full_possible": self.mounted, "races": self.races}


    def elastic(self) -> dict[str, Any]:
        """A second run on the same cluster, elastic (workers [1, 2], the group checks for room
        every 5 s), with two OOMs (``MEMTRAIN_FAULTS``, recovered in-process at half the
        micro-batch) and the worker node removed with nothing to replace it (the group goes on
        with 1 worker once Ray Train gives up waiting, 10 s), then a node added (it grows back to
        2). The arithmetic changes with the world size and the micro-batch, so this run is
        checked for its rows, its restarts and its end, not for exact weights."""
        from trainer.faults import RELEASE_FILE

        self.run_name, self.run_copy = ELASTIC_RUN, self.copy / ELASTIC_RUN
        self.driver_log = self.work / "driver-elastic.log"
        # Growing takes Ray a while: the node joins (seconds), Ray's autoscaling coordinator
        # sees it (it ticks every 20 s), the group's next check (5 s), a restart; the save kill
        # comes after the growth.
        steps, shrink, grow = 200, self.rng.randint(4, 8), self.rng.randint(13, 17)
        save_kill = self.rng.choice([s for s in range(grow + 120, steps - 30)
                                     if s % CHECKPOINT_EVERY == 0])
        ooms = sorted(self.rng.sample([s for s in range(2, steps - 2)
                                       if s not in (shrink, grow, save_kill)], 2))
        # The group held at the growth's step until it restarts (or GROW_LIMIT): a run that
        # went on would end before Ray grows it (200 steps took 15 s on one worker).
        faults = ",".join([*(f"oom@{s}:0" for s in ooms), f"hold@{grow}:0"])
        print(f"elastic run: shrink@{shrink}, grow@{grow}, save_kill@{save_kill}, {faults}",
              flush=True)
        os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "10"  # the driver's controller
        extra = (f"run.name={ELASTIC_RUN}", "parallel.workers=[1, 2]",
                 "parallel.resize_check_seconds=5", f"train.steps={steps}",
                 "train.checkpoint_async=true")
        nodes_up = self.wait(lambda: self.cpu_nodes() >= 2, RECOVERY_LIMIT)
        started = time.time()
        self.start_driver(*extra, faults=faults)
        self.wait(lambda: bool(self.attempts()), RECOVERY_LIMIT)
        start_size = next((a.get("world_size") for a in self.attempts() if "start" in a), None)
        print(f"  started with {start_size} workers ({self.cpu_nodes()} nodes up: "
              f"{nodes_up})", flush=True)
        events = []
        for kind, step in (("node_shrink", shrink), ("node_grow", grow),
                           ("save_kill", save_kill)):
            # (the save kill waits from the step before its checkpoint, to slow the upload)
            ahead = step - 1 if kind == "save_kill" else step
            reached = self.wait(lambda ahead=ahead: self.progress()[1] >= ahead, RECOVERY_LIMIT)
            before = self.started()
            at = time.time()
            if kind == "node_shrink":
                gone = self.worker_node.node_ip_address
                self.cluster.remove_node(self.worker_node, allow_graceful=False)
                self.spare.append(gone)
            elif kind == "node_grow":
                self.worker_node = self.cluster.add_node(**self._node_args(self.spare.pop(0)))
            else:  # the checkpoint's upload slowed, a worker killed as soon as it is in flight
                self.proxy.set("slow", delay=0.3)
                self.wait(lambda step=step: self.progress()[1] >= step, RECOVERY_LIMIT)
                time.sleep(1.0)  # its files written, their upload under way (at 0.3 s a chunk)
                self.kill_a_worker()
                self.proxy.set("pass")
            restarted = self.wait(lambda n=before: self.started() > n,
                                  GROW_LIMIT if kind == "node_grow" else RECOVERY_LIMIT)
            if kind == "node_grow":  # grown or not, the run goes on
                (self.run_copy / RELEASE_FILE).touch()
            recovered = self.wait(self.recovered, RECOVERY_LIMIT)
            events.append({"kind": kind, "step": step, "reached": reached,
                           "restarted": restarted, "recovered": recovered,
                           "seconds": time.time() - at})
            print(f"  {kind} at step {step}: {'restart' if restarted else 'no restart'}, "
                  f"{'recovered' if recovered else 'NOT recovered'} "
                  f"({events[-1]['seconds']:.1f} s)", flush=True)
        finished = self.wait(lambda: self.driver is not None and self.driver.poll() == 0,
                             RECOVERY_LIMIT + steps * 5.0)
        return {"steps": steps, "ooms": ooms, "events": events, "finished": finished,
                "seconds": time.time() - started, "start_world_size": start_size,
                "nodes_up_at_start": nodes_up}

    def cpu_nodes(self) -> int:
        """Alive nodes with a CPU, as Ray's GCS lists them."""
        return sum(1 for node in self.ray.nodes()
                   if node["Alive"] and node["Resources"].get("CPU", 0) > 0)


# -- the checks ----------------------------------------------------------------------------------

def check_elastic(campaign: Campaign, outcome: dict[str, Any]) -> dict[str, Any]:
    """The elastic run: every row once across its world sizes, the OOMs recovered, the shrink
    and the growth each a restart named by its cause."""
    import io

    import torch

    from tests.distributed.rows import recorded_rows, rows_trained, stored_fingerprints

    results = dict(outcome)
    prefix = f"{BUCKET}/runs/{ELASTIC_RUN}"
    with campaign.store.open_input_file(f"{prefix}/checkpoint-{outcome['steps']:08d}/state.pt") \
            as f:
        data = io.BytesIO(f.read())
    loader = torch.load(data, weights_only=True)["loader"]
    sizes = [tuple(s) for s in loader["segments"]] + [
        (loader["world_size"], loader["batch_size"], loader["batch_index"])]
    planned = rows_trained(campaign.corpus / "train", sizes, loader["seed"],
                           loader["shuffle_window"])
    recorded = recorded_rows(campaign.copy / ELASTIC_RUN)
    want = Counter(stored_fingerprints(campaign.corpus / "train", planned))
    got = Counter(row for step in sorted(recorded) for row in recorded[step])
    results["sizes"] = sizes
    results["rows"] = {"steps_recorded": len(recorded), "planned": sum(want.values()),
                       "lost": sum((want - got).values()),
                       "duplicated": sum((got - want).values())}
    attempts = [a for a in campaign.attempts() if "start" in a]
    results["restarts"] = dict(Counter(a["cause"] for a in attempts if a.get("cause")))
    log = campaign.driver_log.read_text(errors="replace")
    results["oom_lines"] = log.count("OOM at step")
    results["grew"] = results["restarts"].get("resize", 0) >= 1
    grow = next(e for e in outcome["events"] if e["kind"] == "node_grow")
    results["grow_seconds"] = grow["seconds"] if grow["restarted"] else None
    results["passed"] = bool(
        outcome["finished"] and results["rows"]["lost"] == 0
        and results["rows"]["duplicated"] == 0 and len(recorded) == outcome["steps"]
        and outcome["start_world_size"] == 2 and results["grew"]
        and results["restarts"].get("node_lost", 0) >= 1
        and results["oom_lines"] >= len(outcome["ooms"])
        and all(e["restarted"] and e["recovered"] for e in outcome["events"]))
    return results


def check(campaign: Campaign, outcome: dict[str, Any]) -> dict[str, Any]:
    """The invariants and the figures (see the module's docstring)."""
    import torch
    from pyarrow import fs

    from tests.distributed.rows import recorded_rows, rows_trained, stored_fingerprints
    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run

    results: dict[str, Any] = dict(outcome)
    store, prefix = campaign.store, f"{BUCKET}/runs/{RUN}"
    with store.open_input_file(f"{prefix}/summary.json") as f:
        summary = json.loads(f.read())
    results["summary"] = {k: summary.get(k) for k in (
        "final_step", "resumed_from_step", "attempt", "restarts", "recovery_seconds", "workers")}
    from trainer.checkpoint.files import load_checkpoint, read_model_weights

    final = campaign.work / "final" / f"checkpoint-{campaign.steps:08d}"
    final.mkdir(parents=True)
    fs.copy_files(f"{prefix}/{final.name}", str(final), source_filesystem=store,
                  destination_filesystem=fs.LocalFileSystem())
    state = load_checkpoint(final)
    weights = read_model_weights(final)

    # Exact weights: an uninterrupted run of the same config, the local launcher, 2 processes.
    from trainer.config import load_config

    reference = campaign.work / "reference"
    overrides = [o for o in campaign.overrides()
                 if not o.startswith(("run.dir=", "run.work_dir=", "parallel.launcher=",
                                      "parallel.max_failures="))]
    cfg, run_dir = prepare_run(load_config(REPO / "configs" / "demo-cpu.yaml", [
        *overrides, f"run.dir={reference}", "parallel.launcher=local"]))
    env = dict(os.environ)
    os.environ.pop("MEMTRAIN_FAULTS", None)
    try:
        launch_local(cfg, run_dir)
    finally:
        os.environ.clear()
        os.environ.update(env)
    expected = read_model_weights(run_dir / f"checkpoint-{campaign.steps:08d}")
    results["weights_exact"] = weights.keys() == expected.keys() and all(
        torch.equal(weights[k], expected[k]) for k in expected)

    # Every row once: the rows the ranks recorded (the last time each step was trained).
    recorded = recorded_rows(campaign.run_copy)
    loader = state["loader"]
    planned = rows_trained(campaign.corpus / "train", [(2, 4, campaign.steps * 2)],
                           loader["seed"], loader["shuffle_window"])
    want = Counter(stored_fingerprints(campaign.corpus / "train", planned))
    got = Counter(row for step in sorted(recorded) for row in recorded[step])
    results["rows"] = {"steps_recorded": len(recorded), "planned": sum(want.values()),
                       "lost": sum((want - got).values()), "duplicated": sum((got - want).values())}

    # Checkpoints: every one the store published loaded; every resume from one of them.
    attempts = [a for a in campaign.attempts() if "start" in a]
    resumed = sorted({a["resumed_from"] for a in attempts if a["resumed_from"]})
    campaign.watch_store()  # the last look: what never loaded is partial on the store
    results["checkpoints"] = {
        "published": sorted(s for s, ok in campaign.published.items() if ok),
        "partial_on_store": sorted(s for s, ok in campaign.published.items() if not ok),
        "resumed_from": resumed,
        "resumed_from_unpublished": [s for s in resumed if not campaign.published.get(s)]}

    # Restarts: counted by cause; a line for each in the driver's output.
    recovered = [a for a in campaign.attempts() if a.get("recovered")]
    causes = Counter(a["cause"] for a in attempts if a.get("cause"))
    log = campaign.driver_log.read_text(errors="replace")
    seconds = [a["recovery_seconds"] for a in recovered]
    results["restarts"] = {
        "by_cause": dict(causes), "total": sum(causes.values()),
        "summary_agrees": summary.get("restarts") == dict(causes),
        "lines": log.count("restarted after "),
        "recovery_p50_seconds": statistics.median(seconds) if seconds else None,
        "recovery_max_seconds": max(seconds) if seconds else None,
        "steps_redone": sum(a["steps_redone"] for a in recovered),
        "tracebacks_in_driver_output": log.count("Traceback (most recent call last)")}
    # The upload race: the partial checkpoint was on the store and memtrain's listing skipped it.
    results["races_skipped"] = all(r["shard_held"] and not r["listed_whole"]
                                   for r in outcome["races"])
    events = [e for e in outcome["events"] if e["kind"] in KINDS]
    results["faults"] = {"injected": len(events), "kinds": dict(Counter(e["kind"] for e in events)),
                         "survived": sum(e["recovered"] for e in events)}
    results["passed"] = bool(
        outcome["finished"] and results["weights_exact"] and results["rows"]["lost"] == 0
        and results["rows"]["duplicated"] == 0
        and not results["checkpoints"]["resumed_from_unpublished"]
        and results["restarts"]["summary_agrees"]
        and results["restarts"]["lines"] >= results["restarts"]["total"]
        and results["races_skipped"]
        and results["faults"]["survived"] == results["faults"]["injected"])
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="The fault kinds to draw from, comma-separated.")
    parser.add_argument("--no-elastic", dest="elastic", action="store_false",
                        help="Leave out the elastic run (its OOMs, a shrink and a growth).")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"--kinds: {', '.join(sorted(unknown))} not among {', '.join(KINDS)}")
    from datapipe.corpus import build_stdlib_corpus
    from tests.conftest import SEQ_LEN

    work = Path(tempfile.mkdtemp(prefix="memtrain-chaos-"))
    corpus = work / "corpus"
    build_stdlib_corpus(corpus, seq_len=SEQ_LEN, max_bytes=400_000, rows_per_shard=1000)
    campaign = Campaign(args.seed, args.faults, work, corpus, kinds)
    try:
        campaign.start()
        outcome = campaign.run()
        results = check(campaign, outcome)
        if args.elastic:
            results["elastic"] = check_elastic(campaign, campaign.elastic())
            results["passed"] = results["passed"] and results["elastic"]["passed"]
            results["faults"]["injected_with_elastic"] = results["faults"]["injected"] + 2 + len(
                results["elastic"]["ooms"])
    finally:
        campaign.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"chaos-{args.seed}.json"
    path.write_text(json.dumps(results, indent=1, sort_keys=True))
    print(json.dumps({k: results.get(k) for k in ("passed", "faults", "restarts", "rows",
                                                  "checkpoints", "weights_exact", "seconds",
                                                  "elastic")},
                     indent=1), flush=True)
    print(f"chaos campaign seed {args.seed}: {'passed' if results['passed'] else 'FAILED'} "
          f"({path})")
    if not results["passed"]:
        for log in campaign.work.glob("driver*.log"):
            shutil.copy(log, args.out / f"chaos-{args.seed}-{log.name}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
