"""The ``memtrain`` command line.

Errors a user can fix (config, dataset, checkpoint, arguments) print one line naming the field,
file or value and exit 2; runtime failures print one line and exit 1. ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.table import Table

from datapipe.commands import data_app
from datapipe.paths import is_remote
from trainer.config import ConfigError, load_config
from trainer.errors import first_line

app = typer.Typer(help="memtrain: distributed PyTorch training that minds GPU memory.",
                  no_args_is_help=True, pretty_exceptions_enable=False,
                  add_completion=False)
app.add_typer(data_app, name="data")  # datapipe/commands.py: memtrain data ...
console = Console(stderr=False)
# The `train` extra's top-level modules: the core install (enough for `memtrain submit`) lacks them.
TRAINING_MODULES = {"torch", "numpy", "pyarrow", "prometheus_client", "tokenizers", "matplotlib",
                    "grafana_foundation_sdk", "pynvml", "pandas", "fsspec"}


@app.callback()
def _root(ctx: typer.Context, debug: Annotated[bool, typer.Option(
        "--debug", help="Show tracebacks, Ray Train's own log lines and DEBUG lines.")] = False,
          log_level: Annotated[str | None, typer.Option(
              "--log-level", help="debug | info (default) | warning | error.")] = None,
          quiet: Annotated[bool, typer.Option(
              "--quiet", "-q", help="Warnings and errors only (--log-level warning).")] = False,
          verbose: Annotated[bool, typer.Option(
              "--verbose", "-v", help="DEBUG lines too (--log-level debug).")] = False) -> None:
    """Logging is set up here, before any command logs; a level given here is exported to the
    workers (``trainer.logs``). ``--debug`` is also read by ``main`` before typer runs (it
    decides how errors print); the commands read it from the context."""
    from trainer.logs import LEVEL_ENV, setup_logging
    from trainer.logs import log_level as parse_level

    level = "debug" if debug or verbose else log_level or ("warning" if quiet else None)
    if level is not None:
        try:
            parse_level(level)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--log-level") from None
        os.environ[LEVEL_ENV] = level.lower()
    setup_logging(level)
    ctx.obj = {"debug": debug}


@app.command("train")
def train_command(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML config file.")],
    launcher: Annotated[str | None, typer.Option(help="ray | local (overrides the config).")
                        ] = None,
    workers: Annotated[int | None, typer.Option(help="Number of workers.")] = None,
    run_name: Annotated[str | None, typer.Option(help="Run name; reuse it to resume.")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a config value: --set train.lr=3e-4 (repeatable).")] = None,
    profile_steps: Annotated[str | None, typer.Option(
        help="torch.profiler with memory for steps A:B; traces in RUN_DIR/profile/.")] = None,
    memory_summary: Annotated[str | None, typer.Option(
        help="CUDA: torch.cuda.memory_summary() after these steps, e.g. 1,100.")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        help="Local launcher: serve metrics on 127.0.0.1:PORT+rank (0: any free port).")
                            ] = None,
    allow_changes: Annotated[bool, typer.Option(
        "--allow-changes", help="Resume even where the config changes what an exact resume "
                                "needs (data, model, global batch, seed).")] = False,
    resume_from: Annotated[str | None, typer.Option(
        "--resume-from", help="latest (the run name's own, the default) or a run or checkpoint "
                              "directory to resume a new run name from, its whole state.")
                           ] = None,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Start this run name anew: its old run directory is moved aside to "
                        "NAME.replaced-TIME, not deleted.")] = False,
) -> None:
    """Train a model; rerunning with the same --run-name resumes from its latest checkpoint,
    saying every setting that changed."""
    from trainer.launch.prepare import prepare_run

    options: dict[str, Any] = {
        "parallel.launcher": launcher, "parallel.workers": workers, "run.name": run_name,
        "memory.profile_steps": profile_steps, "monitoring.port": metrics_port,
        "memory.memory_summary_steps": _step_list(memory_summary, "--memory-summary"),
        "train.resume_from": None if resume_from in (None, "latest") else resume_from,
    }
    cfg = load_config(config, list(overrides or []),
                      {key: value for key, value in options.items() if value is not None})
    # logs auto's choice and what a resume changes, on the console set up by _root
    cfg, run_dir = prepare_run(cfg, allow_changes=allow_changes, fresh=fresh)
    where = (f"{cfg.run.dir.rstrip('/')}/{cfg.run.name} (working copy {run_dir})"
             if is_remote(cfg.run.dir) else str(run_dir))
    console.print(f"[bold]memtrain[/] run [cyan]{cfg.run.name}[/]: launcher "
                  f"{cfg.parallel.launcher}, {cfg.parallel.workers} workers, run dir {where}")
    start = time.perf_counter()
    if cfg.parallel.launcher == "ray":
        from trainer.launch.ray import launch_ray

        summary = launch_ray(cfg, run_dir, ray_logs=bool((ctx.obj or {}).get("debug")))
    else:
        from trainer.launch.local import launch_local

        summary = launch_local(cfg, run_dir)
    _print_summary(summary, time.perf_counter() - start, cfg.parallel.sequence)


def _step_list(text: str | None, option: str) -> list[int] | None:
    """``"1,100"`` -> [1, 100]; a usage error names the option."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of steps",
                                 param_hint=option) from None


