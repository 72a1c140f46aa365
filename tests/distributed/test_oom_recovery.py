"""OOM recovery keeps the global batch: an OOM injected on rank 1 is agreed on by both ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run

pytestmark = pytest.mark.distributed


def _metrics(run_dir: Path, rank: int) -> list[dict]:
    lines = (run_dir / "metrics" / f"rank-{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_injected_oom_on_rank_1_halves_micro_batch_and_keeps_the_update(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ("parallel.launcher=local", "train.steps=6", "train.log_every=1",
              "train.eval_every=0", "train.checkpoint_every=0",
              "memory.oom_recovery=true")  # "auto" is off on CPU
    cfg, clean_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "run.name=clean"))
    clean = launch_local(cfg, clean_dir)

    monkeypatch.setenv("MEMTRAIN_FAULTS", "oom@3:1")  # step 3, rank 1
    cfg, oom_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "run.name=oom"))
    recovered = launch_local(cfg, oom_dir)

    assert recovered["oom_recoveries"] == 1
    assert (recovered["micro_batch_size"], recovered["accumulation_steps"]) == (2, 4)
    assert recovered["global_batch_size"] == clean["global_batch_size"] == 16
    for rank in (0, 1):
        rows = _metrics(oom_dir, rank)
        assert [(r["micro_batch_size"], r["accumulation_steps"]) for r in rows] == \
            [(4, 2)] * 2 + [(2, 4)] * 4
    # The same samples in smaller pieces: the run continues on the clean trajectory.
    clean_losses = [r["loss"] for r in _metrics(clean_dir, 0)]
    oom_losses = [r["loss"] for r in _metrics(oom_dir, 0)]
    assert oom_losses == pytest.approx(clean_losses, rel=2e-3)
    report = json.loads((oom_dir / "memory" / "oom-step00000003-rank1.json").read_text())
    assert report["micro_batch_size"] == 4 and report["step"] == 3


def test_oom_beyond_the_retry_budget_fails_with_a_clear_message(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMTRAIN_FAULTS", "oom@2:0")
    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "memory.max_oom_retries=0", "memory.oom_recovery=true", "train.steps=3",
        "run.name=fail"))
    with pytest.raises(RuntimeError, match="out of memory at step 2 on rank 0 with micro-batch 4"):
        launch_local(cfg, run_dir)
