"""Run preparation: what the driver does before any worker starts.

``prepare_run`` turns a loaded config into one the workers can use anywhere (absolute paths),
checks what would otherwise fail late inside a worker (dataset present, batch arithmetic, worker
count against CPUs, the run store reachable), resolves ``auto`` choices
(``trainer.plan.auto``), says what a resume changes (``trainer.launch.resume``), and writes
the resolved config into the run directory.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

from datapipe.manifest import read_manifest
from datapipe.paths import is_remote
from monitoring.run_files import CONFIG
from monitoring.trackers import PACKAGES as TRACKER_PACKAGES
from trainer.batches import DOCUMENT_IDS, LOSS_MASK
from trainer.checkpoint.adapters import check_resumed_base
from trainer.checkpoint.files import (
    checkpoint_step,
    latest_whole,
    published_checkpoints,
)
from trainer.checkpoint.integrity import local_problem
from trainer.checkpoint.publish import fetch_latest
from trainer.checkpoint.store import RemoteRun, default_work_dir
from trainer.config import Config, ConfigError, check_way_settings
from trainer.errors import first_line
from trainer.launch.resume import check_resume
from trainer.models.hf import PREFIX, config_vocab_size, has_weights
from trainer.plan.auto import resolve_auto

log = logging.getLogger("memtrain")


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare_run(cfg: Config, allow_changes: bool = False, fresh: bool = False
                ) -> tuple[Config, Path]:
    """Validate ``cfg`` for launching and return it with absolute paths, plus the run directory.
    A run name with a checkpoint resumes: what changed since its last launch is said, and a
    change that breaks exactness refused unless ``allow_changes`` (``trainer.launch.resume``);
    ``fresh`` moves such a run's directory aside first."""
    def absolute(path: str | None) -> str | None:
        return path if path is None or is_remote(path) else str(Path(path).resolve())

    data = cfg.data.model_copy(update={"path": absolute(cfg.data.path),
                                       "val_path": absolute(cfg.data.val_path)})
    remote = remote_run(cfg)
    if remote is not None:  # the store is the run directory; workers write a local copy
        try:
            remote.check()
        except OSError as err:
            raise _store_error(cfg, err) from err
        work = Path(cfg.run.work_dir).expanduser() if cfg.run.work_dir else \
            default_work_dir(cfg.run.dir)
        run = cfg.run.model_copy(update={"work_dir": str(work.resolve())})
    else:
        run = cfg.run.model_copy(update={"dir": str(Path(cfg.run.dir).resolve())})
    cfg = cfg.model_copy(update={"data": data, "run": run, "monitoring": _monitoring(cfg),
                                 "train": _init_from(cfg)})
    check_strategies(cfg)
    workers = cfg.parallel.workers
    joins_cluster = cfg.parallel.launcher == "ray" and bool(os.environ.get("RAY_ADDRESS"))
    if not cfg.parallel.use_gpu and not joins_cluster and workers > available_cpus():
        raise ConfigError(f"parallel.workers ({workers}) is more than the {available_cpus()} "
                          "CPUs of this machine and parallel.use_gpu is false")
    low, high = cfg.parallel.worker_range
    if low < high and cfg.parallel.launcher != "ray":
        raise ConfigError(f"parallel.workers [{low}, {high}]: an elastic range needs the Ray "
                          "launcher; the local launcher takes one number")
    # Everything that can be checked before auto is planned: a config that cannot run fails
    # in one line, before seconds of probing and lines about a plan that will not run.
    micro_auto = cfg.train.micro_batch_size == "auto"
    if not micro_auto:
        _check_world_sizes(cfg)
    _check_datasets(cfg)
    cfg = _planned(cfg)
    if micro_auto:
        _check_world_sizes(cfg)  # with the micro-batch auto chose
    run_dir = local_run_dir(cfg)
    if fresh:
        set_aside(cfg, run_dir, remote)
    _check_resume(cfg, run_dir, remote, allow_changes)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG).write_text(cfg.to_yaml())
    if remote is not None:
        try:
            remote.fetch_logs(run_dir)
            remote.upload_file(run_dir / CONFIG, CONFIG)
        except OSError as err:
            raise _store_error(cfg, err) from err
    return cfg, run_dir


