"""scripts/cpu_by_process.py: a command's CPU seconds, summed by kind of process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

# A child that spends 2 s of CPU, then exits 3. (What a process spends after the last sample,
# up to half a second apart, is not counted.)
BURN = ("import sys, time\nstart = time.process_time()\n"
        "while time.process_time() - start < 2:\n    pass\nsys.exit(3)\n")


@pytest.mark.slow
def test_a_commands_cpu_seconds_are_counted_and_its_exit_code_kept() -> None:
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "cpu_by_process.py"), "--",
                          sys.executable, "-c", BURN], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 3, out.stderr
    rows = [(float(m.group(1)), m.group(2)) for m in
            re.finditer(r"^\s*([0-9.]+)\s+\d+\s+(\S.*)$", out.stderr, re.MULTILINE)]
    assert max(seconds for seconds, _ in rows) >= 1.0, out.stderr  # the child's own row
    total = re.search(r"^\s*([0-9.]+)\s+all$", out.stderr, re.MULTILINE)
    assert total is not None and float(total.group(1)) >= 1.0, out.stderr
