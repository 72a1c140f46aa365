"""Asynchronous checkpoint saves (``train.checkpoint_async``, ``trainer/checkpoint/async_save.py``):
staged copies that the next step cannot change, the same checkpoints as a synchronous save, and a
crash in the middle of a save that leaves the previous checkpoint the latest."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.conftest import logged_losses, tiny_config
from trainer.checkpoint.async_save import staged
from trainer.checkpoint.files import published_checkpoints
from trainer.checkpoint.publish import rank_parts_prefix
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run


@pytest.mark.slow
def test_staged_copies_share_nothing_with_what_the_next_step_changes() -> None:
    """Plain tensors and torchao's 8-bit AdamW states (which implement neither ``clone`` nor
    ``new_empty``), changed in place after the staging as a step changes them."""
    from trainer.memory.optimizers import quiet_torchao_import

    with quiet_torchao_import():
        from torchao.optim.subclass_8bit import OptimState8bit

    weight, moment = torch.randn(64, 64), OptimState8bit.zeros((64, 64))
    moment.copy_(torch.randn(64, 64))
    before = {"w": weight.clone(), "m": moment.dequantize().clone()}
    copy = staged({"model": {"w": weight}, "state": {"exp_avg": moment}, "step": 1})
    weight.add_(1.0)
    moment.copy_(torch.randn(64, 64))
    assert torch.equal(copy["model"]["w"], before["w"])
    assert type(copy["state"]["exp_avg"]) is OptimState8bit
    assert torch.equal(copy["state"]["exp_avg"].dequantize(), before["m"])
    assert not torch.equal(moment.dequantize(), before["m"])
    assert copy["step"] == 1


COMMON = ("parallel.launcher=local", "parallel.workers=2", "train.steps=6",
          "train.checkpoint_every=2", "train.eval_every=0", "train.log_every=1")


def _run(corpus_dir: Path, tmp_path: Path, name: str, *overrides: str,
         until: int | None = None) -> tuple[dict, Path]:
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *COMMON, *overrides,
                                           f"run.name={name}"))
    return launch_local(cfg, run_dir, until_step=until), run_dir


@pytest.mark.slow
def test_async_saves_write_what_sync_saves_do_and_resume_exactly(
        corpus_dir: Path, tmp_path: Path) -> None:
    """2 DDP workers, a checkpoint every 2 steps on the save thread: the losses of a
    synchronous run, the same DCP bytes in its last checkpoint, and a resume from the
    step-4 checkpoint to the same losses. The step waited less than the saves took."""
    _, sync_dir = _run(corpus_dir, tmp_path, "sync")
    summary, async_dir = _run(corpus_dir, tmp_path, "async", "train.checkpoint_async=true",
                              until=4)
    assert [s for s, _ in published_checkpoints(async_dir)] == [2, 4]
    resumed, _ = _run(corpus_dir, tmp_path, "async", "train.checkpoint_async=true")
    assert resumed["resumed_from_step"] == 4
    assert logged_losses(async_dir)[-6:] == logged_losses(sync_dir)
    last = "checkpoint-00000006"
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert (async_dir / last / name).read_bytes() == (sync_dir / last / name).read_bytes()


@pytest.mark.slow
def test_a_crash_in_the_middle_of_an_async_save_leaves_the_previous_checkpoint(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 killed in step 4's save, its files written and not published: the run fails
    naming the signal, step 2 stays the latest, and the rerun resumes from it to the losses
    of an uninterrupted run. The killed rank's part, left in the system's temporary directory,
    was cleared by the rerun's start."""
    _, straight = _run(corpus_dir, tmp_path, "straight")
    monkeypatch.setenv("MEMTRAIN_FAULTS", "savekill@4")
    with pytest.raises(RuntimeError, match=r"rank 0 exited with code -9 \(signal SIGKILL\)"):
        _run(corpus_dir, tmp_path, "crash", "train.checkpoint_async=true")
    crashed = tmp_path / "crash"
    assert [s for s, _ in published_checkpoints(crashed)] == [2]
    parts = Path(tempfile.gettempdir()).glob(rank_parts_prefix(crashed) + "*")
    assert any((part / "__0_0.distcp").is_file() for part in parts)  # rank 0's, killed
    summary, _ = _run(corpus_dir, tmp_path, "crash", "train.checkpoint_async=true")
    assert summary["resumed_from_step"] == 2
    assert not list(Path(tempfile.gettempdir()).glob(rank_parts_prefix(crashed) + "*"))
    losses = logged_losses(crashed)
    assert losses[-4:] == logged_losses(straight)[-4:]
