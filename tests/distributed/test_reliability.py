"""Nothing lost: a crash while a checkpoint is written, non-finite numbers, unsafe loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import require_root_mount, tiny_config
from trainer.checkpoint.files import complete_checkpoints
from trainer.errors import NonFiniteError
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]


def test_a_crash_during_checkpoint_write_keeps_the_previous_one_latest(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "train.steps=6",
        "train.checkpoint_every=2", "train.eval_every=0", "run.name=crash"))
    monkeypatch.setenv("MEMTRAIN_FAULTS", "checkpoint@4")
    with pytest.raises(Exception, match="checkpoint write failed at step 4"):
        launch_local(cfg, run_dir)
    assert [step for step, _ in complete_checkpoints(run_dir)] == [2]
    assert (run_dir / ".staging-checkpoint-00000004" / "state.pt").is_file()  # never published
    monkeypatch.delenv("MEMTRAIN_FAULTS")
    resumed = launch_local(cfg, run_dir)
    assert resumed["resumed_from_step"] == 2 and resumed["final_step"] == 6
    # the restart's cause is the failed write, the error the previous launch's rank recorded
    assert resumed["restarts"] == {"worker_error": 1}
    assert [step for step, _ in complete_checkpoints(run_dir)] == [2, 4, 6]


def test_consecutive_non_finite_steps_stop_the_run_naming_step_and_rank(
        corpus_dir: Path, tmp_path: Path) -> None:
    # A learning rate this large makes the weights overflow to inf within a few steps.
    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "memory.precision=fp32", "train.lr=1e30", "train.warmup_steps=0", "train.steps=40",
        "train.grad_clip=1e30", "train.max_nonfinite_steps=3", "train.checkpoint_every=0",
        "train.eval_every=0", "run.name=nan"))
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps, the last at step \d+ on "
                                             r"rank 0"):
        launch_local(cfg, run_dir)
    assert complete_checkpoints(run_dir) == []  # no checkpoint of broken weights


def test_every_torch_load_in_the_code_uses_weights_only() -> None:
    offenders = []
    for path in [*REPO.glob("trainer/**/*.py"), *REPO.glob("datapipe/**/*.py"),
                 *REPO.glob("monitoring/**/*.py"), *REPO.glob("scripts/*.py"),
                 *REPO.glob("bench/*.py"), *REPO.glob("tests/**/*.py")]:
        text = path.read_text()
        for match in re.finditer(r"torch\.load\(", text):
            call = text[match.start(): text.find(")", match.start()) + 1]
            if "weights_only=True" not in call:
                offenders.append(f"{path.relative_to(REPO)}: {call}")
    assert not offenders, offenders


def test_a_model_with_nan_weights_is_never_checkpointed(tmp_path: Path) -> None:
    import torch

    from trainer.context import LocalContext
    from trainer.models.gpt import GPT, GPTConfig
    from trainer.state import TrainState

    model = GPT(GPTConfig(seq_len=8, n_layer=1, n_head=1, n_embd=8))
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight[0, 0] = float("nan")
    ctx = LocalContext(0, 0, 1, torch.device("cpu"), tmp_path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(NonFiniteError, match=r"refusing to checkpoint step 7 on rank 0: "
                                             r"non-finite weights in \['blocks.0.mlp.fc.weight'\]"):
        TrainState(model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False),
                   None, step=7).save(ctx, {})  # type: ignore[arg-type]
    assert complete_checkpoints(tmp_path) == []


def test_fp16_overflow_is_skipped_by_the_grad_scaler_and_counted(corpus_dir: Path,
                                                                 tmp_path: Path) -> None:
    import json
    import warnings

    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "memory.precision=fp16", "memory.grad_scaler_init_scale=1e8", "train.steps=12",
        "train.log_every=1", "train.eval_every=0", "run.name=fp16"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU warns by design
        summary = launch_local(cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics" / "rank-0.jsonl").read_text()
            .splitlines()]
    # A scale of 1e8 overflows fp16 gradients: the scaler skips and halves until they fit.
    assert 1 <= summary["skipped_steps"] < 12
    assert rows[-1]["scale"] < 1e8
    assert rows[-1]["skipped_steps"] == summary["skipped_steps"]
    assert [r["skipped_steps"] for r in rows][-1] == [r["skipped_steps"] for r in rows][-3]
    assert summary["final_loss"] < summary["first_loss"] - 0.3  # and then training went on


def test_a_full_disk_at_checkpoint_time_stops_the_run_and_keeps_the_previous_one(
        corpus_dir: Path, tmp_path: Path) -> None:
    """The run directory on a tmpfs that holds one checkpoint but not two."""
    import subprocess

    from trainer.checkpoint.files import CheckpointWriteError

    require_root_mount()
    probe_cfg, probe_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path / "probe", "parallel.launcher=local", "parallel.workers=1",
        "train.steps=2", "train.checkpoint_every=2", "train.eval_every=0", "run.name=probe"))
    launch_local(probe_cfg, probe_dir)
    one_checkpoint = sum(f.stat().st_size for f in (probe_dir / "checkpoint-00000002").iterdir())

    small = tmp_path / "small"
    small.mkdir()
    size_kib = int(one_checkpoint * 1.5) // 1024 + 256  # one checkpoint and the logs, not two
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(small)],
                   check=True)
    try:
        cfg, run_dir = prepare_run(tiny_config(
            corpus_dir, small, "parallel.launcher=local", "parallel.workers=1",
            "train.steps=6", "train.checkpoint_every=2", "train.eval_every=0", "run.name=full"))
        with pytest.raises(CheckpointWriteError, match=r"checkpoint of step 4 could not be "
                                                      r"written .*No space left on device.*"
                                                      r"previous checkpoint stays the latest"):
            launch_local(cfg, run_dir)
        assert [step for step, _ in complete_checkpoints(run_dir)] == [2]
        assert not (run_dir / ".staging-checkpoint-00000004").exists()  # cleaned up
        from trainer.checkpoint.files import load_checkpoint

        assert load_checkpoint(run_dir / "checkpoint-00000002")["step"] == 2  # still loads
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_read_only_storage_is_one_clear_line_and_the_checkpoint_survives(
        corpus_dir: Path, tmp_path: Path) -> None:
    """A run directory whose filesystem turned read-only (remounted) before a resume."""
    import subprocess

    from tests.conftest import tiny_train_command
    from trainer.checkpoint.files import load_checkpoint

    require_root_mount()
    store = tmp_path / "store"
    store.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(store)], check=True)
    try:
        command = tiny_train_command(corpus_dir, store, "train.steps=2",
                                     "train.checkpoint_every=2", "train.eval_every=0",
                                     "run.name=ro")
        first = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stderr[-2000:]
        subprocess.run(["mount", "-o", "remount,ro", str(store)], check=True)
        again = subprocess.run([*command, "--set", "train.steps=4"], capture_output=True,
                               text=True, timeout=300)
        assert again.returncode != 0
        *said, line = again.stderr.strip().splitlines()
        assert said == ["resuming with train.steps changed: 2 -> 4"]  # then the one error line
        assert line.startswith("memtrain: error: ") and "Read-only file system" in line
        assert str(store / "ro") in line  # names where it could not write
        assert load_checkpoint(store / "ro" / "checkpoint-00000002")["step"] == 2
    finally:
        subprocess.run(["umount", str(store)], check=False)
