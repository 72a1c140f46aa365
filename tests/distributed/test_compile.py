"""``train.compile``: torch.compile with the chunked loss, the loop's evaluation, an OOM
recovery and resuming, on CPU (inductor's C++ backend). Compiled checkpointed blocks are run by
``tests/unit/test_planner.py``'s compiled case."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import logged_losses, tiny_config
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run

pytestmark = pytest.mark.distributed


def test_a_compiled_run_follows_the_eager_one_and_counts_its_recompilations(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Same losses as eager; the compile's seconds in the summary; the first evaluation's
    no-grad graphs are warm-up, but an OOM recovery's smaller micro-batch (new shapes) is a
    recompilation, counted and warned; the compiled run's checkpoint resumes eagerly (compiled
    in place, its parameter names are the model's own)."""
    common = ("parallel.launcher=local", "parallel.workers=1", "train.steps=6",
              "train.log_every=1", "train.eval_every=3", "train.checkpoint_every=3",
              # Every block the same kind (checkpointing with compile: tests/unit/
              # test_planner.py), so one block's graphs are compiled: each costs seconds here.
              "memory.activation_checkpointing=none", "memory.oom_recovery=true",
              "memory.loss_chunk_tokens=64")
    monkeypatch.setenv("MEMTRAIN_FAULTS", "oom@5:0")  # micro-batch 4 -> 2 from step 5
    # inductor compiles C++ on a pool of one process per core; in the suite that pool starves
    # the Ray tests beside it, so this test compiles on its own thread.
    import torch._inductor.config as inductor_config
    monkeypatch.setattr(inductor_config, "compile_threads", 1)

    def run(name: str, *overrides: str) -> tuple[dict, Path]:
        cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common, *overrides,
                                               f"run.name={name}"))
        return launch_local(cfg, run_dir), run_dir

    eager, eager_dir = run("eager", "train.compile=false")
    with caplog.at_level("INFO", logger="memtrain"):
        compiled, compiled_dir = run("compiled", "train.compile=true")
    assert logged_losses(compiled_dir) == pytest.approx(logged_losses(eager_dir), rel=1e-4)
    assert len(logged_losses(compiled_dir)) == 6
    assert eager["compile_seconds"] is None and compiled["compile_seconds"] > 0
    assert compiled["oom_recoveries"] == 1 and compiled["recompilations"] >= 1
    warned = [r.getMessage() for r in caplog.records if "recompiled" in r.getMessage()]
    assert len(warned) == 1 and "by step 5" in warned[0], warned
    assert "torch.compile: each of the 2 blocks" in caplog.text

    resumed, _ = run("compiled", "train.compile=false", "train.steps=8")
    assert resumed["resumed_from_step"] == 6 and resumed["final_step"] == 8
