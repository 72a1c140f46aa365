"""The loader under a real 2-rank gloo group: equal batch counts per rank with uneven shards (a
collective per batch, as DDP does, completes), and a rank whose data fails takes the group
down at once instead of leaving the other rank in a collective."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.unit.test_loader import id_dataset
from trainer.launch.local import free_port, start_workers

pytestmark = pytest.mark.distributed


def _epoch(rank: int, world: int, port: int, path: str, out: str) -> None:
    from datapipe.loader import BatchLoader

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    loader = BatchLoader(path, "x", rank=rank, world_size=world, batch_size=7, seed=3)
    counts = [None] * world
    dist.all_gather_object(counts, len(loader))
    seen = []
    for _ in range(len(loader)):
        batch = next(loader)
        total = torch.tensor([batch.shape[0]])
        dist.all_reduce(total)  # every rank must arrive, as in DDP's gradient all-reduce
        seen += batch[:, 0].tolist()
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"counts": counts, "seen": seen}))
    loader.close()
    dist.destroy_process_group()


def test_two_ranks_get_equal_batches_and_disjoint_rows(tmp_path: Path) -> None:
    path = id_dataset(tmp_path / "ds", [101, 101, 101, 13])  # 316 rows, uneven shards
    start_workers(_epoch, (2, free_port(), str(path), str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["counts"] == ranks[1]["counts"] == [316 // 14, 316 // 14]
    a, b = set(ranks[0]["seen"]), set(ranks[1]["seen"])
    assert not a & b and len(a | b) == 316 // 14 * 14


def _one_rank_fails(rank: int, world: int, port: int, good: str, bad: str) -> None:
    from datapipe.loader import BatchLoader

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    loader = BatchLoader(bad if rank == 1 else good, "x", rank=rank, world_size=world,
                         batch_size=4, seed=0)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here; rank 1 never arrives
    loader.close()


def test_a_rank_whose_data_fails_brings_the_group_down_fast(tmp_path: Path) -> None:
    good = id_dataset(tmp_path / "good", [50, 50])
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="does not exist"):
        start_workers(_one_rank_fails, (2, free_port(), str(good), str(tmp_path / "missing")), 2)
    assert time.monotonic() - start < 60  # not gloo's 30-minute collective timeout
