"""Launch edge: everything the driver does before and after the workers train.

``prepare_run`` turns a loaded config into one the workers can use anywhere (absolute paths),
checks what would otherwise fail late inside a worker (dataset present, batch arithmetic, worker
count against CPUs), and writes the resolved config into the run directory. The launchers
themselves live in ``local.py`` (in-process or spawned processes, no Ray) and ``ray.py``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from datapipe.manifest import read_manifest
from trainer.config import Config, ConfigError


def setup_logging() -> None:
    logging.basicConfig(format="%(message)s", level=logging.INFO, force=True)


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare_run(cfg: Config) -> tuple[Config, Path]:
    """Validate ``cfg`` for launching and return it with absolute paths, plus the run directory."""
    data = cfg.data.model_copy(update={
        "path": str(Path(cfg.data.path).resolve()),
        "val_path": str(Path(cfg.data.val_path).resolve()) if cfg.data.val_path else None,
    })
    run = cfg.run.model_copy(update={"dir": str(Path(cfg.run.dir).resolve())})
    cfg = cfg.model_copy(update={"data": data, "run": run})
    workers = cfg.parallel.workers
    if not cfg.parallel.use_gpu and workers > available_cpus():
        raise ConfigError(f"parallel.workers ({workers}) is more than the {available_cpus()} "
                          "CPUs of this machine and parallel.use_gpu is false")
    cfg.train.accumulation_steps(workers)  # raises ConfigError on impossible batch arithmetic
    for field, path in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if path is None:
            continue
        try:
            manifest = read_manifest(path)
        except ValueError as err:
            raise ConfigError(f"{field}: {err}") from err
        spec = manifest.column(cfg.data.column)
        if spec.shape != (cfg.model.seq_len + 1,):
            raise ConfigError(f"{field}: column {spec.name!r} has rows of shape {list(spec.shape)},"
                              f" model.seq_len {cfg.model.seq_len} needs [{cfg.model.seq_len + 1}]")
    run_dir = Path(cfg.run.dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return cfg, run_dir
