from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from monitoring.report import render_report
from tests.conftest import tiny_config
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run


@pytest.mark.slow
def test_report_png_has_the_size_and_content_of_three_plots(corpus_dir: Path,
                                                             tmp_path: Path) -> None:
    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1", "train.steps=6",
        "train.log_every=1", "train.eval_every=0", "run.name=report"))
    launch_local(cfg, run_dir)
    png = render_report(run_dir)
    pixels = imread(png)
    assert pixels.shape[:2] == (1000, 900)  # 9 x 10 inches at 100 dpi
    rgb = pixels[..., :3].reshape(-1, 3)
    colours = np.unique((rgb * 255).astype(np.uint8), axis=0)
    assert len(colours) > 50  # lines, text and axes, not a blank canvas
    assert (rgb < 0.5).mean() > 0.005  # some dark ink: labels and lines


def test_report_of_a_directory_without_metrics_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="has no rank-\\*.jsonl"):
        render_report(tmp_path)
