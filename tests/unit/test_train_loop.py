"""``train()`` as a whole: its losses pinned against a recording and against a plain reference
loop, and cleanup on failure."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import pytest
import torch

from datapipe.loader import BatchLoader
from tests.conftest import REPO, tiny_config, tiny_train_command
from trainer.checkpoint.files import STATE_FILE, load_checkpoint, load_tensors
from trainer.compat import cpu_capability
from trainer.config import Config
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run
from trainer.memory.loss import summed_loss
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, build_model, model_factory
from trainer.optim import Schedule, build_optimizer

pytestmark = pytest.mark.unit
RECORDED = json.loads((REPO / "tests" / "fixtures" / "losses_before_refactor.json").read_text())


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order, whatever the core count
    yield
    torch.set_num_threads(threads)


# On another CPU kind the run is held to the recording's kernels as far as flags reach (ATen's
# AVX2 kernels, oneDNN's and MKL's AVX2 paths, bf16 emulated), set before torch loads. MKL's
# blocking and oneDNN's emulated bf16 still round differently there: measured on a Xeon with
# AMX, the 20 losses stay within 5.4e-7 (fp32) and 9.1e-5 (bf16) of the recording, while one
# step more of warm-up moves them by up to 0.34, so the tolerances below keep a margin of about
# 10x over rounding and are 300x tighter than any change of seeding, data or schedule.
AVX2_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2,STRICT",
                "OMP_NUM_THREADS": "1"}
ELSEWHERE_RTOL = {"fp32": 1e-5, "bf16": 1e-3}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_twenty_steps_give_the_recorded_losses(precision: str, corpus_dir: Path,
                                               tmp_path: Path) -> None:
    """The losses of 20 steps, recorded with the loop as it was before ``train()`` was split
    into state, metrics and batch plan: any change to the order of seeding, data, steps or
    schedule moves them. Bit for bit on the recording's CPU kind and torch; on any other x86
    kind within ``ELSEWHERE_RTOL``, from a ``memtrain train`` process on ``AVX2_KERNELS``.
    ``test_train_is_a_plain_loop_bit_for_bit`` holds the loop to a reference on every CPU."""
    if RECORDED["python"] != platform.python_version():  # the corpus is this Python's stdlib
        pytest.skip(f"losses recorded on the stdlib of Python {RECORDED['python']}")
    # The recording's own kind: AVX2 by the CPU itself, not by ATEN_CPU_CAPABILITY on a larger one
    exact = cpu_capability() == RECORDED["cpu_capability"] and torch.__version__ == \
        RECORDED["torch"] and "ATEN_CPU_CAPABILITY" not in os.environ
    if not exact and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the recording's AVX2 kernels are x86's")
    command = tiny_train_command(
        corpus_dir, tmp_path, f"memory.precision={precision}", "train.steps=20",
        "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
        f"run.name=rec-{precision}",
        "memory.bf16_norm_inputs=true")  # as recorded, before its default became "auto"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({} if exact else AVX2_KERNELS)}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in
            (tmp_path / f"rec-{precision}" / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    recorded = [float.fromhex(h) for h in RECORDED["losses"][precision]]
    if exact:
        assert [loss.hex() for loss in losses] == RECORDED["losses"][precision]
    else:
        assert losses == pytest.approx(recorded, rel=ELSEWHERE_RTOL[precision], abs=0)


def reference_run(cfg: Config) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """What ``train()`` computes for one CPU worker, written out as a plain loop (nanoGPT's
    shape) from the building blocks: the same seeded model, AdamW, schedule and loader, each
    step reseeded, its micro-batches' summed losses over the step's tokens, clipping, step.
    Returns each step's (loss, grad norm) and the final weights."""
    device = torch.device("cpu")
    model = build_model(model_factory(cfg.model), MemoryTransforms.of(cfg.memory), device,
                        seed=cfg.run.seed)
    policy = precision_policy(cfg.memory.precision, device, warn=False)
    optimizer = build_optimizer(model, cfg.train.lr, cfg.train.weight_decay, cfg.train.betas)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, Schedule.of(cfg.train))
    accumulation = cfg.train.accumulation_steps(1)
    data = cfg.data
    records = []
    with BatchLoader(data.path, data.column, rank=0, world_size=1,
                     batch_size=cfg.train.micro_batch(), seed=cfg.run.seed, shuffle=data.shuffle,
                     device=device, shuffle_window=data.shuffle_window) as batches:
        model.train()
        for step in range(cfg.train.steps):
            # dropout's masks: a seed of (run seed, rank, step), so a resumed step redraws them
            torch.manual_seed((cfg.run.seed * 1_000_003 + step) % 2**63)
            micro_batches = [next(batches) for _ in range(accumulation)]
            tokens = sum(tokens_BT[:, 1:].numel() for tokens_BT in micro_batches)
            loss_sum = torch.zeros(())
            for tokens_BT in micro_batches:
                loss = summed_loss(model, tokens_BT, policy)
                (loss / tokens).backward()
                loss_sum += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            records.append(((loss_sum / tokens).item(), grad_norm.item()))
    return records, model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_is_a_plain_loop_bit_for_bit(precision: str, corpus_dir: Path, tmp_path: Path,
                                           one_thread) -> None:
    """On any CPU: ``train()`` with every cadence on (logging each step, evaluation,
    checkpoints, activation checkpointing, accumulation, dropout) gives the plain reference
    loop's losses, gradient norms and final weights to the last bit. Evaluation, checkpoints
    and metrics must change nothing the step computes."""
    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, f"memory.precision={precision}", "parallel.launcher=local",
        "parallel.workers=1", "train.steps=8", "train.log_every=1", "train.eval_every=3",
        "train.checkpoint_every=4", "model.dropout=0.1", f"run.name=ref-{precision}"))
    launch_local(cfg, run_dir)
    rows = [json.loads(line) for line in
            (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    trained = [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
    expected, weights = reference_run(cfg)
    assert [(loss.hex(), norm.hex()) for loss, norm in trained] == \
        [(loss.hex(), norm.hex()) for loss, norm in expected]
    final = max(run_dir.rglob(STATE_FILE), key=lambda path: load_checkpoint(path.parent)["step"])
    assert load_checkpoint(final.parent)["step"] == 8
    saved = load_tensors(final.parent, {
        name.replace("_checkpoint_wrapped_module.", ""): torch.empty_like(tensor)
        for name, tensor in weights.items()})
    assert all(torch.equal(saved[name.replace("_checkpoint_wrapped_module.", "")], tensor)
               for name, tensor in weights.items())


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
