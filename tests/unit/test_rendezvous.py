"""The process group's rendezvous (``trainer.parallel.rendezvous``): the store listens on the
address the ranks meet at and nowhere else, and a GPU group carries host tensors through gloo."""

from __future__ import annotations

import threading
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from trainer.parallel.rendezvous import backend_for, bound_store, init_process_group

pytestmark = pytest.mark.unit


def test_the_store_listens_on_its_address_alone_and_serves_the_other_ranks() -> None:
    from trainer.launch.local import free_port

    port = free_port()
    stores: dict[int, dist.TCPStore] = {}

    def make(rank: int) -> None:  # rank 0's server waits for the other rank to connect
        stores[rank] = bound_store("127.0.0.1", port, rank, 2, timedelta(seconds=30))

    ranks = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    server, client = stores[0], stores[1]
    client.set("rank-1", "here")
    assert server.get("rank-1") == b"here"
    mine = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert mine == [("127.0.0.1", port)]
    assert backend_for("cpu") == "gloo" and backend_for("cuda") == "cpu:gloo,cuda:nccl"


@pytest.mark.gpu
def test_fsdp_with_cpu_offload_clips_host_gradients_on_a_gpu_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP's CPU offload keeps gradients in host memory: clipping their norm reduces a host
    tensor over the group, which NCCL alone refuses; gloo beside it carries it."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from trainer.launch.local import free_port

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # what the group would set
    init_process_group("cuda", 0, 1, "127.0.0.1", free_port())
    try:
        model = fully_shard(torch.nn.Linear(16, 16, device="cuda"),
                            offload_policy=CPUOffloadPolicy(pin_memory=True))
        model(torch.randn(4, 16, device="cuda")).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    finally:
        dist.destroy_process_group()
