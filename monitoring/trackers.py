"""Experiment trackers: a run's parameters, metrics and artifacts where ML engineers compare runs.

``monitoring.trackers: [tensorboard, mlflow]`` (``pip install 'memtrain[tracking]'``) makes rank 0
write, besides its JSON-lines log:

- at the first start, the resolved config as parameters, flattened (``train.lr``,
  ``memory.precision``); what ``auto`` decided is already in it (the driver's planner resolves
  it before the workers start);
- at every log step: loss, gradient norm, learning rate, tokens/s, the data-wait share, rank 0's
  peak memory, the micro-batch and the OOM recoveries so far; at every evaluation, the eval loss;
  at the end, every rank's peak memory per log step (``peak_memory_bytes/rank_N``), from the
  ranks' metrics logs in the run directory (TensorBoard: this attempt's steps; MLflow: every
  step it does not hold yet);
- at the end: ``summary.json``, ``config.yaml`` and ``report.png`` as artifacts (MLflow;
  TensorBoard keeps scalars and the config as text).

One tracked run per memtrain run, across restarts and resumes:

- **MLflow**: at ``monitoring.mlflow_tracking_uri`` (a server or any store MLflow takes), else
  in an sqlite store of the run directory's own (``mlflow.db``, artifacts in
  ``mlflow-artifacts/``). The run id is kept in ``<run dir>/tracking.json``, and a resumed run
  reopens that run. A restart redoes the steps since its checkpoint, and MLflow keeps every
  value it is given, so steps the run already holds of a metric are not logged again (on an
  exact resume they are the same values). MLflow's HTTP calls are bounded
  (``MLFLOW_HTTP_REQUEST_TIMEOUT`` 5 s, 2 retries, unless set) and a step's metrics go through
  MLflow's asynchronous logging, so a slow server does not hold the step.
- **TensorBoard**: ``<run dir>/tensorboard``; a resumed run's writer purges the events from its
  first step on (``purge_step``), as TensorBoard's readers apply it.

A tracker that fails (its server down, a bad URI) costs one warning line and is dropped; the
run goes on. A missing package is a config error before any worker starts
(``trainer.launch.prepare``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from monitoring.run_files import TENSORBOARD_DIR, TRACKING_FILE

log = logging.getLogger("memtrain")

MLFLOW_DB = "mlflow.db"  # without a tracking URI: the run directory's own MLflow store
MLFLOW_ARTIFACTS = "mlflow-artifacts"
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # what each tracker imports
KINDS = tuple(PACKAGES)


class TrackerError(RuntimeError):
    """A tracker that cannot be used; the message is one line."""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"train": {"lr": 0.1}}`` -> ``{"train.lr": "0.1"}``; lists as JSON."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{name}.")
        else:
            flat[name] = json.dumps(value) if isinstance(value, list) else str(value)
    return flat


class Tracker(ABC):
    name: str

    @abstractmethod
    def start(self, params: dict[str, str], resumed_from: int | None) -> None:
        """Open (or, on resume, reopen) the tracked run."""

    @abstractmethod
    def log_metrics(self, step: int, values: Mapping[str, float]) -> None: ...

    def log_history(self, points: list[tuple[int, dict[str, float]]], after_step: int) -> None:
        """Metrics of past steps, read back at the end of a run: those after ``after_step``
        (the steps of this attempt; a resumed writer has purged the later ones)."""
        for step, values in points:
            if step > after_step:
                self.log_metrics(step, values)

    def log_artifacts(self, paths: Iterable[Path]) -> None:  # noqa: B027 - scalars-only trackers
        """Attach files to the run, where the tracker keeps files."""

    @abstractmethod
    def close(self, status: str) -> None:
        """Flush and end the run: ``FINISHED``, ``FAILED`` or ``KILLED``."""


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: Path):
        self.directory = run_dir / TENSORBOARD_DIR
        self.writer: Any = None

    def start(self, params: dict[str, str], resumed_from: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.directory), purge_step=(
            None if resumed_from is None else resumed_from + 1))
        if resumed_from is None:
            rows = "\n".join(f"| {name} | {value} |" for name, value in sorted(params.items()))
            self.writer.add_text("config", f"| field | value |\n|---|---|\n{rows}", 0)

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, run_dir: Path, uri: str, experiment: str, run_name: str):
        self.run_dir, self.uri, self.experiment, self.run_name = run_dir, uri, experiment, run_name
        self.client: Any = None
        self.run_id = ""
        self.reopened = False  # a run of an earlier attempt: some steps are in it already
        self.logged_to: dict[str, int] = {}  # per metric, the last step in the run
        self.pending: list[Any] = []  # asynchronous logging operations not yet waited on

    def start(self, params: dict[str, str], resumed_from: int | None) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        if self.uri.startswith(("http://", "https://")):
            _check_reachable(self.uri)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # MLflow's own INFO lines (creating a store's tables, ...) are not the run's.
        logging.getLogger("mlflow").setLevel(logging.WARNING)

        self.client = MlflowClient(tracking_uri=self.uri)
        record_path = self.run_dir / TRACKING_FILE
        record = json.loads(record_path.read_text()) if record_path.is_file() else {}
        if record.get("mlflow_run_id") and record.get("mlflow_tracking_uri") == self.uri:
            self.run_id = record["mlflow_run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self.reopened = True
            return
        experiment = self.client.get_experiment_by_name(self.experiment)
        # A new experiment in a store of this run's own keeps its artifacts in the run
        # directory too; a server's experiments keep theirs where the server puts them.
        local = self.uri.startswith("sqlite:///") and self.uri.endswith(f"/{MLFLOW_DB}")
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(self.experiment, artifact_location=(
                             (self.run_dir / MLFLOW_ARTIFACTS).resolve().as_uri()
                             if local else None)))
        run = self.client.create_run(experiment_id, run_name=self.run_name,
                                     tags={"memtrain.run_dir": str(self.run_dir)})
        self.run_id = run.info.run_id
        record_path.write_text(json.dumps({"mlflow_run_id": self.run_id,
                                           "mlflow_tracking_uri": self.uri}, indent=2))
        items = [Param(name, value[:6000]) for name, value in sorted(params.items())]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=items[start:start + 100])

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        # Steps logged before a restart are left as they are: MLflow would keep both values.
        fresh = {name: value for name, value in values.items()
                 if step > self._logged_to(name)}
        if not fresh:
            return
        stamp = int(time.time() * 1000)
        metrics = [Metric(name, float(value), stamp, step) for name, value in fresh.items()]
        self.pending.append(self.client.log_batch(self.run_id, metrics=metrics,
                                                  synchronous=False))

    def log_history(self, points: list[tuple[int, dict[str, float]]], after_step: int) -> None:
        """Every step the run does not hold yet, an earlier attempt's too (it may have failed
        before logging them)."""
        for step, values in points:
            self.log_metrics(step, values)

    def _logged_to(self, name: str) -> int:
        """The last step of metric ``name`` in the run (0 in a new run; asked once per metric
        in a reopened one)."""
        if name not in self.logged_to:
            history = self.client.get_metric_history(self.run_id, name) if self.reopened else []
            self.logged_to[name] = max((m.step for m in history), default=0)
        return self.logged_to[name]

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        self._flush()
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str) -> None:
        if self.client is None or not self.run_id:
            return
        self._flush()
        self.client.set_terminated(self.run_id, status=status)

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        for operation in pending:
            operation.wait()


def _check_reachable(uri: str) -> None:
    """An MLflow server answers ``/health``; fail in seconds rather than in MLflow's retries."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=5) as response:
            response.read()
    except OSError as err:
        reason = getattr(err, "reason", err)
        raise TrackerError(f"the MLflow server at {uri} did not answer ({reason})") from err


