"""Launch edge: everything the driver does before and after the workers train.

``prepare_run`` turns a loaded config into one the workers can use anywhere (absolute paths),
checks what would otherwise fail late inside a worker (dataset present, batch arithmetic, worker
count against CPUs), resolves ``auto`` choices with the memory planner, and writes the resolved
config into the run directory. The launchers
themselves live in ``local.py`` (in-process or worker processes, no Ray) and ``ray.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datapipe.paths import is_remote
from trainer.config import Config, ConfigError
from trainer.errors import error_kind, first_line, is_user_error

if TYPE_CHECKING:
    from trainer.memory.planner import ActivationProfile, PlanRow, StaticBytes
    from trainer.runstore import RemoteRun

log = logging.getLogger("memtrain")
ERRORS_DIR = "errors"  # run_dir/errors/rank-<r>.json: a failed worker's own error, one line


class WorkerError(RuntimeError):
    """A worker failed: the message is one line, the rank and the worker's own error. Exit 2
    when the worker's error is one a user fixes (config, data, checkpoint: a ValueError), else
    1, as for the same error in the driver."""

    one_line = True

    def __init__(self, rank: int, kind: str, message: str, user_error: bool):
        # kind "": the worker's message was written for the user and names what failed itself
        super().__init__(f"rank {rank}: " + ": ".join(part for part in (kind, message) if part))
        self.rank, self.kind = rank, kind
        self.exit_code = 2 if user_error else 1


def record_worker_error(run_dir: Path, rank: int, err: BaseException) -> None:
    """In a failing worker: keep its error where the launcher finds it (best effort: a run
    directory the driver cannot see, on another node, just leaves the launcher's fallback)."""
    import json

    record = {"kind": error_kind(err), "message": first_line(err, ""),
              "user_error": is_user_error(err)}
    try:
        path = run_dir / ERRORS_DIR / f"rank-{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    except OSError:
        log.debug("could not record rank %d's error in %s", rank, run_dir, exc_info=True)


def recorded_worker_error(run_dir: Path, rank: int | None = None) -> WorkerError | None:
    """The error a failed worker recorded (``rank``, or the lowest rank that recorded one)."""
    import json

    paths = sorted((run_dir / ERRORS_DIR).glob("rank-*.json"),
                   key=lambda p: int(p.stem.removeprefix("rank-")))
    if rank is not None:
        paths = [p for p in paths if p.stem == f"rank-{rank}"]
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        return WorkerError(int(path.stem.removeprefix("rank-")), record["kind"],
                           record["message"], record["user_error"])
    return None


def clear_worker_errors(run_dir: Path) -> None:
    import shutil

    shutil.rmtree(run_dir / ERRORS_DIR, ignore_errors=True)


def setup_logging() -> None:
    logging.basicConfig(format="%(message)s", level=logging.INFO, force=True)


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def device_memory_bytes(cfg: Config) -> int:
    """Memory of one device for the planner's ``auto`` choices."""
    from monitoring.units import parse_bytes

    if cfg.memory.device_memory:
        try:
            return parse_bytes(cfg.memory.device_memory, "memory.device_memory")
        except ValueError as err:
            raise ConfigError(str(err)) from err
    if cfg.parallel.use_gpu:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("memory.device_memory must be set for 'auto' when this machine "
                              "has no GPU to read it from")
        return torch.cuda.get_device_properties(0).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // cfg.parallel.workers


def planned_precision(cfg: Config) -> str:
    """The precision the planner plans ``cfg`` with: ``memory.precision``, ``auto`` resolved on
    this machine's device (the workers resolve it again on theirs, ``trainer.loop``). A driver
    without the GPU a run asks for plans bf16, what ``auto`` picks on every GPU since Ampere."""
    if cfg.memory.precision != "auto":
        return cfg.memory.precision
    import torch

    from trainer.memory.precision import resolve_precision

    if cfg.parallel.use_gpu and not torch.cuda.is_available():
        return "bf16"
    device = torch.device("cuda", 0) if cfg.parallel.use_gpu else torch.device("cpu")
    return resolve_precision("auto", device, cfg.parallel.strategy).name


def probe_config(cfg: Config, precisions: Iterable[str], ac_modes: Iterable[str]
                 ) -> tuple[StaticBytes, list[ActivationProfile]]:
    """The planner's inputs for ``cfg``: one rank's static bytes and an activation profile per
    (precision, checkpointing) pair, probed on CPU for the configured device type."""
    from trainer.build import MemoryTransforms, build_model, model_factory
    from trainer.compat import fake_tensor_mode
    from trainer.memory.planner import profile_all, static_bytes

    factory = model_factory(cfg.model)
    transforms = MemoryTransforms.of(cfg.memory)
    profiles = profile_all(factory, transforms, cfg.model.seq_len, cfg.model.vocab_size,
                           precisions, ac_modes,
                           target="cuda" if cfg.parallel.use_gpu else "cpu")
    with fake_tensor_mode():  # only sizes are counted: no memory, no initialisation
        plain = build_model(factory, transforms.replace(activation_checkpointing="none"))
        static = static_bytes(plain, cfg.parallel.strategy, cfg.parallel.workers)
    return static, profiles


def resolve_auto(cfg: Config) -> Config:
    """Replace ``micro_batch_size: auto``, ``activation_checkpointing: auto`` and
    ``bf16_norm_inputs: auto`` by the planner's choice (``trainer.planner.choose_plan``,
    ``choose_norm_inputs``); configs without ``auto`` pass unchanged."""
    micro_auto = cfg.train.micro_batch_size == "auto"
    ac_auto = cfg.memory.activation_checkpointing == "auto"
    norm_auto = cfg.memory.bf16_norm_inputs == "auto"
    if not (micro_auto or ac_auto or norm_auto):
        return cfg
    from trainer.memory.planner import AC_MODES, choose_norm_inputs, choose_plan

    world = cfg.parallel.workers
    if cfg.train.global_batch_size % world:
        raise ConfigError(f"train.global_batch_size ({cfg.train.global_batch_size}) must be a "
                          f"multiple of the workers ({world})")
    precision = planned_precision(cfg)

    def resolved(plan: PlanRow | None, norm: bool | str) -> Config:
        memory: dict[str, Any] = {"bf16_norm_inputs": norm}
        train: dict[str, Any] = {}
        if plan is not None:
            memory["activation_checkpointing"] = plan.activation_checkpointing
            train["micro_batch_size"] = plan.micro_batch_size
        return cfg.model_copy(update={
            "train": cfg.train.model_copy(update=train),
            "memory": cfg.memory.model_copy(update=memory)})

    if norm_auto and precision != "bf16":  # the copies exist only under bf16 autocast
        cfg, norm_auto = resolved(None, False), False
        if not (micro_auto or ac_auto):
            return cfg
    try:
        budget = device_memory_bytes(cfg)
    except ConfigError:
        if micro_auto or ac_auto:
            raise
        log.info("auto: bf16 norm inputs on (this machine cannot read the GPU's memory and "
                 "memory.device_memory is unset; on fits more)")
        return resolved(None, True)
    modes = AC_MODES if ac_auto else (cfg.memory.activation_checkpointing,)
    fixed = None if micro_auto else cfg.train.micro_batch()

    def plan_with(norm: bool) -> PlanRow | None:
        static, profiles = probe_config(
            cfg.model_copy(update={"memory": cfg.memory.model_copy(
                update={"bf16_norm_inputs": norm})}), [precision], modes)
        return choose_plan(static, profiles, cfg.train.global_batch_size, world, budget, fixed)

    norm: bool | str = cfg.memory.bf16_norm_inputs
    if norm_auto:
        without, with_ = plan_with(False), plan_with(True)
        norm, why = choose_norm_inputs(without, with_, cfg.train.global_batch_size // world)
        plan = with_ if norm else without
        log.info("auto: bf16 norm inputs %s (%s)", "on" if norm else "off", why)
    else:
        plan = plan_with(norm is True)
    if plan is None:
        if micro_auto or ac_auto:
            raise ConfigError(f"nothing fits {budget / 2**30:.1f} GiB per device with "
                              f"precision {precision} (memory.device_memory); try FSDP, a "
                              "shorter sequence or a smaller model")
        return resolved(None, norm)  # the run's own OOM handling has the last word
    log.info("auto: activation checkpointing %s, micro-batch %d x accumulation %d; predicted "
             "peak %.2f GiB of %.2f GiB", plan.activation_checkpointing, plan.micro_batch_size,
             plan.accumulation_steps, plan.predicted_peak_bytes / 2**30, budget / 2**30)
    return resolved(plan, norm)


def prepare_run(cfg: Config) -> tuple[Config, Path]:
    """Validate ``cfg`` for launching and return it with absolute paths, plus the run directory."""
    # Here, not at the top: ``memtrain submit`` imports this package where pyarrow may be absent.
    from datapipe.manifest import read_manifest

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
        from trainer.runstore import default_work_dir

        work = Path(cfg.run.work_dir).expanduser() if cfg.run.work_dir else \
            default_work_dir(cfg.run.dir)
        run = cfg.run.model_copy(update={"work_dir": str(work.resolve())})
    else:
        run = cfg.run.model_copy(update={"dir": str(Path(cfg.run.dir).resolve())})
    cfg = cfg.model_copy(update={"data": data, "run": run})
    workers = cfg.parallel.workers
    joins_cluster = cfg.parallel.launcher == "ray" and bool(os.environ.get("RAY_ADDRESS"))
    if not cfg.parallel.use_gpu and not joins_cluster and workers > available_cpus():
        raise ConfigError(f"parallel.workers ({workers}) is more than the {available_cpus()} "
                          "CPUs of this machine and parallel.use_gpu is false")
    cfg = resolve_auto(cfg)
    low, high = cfg.parallel.worker_range
    if low < high and cfg.parallel.launcher != "ray":
        raise ConfigError(f"parallel.workers [{low}, {high}]: an elastic range needs the Ray "
                          "launcher; the local launcher takes one number")
    for world in range(low, high + 1):  # an elastic group may run at any size in the range
        cfg.train.accumulation_steps(world)  # ConfigError naming the sizes that fit
    for field, path in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if path is None:
            continue
        try:
            manifest = read_manifest(path)
        except ValueError as err:
            raise ConfigError(f"{field}: {err}") from err
        spec = manifest.column(cfg.data.column)
        vocab = manifest.metadata.get("vocab_size")
        if vocab is not None and vocab.isdigit() and int(vocab) > cfg.model.vocab_size:
            written = manifest.metadata.get("tokenizer", "byte tokens")
            raise ConfigError(f"model.vocab_size {cfg.model.vocab_size} is smaller than the "
                              f"vocabulary of {field} ({vocab}, {written}): set model.vocab_size "
                              f"to at least {vocab}")
        if spec.shape != (cfg.model.seq_len + 1,):
            raise ConfigError(f"{field}: column {spec.name!r} has rows of shape {list(spec.shape)},"
                              f" model.seq_len {cfg.model.seq_len} needs [{cfg.model.seq_len + 1}]")
    run_dir = local_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    if remote is not None:
        try:
            remote.fetch_logs(run_dir)
            remote.upload_file(run_dir / "config.yaml", "config.yaml")
        except OSError as err:
            raise _store_error(cfg, err) from err
    return cfg, run_dir


def remote_run(cfg: Config) -> RemoteRun | None:
    """The run directory on object storage (``run.dir: s3://...``), or None for a local one."""
    if not is_remote(cfg.run.dir):
        return None
    from trainer.runstore import RemoteRun

    try:
        return RemoteRun(f"{cfg.run.dir.rstrip('/')}/{cfg.run.name}")
    except (OSError, ValueError) as err:  # pyarrow: an unknown scheme, a malformed URI
        raise _store_error(cfg, err) from err


def _store_error(cfg: Config, err: Exception) -> ConfigError:
    """The store behind ``run.dir`` cannot be used: one line naming it (exit 2)."""
    return ConfigError(f"run.dir {cfg.run.dir!r}: {first_line(err)}")


def local_run_dir(cfg: Config) -> Path:
    """Where the workers write: the run directory, or its working copy when it is remote."""
    if is_remote(cfg.run.dir):
        assert cfg.run.work_dir is not None, "prepare_run sets run.work_dir"
        return Path(cfg.run.work_dir) / cfg.run.name
    return Path(cfg.run.dir) / cfg.run.name
