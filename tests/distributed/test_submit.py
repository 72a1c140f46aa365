"""`memtrain submit` against a real local Ray cluster's Jobs API (dashboard on 127.0.0.1).

The session's cluster runs with Ray's token auth on (Ray's default for a local cluster); the CLI
runs as a subprocess without Ray's auth environment, so it must find and send the token itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import REPO, set_args, tiny_overrides

# One Ray cluster for the session: every test on it runs in one xdist worker.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("ray")]
MEMTRAIN = [sys.executable, "-m", "trainer.cli"]


def client_env() -> dict[str, str]:
    """The environment of a user's shell: no RAY_AUTH_* variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}


@pytest.fixture(scope="module")
def jobs_api(ray_cluster) -> str:
    return "http://" + ray_cluster._private.worker.get_dashboard_url()


def submit(*args: str, timeout: float = 360, cwd: Path = REPO,
           python: list[str] = MEMTRAIN) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([*python, "submit", "--config",
                               str(REPO / "configs/demo-cpu.yaml"), *args], capture_output=True,
                              text=True, env=client_env(), timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as err:  # what the job printed says where it stopped
        output = [(part.decode() if isinstance(part, bytes) else part or "")[-4000:]
                  for part in (err.stdout, err.stderr)]
        pytest.fail(f"submit did not return in {timeout} s:\n{output[0]}\n{output[1]}")


# `memtrain submit` with torch, numpy, pyarrow and the rest of the `train` extra unimportable:
# what a laptop with only the core install runs.
WITHOUT_TRAINING_DEPS = [sys.executable, str(REPO / "tests/fixtures/without_training_deps.py")]


def test_a_resubmitted_run_resumes_from_its_checkpoint_in_the_users_directory(
        jobs_api: str, corpus_dir: Path, tmp_path: Path, ray_cluster) -> None:
    """The config's relative run directory means this directory (``--local-paths``), not Ray's
    per-job working directory: the checkpoints stay where the user looks, and a resubmission
    with the same ``--run-name`` resumes from them.

    The resubmission runs without torch and with ``--no-follow``: submit returns at once with
    the job id while the job is still starting or training, and it is a real job of the
    cluster's: it resumes from step 4, and stopped while training, it ends and its workers free
    the cluster's CPUs. It is stopped once training: stopped while still PENDING, Ray 2.60
    reported it STOPPED and then ran it to the end (seen here once; ray-project/ray#28221 is
    about stopping during a job's runtime env setup)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    from trainer.launch.submit import wait

    overrides = tiny_overrides(corpus_dir, tmp_path, "train.steps=4", "train.eval_every=4",
                               "train.checkpoint_every=4", "run.dir=runs")
    out = submit("--address", jobs_api, *set_args(overrides), "--job-id", "memtrain-submit-ok",
                 "--run-name", "submitted", "--local-paths", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "submitted job memtrain-submit-ok" in out.stdout
    assert "job memtrain-submit-ok: SUCCEEDED" in out.stdout
    assert "steps (this run)" in out.stdout  # the job's own summary table, streamed back
    summary_path = tmp_path / "runs" / "submitted" / "summary.json"
    summary = json.loads(summary_path.read_text())
    assert summary["final_step"] == 4 and summary["workers"] == 2

    overrides = [o.replace("train.steps=4", "train.steps=200") for o in overrides]
    out = submit("--address", jobs_api, *set_args([*overrides, "train.log_every=1"]),
                 "--run-name", "submitted", "--local-paths", "--no-follow",
                 "--job-id", "memtrain-no-follow", cwd=tmp_path, python=WITHOUT_TRAINING_DEPS)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "memtrain-no-follow" in out.stdout
    client = JobSubmissionClient(jobs_api)  # this process has Ray's auth env: token sent
    assert client.get_job_status("memtrain-no-follow") in (JobStatus.PENDING, JobStatus.RUNNING)
    deadline = time.monotonic() + 180
    while "step     5/" not in client.get_job_logs("memtrain-no-follow"):
        assert client.get_job_status("memtrain-no-follow") in (JobStatus.PENDING,
                                                               JobStatus.RUNNING)
        assert time.monotonic() < deadline, client.get_job_logs("memtrain-no-follow")[-2000:]
        time.sleep(0.5)
    assert "resuming from step 4" in client.get_job_logs("memtrain-no-follow")
    assert client.stop_job("memtrain-no-follow")
    assert wait(client, "memtrain-no-follow", timeout_seconds=120) == JobStatus.STOPPED
    total = ray_cluster.cluster_resources()["CPU"]
    deadline = time.monotonic() + 60
    while ray_cluster.available_resources().get("CPU", 0) < total:
        assert time.monotonic() < deadline, "the stopped job's workers still hold CPUs"
        time.sleep(0.5)
    assert json.loads(summary_path.read_text())["final_step"] == 4  # it did not train on
    # Its workers, killed by the stop, may have been in a save: their parts wait in the
    # system's temporary directory for the run's next start, which this test does not make.
    from trainer.checkpoint.publish import clear_rank_parts

    clear_rank_parts(summary_path.parent)


@pytest.mark.parametrize(("relative", "field"), [
    ([], "data.path"),  # the shipped demo config: data/stdlib/train, runs
    (["data.path=/srv/train", "data.val_path=s3://bucket/val"], "run.dir"),
])
def test_relative_paths_are_refused_before_anything_is_sent(relative: list[str],
                                                            field: str) -> None:
    out = submit("--address", "http://127.0.0.1:9", *set_args(relative),
                 python=WITHOUT_TRAINING_DEPS)
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"memtrain: error: {field}: ")
    assert "is relative" in line and "--local-paths" in line and f"--set {field}=/" in line


def test_a_cluster_without_memtrains_dependencies_is_named_in_one_line(
        jobs_api: str, corpus_dir: Path, tmp_path: Path) -> None:
    """A head whose Python lacks memtrain's dependencies (here: a bare virtual environment as
    the job's interpreter) fails the job importing them; submit says so in one line."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    out = submit("--address", jobs_api, *set_args(tiny_overrides(corpus_dir, tmp_path)),
                 "--python", str(bare / "bin" / "python"), python=WITHOUT_TRAINING_DEPS)
    assert out.returncode == 1
    assert ": FAILED" in out.stdout
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("memtrain: error: the cluster's Python has no module '")
    assert "pip install '.[train]' in memtrain's checkout" in line