class Trackers:
    """Rank 0's trackers (an empty set on the other ranks). Each call goes to every tracker
    still active; one that raises is dropped with a warning, and the run goes on."""

    def __init__(self, trackers: list[Tracker]):
        self.active = list(trackers)
        self.finished = False

    def __bool__(self) -> bool:
        return bool(self.active)

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.active):
            try:
                call(tracker)
            except Exception as err:  # a tracker never costs the run
                message = str(err).strip().splitlines()[0] if str(err).strip() else ""
                log.warning("tracker %s dropped (%s): %s%s", tracker.name, what,
                            type(err).__name__, f": {message}" if message else "")
                self.active.remove(tracker)
                with contextlib.suppress(Exception):  # already reported; the run goes on
                    tracker.close("FAILED")

    def start(self, params: dict[str, str], resumed_from: int | None) -> None:
        self._each("starting", lambda t: t.start(params, resumed_from))

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        self._each(f"logging step {step}", lambda t: t.log_metrics(step, values))

    def log_rank_peaks(self, run_dir: Path, after_step: int) -> None:
        """Every rank's peak memory per log step, from the ranks' metrics logs in ``run_dir``
        (``peak_memory_bytes/rank_N``), for the steps after ``after_step``
        (this attempt's; MLflow takes every step it does not hold yet): at the end of a run,
        after the last step's checkpoint, which waits for every rank. A rank whose log is
        elsewhere (another node's working copy) is not in it."""
        from monitoring.report import load_metrics  # (matplotlib: only where trackers are on)

        per_step: dict[int, dict[str, float]] = {}
        for rank, records in load_metrics(run_dir).items():
            for record in records:  # the last record of a step wins: a restart's redone step
                per_step.setdefault(record["step"], {})[f"peak_memory_bytes/rank_{rank}"] = \
                    record["peak_memory_bytes"]
        self._each("logging the ranks' peaks",
                   lambda t: t.log_history(sorted(per_step.items()), after_step))

    def finish(self, artifacts: Iterable[Path]) -> None:
        paths = [p for p in artifacts if p.is_file()]
        self._each("logging artifacts", lambda t: t.log_artifacts(paths))
        self._each("closing", lambda t: t.close("FINISHED"))
        self.finished = True

    def close(self) -> None:
        """On any exit: a run that did not finish is ended as failed."""
        if not self.finished:
            self._each("closing", lambda t: t.close("FAILED"))
            self.finished = True


def open_trackers(kinds: Iterable[str], run_dir: Path, run_name: str, *,
                  mlflow_uri: str | None = None, mlflow_experiment: str = "memtrain",
                  params: dict[str, str], resumed_from: int | None) -> Trackers:
    """Start the trackers ``kinds`` names for the run in ``run_dir``."""
    trackers: list[Tracker] = []
    for kind in kinds:
        if kind == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir))
        elif kind == "mlflow":
            # MLflow's own default is an sqlite file in the working directory; memtrain's is
            # one in the run directory (its file store, ``mlruns``, is in maintenance mode).
            uri = mlflow_uri or f"sqlite:///{(run_dir / MLFLOW_DB).resolve()}"
            trackers.append(MlflowTracker(run_dir, uri, mlflow_experiment, run_name))
        else:
            raise ValueError(f"monitoring.trackers: unknown tracker {kind!r} (one of {KINDS})")
    opened = Trackers(trackers)
    opened.start(params, resumed_from)
    return opened