def _planned(cfg: Config) -> Config:
    """``cfg`` with its ``auto`` choices resolved (``resolve_auto``), the model's split over the
    ranks checked (``check_splits``) before planning where the way is set, after it where
    ``auto`` chose it."""
    from trainer.parallel.choice import check_splits

    checked = check_splits(cfg)
    cfg = resolve_auto(cfg)
    if not checked:
        check_splits(cfg)
    return cfg


def _monitoring(cfg: Config) -> Any:
    """``cfg.monitoring``, its trackers' packages checked before any worker starts (not as a
    warning in each), MLflow's URI the driver's for every worker."""
    monitoring = cfg.monitoring
    for kind in monitoring.trackers:
        if importlib.util.find_spec(TRACKER_PACKAGES[kind]) is None:
            raise ConfigError(f"monitoring.trackers: {kind!r} needs the "
                              f"{TRACKER_PACKAGES[kind]} package: pip install "
                              "'memtrain[tracking]'")
    if "mlflow" in monitoring.trackers and monitoring.mlflow_tracking_uri is None \
            and os.environ.get("MLFLOW_TRACKING_URI"):
        monitoring = monitoring.model_copy(
            update={"mlflow_tracking_uri": os.environ["MLFLOW_TRACKING_URI"]})
    return monitoring


def _init_from(cfg: Config) -> Any:
    """``cfg.train`` with ``init_from`` and ``resume_from`` resolved to one whole checkpoint
    directory each (a run directory's latest), absolute, so every worker reads the same;
    ConfigError where there is none."""
    train = cfg.train
    if train.init_from is not None and train.resume_from is not None:
        raise ConfigError("train.init_from and train.resume_from: give one (weights alone, or "
                          "the whole state)")
    hf_weights = train.init_from is not None and train.init_from.startswith(PREFIX)
    update = {key: _whole_checkpoint(cfg, key, value) for key in ("init_from", "resume_from")
              if (value := getattr(train, key)) is not None and not (
                  key == "init_from" and hf_weights)}
    if hf_weights:
        update["init_from"] = _hf_weights(str(train.init_from))
    return train.model_copy(update=update)


def _hf_weights(value: str) -> str:
    """``train.init_from: hf:DIR``, checked (a directory with safetensors) and absolute, so every
    worker reads the same."""
    directory = Path(value.removeprefix(PREFIX)).expanduser().resolve()
    if not has_weights(str(directory)):
        raise ConfigError(f"train.init_from {value!r}: no model.safetensors (or its index) in "
                          f"{directory}")
    return f"{PREFIX}{directory}"


def _whole_checkpoint(cfg: Config, key: str, value: str) -> str:
    """The whole checkpoint ``train.<key>`` names: itself, or a run directory's latest."""
    if is_remote(value):
        raise ConfigError(f"train.{key} {value!r}: a local run or checkpoint directory "
                          "(download a store's checkpoint first)")
    path = Path(value).expanduser().resolve()
    hashes = cfg.run.checkpoint_verify == "hashes"
    if checkpoint_step(path.name) is not None:
        problem = local_problem(path, hashes) if path.is_dir() else "it does not exist"
        chosen = None if problem else path
    else:
        chosen = latest_whole(published_checkpoints(path), hashes)
        problem = "no whole checkpoint in it"
    if chosen is None:
        raise ConfigError(f"train.{key} {value!r}: {problem}")
    return str(chosen)


