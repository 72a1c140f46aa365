"""A killed driver's resource request, released by the next driver of the same run.

Ray Train registers each run's workers with the cluster's AutoscalingCoordinator (a detached
actor shared by every run) and cancels them when its controller shuts down; a driver killed
without that shutdown leaves them reserved for 180 s, and an elastic run started meanwhile is
given what is left. Here, on a real Ray cluster and its real coordinator: a request standing for
a dead run holds the cluster's CPUs, so another requester is reserved none; once the next
driver of that run has released it (``release_orphaned_request``), the other is reserved them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("ray")]
# The coordinator's first call waits for its actor's process to start: on 2 cores busy with the
# rest of the suite that took over 10 s.
ACTOR_SECONDS = 60


def reserved_cpus(ray, coordinator, requester: str) -> float:
    """The CPUs the coordinator has reserved for ``requester``, over every node."""
    reserved = ray.get(coordinator.get_reserved_resources.remote(requester), timeout=ACTOR_SECONDS)
    return sum(node.get("CPU", 0.0) for node in reserved.values())


def test_the_next_driver_releases_a_killed_drivers_request(ray_cluster, tmp_path: Path) -> None:
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        ResourceRequestPriority,
        get_or_create_autoscaling_coordinator,
    )

    from trainer.launch.ray import REQUEST_FILE, release_orphaned_request

    coordinator = get_or_create_autoscaling_coordinator()
    cpus = int(ray_cluster.cluster_resources()["CPU"])
    dead, alive = "train-killed-driver", "train-elastic-run"
    # What a Train V2 controller registers (trainer's ScalingConfig: one CPU a worker), at its
    # priority, and never cancels when its driver is SIGKILLed.
    ray_cluster.get(coordinator.request_resources.remote(
        requester_id=dead, resources=[{"CPU": 1.0}] * cpus, expire_after_s=180,
        priority=ResourceRequestPriority.HIGH), timeout=ACTOR_SECONDS)
    try:
        ray_cluster.get(coordinator.request_resources.remote(
            requester_id=alive, resources=[{"CPU": 1.0}] * cpus, expire_after_s=180,
            priority=ResourceRequestPriority.HIGH), timeout=ACTOR_SECONDS)
        assert reserved_cpus(ray_cluster, coordinator, alive) < cpus  # the dead run holds the CPUs

        (tmp_path / REQUEST_FILE).write_text(dead + "\n")  # the killed driver's note
        release_orphaned_request(tmp_path)
        deadline = time.monotonic() + 10
        while reserved_cpus(ray_cluster, coordinator, alive) < cpus and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reserved_cpus(ray_cluster, coordinator, alive) == cpus
        assert reserved_cpus(ray_cluster, coordinator, dead) == 0
        release_orphaned_request(tmp_path)  # again: the request is gone, a no-op
    finally:
        for requester in (dead, alive):
            ray_cluster.get(coordinator.cancel_request.remote(requester_id=requester),
                            timeout=ACTOR_SECONDS)
