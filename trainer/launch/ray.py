"""The Ray launcher: Ray Train's ``TorchTrainer`` (Train V2) runs the same loop on N workers.

With ``trainer/launch/submit.py`` (the Jobs client) it is the launch edge, the only code that
imports ``ray``; private Ray keywords come from ``trainer.compat``. The driver starts (or joins)
a Ray cluster whose node IP is 127.0.0.1, so every worker, the rendezvous (MASTER_ADDR) and the
metrics agent stay on loopback; Ray's token authentication is left as Ray configures it (on).
Checkpoints go through ``ray.train.report`` into ``<run.dir>/<run.name>/``; running again with
the same run name makes Ray Train restore the latest one, and the loop resumes from it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

# Must be set before ray is imported: with it, Ray on Linux reports 127.0.0.1 as the node IP,
# which is what Ray Train hands to workers and to torch's rendezvous (MASTER_ADDR).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

import pyarrow.fs  # noqa: E402
import ray  # noqa: E402
import ray.train  # noqa: E402
import torch  # noqa: E402
from ray.train import (  # noqa: E402
    CheckpointConfig,
    CheckpointUploadMode,
    FailureConfig,
    LoggingConfig,
    RunConfig,
    ScalingConfig,
)
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402
from ray.util.metrics import Counter, Gauge, Histogram  # noqa: E402

from monitoring.memory import worker_labels  # noqa: E402
from monitoring.metrics import LABELS, METRICS, STEP_SECONDS_BUCKETS  # noqa: E402
from monitoring.run_files import ERRORS_DIR, SUMMARY  # noqa: E402
from monitoring.sinks import Sink  # noqa: E402
from trainer import faults  # noqa: E402
from trainer.checkpoint.files import checkpoint_dir_name, verified  # noqa: E402
from trainer.checkpoint.store import RemoteRun  # noqa: E402
from trainer.compat import (  # noqa: E402
    ray_cancel_train_request,
    ray_loopback_init_kwargs,
    ray_metrics_export_seconds,
    ray_torch_backend,
    ray_train_request_id,
    ray_worker_output_filter,
)
from trainer.config import Config, ConfigError  # noqa: E402
from trainer.context import WorkerContext  # noqa: E402
from trainer.errors import error_kind, first_line, is_user_error  # noqa: E402
from trainer.launch.console import TracebackFilter  # noqa: E402
from trainer.launch.prepare import (  # noqa: E402
    available_cpus,
    checkpoint_settings,
    remote_run,
)
from trainer.logs import LEVEL_ENV, setup_logging  # noqa: E402
from trainer.loop import train  # noqa: E402
from trainer.memory.allocator import configure_allocator_env  # noqa: E402
from trainer.models.hf import PREFIX as HF_PREFIX  # noqa: E402
from trainer.parallel.rendezvous import init_process_group  # noqa: E402
from trainer.telemetry.worker_errors import (  # noqa: E402
    WorkerError,
    clear_worker_errors,
    record_controller_error,
    record_worker_error,
    recorded_worker_error,
)

LOOPBACK = "127.0.0.1"
log = logging.getLogger("memtrain")
# Under the run's working copy: where a node's workers read a checkpoint from remote storage.
RESTORE_DIR = ".restore"


class RaySink(Sink):
    """The metrics contract through ``ray.util.metrics``: the node's endpoint serves them as
    ``ray_memtrain_...`` (checked against Ray 2.60: gauges, counters and histograms keep their
    names), the same final names as the standalone exporter."""

    def __init__(self, labels: dict[str, str]):
        super().__init__(labels)
        # The agent drops a gauge after two export intervals: republish at least once in each.
        self.max_publish_seconds = ray_metrics_export_seconds()
        self._metrics: dict[str, Any] = {}
        for metric in METRICS:
            made: Any
            if metric.kind == "gauge":
                made = Gauge(metric.name, metric.help, tag_keys=LABELS)
            elif metric.kind == "counter":
                made = Counter(metric.name, metric.help, tag_keys=LABELS + metric.extra_labels)
            else:
                made = Histogram(metric.name, metric.help, boundaries=list(STEP_SECONDS_BUCKETS),
                                 tag_keys=LABELS)
            made.set_default_tags(self.labels)
            self._metrics[metric.name] = made

    def _set_gauge(self, name: str, value: float) -> None:
        self._metrics[name].set(value)

    def _inc_counter(self, name: str, delta: float, extra: Mapping[str, str]) -> None:
        self._metrics[name].inc(delta, tags=dict(extra) or None)

    def _observe(self, name: str, value: float) -> None:
        self._metrics[name].observe(value)


@dataclass
class RayContext(WorkerContext):
    node_id: str = field(default="", kw_only=True)  # Ray's node id, 12 characters (labels)

    @property
    def takes_checkpoint_files(self) -> bool:
        return self.checkpoint_async  # Ray uploads them after report returns, then deletes

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, step: int,
               group: Any = None) -> None:
        """Ray Train publishes (``group`` unused: Ray's own report synchronises the workers).
        With ``train.checkpoint_async`` it uploads the files in the background
        (``CheckpointUploadMode.ASYNC``), the step having waited only for their writing."""
        faults.maybe_fail_checkpoint(self.run_dir, step, self.rank)  # every rank (faults.py)
        checkpoint = (ray.train.Checkpoint.from_directory(str(checkpoint_dir))
                      if checkpoint_dir is not None else None)
        mode = CheckpointUploadMode.ASYNC if self.checkpoint_async else CheckpointUploadMode.SYNC
        ray.train.report(metrics, checkpoint=checkpoint,  # type: ignore[call-arg]
                         checkpoint_dir_name=checkpoint_dir_name(step),
                         checkpoint_upload_mode=mode)

    def node_address(self) -> str:
        return ray.util.get_node_ip_address()

    def lost_nodes(self, addresses: list[str]) -> list[str]:
        alive = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        return sorted(set(addresses) - alive)

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[Path | None]:
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        # Ray Train chose it (a checkpoint is registered once every worker's upload is done);
        # its files are still checked against the manifest, by one worker per node.
        if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
            if self.local_rank == 0:
                verified(Path(checkpoint.path), self.verify_hashes)
            yield Path(checkpoint.path)
            return
        directory = (self.run_dir / RESTORE_DIR
                     / f"{self.node_id}-{PurePosixPath(checkpoint.path).name}")
        with node_copy(checkpoint, directory, self.local_rank == 0, self.barrier) as copy:
            if self.local_rank == 0:
                verified(copy, self.verify_hashes)
            yield copy


@contextlib.contextmanager
def node_copy(checkpoint: ray.train.Checkpoint, directory: Path, downloads: bool,
              barrier: Callable[[], None]) -> Iterator[Path]:
    """A remote checkpoint's files in ``directory``, downloaded once for the node's workers.

    Every worker of the node calls, with the same ``directory``; the one that ``downloads``
    writes it, the others wait at ``barrier``, and it is removed once all have read it. Ray's
    ``Checkpoint.as_directory`` shares one download per node too, but a worker that comes after
    the download has finished downloads it again over the files another worker is reading
    (ray-project/ray#48726: a truncated ``state.pt`` seen in this project's CI).
    """
    if downloads:
        shutil.rmtree(directory, ignore_errors=True)  # a killed attempt's partial copy
        checkpoint.to_directory(str(directory))
    barrier()
    try:
        yield directory
    finally:
        barrier()  # every worker of the node has read it
        if downloads:
            shutil.rmtree(directory, ignore_errors=True)


class _RayInfoFilter(logging.Filter):
    """Drops Ray's own records below WARNING. Ray Train's ``LoggingConfig`` level covers the
    ``ray.train`` loggers, but some of its modules log under their file path (Ray 2.60's
    "Reporting training result ..." does), which reaches the root logger: so the test is
    where the record was made, inside Ray's package."""

    RAY_PACKAGE = str(Path(ray.__file__).parent)

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.WARNING
                or not record.pathname.startswith(self.RAY_PACKAGE))


def _worker_loop(loop_config: dict[str, Any]) -> None:
    setup_logging(loop_config.get("log_level") or None)  # the driver's level
    if not loop_config.get("ray_logs"):
        for handler in logging.getLogger().handlers:
            handler.addFilter(_RayInfoFilter())
    if loop_config.get("faults"):  # tests: Ray's workers started before the test set it
        os.environ[faults.ENV] = loop_config["faults"]
    configure_allocator_env()
    cfg = Config.model_validate(loop_config["config"])
    context = ray.train.get_context()
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = RayContext(rank=context.get_world_rank(), local_rank=context.get_local_rank(),
                     world_size=context.get_world_size(), device=device,
                     run_dir=Path(loop_config["run_dir"]),
                     node_id=ray.get_runtime_context().get_node_id()[:12],
                     launch_id=loop_config.get("launch_id", ""),
                     **checkpoint_settings(cfg))
    ctx.metrics_sink = RaySink(worker_labels(cfg.run.name, ctx.rank, ctx.local_rank,
                                             ctx.node_id, device))
    # The driver's filesystem object: a worker's own environment may not reach the store (a
    # cluster started before AWS_ENDPOINT_URL was set), and Ray's storage_filesystem is the same.
    remote = loop_config.get("remote")
    if remote is not None and ctx.local_rank == 0:  # this node's copy continues the store's logs
        remote.fetch_logs(ctx.run_dir)
    try:
        train(cfg, ctx)
    except BaseException as err:
        record_worker_error(ctx.run_dir, ctx.rank, err)
        if remote is not None:  # its error line, where the driver looks for it
            with contextlib.suppress(OSError):
                remote.upload_logs(ctx.run_dir)
        raise
    if remote is not None:  # each node's ranks' logs; rank 0's node has the summary
        ctx.barrier()  # every rank's last line is written
        if ctx.local_rank == 0:
            remote.upload_logs(ctx.run_dir)


def shipped_model_code(model_name: str) -> list[str]:
    """Where the code of a ``module:function`` model lives, for Ray's workers to receive it
    (``runtime_env`` ``py_modules``): the module's top-level package directory or file. Nothing
    for registered models, Hugging Face model directories (``hf:``: read from a path every node
    must see, as a dataset is), memtrain's own packages or installed ones (site-packages)."""
    if ":" not in model_name or model_name.startswith(HF_PREFIX):
        return []
    import importlib

    top = model_name.partition(":")[0].split(".")[0]
    try:
        module = importlib.import_module(top)
    except ImportError as err:
        raise ConfigError(f"model.name {model_name!r}: cannot import {top!r} ({err})") from err
    file = getattr(module, "__file__", None)
    if file is None or top in ("trainer", "datapipe", "monitoring"):
        return []
    path = Path(file).parent if Path(file).name == "__init__.py" else Path(file)
    if {"site-packages", "dist-packages"} & set(path.parts):
        return []
    return [str(path)]


def init_ray(address: str | None = None, num_cpus: int | None = None,
             metrics_export_port: int | None = None, **kwargs: Any) -> None:
    """Join ``address`` or start a local cluster on loopback (no-op if already initialised).

    A job submitted to a cluster (``memtrain submit``) runs with ``RAY_ADDRESS`` set by Ray's
    job supervisor: then the driver joins that cluster instead of starting its own.
    ``metrics_export_port`` fixes the port of the node's metrics endpoint (Prometheus scrapes
    it); unset, Ray picks one.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **kwargs)
        return
    kwargs.update(ray_loopback_init_kwargs(LOOPBACK, metrics_export_port))
    runtime_env = kwargs.pop("runtime_env", {})
    runtime_env.setdefault("env_vars", {})["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=num_cpus, include_dashboard=True, dashboard_host=LOOPBACK,
             runtime_env=runtime_env, **kwargs)


def launch_ray(cfg: Config, run_dir: Path, address: str | None = None,
               ray_logs: bool = False) -> dict[str, Any]:
    """Train with Ray Train on ``cfg.parallel.workers`` workers; returns rank 0's summary.

    Ray Train's own INFO lines (a "Reporting training result ..." per worker and report, the
    worker group's start) go to the session's log files only, unless ``ray_logs``
    (``memtrain --debug train``); its warnings and errors always reach the console.
    """
    shipped = shipped_model_code(cfg.model.name)
    runtime_env: dict[str, Any] = {"py_modules": shipped} if shipped else {}
    init_ray(address, num_cpus=None if address else max(available_cpus(), cfg.parallel.workers),
             runtime_env=runtime_env)
    if not ray_logs:  # tracebacks stay in Ray's logs (trainer/launch/console.py)
        ray_worker_output_filter(TracebackFilter())
    remote = remote_run(cfg)
    trainer = partial(_torch_trainer, cfg, run_dir, remote, uuid.uuid4().hex, ray_logs)
    clear_worker_errors(run_dir)
    if remote is not None:
        remote.clear_errors()
    release_orphaned_request(run_dir)
    restarts = 0
    while True:
        try:
            run = trainer()
            record_request(run_dir, run)
            run.fit()
            break
        except ray.train.TrainingFailedError as err:
            limit = cfg.parallel.max_failures
            if storage_failure(err) and (limit == -1 or restarts < limit):
                restarts += 1
                restart_after_storage_failure(err, run_dir, remote, restarts, limit)
                continue
            if remote is not None:  # rank errors recorded on other nodes
                with contextlib.suppress(OSError):
                    remote.download_dir(ERRORS_DIR, run_dir / ERRORS_DIR)
            raise worker_error(run_dir, err) from err
    if remote is not None:  # rank 0 may have run on another node
        return json.loads(remote.read_text(SUMMARY))
    return json.loads((run_dir / SUMMARY).read_text())


# In the run directory: the resource request of the Ray Train run this run's driver started.
REQUEST_FILE = "ray-train-request"


def record_request(run_dir: Path, trainer: TorchTrainer) -> None:
    """Note the Ray Train run's resource request (``train-<run id>``, the id its controller
    registers with), for ``release_orphaned_request`` of the next driver of this run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / REQUEST_FILE).write_text(ray_train_request_id(trainer) + "\n")


