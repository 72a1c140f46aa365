"""Real gloo process groups for the tests: ``on_ranks`` runs a function on N ranks, each a
process of the local launcher's fork server, and ``one_rank_group`` opens a group of one in the
test's own process.

The set-up (address, port, thread count, teardown) is written once here, with a collective
timeout of a minute: a rank left waiting in a collective its peers never join fails its test
instead of holding the suite for gloo's default 30 minutes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainer.launch.local import PRELOAD, free_port, start_workers

TIMEOUT = timedelta(seconds=60)


def on_ranks(fn: Callable[..., None], world_size: int, *args: Any,
             timeout: timedelta = TIMEOUT, modules: tuple[str, ...] = PRELOAD) -> None:
    """Run ``fn(rank, *args)`` on ``world_size`` ranks, each in its own process inside one gloo
    group on 127.0.0.1, with one torch thread; returns when every rank has. A rank's group is
    destroyed when ``fn`` returns; one whose ``fn`` raised is closed by its process's exit.

    Args:
        fn: a module-level function (it is pickled by name).
        world_size: the number of ranks.
        args: passed to ``fn`` after the rank; picklable.
        timeout: how long a collective, of the default group or of a ``dist.new_group``,
            waits for its peers before it raises.
        modules: what the fork server imports, on the process's first launch only
            (``trainer.launch.local.start_workers``).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback in the
            message; the first rank to fail, not a peer that then lost its connection).
        torch.multiprocessing.ProcessExitedException: a rank was killed.
    """
    start_workers(_in_group, (world_size, free_port(), timeout, fn, *args), world_size,
                  modules=modules)


def _in_group(rank: int, world_size: int, port: int, timeout: timedelta,
              fn: Callable[..., None], *args: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # ``dist.new_group`` takes torch's default timeout, not the default group's; this process
    # is the rank's own, so the module's default is set for it alone.
    distributed_c10d.default_pg_timeout = timeout
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    fn(rank, *args)
    # Only on success: a rank that raised leaves its group to its process's exit, which comes
    # once its error is recorded. Destroyed before, the group's connections close while peers
    # wait in a collective, and a peer's "Connection reset by peer" can be the error reported
    # in place of the rank's own (12 times in 15 with test_loader_ranks' failing rank).
    dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A gloo group of this process alone (rank 0 of 1), its store the file ``tmp_path/store``;
    destroyed on exit."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
