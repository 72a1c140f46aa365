"""The local launcher: no Ray. One worker in-process, or N worker processes with a process group.

This is how memtrain runs on a GPU box without Ray, and how tests run real process groups (gloo
on CPU) cheaply. All rendezvous traffic stays on 127.0.0.1.

Workers start from a fork server (``multiprocessing``'s "forkserver"), not by "spawn": the server
imports torch and the trainer once, before any CUDA context exists, and each worker is a fork of
it, so N workers cost one import instead of N (on the 2-core AMD EPYC VMs of
docs/benchmarks.md: a 2-worker launch of the tests' tiny config took 15 CPU-seconds spawned;
forked, each worker took 0.6 CPU-seconds, the server 3.9 once). Each worker still starts clean:
the server has only imported modules, never trained or touched a GPU.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from monitoring.run_files import SUMMARY
from trainer.config import Config
from trainer.context import LocalContext
from trainer.errors import first_line
from trainer.launch.prepare import available_cpus, checkpoint_settings, remote_run
from trainer.logs import setup_logging
from trainer.loop import train
from trainer.memory.allocator import configure_allocator_env
from trainer.models.hf import config_model_type
from trainer.parallel.rendezvous import free_port, init_process_group
from trainer.telemetry.worker_errors import (
    clear_worker_errors,
    record_worker_error,
    record_worker_exit,
    recorded_worker_error,
)

log = logging.getLogger("memtrain")


def _device(use_gpu: bool, local_rank: int) -> torch.device:
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("parallel.use_gpu is true but CUDA is not available")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def attach_metrics(ctx: LocalContext, cfg: Config) -> None:
    """Serve this rank's metrics on 127.0.0.1:(monitoring.port + rank) when a port is set."""
    if cfg.monitoring.port is None:
        return
    from monitoring.memory import worker_labels
    from monitoring.sinks import PrometheusSink

    sink = PrometheusSink(worker_labels(cfg.run.name, ctx.rank, ctx.local_rank,
                                        socket.gethostname(), ctx.device))
    port = sink.serve(cfg.monitoring.port + ctx.rank if cfg.monitoring.port else 0)
    log.info("rank %d metrics on http://127.0.0.1:%d/metrics", ctx.rank, port)
    ctx.metrics_sink = sink


def _worker(rank: int, cfg_json: str, run_dir: str, port: int, until_step: int | None,
            launch_id: str) -> None:
    setup_logging()
    cfg = Config.model_validate_json(cfg_json)
    world_size = cfg.parallel.workers
    device = _device(cfg.parallel.use_gpu, rank)
    if device.type == "cpu":  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, available_cpus() // world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_process_group(device.type, rank, world_size, "127.0.0.1", port)
    try:
        ctx = LocalContext(rank, rank, world_size, device, Path(run_dir), remote=remote_run(cfg),
                           launch_id=launch_id, **checkpoint_settings(cfg))
        attach_metrics(ctx, cfg)
        train(cfg, ctx, until_step)
    except BaseException as err:
        record_worker_error(Path(run_dir), rank, err)
        raise
    finally:
        dist.destroy_process_group()


def _with_environ(rank: int, environ: dict[str, str], fn: Callable[..., None],
                  *args: Any) -> None:
    # The fork server kept the environment of the launch that started it; a worker gets this
    # launch's (MEMTRAIN_FAULTS, the allocator setting, anything the caller set since), as a
    # spawned one would. What a library read when the server imported it stays the server's
    # (OpenMP's thread count: _worker sets torch's own).
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


# What the fork server imports before it forks any worker, once per process: this module
# (torch, the trainer); DCP, which every checkpoint goes through (its DTensor imports cost about
# 1.5 s of CPU); torch._dynamo, which torch.optim's optimizers import when the first one is built
# (0.8 s). A name the installed torch lacks is skipped (the server ignores an ImportError).
PRELOAD = (__name__, "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.checkpoint._fsspec_filesystem", "torch._dynamo")
# And for workers that compile (torch.compile, or torchao's compiled low-bit step): Inductor and
# torchao, 1-2.5 s of CPU a worker otherwise. Not for every launch: about 1 s more before the
# first worker starts, and torchao's import is only wanted where it is used.
PRELOAD_COMPILE = (*PRELOAD, "trainer.launch.compile_preload")


