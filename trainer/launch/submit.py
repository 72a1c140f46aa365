"""Submit a training job to a running Ray cluster through the Ray Jobs API.

The Jobs API lives on the head's dashboard port (8265). ``memtrain submit`` validates the config
here first, so a typo fails on the laptop and not minutes later on the cluster, then sends a job
whose working directory holds that config and whose ``py_modules`` carry this checkout's
``trainer``, ``datapipe`` and ``monitoring`` packages (the image has them installed too; the
shipped ones come first on the path, so the cluster runs the code the user is looking at).

Paths inside the config (``data.path``, ``data.val_path``, ``run.dir``) are read on the cluster.
A relative one would resolve inside Ray's per-job temporary working directory, where a dataset
is missing and checkpoints are lost with the session, so ``cluster_paths`` refuses them before
anything is sent, or resolves them against this directory when the cluster shares this
machine's files (``--local-paths``).

This module imports only Ray's job SDK and memtrain's config: no torch, numpy or pyarrow, so
``memtrain submit`` works from an environment with the core install alone.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

import datapipe
import monitoring
import trainer
from datapipe.paths import is_remote
from trainer.compat import ray_server_version
from trainer.config import Config, ConfigError

JOB_CONFIG_NAME = "memtrain-job.yaml"
TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}


class SubmitError(RuntimeError):
    """A submission problem the user can fix: unreachable cluster, token, Ray version."""

    one_line = True  # the CLI prints the message alone, exit 1


def read_token(explicit: str | None) -> str | None:
    """The Ray auth token, looked up as Ray itself does: ``--token``, then ``RAY_AUTH_TOKEN``,
    then the file named by ``RAY_AUTH_TOKEN_PATH``, then ``~/.ray/auth_token``."""
    if explicit:
        return explicit.strip()
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if path.is_file():
        return path.read_text().strip() or None
    return None


def request_headers(token: str | None, headers: list[str]) -> dict[str, str]:
    """HTTP headers for the Jobs API: ``Authorization: Bearer TOKEN`` plus any ``--header K=V``
    (for a proxy in front of the dashboard)."""
    out = {"Authorization": f"Bearer {token}"} if token else {}
    for item in headers:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--header {item!r} is not KEY=VALUE")
        out[key.strip()] = value
    return out


def connect(address: str, headers: dict[str, str]) -> JobSubmissionClient:
    """A client for ``address`` after checking reachability, the token and the Ray version."""
    try:
        # The constructor GETs /api/version, which needs the token when auth is on.
        client = JobSubmissionClient(address, headers=headers)
    except ConnectionError as err:
        raise SubmitError(f"cannot reach the Ray Jobs API at {address}: is the cluster up and "
                          "the dashboard port (8265) forwarded?") from err
    except AuthenticationError as err:
        reason = "no token was sent" if "Authorization" not in headers else "the token is wrong"
        raise SubmitError(f"the Ray cluster at {address} refused the request ({reason}): pass "
                          "--token, or set RAY_AUTH_TOKEN") from err
    check_versions(ray_server_version(client), address)  # what /api/version answered
    return client


def check_versions(cluster_ray: str | None, address: str) -> None:
    """The driver and the cluster must run the same Ray: Ray refuses mixed versions late and
    obscurely, so refuse here, early and plainly."""
    if cluster_ray is not None and cluster_ray != ray.__version__:
        raise SubmitError(f"the cluster at {address} runs Ray {cluster_ray}, this machine Ray "
                          f"{ray.__version__}: memtrain needs the same Ray on both")


def cluster_paths(cfg: Config, local_root: Path | None) -> list[str]:
    """``--set`` overrides that make every path of ``cfg`` mean on the cluster what it means
    here: none when all are absolute or URIs; with ``local_root``, relative ones resolved
    against it; else a ``ConfigError`` naming the first relative one."""
    out = []
    for field, value in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path),
                         ("run.dir", cfg.run.dir)):
        if value is None or is_remote(value) or Path(value).is_absolute():
            continue
        if local_root is None:
            where = "/mnt/memtrain/runs" if field == "run.dir" else "/mnt/memtrain/data/..."
            remote = " or s3://BUCKET/PREFIX"
            raise ConfigError(
                f"{field}: {value!r} is relative, and the job would resolve it inside Ray's "
                f"temporary working directory (lost with the session): give an absolute path on "
                f"storage the cluster sees (--set {field}={where}){remote}, or pass "
                "--local-paths when the cluster runs on this machine")
        out.append(f"{field}={(local_root / value).resolve()}")
    return out


def missing_module(logs: str) -> str | None:
    """The module a failed job's Python could not import, from its logs (the last one named)."""
    found = re.findall(r"ModuleNotFoundError: No module named '([^']+)'", logs)
    return found[-1] if found else None


def project_packages() -> list[str]:
    """Directories of the packages the job needs, from this installation or checkout."""
    return [str(Path(module.__file__).parent)  # type: ignore[arg-type]
            for module in (trainer, datapipe, monitoring)]


@dataclass
class Submission:
    job_id: str
    entrypoint: str


def submit(client: JobSubmissionClient, config: Path, overrides: list[str],
           python: str = "python", ship_code: bool = True, job_id: str | None = None,
           env: dict[str, str] | None = None) -> Submission:
    """Send ``memtrain train --config CONFIG --set ...`` as a Ray job; returns its id."""
    working_dir = Path(tempfile.mkdtemp(prefix="memtrain-submit-"))
    try:
        shutil.copyfile(config, working_dir / JOB_CONFIG_NAME)
        sets = "".join(f" --set {shlex.quote(item)}" for item in overrides)
        entrypoint = f"{python} -m trainer.cli train --config {JOB_CONFIG_NAME}{sets}"
        runtime_env: dict[str, object] = {
            "working_dir": str(working_dir),
            "env_vars": {"PYTHONUNBUFFERED": "1", **(env or {})},
        }
        if ship_code:
            runtime_env["py_modules"] = project_packages()
            runtime_env["excludes"] = ["__pycache__", "*.pyc"]
        submitted = _submit_when_an_agent_is_ready(
            lambda: client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                      submission_id=job_id,
                                      metadata={"memtrain_config": config.name}))
    finally:  # the SDK has uploaded the directory's zip by now
        shutil.rmtree(working_dir, ignore_errors=True)
    return Submission(submitted, entrypoint)


NO_AGENT = "No available agent to submit job"


def _submit_when_an_agent_is_ready(send: Callable[[], str], timeout_seconds: float = 60) -> str:
    """``send()``, retried while Ray answers that no job agent is up yet (it says to try again
    later: a head that has just started, or a busy one, registers its agents late)."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            return send()
        except RuntimeError as err:
            if NO_AGENT not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(1)


def follow(client: JobSubmissionClient, job_id: str, write: Callable[[str], object]) -> JobStatus:
    """Stream the job's logs until it ends; returns its final status."""

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            write(lines)

    asyncio.run(tail())
    return wait(client, job_id, timeout_seconds=30)


def wait(client: JobSubmissionClient, job_id: str, timeout_seconds: float) -> JobStatus:
    """Poll until the job reaches a terminal status (or the timeout passes)."""
    deadline = time.monotonic() + timeout_seconds
    status = client.get_job_status(job_id)
    while status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    return status
