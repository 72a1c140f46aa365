"""The process group's rendezvous, its store listening on one address only.

torch's ``env://`` and ``tcp://`` rendezvous start rank 0's ``TCPStore`` server on every
interface of its node, unauthenticated: whoever reaches the port can read and write the store,
and so join or stall the group. memtrain binds that socket itself, to the address the ranks
meet at (127.0.0.1 on one node; rank 0's node address when a group spans nodes, where
docs/deploy.md's network policy admits the namespace's pods), and hands it to the store
(``master_listen_fd``).

On a GPU the group is NCCL for device tensors with gloo beside it for host tensors
(``cpu:gloo,cuda:nccl``): FSDP's CPU offload clips and reduces gradients and norms that live in
host memory, which NCCL cannot carry.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# torch's default for a process group's operations (and so for its store's)
DEFAULT_TIMEOUT = timedelta(minutes=30)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device_type: str) -> str:
    """The process group's backends for a run on ``device_type``."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def bound_store(addr: str, port: int, rank: int, world_size: int,
                timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """The group's store: rank 0 serves it on ``addr:port`` alone, the others connect."""
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, port))
        listener.listen(max(128, world_size))
    except OSError:
        listener.close()
        raise
    # The store owns the socket from here on (``detach``: Python no longer closes it).
    return dist.TCPStore(addr, port, world_size, True, timeout,
                         master_listen_fd=listener.detach())


def init_process_group(device_type: str, rank: int, world_size: int, addr: str, port: int,
                       timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """This rank's process group, met at ``addr:port`` through ``bound_store``. On a GPU a
    timed-out NCCL collective aborts its communicator before the process is torn down
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, as Ray Train's own setup sets it; torch's default
    tears the process down without the abort), unless the user set it or blocking waits."""
    if device_type == "cuda" and not {"TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                      "TORCH_NCCL_BLOCKING_WAIT"} & set(os.environ):
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    dist.init_process_group(backend_for(device_type),
                            store=bound_store(addr, port, rank, world_size, timeout),
                            rank=rank, world_size=world_size, timeout=timeout)


def any_rank(flag: bool, device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``flag`` is set on any rank of ``group`` (None: every rank): one all-reduce (MAX)
    of one number on ``device``, read back (a host sync where ``device`` is a GPU; a host tensor
    goes over gloo, beside NCCL on GPUs)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