def preload(cfg: Config) -> tuple[str, ...]:
    """What the fork server imports for ``cfg``'s workers: ``PRELOAD`` (``PRELOAD_COMPILE``
    where they compile) and, for an ``hf:`` model, transformers' model code for its
    architecture, with PEFT where it trains adapters. Imported in each worker, those
    are about 90 MB of its own memory (transformers' modeling code 70 MB, the architecture's
    module 10, PEFT 8) and 2.5 s of its CPU; imported once by the server, every worker shares
    the server's pages."""
    names: tuple[str, ...] = PRELOAD_COMPILE if compiles(cfg) else PRELOAD
    model_type = config_model_type(cfg.model.name)
    if model_type is not None:
        # transformers' own layout: models/<model_type>/modeling_<model_type>.py ("-" as "_")
        module = model_type.replace("-", "_")
        names += ("transformers.modeling_utils", f"transformers.models.{module}.modeling_{module}")
        if cfg.model.frozen_base():  # its adapters are PEFT's
            names += ("peft",)
    return names


def compiles(cfg: Config) -> bool:
    """Whether ``cfg``'s workers compile: the model (``Config.compiles_model``, on the device
    this launcher gives them), or torchao's low-bit step (AdamW states other than fp32)."""
    return cfg.memory.optimizer_states != "fp32" or cfg.compiles_model(
        "cuda" if cfg.parallel.use_gpu else "cpu")


def start_workers(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int,
                  modules: tuple[str, ...] = PRELOAD) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from the fork server, with this
    process's environment, joined; a worker's exception is raised as torch's
    ``ProcessRaisedException``, a killed worker as ``ProcessExitedException``.

    The server is started by a process's first launch and serves every later one, with what
    it imported then: ``modules`` (``preload``) count only on the first."""
    mp.set_forkserver_preload(list(modules))
    mp.start_processes(_with_environ, args=(dict(os.environ), fn, *args), nprocs=nprocs,
                       start_method="forkserver")


def _run_workers(cfg: Config, run_dir: Path, until_step: int | None) -> None:
    """``cfg.parallel.workers`` processes with one process group; a worker's error is raised
    as its own line (``WorkerError``)."""
    clear_worker_errors(run_dir)
    try:
        start_workers(_worker, (cfg.model_dump_json(), str(run_dir), free_port(), until_step,
                                uuid.uuid4().hex), cfg.parallel.workers,
                      modules=preload(cfg))
    except mp.ProcessRaisedException as err:
        # torch's message is the worker's whole traceback; the worker recorded its own line.
        recorded = recorded_worker_error(run_dir, err.error_index)
        if recorded is None:
            raise
        raise recorded from err
    except mp.ProcessExitedException as err:  # killed (OOM killer, signal): no line of its own
        how = (f"exited with code {err.exit_code}"
               f"{f' (signal {err.signal_name})' if err.signal_name else ''}")
        record_worker_exit(run_dir, err.error_index, how)
        raise RuntimeError(f"rank {err.error_index} {how}") from err


def launch_local(cfg: Config, run_dir: Path, until_step: int | None = None) -> dict[str, Any]:
    """Train with ``cfg.parallel.workers`` local workers; returns rank 0's summary.

    ``until_step`` stops early at that step of the same schedule (see ``trainer.loop.train``).
    """
    configure_allocator_env()
    remote = remote_run(cfg)
    if remote is not None:
        remote.clear_errors()
    try:
        if cfg.parallel.workers == 1:  # in-process: the worker's error is the user's, as it is
            ctx = LocalContext(0, 0, 1, _device(cfg.parallel.use_gpu, 0), run_dir, remote=remote,
                               launch_id=uuid.uuid4().hex, **checkpoint_settings(cfg))
            attach_metrics(ctx, cfg)
            return train(cfg, ctx, until_step)
        _run_workers(cfg, run_dir, until_step)
    finally:
        if remote is not None:  # the logs and summary, whether training finished or failed
            try:
                remote.upload_logs(run_dir)
            except OSError as err:  # the checkpoints are there; never hide the run's own error
                log.warning("could not upload the run's logs to %s: %s", remote.uri,
                            first_line(err))
    return json.loads((run_dir / SUMMARY).read_text())
