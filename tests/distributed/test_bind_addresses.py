"""Nothing memtrain starts listens beyond loopback: every TCP socket in LISTEN state owned by
this test process or its descendants (the local Ray cluster's GCS, raylet, dashboard, agents,
workers, the metrics endpoint, the process group's rendezvous store and gloo's pairs) is bound
to 127.0.0.1. ``ListeningSockets`` samples them while a run trains; the Ray Train run of
``tests/distributed/test_ray_train.py`` is sampled by it too."""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
import pytest

from tests.conftest import tiny_config

# One Ray cluster for the session: every test on it runs in one xdist worker.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("ray")]
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def listening() -> set[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of this process and its
    descendants."""
    me = psutil.Process()
    found = set()
    for process in [me, *me.children(recursive=True)]:
        try:
            found |= {(process.name(), c.laddr.ip, c.laddr.port)
                      for c in process.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class ListeningSockets:
    """The listening sockets seen while the ``with`` block runs (sampled every 50 ms), and
    those that were there before it (``before``)."""

    def __init__(self) -> None:
        self.before: set[tuple[str, str, int]] = set()
        self.seen: set[tuple[str, str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.seen |= listening()

    def __enter__(self) -> ListeningSockets:
        self.before = listening()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def new(self) -> set[tuple[str, str, int]]:
        return self.seen - self.before

    def beyond_loopback(self) -> list[tuple[str, str, int]]:
        return sorted(entry for entry in self.seen if entry[1] not in LOOPBACK)


def test_the_local_ray_cluster_listens_on_loopback_only(ray_cluster) -> None:
    found = listening()
    names = {name for name, _, _ in found}
    assert {"gcs_server", "raylet"} <= names, names  # the cluster's own servers were seen
    assert [entry for entry in found if entry[1] not in LOOPBACK] == []


def test_the_local_launchers_process_group_listens_on_loopback_only(corpus_dir: Path,
                                                                     tmp_path: Path) -> None:
    """Two local workers: rank 0's rendezvous store (torch's own listens on every interface)
    and gloo's sockets, sampled while they train."""
    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run

    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.launcher=local",
                                           "parallel.workers=2", "train.steps=3",
                                           "train.checkpoint_every=0", "train.eval_every=0"))
    with ListeningSockets() as sockets:
        assert launch_local(cfg, run_dir)["final_step"] == 3
    assert sockets.new, "no socket of the workers was seen"
    assert sockets.beyond_loopback() == []
