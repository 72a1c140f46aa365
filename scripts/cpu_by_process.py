"""Run a command and say where the machine's CPU time went, by kind of process (Linux only).

    python scripts/cpu_by_process.py -- .venv/bin/pytest -n 2 --dist loadgroup

Every process on the machine is sampled from /proc twice a second; each is named by what it is
(a Ray actor by its class, a Ray node's daemons, a ``memtrain`` subcommand, a local launcher
worker, an xdist worker) and its CPU seconds while the command ran are summed per name. What
a process spends after the last sample before it exits (up to half a second) is missed, and so
is a process that lives less than that. This is how the test suite's time was
split between Ray, the local launcher's workers and the tests' own processes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
# A process's name for the table: the first of these found in its command line.
KINDS = re.compile(
    r"(dashboard/agent\.py|dashboard/dashboard\.py|runtime_env/agent|log_monitor|monitor\.py"
    r"|default_worker\.py|trainer\.cli \w+|tests\.distributed\.multinode|without_training_deps"
    r"|xdist|gpu_check|forkserver|spawn_main|compileall|moto_server|prometheus|promtool)")
# Names a process shows before it becomes what it will be (an idle Ray worker becomes an actor).
PROVISIONAL = {"default_worker.py", "ray::IDLE", "python", "python3", "python3.11"}


def kind(pid: str) -> str | None:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if command.startswith("ray::"):  # a Ray worker titles itself with its actor and method
        return command.split()[0].split(".")[0]
    for daemon in ("gcs_server", "raylet"):
        if name.startswith(daemon):
            return daemon
    found = KINDS.search(command)
    return found.group(1) if found else name


def cpu_seconds(pid: str) -> tuple[str, float] | None:
    """(start time, user + system seconds) of a process, or None once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[19], (int(fields[11]) + int(fields[12])) / TICKS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=30, help="rows to print")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")

    before: dict[tuple[str, str], float] = {}  # CPU already spent when the command started
    seen: dict[tuple[str, str], list] = {}  # (pid, start) -> [kind, CPU seconds]

    def sample(first: bool = False) -> None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            stat = cpu_seconds(pid)
            if stat is None:
                continue
            key = (pid, stat[0])
            if first:
                before[key] = stat[1]
            entry = seen.get(key)
            if entry is None or entry[0] in PROVISIONAL:
                name = kind(pid)
                if name is None:
                    continue
                if entry is None or name not in PROVISIONAL:
                    entry = seen[key] = [name, stat[1]]
            entry[1] = stat[1]

    sample(first=True)
    started = time.monotonic()
    process = subprocess.Popen(command)
    while process.poll() is None:
        sample()
        time.sleep(0.5)
    wall = time.monotonic() - started
    cpu: Counter[str] = Counter()
    processes: Counter[str] = Counter()
    for key, (name, seconds) in seen.items():
        cpu[name] += seconds - before.get(key, 0.0)
        processes[name] += 1
    print(f"\n{'CPU s':>9} {'procs':>6}  kind (wall {wall:.0f} s, {os.cpu_count()} CPUs)",
          file=sys.stderr)
    for name, seconds in cpu.most_common(args.top):
        print(f"{seconds:9.1f} {processes[name]:6d}  {name}", file=sys.stderr)
    print(f"{cpu.total():9.1f} {'':6}  all", file=sys.stderr)
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