def test_a_failing_job_makes_submit_exit_non_zero(jobs_api: str, corpus_dir: Path,
                                                  tmp_path: Path) -> None:
    # Valid here, wrong on the cluster: the dataset path does not exist there.
    overrides = tiny_overrides(corpus_dir, tmp_path, f"data.path={tmp_path / 'missing'}")
    out = submit("--address", jobs_api, *set_args(overrides))
    assert out.returncode == 1
    assert ": FAILED" in out.stdout
    assert "data.path" in out.stdout  # the job's own one-line error, in the streamed logs


def test_a_wrong_token_is_one_clear_line(jobs_api: str) -> None:
    out = submit("--address", jobs_api, "--token", "not-the-token", "--local-paths")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"memtrain: error: the Ray cluster at {jobs_api} refused the request (the token is "
        "wrong): pass --token, or set RAY_AUTH_TOKEN"]


def test_an_unreachable_cluster_is_one_clear_line() -> None:
    from trainer.launch.local import free_port

    address = f"http://127.0.0.1:{free_port()}"
    out = submit("--address", address, "--local-paths")
    assert out.returncode == 1
    assert out.stderr.strip() == (f"memtrain: error: cannot reach the Ray Jobs API at {address}: "
                                  "is the cluster up and the dashboard port (8265) forwarded?")


def test_a_bad_config_fails_before_anything_is_sent() -> None:
    out = submit("--address", "http://127.0.0.1:9", "--set", "train.no_such_key=1")
    assert out.returncode == 2
    assert "train.no_such_key" in out.stderr and "Traceback" not in out.stderr


class _OtherRay(BaseHTTPRequestHandler):
    """What a cluster on another Ray version answers (only the routes the client calls)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        body = (json.dumps({"ray_version": "2.59.0", "version": "4", "ray_commit": "x"})
                if self.path == "/api/version" else "[]").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_ray_version_mismatch_is_refused_before_submitting() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtherRay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"http://127.0.0.1:{server.server_address[1]}"
        out = submit("--address", address, "--local-paths", timeout=60)
    finally:
        server.shutdown()
    assert out.returncode == 1
    assert "runs Ray 2.59.0, this machine Ray 2.60.0" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_headers_and_tokens_are_built_as_ray_reads_them(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.launch.submit import read_token, request_headers

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    (tmp_path / "token").write_text("from-file\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    assert read_token(None) == "from-file"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert read_token(None) == "from-env"
    assert read_token("explicit") == "explicit"
    assert request_headers("t", ["X-Proxy=a=b"]) == {"Authorization": "Bearer t",
                                                     "X-Proxy": "a=b"}
    with pytest.raises(ValueError, match="--header 'nope' is not KEY=VALUE"):
        request_headers(None, ["nope"])
