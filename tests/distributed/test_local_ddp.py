"""The local launcher with 2 real gloo processes: DDP, AMP, activation ckpt, accumulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from trainer.context import complete_checkpoints
from trainer.launch import prepare_run
from trainer.launch.local import launch_local

pytestmark = pytest.mark.distributed


def test_two_process_ddp_trains_checkpoints_and_resumes(corpus_dir: Path,
                                                        tmp_path: Path) -> None:
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.launcher=local",
                                           "run.name=ddp"))
    summary = launch_local(cfg, run_dir)
    assert summary["workers"] == 2 and summary["accumulation_steps"] == 2
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    assert [step for step, _ in complete_checkpoints(run_dir)] == [6, 12]
    ranks = sorted(p.name for p in (run_dir / "metrics").iterdir())
    assert ranks == ["rank-0.jsonl", "rank-1.jsonl"]

    more, _ = prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.launcher=local",
                                      "run.name=ddp", "train.steps=16"))
    resumed = launch_local(more, run_dir)
    assert resumed["resumed_from_step"] == 12
    assert resumed["steps_this_run"] == 4 and resumed["final_step"] == 16
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    assert steps[-1] == 16


def test_resume_is_exact_for_a_single_worker(corpus_dir: Path, tmp_path: Path) -> None:
    """12 steps in one go give the same loss as 6 steps, a stop, and 6 more."""
    straight_cfg, straight_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "run.name=straight", "train.eval_every=0"))
    straight = launch_local(straight_cfg, straight_dir)
    first_cfg, split_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "run.name=split", "train.eval_every=0"))
    launch_local(first_cfg, split_dir, until_step=6)  # same 12-step schedule, stopped at 6
    resumed = launch_local(first_cfg, split_dir)
    assert resumed["resumed_from_step"] == 6
    assert resumed["final_loss"] == straight["final_loss"]


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


def test_resuming_at_other_worker_counts_keeps_the_global_batch_schedule_and_data(
        corpus_dir: Path, tmp_path: Path) -> None:
    """2 workers to step 4, 1 worker to step 8, 2 workers to step 12 (the local launcher's
    --workers changed between runs): the global batch is kept by the accumulation steps, the
    step count and LR schedule continue, and each checkpoint's loader state names the sizes
    that read its epoch so far (datapipe/split.py turns that into exactly-once rows, tested
    there and in tests/unit/test_loader.py)."""
    import torch

    def run(workers: int, until: int) -> dict:
        cfg, run_dir = prepare_run(tiny_config(
            corpus_dir, tmp_path, "parallel.launcher=local", f"parallel.workers={workers}",
            "run.name=resize", "train.eval_every=0", "train.checkpoint_every=4"))
        return launch_local(cfg, run_dir, until_step=until)

    first = run(2, 4)
    assert (first["workers"], first["accumulation_steps"], first["final_step"]) == (2, 2, 4)
    # The middle run in this process, as the local launcher runs one worker, with an exporter
    # to read the resize from.
    from monitoring.memory import worker_labels
    from monitoring.sinks import PrometheusSink
    from trainer.context import LocalContext
    from trainer.loop import train

    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "run.name=resize", "train.eval_every=0", "train.checkpoint_every=4"))
    ctx = LocalContext(0, 0, 1, torch.device("cpu"), run_dir)
    ctx.metrics_sink = sink = PrometheusSink(worker_labels("resize", 0, 0, "n", ctx.device))
    second = train(cfg, ctx, until_step=8)
    labels = dict(sink.labels)
    assert sink.registry.get_sample_value("ray_memtrain_train_world_size", labels) == 1
    assert sink.registry.get_sample_value("ray_memtrain_train_world_size_changes_total",
                                          labels) == 1
    assert (second["workers"], second["accumulation_steps"]) == (1, 4)  # 16 = 1 x 4 x 4
    assert (second["resumed_from_step"], second["final_step"]) == (4, 8)
    third = run(2, 12)
    assert (third["resumed_from_step"], third["final_step"]) == (8, 12)
    assert third["final_loss"] < first["first_loss"] - 0.5

    run_dir = tmp_path / "resize"
    states = {step: torch.load(path / "state.pt", weights_only=True)
              for step, path in complete_checkpoints(run_dir)}
    assert sorted(states) == [4, 8, 12]
    loader_4, loader_8, loader_12 = (states[s]["loader"] for s in (4, 8, 12))
    # One epoch: 2 ranks read 8 micro-batches each, then 1 rank 16, then 2 ranks 8 each.
    assert loader_4["segments"] == [] and (loader_4["epoch"], loader_4["batch_index"]) == (0, 8)
    assert loader_8["segments"] == [[2, 4, 8]] and loader_8["batch_index"] == 16
    assert loader_12["segments"] == [[2, 4, 8], [1, 4, 16]] and loader_12["batch_index"] == 8
    # The rows those reads were, from the shard layout: none twice.
    rows = rows_trained(corpus_dir / "train", [(2, 4, 8), (1, 4, 16), (2, 4, 8)],
                        seed=loader_4["seed"], window=loader_4["shuffle_window"])
    assert len(rows) == len(set(rows)) == 3 * 64
    # The schedule is the uninterrupted run's: LambdaLR's step count and the LR at step 12.
    straight_cfg, straight_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "run.name=straight", "train.eval_every=0", "train.checkpoint_every=12"))
    launch_local(straight_cfg, straight_dir)
    [(_, straight_ckpt)] = complete_checkpoints(straight_dir)
    straight = torch.load(straight_ckpt / "state.pt", weights_only=True)
    assert states[12]["scheduler"] == straight["scheduler"]
    assert states[12]["step"] == straight["step"] == 12
