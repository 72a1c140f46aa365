"""``memory.precision: auto``: bf16 only where the hardware runs it natively.

The CPU's bf16 kind (``trainer.compat.cpu_bf16_support``) and CUDA's capability queries are
stubbed at their boundary so both branches run on any machine; one test checks the real one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_config
from trainer.compat import cpu_bf16_support
from trainer.config import Config, load_config
from trainer.memory import precision as precision_module
from trainer.memory.precision import resolve_precision
from trainer.parallel.choice import runs_fp16
from trainer.plan.auto import planned_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(("support", "expected"), [
    ("native", "bf16"), ("onednn-emulated", "fp32"), ("emulated", "fp32")])
def test_auto_on_cpu_takes_bf16_only_where_it_is_native(monkeypatch: pytest.MonkeyPatch,
                                                        support: str, expected: str) -> None:
    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: support)
    choice = resolve_precision("auto", CPU)
    assert choice.name == expected
    assert choice.warning is None
    assert ("no native bf16" in choice.reason) == (expected == "fp32")


def test_explicit_bf16_on_a_cpu_without_it_runs_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: "emulated")
    choice = resolve_precision("bf16", CPU)
    assert choice.name == "bf16"
    assert choice.warning is not None and "emulated" in choice.warning
    assert "\n" not in choice.warning
    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: "native")
    assert resolve_precision("bf16", CPU).warning is None
    assert resolve_precision("fp32", CPU).warning is None


@pytest.mark.parametrize(("native_bf16", "strategy", "expected"), [
    (True, "ddp", "bf16"), (False, "ddp", "fp16"), (False, "fsdp", "fp32"), (True, "fsdp", "bf16")])
def test_auto_on_cuda_takes_bf16_else_fp16(monkeypatch: pytest.MonkeyPatch, native_bf16: bool,
                                           strategy: str, expected: str) -> None:
    asked = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return native_bf16

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    cfg = Config.model_validate({"parallel": {"strategy": strategy}})
    choice = resolve_precision("auto", torch.device("cuda", 0), runs_fp16(cfg))
    assert choice.name == expected
    assert asked == [False]  # emulated bf16 does not count
    assert "Tesla V100" in choice.reason


def test_auto_resolves_to_this_machines_kind() -> None:
    """No stub: whatever this CPU is, ``auto`` agrees with ``cpu_bf16_support``."""
    native = cpu_bf16_support() == "native"
    assert resolve_precision("auto", CPU).name == ("bf16" if native else "fp32")


def test_shipped_configs_default_to_auto() -> None:
    root = Path(__file__).resolve().parents[2] / "configs"
    for path in sorted(root.glob("*.yaml")):
        assert load_config(path).memory.precision == "auto", path.name


def test_the_planner_plans_the_precision_auto_resolves_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo-cpu.yaml")
    for support, expected in (("native", "bf16"), ("emulated", "fp32")):
        monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda support=support: support)
        assert planned_precision(cfg) == expected
    gpu = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"use_gpu": True})})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert planned_precision(gpu) == "bf16"  # a driver without the run's GPU


def test_a_run_logs_the_choice_and_its_reason(corpus_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A one-step local run with ``auto`` on a stubbed CPU without bf16 trains in fp32 and
    says why in its start line."""
    from trainer.launch.local import launch_local
    from trainer.launch.prepare import prepare_run

    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: "emulated")
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "memory.precision=auto",
                                           "parallel.launcher=local", "parallel.workers=1",
                                           "train.steps=1", "train.eval_every=0",
                                           "train.checkpoint_every=0"))
    with caplog.at_level(logging.INFO, logger="memtrain"):
        summary = launch_local(cfg, run_dir)
    assert summary["precision"] == "fp32"
    start = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("training"))
    assert "precision fp32 (auto: this CPU" in start and "no native bf16" in start
