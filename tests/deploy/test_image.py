"""The image built and run for real: the CPU variant of docker/Dockerfile under podman
(scripts/image_check.py, `make image-check`). Where podman is absent (CI's machines), this skips
and says so; the figures of the last run are in docs/deploy.md."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# In the Ray tests' process: the check starts Ray heads and trainings of its own, and beside the
# Ray tests on two cores it slows their clusters past their timeouts.
pytestmark = [pytest.mark.deploy, pytest.mark.xdist_group("ray")]


def test_the_cpu_image_builds_trains_as_non_root_and_serves_submitted_jobs(
        tmp_path: Path) -> None:
    """Besides the demo: LoRA with 8-bit AdamW states trains in the image (its lock holds peft
    and torchao, and it has the compiler torchao's compiled step needs)."""
    if shutil.which("podman") is None:
        pytest.skip("podman not installed (apt-get install podman runc debootstrap): the image "
                    "is checked offline only; make image-check builds and runs it")
    if not (REPO / "data/stdlib/train/manifest.json").is_file():
        pytest.skip("no demo data (make data)")
    wheels = Path("/opt/wheels")  # this machine's torch CPU wheel; elsewhere PyTorch's index
    links = ["--torch-find-links", str(wheels)] if any(wheels.glob("torch-*+cpu-*.whl")) else []
    out = subprocess.run([sys.executable, str(REPO / "scripts/image_check.py"), "--out",
                          str(tmp_path), "--steps", "8", *links],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = json.loads((tmp_path / "image-check.json").read_text())
    assert figures["demo_steps"] == 8 and figures["healthcheck"] == "passed"
    assert figures["resubmitted_run"] == "resumed from step 4, finished at 8"
    assert figures["lora_8bit_steps"] == 4 and figures["lora_8bit_moment_to_weight_bytes"] < 0.5
    # a code-only change is memtrain's own small layers, never the locked packages' layer
    biggest = max(size for _, size, _ in figures["layers"])
    assert figures["code_change_layers"] >= 1
    assert figures["code_change_push_kib"] * 1024 < 0.01 * biggest