def _check_resume(cfg: Config, run_dir: Path, remote: RemoteRun | None,
                  allow_changes: bool) -> None:
    """A run with checkpoints resumes from its own latest: what changed is said (refused where
    exactness breaks unless ``allow_changes``), and ``train.resume_from`` is refused. A LoRA
    run resumes on the base its checkpoint trained on (``check_resumed_base``)."""
    previous = previous_config(run_dir, remote)
    if previous is None:
        if cfg.train.resume_from is not None:
            check_resumed_base(cfg, Path(cfg.train.resume_from), allow_changes, own=False)
        return
    if cfg.train.resume_from is not None:
        raise ConfigError(f"train.resume_from: run {cfg.run.name!r} has checkpoints of its "
                          "own, and its latest resumes; to start it from "
                          f"{cfg.train.resume_from} instead, add --fresh")
    check_resume(previous, cfg, allow_changes)
    if cfg.model.frozen_base():
        hashes = cfg.run.checkpoint_verify == "hashes"
        latest = latest_whole(published_checkpoints(run_dir), hashes) if remote is None \
            else fetch_latest(remote, run_dir, hashes)
        check_resumed_base(cfg, latest, allow_changes)


def previous_config(run_dir: Path, remote: RemoteRun | None) -> str | None:
    """The config a run last launched with, where the run has a checkpoint to resume from
    (the store's, for a run directory on object storage); else None."""
    if remote is not None:
        try:
            names = remote.directories()
            if any(checkpoint_step(name) is not None for name in names) and \
                    remote.is_file(CONFIG):
                return remote.read_text(CONFIG)
            return None
        except OSError as err:
            raise ConfigError(f"run.dir {remote.uri!r}: {first_line(err)}") from err
    if published_checkpoints(run_dir) and (run_dir / CONFIG).is_file():
        return (run_dir / CONFIG).read_text()
    return None


def set_aside(cfg: Config, run_dir: Path, remote: RemoteRun | None) -> None:
    """``--fresh``: a run directory with checkpoints is renamed to ``NAME.replaced-<UTC time>``
    beside it (nothing is deleted; a rename is atomic). A store cannot rename a directory: a
    remote run with checkpoints is refused, naming it."""
    if remote is not None:
        if previous_config(run_dir, remote) is not None:
            raise ConfigError(f"--fresh: run {cfg.run.name!r} on {remote.uri} has checkpoints, "
                              "and an object store cannot move them aside; pick another "
                              "--run-name, or delete that prefix first")
        return
    if not run_dir.is_dir():
        return
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    os.replace(run_dir, aside)
    log.info("--fresh: the previous run %s moved aside to %s", cfg.run.name, aside)


def _check_world_sizes(cfg: Config) -> None:
    """Every world size the run may take (an elastic range: any) keeps the global batch."""
    low, high = cfg.parallel.worker_range
    for world in range(low, high + 1):
        # a ConfigError naming the sizes that fit
        cfg.train.accumulation_steps(cfg.parallel.data_workers(world), cfg.parallel.sequence)


