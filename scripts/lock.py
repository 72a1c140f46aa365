"""Write the image's lock files: every Python package of
``memtrain[train,hf,strategies,tracking]``, pinned with hashes.

    python scripts/lock.py            # make lock: (re)write docker/requirements/{gpu,cpu}.txt
    python scripts/lock.py --check    # exit 1 when pyproject.toml changed since the last lock

The image installs one of them with ``pip install --require-hashes --no-deps``, so a build gets
exactly these files or fails. Both are resolved for the image's platform (Linux x86_64, glibc
2.28+, Python 3.11), not for the machine running this script:

- ``gpu.txt``: torch from PyPI, whose Linux build bundles CUDA 13's runtime libraries as
  ``nvidia-*`` wheels (so the image needs no CUDA base, only a driver that supports CUDA 13);
- ``cpu.txt``: torch's CPU build (``2.13.0+cpu``), from ``TORCH_FIND_LINKS`` (default: PyTorch's
  CPU wheel listing); everything else is the same as in ``gpu.txt``.

Each file starts with the digest of what it was resolved from (pyproject.toml's dependency
lists and this script's resolver arguments); ``--check`` and tests/deploy compare it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docker" / "requirements"
PLATFORM = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28"]
INDEX = "https://pypi.org/simple"
TORCH_CPU = "torch==2.13.0+cpu"
# It trains, Hugging Face models too, with every memory strategy (LoRA: peft; 8-bit, 4-bit and
# bf16 optimizer states and bf16 weights: torchao), and runs MLflow. Not dev's tools, nor bench's.
EXTRAS = ("train", "hf", "strategies", "tracking")
DIGEST_PREFIX = "# inputs-sha256: "


def inputs_digest(pyproject: Path = REPO / "pyproject.toml") -> str:
    """What a lock depends on: the core dependencies and the image's extras, the Python range,
    and how the resolver is called. Any change to them means the lock is stale."""
    project = tomllib.loads(pyproject.read_text())["project"]
    inputs = {"dependencies": project["dependencies"],
              **{extra: project["optional-dependencies"][extra] for extra in EXTRAS},
              "requires-python": project["requires-python"],
              "resolver": PLATFORM + [INDEX, TORCH_CPU]}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def recorded_digest(lock: Path) -> str | None:
    for line in lock.read_text().splitlines():
        if line.startswith(DIGEST_PREFIX):
            return line.removeprefix(DIGEST_PREFIX).strip()
    return None


def compile_lock(variant: str, torch_find_links: str) -> str:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        raise SystemExit("lock: uv not found (pip install uv; `make setup` installs it)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lock.txt"
        cmd = [uv, "pip", "compile", str(REPO / "pyproject.toml"),
               *(arg for extra in EXTRAS for arg in ("--extra", extra)),
               "--generate-hashes", "--no-header", "--index-url", INDEX, *PLATFORM, "-o", str(out)]
        if variant == "cpu":
            override = Path(tmp) / "override.txt"
            override.write_text(TORCH_CPU + "\n")
            cmd += ["--find-links", torch_find_links, "--override", str(override)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return out.read_text()


def write(variant: str, torch_find_links: str) -> Path:
    body = compile_lock(variant, torch_find_links)
    header = (f"# memtrain[{','.join(EXTRAS)}] for the {variant.upper()} image (Linux x86_64, "
              "Python 3.11), pinned with hashes.\n"
              "# Written by `make lock` (scripts/lock.py); do not edit.\n"
              f"{DIGEST_PREFIX}{inputs_digest()}\n")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{variant}.txt"
    path.write_text(header + body)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a lock is stale")
    parser.add_argument("--torch-find-links", default=os.environ.get(
        "TORCH_FIND_LINKS", "https://download.pytorch.org/whl/cpu/torch/"),
        help="where the CPU build of torch is listed (a URL or a folder of wheels)")
    args = parser.parse_args()
    if args.check:
        stale = [variant for variant in ("gpu", "cpu")
                 if not (OUT / f"{variant}.txt").is_file()
                 or recorded_digest(OUT / f"{variant}.txt") != inputs_digest()]
        if stale:
            print(f"lock: docker/requirements/{{{','.join(stale)}}}.txt are stale against "
                  "pyproject.toml: run make lock", file=sys.stderr)
            raise SystemExit(1)
        return
    for variant in ("gpu", "cpu"):
        print(f"lock: wrote {write(variant, args.torch_find_links).relative_to(REPO)}")


if __name__ == "__main__":
    main()
