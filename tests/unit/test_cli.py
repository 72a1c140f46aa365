"""Bad input: one line naming the field or file, a non-zero exit, no traceback."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.cli import main
from trainer.config import load_config

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo-cpu.yaml")


def memtrain(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120,
                          env=None if env is None else {**os.environ, **env})


def memtrain_here(capsys: pytest.CaptureFixture[str], *args: str
                  ) -> subprocess.CompletedProcess[str]:
    """``memtrain ARGS`` through the console entry point in this process (a subprocess costs
    seconds of imports); the root logger's handlers are put back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with pytest.raises(SystemExit) as exited:
            main(list(args))
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    captured = capsys.readouterr()
    code = exited.value.code
    return subprocess.CompletedProcess(args, code if isinstance(code, int) else 1, captured.out,
                                       captured.err)


@pytest.fixture(scope="module")
def bad_yaml(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cfg") / "bad.yaml"
    path.write_text("train: {steps: 3\n")
    return str(path)


@pytest.mark.parametrize("case, args, expected", [
    ("missing config", ["train", "-c", "nope.yaml"], "config file nope.yaml does not exist"),
    ("malformed config", ["train", "-c", "{bad_yaml}"], "not valid YAML"),
    ("unknown key", ["train", "-c", DEMO, "--set", "train.stepz=3"], "unknown key 'train.stepz'"),
    ("negative lr", ["train", "-c", DEMO, "--set", "train.lr=-0.1"], "train.lr"),
    ("accumulation 0", ["train", "-c", DEMO, "--set", "train.global_batch_size=8",
                        "--set", "train.micro_batch_size=8"], "train.global_batch_size (8)"),
    ("too many workers", ["train", "-c", DEMO, "--workers", "512"], "parallel.workers (512)"),
    ("missing dataset", ["train", "-c", DEMO, "--set", "data.path=/nonexistent/ds"],
     "data.path: dataset path /nonexistent/ds does not exist"),
    ("bad launcher", ["train", "-c", DEMO, "--launcher", "slurm"], "parallel.launcher"),
    ("inspect missing", ["data", "inspect", "/nonexistent/ds"], "does not exist"),
])
def test_bad_input_gives_one_line_and_exit_2(case: str, args: list[str], expected: str,
                                             bad_yaml: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    args = [a.replace("{bad_yaml}", bad_yaml) for a in args]
    result = memtrain_here(capsys, *args, "--set", f"run.dir={tmp_path}") \
        if args[0] == "train" else memtrain_here(capsys, *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("memtrain: error: ")
    assert expected in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_the_old_name_of_activation_checkpointing_every_is_refused_naming_the_new_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.models.build import (
        MemoryTransforms,
        build_model,
        checkpointed_blocks,
        model_factory,
    )

    old_file = tmp_path / "old.yaml"
    old_file.write_text("memory: {checkpoint_every_k: 3}\n")
    moved = "memory.checkpoint_every_k is now memory.activation_checkpointing_every"
    for args, source in [(["-c", DEMO, "--set", "memory.checkpoint_every_k=3"], DEMO),
                         (["-c", str(old_file)], str(old_file))]:
        # No dataset there: were the key taken, the run would stop before it starts.
        result = memtrain_here(capsys, "train", *args, "--set", f"run.dir={tmp_path}",
                               "--set", f"data.path={tmp_path / 'none'}")
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [f"memtrain: error: {source}: {moved}"]

    new_file = tmp_path / "new.yaml"
    new_file.write_text("memory: {activation_checkpointing: selective, "
                        "activation_checkpointing_every: 3}\nmodel: {n_layer: 5}\n")
    for cfg in (load_config(new_file),
                load_config(None, ["memory.activation_checkpointing=selective", "model.n_layer=5",
                                   "memory.activation_checkpointing_every=3"])):
        transforms = MemoryTransforms.of(cfg.memory)
        assert transforms.activation_checkpointing_every == 3
        model = build_model(model_factory(cfg.model), transforms)
        assert checkpointed_blocks(model) == [0, 3]  # the default, 2, gives [0, 2, 4]


@pytest.mark.slow
def test_debug_shows_the_traceback() -> None:
    result = memtrain("--debug", "train", "-c", "nope.yaml")
    assert result.returncode != 0
    assert "Traceback" in result.stderr


def test_help_lists_the_commands() -> None:
    result = memtrain("--help")
    assert result.returncode == 0
    for command in ("train", "data"):
        assert command in result.stdout


@pytest.mark.slow
def test_plan_reports_every_precision_and_checkpointing_choice() -> None:
    """Peaks and predicted tokens/s per row, ``auto``'s row marked, and ``--measure`` running
    the fastest predicted plans on this CPU beside their predictions, on this CPU's real
    calibration (the suite's shared cache, ``tests/conftest.py``: measured once)."""
    result = memtrain("plan", "-c", DEMO, "--device-memory", "1GiB", "--measure", "--top", "2",
                      "--steps", "1")
    assert result.returncode == 0, result.stderr
    table = result.stdout
    for mode in ("none", "selective", "full"):
        assert mode in table
    assert "global batch 32 kept" in table
    assert "peak at" in table  # the moment that sets each predicted peak
    # An 80-column terminal shows every line whole: no header or value cut to "…".
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= 80, table
    assert "backward start" in table and "selective" in table
    assert "tokens/s" in table and table.count("<- auto") == 1, table
    # Each memory strategy added to the configured plan: its own row, with host bytes.
    for strategy in ("as configured", "8-bit AdamW states", "optimizer step in backward",
                     "offload what checkpoints keep", "offload every saved tensor"):
        assert strategy in table, table
    words = " ".join(table.split())  # rich wraps long lines at 80 columns
    assert re.search(r"speed: .+ \(measured on this CPU, \d+ threads?, \d+ (min|h|days) ago, "
                     r"repeats within \d+% \((stable|over 10%: unstable)", words), table
    # The probes' profiler (torch's Kineto) logs to stderr from C++: held back.
    assert "USDT" not in result.stderr and "profiler_start" not in result.stderr, result.stderr
    # The demo's dataset may not be built in this checkout: its loader is measured or named.
    assert re.search(r"data loader: (\d[\d,]* us a batch of 1, [\d,]+ us of 16|not in the "
                     r"time model \(data/stdlib/train cannot be read here\))", table), table
    measured = table[table.index("measured: 2 fastest predicted plans"):]
    rows = [line.split() for line in measured.splitlines()
            if line.split() and line.split()[0] in ("fp32", "bf16")]
    assert len(rows) == 2, measured
    for row in rows:  # predicted and measured tokens/s, predicted and measured peak GiB
        predicted, got = (float(v.replace(",", "")) for v in row[3:5])
        assert predicted > 0 and got > 0
        assert float(row[5]) > 0 and float(row[6]) > 0


def test_plan_measures_cpu_configs_only(capsys: pytest.CaptureFixture[str]) -> None:
    result = memtrain_here(capsys, "plan", "-c", DEMO, "--measure", "--set",
                           "parallel.use_gpu=true")
    assert result.returncode == 2
    assert "--measure runs plans on this machine's CPU" in result.stderr
    assert "parallel.use_gpu" in result.stderr


def test_plan_rejects_a_bad_device_memory(capsys: pytest.CaptureFixture[str]) -> None:
    result = memtrain_here(capsys, "plan", "-c", DEMO, "--device-memory", "lots")
    assert result.returncode == 2
    assert "--device-memory 'lots'" in result.stderr


@pytest.mark.slow
def test_plan_divides_the_global_batch_over_the_sequence_groups(
        capsys: pytest.CaptureFixture[str]) -> None:
    """4 workers in sequence groups of 2 are 2 data ranks: a global batch of 2 is one row
    each, as ``train`` splits it, not a batch 4 workers cannot share."""
    result = memtrain_here(capsys, "plan", "-c", DEMO, "--workers", "4", "--set",
                           "parallel.sequence=2", "--set", "train.global_batch_size=2",
                           "--set", "train.micro_batch_size=1")
    assert result.returncode == 0, result.stderr
    assert "micro-batch 1 x accumulation 1 x 2 workers" in result.stdout


def test_plan_refuses_bf16_weights_where_auto_gives_fp32(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan`` refuses what ``train`` refuses: bf16 weights compute only in bf16, and
    ``auto`` resolves to fp32 here (a CPU without native bf16, stood in for: this machine's
    kind must not decide the test)."""
    import trainer.memory.precision

    monkeypatch.setattr(trainer.memory.precision, "cpu_bf16_support", lambda: "emulated")
    result = memtrain_here(capsys, "plan", "-c", DEMO, "--set", "model.dtype=bf16",
                           "--set", "memory.optimizer_states=bf16")
    assert result.returncode == 2
    assert "model.dtype 'bf16': memory.precision auto resolves to fp32 here" in result.stderr


@pytest.mark.slow
def test_plan_keeps_bf16_weights_and_the_step_in_backward_to_what_train_runs(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """bf16 weights are probed in bf16 alone; the optimizer step in backward takes one
    micro-batch a step, so the fastest-plans table keeps the per-rank batch whole (16 = 32
    over 2 workers) and marks no ``auto`` row (``train`` refuses ``auto`` there)."""
    from trainer.plan import calibrate as calibration
    from trainer.plan import devices as plan_devices

    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "calibrate_cpu", lambda: plan_devices.DeviceSpeed(
        "test CPU", {"matmul:fp32:k256": 1e11, "matmul:bf16:k256": 1e11, "memory:fp32": 1e10},
        {"matmul": 1e-5, "memory": 1e-5}, 1e9, source="a stand-in"))
    result = memtrain_here(capsys, "plan", "-c", DEMO, "--device-memory", "1GiB",
                           "--set", "model.n_layer=1", "--set", "model.dtype=bf16",
                           "--set", "memory.precision=bf16", "--set", "train.grad_clip=0",
                           "--set", "memory.optimizer_states=8bit",
                           "--set", "memory.optimizer_in_backward=true",
                           "--set", "train.micro_batch_size=16")
    assert result.returncode == 0, result.stderr
    assert "(3 probes," in result.stdout  # bf16 x three checkpointing modes, no fp32
    best = result.stdout.split("fastest micro-batch")[1]
    rows = [line.split() for line in best.splitlines() if line.split()[:1] == ["bf16"]]
    assert len(rows) == 3, best
    assert all(row[2:4] == ["16", "1"] for row in rows), best
    assert "<- auto" not in best and "fp32" not in best


@pytest.mark.slow
def test_plan_with_the_micro_batch_auto_searches_it_and_names_bad_sizes(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """``train.micro_batch_size: auto`` is what the fastest-plans table searches: no table at a
    configured micro-batch, ``auto``'s row marked; a global batch the workers do not divide is
    one line naming both."""
    from trainer.plan import calibrate as calibration
    from trainer.plan import devices as plan_devices

    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "calibrate_cpu", lambda: plan_devices.DeviceSpeed(
        "test CPU", {"matmul:fp32:k256": 1e11, "matmul:bf16:k256": 1e11, "memory:fp32": 1e10},
        {"matmul": 1e-5, "memory": 1e-5}, 1e9, source="a stand-in"))
    result = memtrain_here(capsys, "plan", "-c", DEMO, "--device-memory", "1GiB",
                           "--set", "model.n_layer=1", "--set", "train.micro_batch_size=auto")
    assert result.returncode == 0, result.stderr
    assert "configured micro-batch" not in result.stdout
    assert "fastest micro-batch" in result.stdout and result.stdout.count("<- auto") == 1
    result = memtrain_here(capsys, "plan", "-c", DEMO, "--set", "train.micro_batch_size=auto",
                           "--set", "train.global_batch_size=31")
    assert result.returncode == 2
    assert "train.global_batch_size (31) must be a multiple of the workers (2)" in result.stderr


@pytest.mark.slow
def test_plan_calibrate_measures_this_cpu_again(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    from trainer.plan import calibrate as calibration
    from trainer.plan import devices as plan_devices

    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path))
    calls = []

    def calibrate() -> plan_devices.DeviceSpeed:
        calls.append(1)
        return plan_devices.DeviceSpeed(
            "test CPU", {"matmul:fp32:k256": 1e11, "memory:fp32": 1e10},
            {"matmul": 1e-5, "memory": 1e-5}, 1e9, source="a stand-in")

    monkeypatch.setattr(calibration, "calibrate_cpu", calibrate)
    for _ in range(2):
        result = memtrain_here(capsys, "plan", "-c", DEMO, "--device-memory", "1GiB",
                               "--calibrate", "--set", "model.n_layer=1",
                               "--set", "memory.bf16_norm_inputs=true")
        assert result.returncode == 0, result.stderr
        assert "speed: test CPU (a stand-in)" in result.stdout
        # The calibration's log line reaches the console, with the file that keeps it.
        assert re.search(r"^planner: calibrated this CPU in [\d.]+ s, repeats within \d+% "
                         rf"\({re.escape(str(tmp_path))}/cpu-speed-\w+\.json\)",
                         result.stderr, re.M), result.stderr
    assert len(calls) == 2  # measured on each --calibrate, read from the cache otherwise
