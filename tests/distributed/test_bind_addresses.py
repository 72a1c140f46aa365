"""Nothing memtrain starts listens beyond loopback: every TCP socket in LISTEN state owned by
this test process or its descendants (the local Ray cluster's GCS, raylet, dashboard, agents,
workers, the metrics endpoint) is bound to 127.0.0.1. The known exception, torch's rendezvous
store while a process group exists, is documented in docs/architecture.md; none exists here."""

from __future__ import annotations

import psutil
import pytest

# One Ray cluster for the session: every test on it runs in one xdist worker.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("ray")]
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def test_the_local_ray_cluster_listens_on_loopback_only(ray_cluster) -> None:
    me = psutil.Process()
    listening = []
    for process in [me, *me.children(recursive=True)]:
        try:
            connections = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(process.name(), c.laddr.ip, c.laddr.port) for c in connections
                      if c.status == psutil.CONN_LISTEN]
    names = {name for name, _, _ in listening}
    assert {"gcs_server", "raylet"} <= names, names  # the cluster's own servers were seen
    assert [entry for entry in listening if entry[1] not in LOOPBACK] == []