def _print_summary(summary: dict[str, Any], wall_seconds: float, sequence: int = 1) -> None:
    """The run's summary table; ``sequence``: ``parallel.sequence``, the ranks of a group that
    read the same rows, so the global batch is micro x accumulation x the data ranks."""
    from monitoring.units import format_bytes

    table = Table(title=f"run {summary['run']}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")

    def fmt(value: Any, spec: str = "") -> str:
        return "-" if value is None else format(value, spec)

    rows = [
        ("workers x device", f"{summary['workers']} x {summary['device']}"),
        ("precision / activation ckpt", f"{summary['precision']} / "
                                        f"{summary['activation_checkpointing']}"),
        ("micro-batch x accum x " + ("workers" if sequence == 1 else "data ranks"),
         f"{summary['micro_batch_size']} x {summary['accumulation_steps']} x "
         f"{summary['workers'] // sequence} = {summary['global_batch_size']}"),
        ("steps (this run)", f"{summary['final_step']} ({summary['steps_this_run']}, resumed "
                             f"from {fmt(summary['resumed_from_step'])})"),
        ("loss first -> final", f"{fmt(summary['first_loss'], '.4f')} -> "
                                f"{fmt(summary['final_loss'], '.4f')}"),
        ("eval loss", fmt(summary["eval_loss"], ".4f")),
        ("trained tokens/s (all workers)" if summary.get("tokens_counted") == "trained" else
         "tokens/s (all workers)", fmt(summary["tokens_per_second"], ",.0f")),
        ("data wait share", fmt(summary["data_wait_share"] and
                                100 * summary["data_wait_share"], ".1f") + " %"),
        (f"peak memory rank 0 ({summary['peak_memory_kind']})",
         format_bytes(summary["peak_memory_bytes"])),
        ("checkpoints written at steps", ", ".join(map(str, summary["checkpoints_written"]))),
        *([("torch.compile", f"{summary['compile_seconds']:.1f} s, "
                             f"{summary['recompilations']} recompilations")]
          if summary.get("compile_seconds") is not None else []),
        ("wall time", f"{wall_seconds:.1f} s"),
        ("run directory", summary["run_dir"]),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


@app.command("submit")
def submit_command(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML config file.")],
    address: Annotated[str, typer.Option(
        envvar="RAY_API_SERVER_ADDRESS",
        help="Ray Jobs API (the dashboard), e.g. http://127.0.0.1:8265.")
                       ] = "http://127.0.0.1:8265",
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a config value: --set train.lr=3e-4 (repeatable).")] = None,
    token: Annotated[str | None, typer.Option(
        help="Ray auth token (default: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token).")
                     ] = None,
    headers: Annotated[list[str] | None, typer.Option(
        "--header", help="Extra HTTP header KEY=VALUE for a proxy (repeatable).")] = None,
    follow: Annotated[bool, typer.Option(
        "--follow/--no-follow", help="Stream the logs; exit with the job's outcome.")] = True,
    python: Annotated[str, typer.Option(help="Python interpreter on the cluster.")] = "python",
    ship_code: Annotated[bool, typer.Option(
        "--ship-code/--no-ship-code",
        help="Send this checkout's packages with the job (else use the image's).")] = True,
    job_id: Annotated[str | None, typer.Option(help="Submission id (default: Ray's).")] = None,
    run_name: Annotated[str | None, typer.Option(
        help="Run name; resubmit with the same name to resume.")] = None,
    local_paths: Annotated[bool, typer.Option(
        "--local-paths", help="Resolve the config's relative paths against this directory "
                              "(a cluster that runs on this machine).")] = False,
) -> None:
    """Send a training job to a Ray cluster; paths in the config are read on the cluster."""
    from trainer.launch.submit import cluster_paths, connect, read_token, request_headers, submit
    from trainer.launch.submit import follow as follow_job

    if not (ctx.obj or {}).get("debug"):  # Ray's upload and websocket lines: noise here
        for name in ("ray.dashboard.modules.dashboard_sdk", "ray._private.runtime_env.packaging",
                     "ray.dashboard.modules.job.sdk"):
            logging.getLogger(name).setLevel(logging.WARNING)
    extra = list(overrides or []) + ([f"run.name={run_name}"] if run_name else [])
    cfg = load_config(config, extra)  # fail here, not on the cluster
    extra += cluster_paths(cfg, Path.cwd() if local_paths else None)
    client = connect(address, request_headers(read_token(token), list(headers or [])))
    submission = submit(client, config, extra, python=python, ship_code=ship_code,
                        job_id=job_id)
    console.print(f"submitted job [cyan]{submission.job_id}[/] to {address}")
    console.print(f"  entrypoint: {submission.entrypoint}")
    if not follow:
        console.print(f"  logs: ray job logs --address {address} --follow {submission.job_id}")
        return
    status = follow_job(client, submission.job_id, lambda text: print(text, end="", flush=True))
    console.print(f"job {submission.job_id}: {status.value}")
    if status.value != "SUCCEEDED":
        _explain_missing_module(client, submission.job_id)
        raise typer.Exit(1)


def _explain_missing_module(client: Any, job_id: str) -> None:
    """A job that died importing a module says so in one line: the cluster's Python lacks
    memtrain's dependencies (a head started outside memtrain's image)."""
    from trainer.launch.submit import missing_module

    name = missing_module(client.get_job_logs(job_id))
    if name is not None:
        print(f"memtrain: error: the cluster's Python has no module {name!r}: run the cluster "
              "from memtrain's image, or install memtrain's training dependencies there "
              "(pip install '.[train]' in memtrain's checkout; docs/deploy.md)", file=sys.stderr)


@app.command("plan")
def plan_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML config file.")],
    device_memory: Annotated[str, typer.Option(help="Memory of one device, e.g. 80GiB.")
                             ] = "80GiB",
    workers: Annotated[int | None, typer.Option(help="Number of workers.")] = None,
    gpu: Annotated[str | None, typer.Option(
        help="The GPU a GPU config is planned for: h200 | h100 | a100 (default: this "
             "machine's, else h200).")] = None,
    measure: Annotated[bool, typer.Option(
        "--measure", help="Run the fastest plans for a few steps on this CPU and print "
                          "predicted against measured tokens/s and peak.")] = False,
    top: Annotated[int, typer.Option(min=1, help="--measure: how many plans.")] = 3,
    steps: Annotated[int, typer.Option(min=1, help="--measure: timed steps per plan.")] = 3,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="Measure this CPU's speed again instead of reading the cached "
                            "calibration (after a change of machine load, say).")] = False,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a config value (repeatable).")] = None,
) -> None:
    """Predict memory and speed per rank before training: what fits, and what is fastest."""
    from monitoring.units import parse_bytes
    from trainer.config import check_way_settings
    from trainer.launch.prepare import check_weight_precision
    from trainer.plan.table import print_plan

    cfg = load_config(config, list(overrides or []),
                      {"parallel.workers": workers} if workers else None)
    budget = parse_bytes(device_memory, "--device-memory")
    if measure and cfg.parallel.use_gpu:
        _fail("--measure runs plans on this machine's CPU, and the config trains on GPUs "
              "(parallel.use_gpu: true); measure a CPU config", 2)
    if cfg.train.micro_batch_size == "auto":  # every micro-batch the global batch allows
        cfg.train.per_rank_batch(cfg.parallel.data_workers(cfg.parallel.workers),
                                 cfg.parallel.sequence)
    else:
        # a ConfigError naming sizes that fit; the batch divides over the sequence groups
        cfg.train.accumulation_steps(cfg.parallel.data_workers(cfg.parallel.workers),
                                     cfg.parallel.sequence)
    check_way_settings(cfg)
    check_weight_precision(cfg)
    print_plan(console, cfg, budget, device_memory, gpu=gpu, calibrate=calibrate,
               measure_top=top if measure else 0, measure_steps=steps)


