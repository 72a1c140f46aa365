"""``train()`` as a whole: its losses pinned against a recording, and cleanup on failure."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, tiny_config
from trainer.compat import cpu_capability
from trainer.launch import prepare_run
from trainer.launch.local import launch_local

pytestmark = pytest.mark.unit
RECORDED = json.loads((REPO / "tests" / "fixtures" / "losses_before_refactor.json").read_text())


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order, whatever the core count
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_twenty_steps_give_the_recorded_losses_bit_for_bit(precision: str, corpus_dir: Path,
                                                          tmp_path: Path, one_thread) -> None:
    """The losses of 20 steps, recorded with the loop as it was before ``train()`` was split
    into state, metrics and batch plan: any change to the order of seeding, data, steps or
    schedule changes a bit. Kernels differ between CPU instruction sets and the corpus between
    Python versions, so the recording holds where it was made (and on CI machines like it)."""
    here = {"cpu_capability": cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version()}  # the corpus is this Python's stdlib
    if any(RECORDED[key] != value for key, value in here.items()):
        pytest.skip(f"losses recorded with {', '.join(f'{k} {RECORDED[k]}' for k in here)}; "
                    f"this machine has {here}")
    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, f"memory.precision={precision}", "parallel.launcher=local",
        "parallel.workers=1", "train.steps=20", "train.log_every=1", "train.eval_every=0",
        "train.checkpoint_every=0", f"run.name=rec-{precision}",
        "memory.bf16_norm_inputs=true"))  # as recorded, before its default became "auto"
    launch_local(cfg, run_dir)
    rows = [json.loads(line) for line in
            (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    assert [r["loss"].hex() for r in rows if "loss" in r] == RECORDED["losses"][precision]


def test_a_run_that_fails_midway_restores_gc_and_stops_the_loader_threads(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Local runs and the tests train in-process: whatever a failed run turned off or started
    (automatic gc, the loaders' read-ahead threads) must be back or gone when it raises."""
    import gc
    import threading
    import time

    def loader_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("memtrain-read")]

    assert gc.isenabled() and not loader_threads()
    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "memory.gc_every=2", "train.steps=6", "train.checkpoint_every=2", "train.eval_every=2",
        "run.name=fails"))
    monkeypatch.setenv("MEMTRAIN_FAULTS", "checkpoint@4")
    seen_during: list[bool] = []
    monkeypatch.setattr("trainer.loop.gc.collect", lambda *a: seen_during.append(gc.isenabled()))
    with pytest.raises(OSError, match="checkpoint write failed at step 4"):
        launch_local(cfg, run_dir)
    assert seen_during == [False]  # gc was off while it trained (collected at step 2)
    assert gc.isenabled()
    deadline = time.monotonic() + 5  # shut down without waiting: idle threads exit at once
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loader_threads() == []
