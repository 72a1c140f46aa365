"""Screenshots of MLflow's and TensorBoard's UIs showing memtrain runs, for the docs.

    python scripts/tracker_screenshots.py --out docs/images    # make tracker-screenshots

Trains two short runs of the tiny GPT (learning rates 0.005 and 0.002, local launcher, one
worker) on the standard library corpus with ``monitoring.trackers: [tensorboard, mlflow]``,
logging to an ``mlflow server`` on 127.0.0.1 (sqlite store) started here, starts ``tensorboard``
on 127.0.0.1 over the runs, and takes a screenshot of each UI with headless Chromium (Debian's
``chromium`` package). Everything lives in a temporary directory and listens on loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def wait_for(url: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"tracker-screenshots: {url} did not answer in {seconds:.0f} s")


def start(command: list[str], log: Path, **env: str) -> subprocess.Popen:
    """A server in its own process group (its children end with it)."""
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, **env})


def screenshot(chromium: str, url: str, out: Path, attempts: int = 4) -> None:
    """The page after 60 s of virtual time. MLflow's lazily loaded charts are sometimes still
    spinning then (seen in about half the shots here), and a shot with its charts drawn is the
    larger file (227 against 153 KB): of ``attempts`` shots, the largest is kept."""
    shots = []
    for attempt in range(attempts):
        shot = out.with_name(f".{out.stem}-{attempt}.png")
        # Software WebGL (SwiftShader) for the charts that ask for a WebGL context
        subprocess.run([chromium, "--headless", "--no-sandbox", "--enable-unsafe-swiftshader",
                        "--hide-scrollbars", "--window-size=1600,1000",
                        "--virtual-time-budget=60000", f"--screenshot={shot}", url],
                       check=True, capture_output=True, timeout=300)
        shots.append(shot)
    best = max(shots, key=lambda p: p.stat().st_size)
    best.replace(out)
    for shot in shots:
        shot.unlink(missing_ok=True)
    print(f"tracker-screenshots: wrote {out} (the largest of {attempts} shots)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("tracker-screenshots: needs Chromium (apt-get install chromium)")
    from datapipe.corpus import build_stdlib_corpus
    from trainer.config import load_config
    from trainer.launch.local import free_port, launch_local
    from trainer.launch.prepare import prepare_run

    args.out.mkdir(parents=True, exist_ok=True)
    servers: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="memtrain-screenshots-") as tmp:
        work = Path(tmp)
        try:
            mlflow_port, tensorboard_port = free_port(), free_port()
            servers.append(start(
                [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
                 "--port", str(mlflow_port), "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
                 "--artifacts-destination", str(work / "artifacts")],
                work / "mlflow.log", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
            build_stdlib_corpus(work / "data", seq_len=64, max_bytes=400_000,
                                rows_per_shard=1000)
            mlflow_uri = f"http://127.0.0.1:{mlflow_port}"
            wait_for(f"{mlflow_uri}/health")
            for name, lr in (("lr-0.005", 0.005), ("lr-0.002", 0.002)):
                cfg = load_config(REPO / "configs" / "demo-cpu.yaml", [
                    f"data.path={work / 'data' / 'train'}",
                    f"data.val_path={work / 'data' / 'val'}",
                    f"run.dir={work / 'runs'}", f"run.name={name}", "model.seq_len=64",
                    "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
                    f"train.steps={args.steps}", "train.global_batch_size=16",
                    "train.micro_batch_size=8", "train.warmup_steps=4", "train.log_every=2",
                    f"train.eval_every={args.steps // 4}", "train.checkpoint_every=0",
                    f"train.lr={lr}", "memory.precision=fp32", "parallel.launcher=local",
                    "parallel.workers=1", "monitoring.trackers=[tensorboard, mlflow]",
                    f"monitoring.mlflow_tracking_uri={mlflow_uri}"])
                launch_local(*prepare_run(cfg))
            servers.append(start(
                [str(Path(sys.executable).with_name("tensorboard")), "--logdir",
                 str(work / "runs"), "--host", "127.0.0.1", "--port", str(tensorboard_port)],
                work / "tensorboard.log"))
            with urllib.request.urlopen(f"{mlflow_uri}/ajax-api/2.0/mlflow/experiments/"
                                        "get-by-name?experiment_name=memtrain") as response:
                experiment = json.loads(response.read())["experiment"]["experiment_id"]
            # The runs' metric charts side by side (MLflow's "Model training" view)
            screenshot(chromium, f"{mlflow_uri}/#/experiments/{experiment}/runs"
                                 "?compareRunsMode=CHART", args.out / "mlflow.png")
            wait_for(f"http://127.0.0.1:{tensorboard_port}/")
            # The Scalars dashboard draws without WebGL (Time Series' charts need it)
            screenshot(chromium, f"http://127.0.0.1:{tensorboard_port}/#scalars&tagFilter=loss",
                       args.out / "tensorboard.png")
        finally:
            for server in servers:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=30)


if __name__ == "__main__":
    main()