@app.command("dashboards")
def dashboards_command(
    out: Annotated[Path | None, typer.Option(help="Output directory.")] = None,
    ray: Annotated[Path | None, typer.Option(
        help="Write Ray's own Default and Train dashboards here instead (what Ray's web UI "
             "embeds once RAY_GRAFANA_HOST is set; memtrain's core install suffices).")
                   ] = None,
) -> None:
    """Generate the Grafana dashboards' JSON from monitoring/dashboards.py (or Ray's, --ray)."""
    if ray is None or out is not None:
        from monitoring.dashboards import CONFIGMAP_PATH, OUT_DIR, write_dashboards

        for path in write_dashboards(out or OUT_DIR, None if out else CONFIGMAP_PATH):
            console.print(f"wrote {path}")
    if ray is not None:
        from trainer.compat import ray_grafana_dashboards

        ray.mkdir(parents=True, exist_ok=True)
        for uid, content in ray_grafana_dashboards().items():
            path = ray / f"{uid}.json"
            path.write_text(content)
            console.print(f"wrote {path}")


@app.command("report")
def report_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory, e.g. runs/demo.")],
    out: Annotated[Path | None, typer.Option(help="PNG path (default RUN_DIR/report.png).")
                   ] = None,
) -> None:
    """Render memory per rank, throughput and data wait of a run as a PNG."""
    from monitoring.report import render_report

    console.print(f"wrote {render_report(run_dir, out)}")