def release_orphaned_request(run_dir: Path) -> None:
    """Cancel the resource request of this run's previous driver, if it still stands.

    Every Ray Train run registers its workers' resources with the cluster's
    AutoscalingCoordinator (one detached actor, shared by every run on the cluster; Ray 2.60),
    at high priority, and cancels them when its controller shuts down. A driver killed without
    that shutdown (SIGKILL, a lost machine) leaves its request standing for 180 s. Meanwhile the
    coordinator keeps the nodes' CPUs reserved for the dead run: an elastic run started then is
    given what is left and starts with fewer workers than the cluster holds (or waits for its
    minimum), and a node that joins is reserved for the dead run too, so the group does not grow
    until the request expires. The driver that runs the same run again cancels it first (a no-op
    where the request is gone). A failure to reach the coordinator is a warning: the request
    then expires as Ray intends."""
    path = run_dir / REQUEST_FILE
    if not path.is_file():
        return
    requester = path.read_text().strip()
    try:
        ray_cancel_train_request(requester)
    except Exception as err:  # noqa: BLE001 - Ray's internals: any failure is only a delay
        log.warning("could not release the previous driver's resource request %s (%s); Ray "
                    "lets it expire within 180 s", requester, first_line(err))


_TorchBackend, _set_torchrun_env, _address_and_port, _V1WorkerGroup = ray_torch_backend()


