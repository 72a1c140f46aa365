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

from tests.gloo import on_ranks
from tests.unit.test_loader import id_dataset

pytestmark = pytest.mark.distributed


def _epoch(rank: int, path: str, out: str) -> None:
    from datapipe.loader import BatchLoader

    world = dist.get_world_size()
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


def test_two_ranks_get_equal_batches_and_disjoint_rows(tmp_path: Path) -> None:
    path = id_dataset(tmp_path / "ds", [101, 101, 101, 13])  # 316 rows, uneven shards
    on_ranks(_epoch, 2, str(path), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["counts"] == ranks[1]["counts"] == [316 // 14, 316 // 14]
    a, b = set(ranks[0]["seen"]), set(ranks[1]["seen"])
    assert not a & b and len(a | b) == 316 // 14 * 14


def _one_rank_fails(rank: int, good: str, bad: str) -> None:
    from datapipe.loader import BatchLoader

    loader = BatchLoader(bad if rank == 1 else good, "x", rank=rank,
                         world_size=dist.get_world_size(), batch_size=4, seed=0)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here; rank 1 never arrives
    loader.close()


def test_a_rank_whose_data_fails_brings_the_group_down_fast(tmp_path: Path) -> None:
    good = id_dataset(tmp_path / "good", [50, 50])
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="does not exist"):
        on_ranks(_one_rank_fails, 2, str(good), str(tmp_path / "missing"))
    assert time.monotonic() - start < 60  # not rank 0's collective timing out (tests.gloo)
