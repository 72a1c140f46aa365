"""Which rows a run trained on: as its ranks recorded them (``data.record_rows``), as the
loader's split plans them, and the fingerprints of a dataset's rows to compare the two."""

from __future__ import annotations

import json
from pathlib import Path


def recorded_rows(run_dir: Path) -> dict[int, list[str]]:
    """Step -> the fingerprints the ranks recorded for it (``data.record_rows``). A step trained
    more than once (redone after a restart) counts as its last group trained it: the latest
    record of that step gives the group's world size, and each of its ranks' latest record at
    that size is taken (records of ranks a smaller group no longer has are left out)."""
    latest: dict[int, dict[int, dict]] = {}  # step -> rank -> its latest record
    for log in (run_dir / "metrics").glob("rows-rank-*.jsonl"):
        rank = int(log.stem.removeprefix("rows-rank-"))
        for line in log.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # cut short by a kill or a full disk: that step was redone
                continue
            mine = latest.setdefault(entry["step"], {})
            if rank not in mine or entry["time"] >= mine[rank]["time"]:
                mine[rank] = entry
    steps: dict[int, list[str]] = {}
    for step, by_rank in latest.items():
        world = max(by_rank.values(), key=lambda entry: entry["time"])["world_size"]
        steps[step] = [row for rank in range(world) for row in by_rank[rank]["rows"]
                       if by_rank[rank]["world_size"] == world]
    return steps


def stored_fingerprints(dataset: Path, rows: list[tuple[int, int]]) -> list[str]:
    """``row_fingerprint`` of each (shard, row) of ``dataset``, read from its shard files."""
    import numpy as np
    import pyarrow as pa

    from datapipe.audit import row_fingerprint
    from datapipe.shards import ShardSource

    files = ShardSource(dataset, "tokens").files
    columns = {}
    for shard in {shard for shard, _ in rows}:
        with pa.memory_map(files[shard]) as source:
            columns[shard] = pa.ipc.open_file(source).read_all().column("tokens")
    return [row_fingerprint(np.asarray(columns[shard][row].values)) for shard, row in rows]


def rows_trained(dataset: Path, sizes: list[tuple[int, int, int]], seed: int,
                 window: int) -> list[tuple[int, int]]:
    """(shard, row) of every row read in epoch 0 by ``(world, batch, batches)`` in turn, each
    rank reading its first ``batches`` batches, through the loader's own planning functions."""
    from datapipe.shards import ShardSource
    from datapipe.split import Segment, batch_positions, resumed_ranges, span_ranges

    shard_rows = ShardSource(dataset, "tokens").shard_rows
    segments: list[Segment] = []
    read = []
    for world, batch, batches in sizes:
        spans = resumed_ranges(shard_rows, segments, world, batch, seed, 0, True, window)
        for rank, ranges in enumerate(spans):
            span = sum(r.rows for r in ranges)
            for k in range(batches):
                for position in batch_positions(span, batch, window, k, seed, 0, rank, True):
                    [piece] = span_ranges(ranges, int(position), int(position) + 1)
                    read.append((piece.shard, piece.start))
        segments.append(Segment(world, batch, batches))
    return read
