"""A short soak through the real loop (loader, metrics exporter, evaluation, checkpoints): the
live-tensor count and resident memory stay flat after warm-up. ``bench/soak.py`` runs the long
version (5000 steps, < 1%); this one is 600 steps with a looser memory bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import soak

pytestmark = pytest.mark.unit


@pytest.mark.slow
def test_a_short_soak_stays_flat(tmp_path: Path) -> None:
    report = soak(steps=600, every=50, warmup_share=0.25, work=tmp_path)
    assert len(report["samples"]) >= 10
    assert report["live_tensor_growth"] == 0, report["live_tensors"]
    assert report["resident_growth"] < 0.05, report["resident_bytes"]
    assert report["leak_findings"] == []