def _check_datasets(cfg: Config) -> None:
    """``data.path`` and ``data.val_path`` hold valid datasets whose rows fit the model: one
    ``ConfigError`` naming the field otherwise."""
    model_vocab = config_vocab_size(cfg.model.name)  # an hf: model's config.json, else None
    for field, path in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if path is None:
            continue
        try:
            manifest = read_manifest(path)
        except ValueError as err:
            raise ConfigError(f"{field}: {err}") from err
        spec = manifest.column(cfg.data.column)
        vocab = manifest.metadata.get("vocab_size")
        data_vocab = int(vocab) if vocab is not None and vocab.isdigit() else None
        written = manifest.metadata.get("tokenizer", "byte tokens")
        # A Hugging Face model's vocabulary is its config's; memtrain's GPT takes model.vocab_size.
        if data_vocab is not None and model_vocab is None and data_vocab > cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size {cfg.model.vocab_size} is smaller than the "
                              f"vocabulary of {field} ({vocab}, {written}): set model.vocab_size "
                              f"to at least {vocab}")
        if data_vocab is not None and model_vocab is not None and data_vocab > model_vocab:
            raise ConfigError(f"{field}: its vocabulary ({vocab}, {written}) is larger than "
                              f"that of model.name {cfg.model.name!r} ({model_vocab})")
        if spec.shape != (cfg.model.seq_len + 1,):
            raise ConfigError(f"{field}: column {spec.name!r} has rows of shape {list(spec.shape)},"
                              f" model.seq_len {cfg.model.seq_len} needs [{cfg.model.seq_len + 1}]")
        for extra in (c for c in manifest.columns if c.name in (LOSS_MASK, DOCUMENT_IDS)):
            if extra.shape != spec.shape:  # trainer.batches reads them beside the tokens
                raise ConfigError(f"{field}: column {extra.name!r} has rows of shape "
                                  f"{list(extra.shape)}, its tokens {list(spec.shape)}")


def checkpoint_settings(cfg: Config) -> dict[str, Any]:
    """A worker context's checkpoint settings (``trainer.context.WorkerContext``), from
    ``cfg``: the same under either launcher."""
    return {"keep_checkpoints": cfg.run.keep_checkpoints,
            "verify_hashes": cfg.run.checkpoint_verify == "hashes",
            "checkpoint_async": cfg.train.checkpoint_async}


def remote_run(cfg: Config) -> RemoteRun | None:
    """The run directory on object storage (``run.dir: s3://...``), or None for a local one."""
    if not is_remote(cfg.run.dir):
        return None
    try:
        return RemoteRun(f"{cfg.run.dir.rstrip('/')}/{cfg.run.name}")
    except (OSError, ValueError) as err:  # pyarrow: an unknown scheme, a malformed URI
        raise _store_error(cfg, err) from err


def check_strategies(cfg: Config) -> None:
    """The memory strategies' libraries (the ``strategies`` extra) and, for bf16 weights, the
    precision ``auto`` resolves to here: one line each, before any worker starts."""
    needed = [("memory.optimizer_states " + cfg.memory.optimizer_states, "torchao")
              ] if cfg.memory.optimizer_states != "fp32" else []
    needed += cfg.model.packages()
    for field, package in needed:
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"{field} needs the {package} package: pip install "
                              "'memtrain[strategies]'")
    check_way_settings(cfg)
    check_weight_precision(cfg)


def check_weight_precision(cfg: Config) -> None:
    """bf16 weights (``model.dtype``, a LoRA base's ``base_dtype``) compute in bf16 only: with
    ``memory.precision: auto``, ``auto`` must resolve to bf16 here, else one line saying so
    (``train`` and ``plan`` both)."""
    from trainer.plan.auto import bf16_weights, planned_precision

    if bf16_weights(cfg) and cfg.memory.precision == "auto":
        field, value = cfg.model.weights_dtype()
        weights = "base weights" if cfg.model.frozen_base() else "weights"
        if (precision := planned_precision(cfg)) != "bf16":
            raise ConfigError(f"{field} {value!r}: memory.precision auto resolves to "
                              f"{precision} here, and {value} {weights} compute in bf16; set "
                              f"memory.precision bf16, or {field} fp32")


def _store_error(cfg: Config, err: Exception) -> ConfigError:
    """The store behind ``run.dir`` cannot be used: one line naming it (exit 2)."""
    return ConfigError(f"run.dir {cfg.run.dir!r}: {first_line(err)}")


def local_run_dir(cfg: Config) -> Path:
    """Where the workers write: the run directory, or its working copy when it is remote."""
    if is_remote(cfg.run.dir):
        assert cfg.run.work_dir is not None, "prepare_run sets run.work_dir"
        return Path(cfg.run.work_dir) / cfg.run.name
    return Path(cfg.run.dir) / cfg.run.name