def _set_master(addr: str, port: int) -> None:
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))


class _BoundStoreBackend(_TorchBackend):  # type: ignore[misc, valid-type]
    """Ray Train's torch backend with memtrain's process group (``trainer.parallel.rendezvous``):
    the store listens on rank 0's node address alone, and GPUs get gloo beside NCCL."""

    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        device_type = "cuda" if worker_group.get_resources_per_worker().get("GPU", 0) else "cpu"
        addr, port = worker_group.execute_single(0, _address_and_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        if not isinstance(worker_group, _V1WorkerGroup):  # as Ray's own on_start
            worker_group.execute(_set_torchrun_env)
        timeout = timedelta(seconds=backend_config.timeout_s)
        ray.get([worker_group.execute_single_async(rank, init_process_group, device_type, rank,
                                                   len(worker_group), addr, port, timeout)
                 for rank in range(len(worker_group))])


class BoundStoreTorchConfig(TorchConfig):
    """``TorchConfig`` whose backend is ``_BoundStoreBackend``."""

    @property
    def backend_cls(self) -> type:
        return _BoundStoreBackend


def _torch_trainer(cfg: Config, run_dir: Path, remote: RemoteRun | None, launch_id: str,
                   ray_logs: bool) -> TorchTrainer:
    """Ray Train's trainer for ``cfg``: one launch (``launch_id``), however often the
    controller is started again. Checkpoints: Ray Train writes and restores them in the run
    directory, on object storage through the same pyarrow filesystem (trainer.checkpoint.store) when
    run.dir is a URI."""
    storage: dict[str, Any] = (
        {"storage_path": remote.root.rsplit("/", 1)[0], "storage_filesystem": remote.fs}
        if remote is not None else {"storage_path": str(Path(cfg.run.dir).resolve())})
    low, high = cfg.parallel.worker_range
    # (min, max): Train V2's elastic group, sized by what the cluster holds. V2's ScalingConfig
    # takes it; the stubs describe V1's, which takes an int only.
    num_workers: Any = (low, high) if low < high else high
    elastic: dict[str, Any] = ({"elastic_resize_monitor_interval_s":
                                cfg.parallel.resize_check_seconds} if low < high else {})
    return TorchTrainer(
        _worker_loop,
        train_loop_config={"config": cfg.model_dump(mode="json"), "run_dir": str(run_dir),
                           "faults": os.environ.get(faults.ENV, ""), "ray_logs": ray_logs,
                           "log_level": os.environ.get(LEVEL_ENV, ""),
                           "launch_id": launch_id, "remote": remote},
        torch_config=BoundStoreTorchConfig(),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=cfg.parallel.use_gpu,
                                     resources_per_worker={"CPU": 1}, **elastic),
        run_config=RunConfig(
            name=cfg.run.name, **storage,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
            failure_config=FailureConfig(max_failures=cfg.parallel.max_failures),
            # Train V2's RunConfig (RAY_TRAIN_V2_ENABLED); the stubs describe V1's
            logging_config=LoggingConfig(  # type: ignore[call-arg]
                log_level="INFO" if ray_logs else "WARNING"),
        ),
    )


