from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import tiny_config
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run
from trainer.models.gpt import GPT, GPTConfig
from trainer.telemetry.diagnostics import Diagnostics, LeakGuard, parse_step_range


def _eval_loop(detach: bool) -> list[str]:
    """Evaluation without no_grad, summing the loss: the guide's pitfall when not detached."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=128, n_layer=2, n_head=2, n_embd=128))
    guard = LeakGuard(warmup_steps=2)
    total = torch.zeros(())
    for step in range(1, 13):
        tokens = torch.randint(0, 256, (16, 129))
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        # Not detached, the running total keeps every step's graph and its activations alive.
        total = total + (loss.detach() if detach else loss)
        del loss
        guard.sample(step, torch.device("cpu"))
    return guard.findings()


@pytest.mark.slow
def test_leak_guard_flags_a_loss_summed_without_detach() -> None:
    findings = _eval_loop(detach=False)
    assert any(f.startswith("resident_bytes grew") for f in findings), findings


@pytest.mark.slow
def test_leak_guard_passes_the_same_loop_with_detach() -> None:
    assert _eval_loop(detach=True) == []


def test_leak_guard_counts_tensors_kept_by_python_references() -> None:
    guard = LeakGuard(warmup_steps=0)
    kept = []
    for step in range(1, 5):
        kept.append(torch.ones(3))  # e.g. outputs appended to a list for later logging
        guard.sample(step, torch.device("cpu"))
    assert any("live tensors grew" in f for f in guard.findings())


class _Referent:
    pass


@pytest.fixture
def dead_proxy() -> Iterator[object]:
    """A ``weakref.proxy`` whose referent has died, alive in gc for the test: what a library
    in the same process (a tracker, transformers, Ray) may hold. Any look at it but its type
    raises ``ReferenceError``."""
    referent = _Referent()
    proxy = weakref.proxy(referent)
    del referent
    held = [proxy]
    with pytest.raises(ReferenceError):
        isinstance(proxy, torch.Tensor)  # noqa: B015 (what the guard must not do)
    yield held
    held.clear()


def test_counting_tensors_never_looks_through_a_dead_proxy(dead_proxy: object) -> None:
    guard = LeakGuard(warmup_steps=0)
    guard.sample(1, torch.device("cpu"))
    kept = [torch.ones(2), torch.nn.Parameter(torch.zeros(3))]  # a subclass counts too
    guard.sample(2, torch.device("cpu"))
    del kept
    guard.sample(3, torch.device("cpu"))
    counts = [sample.live_tensors for sample in guard.samples]
    assert counts[1] == counts[0] + 2 and counts[2] == counts[0], counts


def test_a_failing_diagnostic_warns_once_and_turns_off(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise ReferenceError("weakly-referenced object no longer exists")

    diagnostics = Diagnostics(rank=3)
    with caplog.at_level(logging.WARNING, logger="memtrain"):
        for _ in range(3):
            assert diagnostics.run("the leak guard", broken) is None
    assert len(calls) == 1
    assert diagnostics.off == {"the leak guard":
                               "ReferenceError: weakly-referenced object no longer exists"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["the leak guard failed on rank 3 and is off for the rest of this run: "
                        "ReferenceError: weakly-referenced object no longer exists"]
    assert diagnostics.run("the profiler", lambda: 7) == 7  # the others stay on


@pytest.mark.slow
def test_the_real_loop_keeps_memory_flat(corpus_dir: Path, tmp_path: Path,
                                         dead_proxy: object) -> None:
    """The real loop with the leak guard every 2 steps, a dead weak proxy in the process."""
    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "memory.leak_check_every=2", "train.steps=14", "train.eval_every=4",
        "train.checkpoint_every=5", "memory.profile_steps='3:4'", "run.name=flat"))
    summary = launch_local(cfg, run_dir)
    assert summary["leak_findings"] == [] and summary["diagnostics_off"] == {}
    assert len(summary["leak_samples"]) == 5  # steps 6 to 14, every 2 (warm-up: 5 steps)
    trace = json.loads((run_dir / "profile" / "rank-0.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "[memory]" in names  # allocation events: the trace was taken with profile_memory


@pytest.mark.parametrize("text", ["3", "0:2", "5:4", "a:b"])
def test_bad_profile_ranges_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="profile_steps"):
        parse_step_range(text)


def test_gc_policy_collects_on_cadence_and_restores_automatic_gc(corpus_dir: Path,
                                                                  tmp_path: Path) -> None:
    import gc

    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "memory.gc_every=2", "train.steps=6", "train.eval_every=0", "run.name=gc"))
    before = gc.get_stats()[1]["collections"]
    launch_local(cfg, run_dir)
    assert gc.isenabled()
    assert gc.get_stats()[1]["collections"] - before >= 3  # steps 2, 4, 6
