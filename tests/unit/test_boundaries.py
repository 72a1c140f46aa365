"""The core never imports the orchestrator: only trainer.launch.ray imports ray."""

from __future__ import annotations

import subprocess
import sys


def test_loop_loader_and_cli_do_not_import_ray() -> None:
    code = ("import sys, trainer.loop, trainer.cli, trainer.launch.local, datapipe.loader, "
            "monitoring; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_datapipe_does_not_import_trainer() -> None:
    code = "import sys, datapipe.loader, datapipe.corpus; print('trainer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