@app.command("export")
def export_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory, e.g. runs/demo.")],
    hf: Annotated[Path, typer.Option("--hf", help="Write a Hugging Face save_pretrained "
                                                  "directory here.")],
    step: Annotated[int | None, typer.Option(help="Checkpoint step (default: the latest).")
                    ] = None,
    max_shard_size: Annotated[str, typer.Option(
        help="Largest safetensors file written (and the most weights held in memory "
             "meanwhile, a file at a time from the checkpoint's DCP files), e.g. 2GB, 500MiB.")
    ] = "2GB",
    merge: Annotated[bool, typer.Option(
        "--merge", help="A LoRA run: the model with its adapters merged into the weights, in "
                        "place of PEFT's adapter directory.")] = False,
) -> None:
    """Write a run's trained weights in the model's own format (a Hugging Face model's
    save_pretrained directory)."""
    from monitoring.units import parse_bytes
    from trainer.checkpoint.export import export_hf

    with console.status(f"exporting {run_dir} to {hf} (checking the checkpoint, building the "
                        "model, writing its files)"):
        exported = export_hf(run_dir, hf, step,
                             parse_bytes(max_shard_size, "--max-shard-size"), merge)
    tokenizer = ", with the dataset's tokenizer.json" if exported.tokenizer else ""
    console.print(f"wrote {exported.out} (checkpoint of step {exported.step}{tokenizer})")


def _fail(message: str, code: int) -> None:
    print(f"memtrain: error: {message}", file=sys.stderr)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app and turn exceptions into one-line errors."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        result = app(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted", 130)
    except click.ClickException as err:  # usage errors: bad option, missing argument
        if debug:
            raise
        _fail(err.format_message().replace("\n", " "), err.exit_code)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        if debug:
            raise
        _fail(first_line(err), 2)
    except ModuleNotFoundError as err:
        if debug or err.name is None or err.name.split(".")[0] not in TRAINING_MODULES:
            raise
        _fail(f"this command needs memtrain's training dependencies (no module {err.name!r}): "
              "pip install '.[train]' in memtrain's checkout", 1)
    except Exception as err:  # a runtime failure: one line, the details with --debug
        if debug:
            raise
        logging.getLogger("memtrain").debug("failure", exc_info=True)
        if getattr(err, "one_line", False):  # a message written for the user, e.g. SubmitError
            _fail(str(err), getattr(err, "exit_code", 1))
        message = first_line(err, "")
        _fail(f"{type(err).__name__}: {message}" if message else type(err).__name__, 1)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