# How long the driver waits for the run's store to answer again after a storage failure.
STORE_WAIT_SECONDS = 120.0


def storage_failure(err: Exception) -> bool:
    """Whether Ray Train's controller itself failed on the run's storage (Ray 2.60 retries a
    controller's errors only when the worker group fails to start: a store that drops a request
    while the controller writes its checkpoint records ends the whole run)."""
    return isinstance(err, ray.train.ControllerError) and \
        isinstance(err.controller_failure, OSError)


def restart_after_storage_failure(err: Exception, run_dir: Path,
                                  remote: Any, restarts: int, limit: int) -> None:
    """Record the failure for the next attempt's restart line, wait until the store answers,
    and say so in one line; the caller then fits again, from the latest checkpoint."""
    reason = first_line(getattr(err, "controller_failure", err))
    record_controller_error(run_dir, f"OSError: {reason}")
    log.warning("Ray Train's controller failed on the run's storage (%s); starting the "
                "run again from its latest checkpoint (%d of %s)", reason, restarts,
                "unlimited" if limit == -1 else limit)
    deadline = time.monotonic() + STORE_WAIT_SECONDS
    while remote is not None:
        try:
            remote.check()
            return
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(2.0)


def worker_error(run_dir: Path, err: Exception) -> Exception:
    """One line for a failed Ray Train run: the lowest failed rank's own error (recorded by the
    worker in the run directory, else read from Ray's exception), or Ray's own first line."""
    recorded = recorded_worker_error(run_dir)
    if recorded is not None:
        return recorded
    failures = getattr(err, "worker_failures", None) or {}
    if failures:
        rank = min(failures)
        cause = failures[rank]
        cause = getattr(cause, "cause", None) or cause  # a RayTaskError wraps the user's error
        lines = [line for line in str(cause).strip().splitlines() if line.strip()]
        return WorkerError(rank, error_kind(cause), lines[-1] if lines else "",
                           is_user_error(cause))
    lines = str(err).strip().splitlines()
    return RuntimeError(lines[-1] if lines else type(err).__name__)
