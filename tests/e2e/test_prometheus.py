"""A real Prometheus server scrapes a real 2-worker Ray training; rules pass promtool.

Beside the Ray node it scrapes two standalone exporters serving allocator statistics recorded on
an H200 and a stand-in dcgm-exporter serving its real text format for the same GPU UUIDs, so
every dashboard panel, CUDA and dcgm ones included, is queried against series of the real shapes.

Prometheus comes from Debian's `prometheus` package (`.ci/run` installs it). With CI=true these
tests run or fail, never skip.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from monitoring.metrics import METRICS
from tests.conftest import require_tool, tiny_config, wait_for_http
from trainer.launch.local import free_port
from trainer.launch.prepare import prepare_run

# One Ray cluster for the session: every test on it runs in one xdist worker.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("ray")]
PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "monitoring" / "prometheus"
# Counters that stay 0 in a healthy CPU run: Ray cannot export a counter before its first
# increment, so they have no series (dashboards use `or vector(0)`).
ZERO_IN_A_HEALTHY_RUN = {"memtrain_train_skipped_steps_total", "memtrain_data_skipped_shards_total",
                         "memtrain_train_world_size_changes_total",
                         "memtrain_train_restarts_total",
                         "memtrain_train_recovery_seconds_total"}


def _need(tool: str) -> str:
    return require_tool(tool, " (Debian's prometheus package; `make test` installs it)")


def test_rules_and_config_pass_promtool() -> None:
    promtool = _need("promtool")
    for args in (["check", "rules", "rules.yml"], ["test", "rules", "rules_test.yml"],
                 ["check", "config", "prometheus.yml"]):
        result = subprocess.run([promtool, *args], cwd=PROMETHEUS_DIR, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def _query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["data"]["result"]


def _query_range(port: int, promql: str, start: float, end: float, step: float) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": promql, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["data"]["result"]


def _rule_expr(alert: str) -> str:
    import yaml

    groups = yaml.safe_load((PROMETHEUS_DIR / "rules.yml").read_text())["groups"]
    return next(r["expr"] for g in groups for r in g["rules"] if r.get("alert") == alert)


RECORDED_RUN = "recorded-h200"
RECORDED_UUIDS = ("GPU-6f1c2a7e-3b1d-4c2e-9a51-0d2b7c9e4f10",
                  "GPU-a83e5d02-71c4-4f6b-8e2d-5b9c0a7f3e21")
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "memory_stats_h200.json"


@pytest.fixture
def recorded_cuda_exporters() -> list[int]:
    """Two standalone exporters serving the allocator statistics recorded on an H200.

    The dict goes through the real reader and the real exporter; rank 1 reads 70% of rank 0's
    bytes so the skew panel has something to show. NVML was not recorded: the device family
    uses the H200's total (143,771 MiB) and rank 0's reserved bytes as "used".
    """
    from monitoring.memory import read_cuda_allocator
    from monitoring.sinks import PrometheusSink

    stats = json.loads(FIXTURE.read_text())["memory_stats"]
    ports = []
    for rank, scale in (("0", 1.0), ("1", 0.7)):
        values = {k: v * scale for k, v in read_cuda_allocator(stats).items()}
        values["memtrain_gpu_alloc_retries_total"] += 3  # something to increase
        values["memtrain_gpu_device_total_bytes"] = 143_771 * 2**20
        values["memtrain_gpu_device_used_bytes"] = values["memtrain_gpu_memory_reserved_bytes"]
        sink = PrometheusSink({"run": RECORDED_RUN, "rank": rank, "local_rank": rank,
                               "node": "h200", "device": f"cuda:{rank}",
                               "gpu_uuid": RECORDED_UUIDS[int(rank)],
                               "hostname": f"memtrain-worker-{rank}"})
        sink.set(values)
        ports.append(sink.serve(0))
    return ports


# dcgm-exporter 4.x's text for DCGM_FI_DEV_FB_USED (MiB) on Kubernetes, with its pod mapping:
# the GPUs of the recorded run, each with 1.5 GiB more in use than PyTorch reserved (the CUDA
# context and library workspaces), and a third GPU that no memtrain run uses.
DCGM_FB_EXTRA_MIB = 1536


def dcgm_text(reserved_bytes: list[float]) -> str:
    lines = ["# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).",
             "# TYPE DCGM_FI_DEV_FB_USED gauge"]
    gpus = [*zip(RECORDED_UUIDS, reserved_bytes, strict=True),
            ("GPU-0e9d8c7b-6a5f-4e3d-2c1b-0a9f8e7d6c5b", 40 * 2**30)]
    for gpu, (uuid, reserved) in enumerate(gpus):
        mib = int(reserved // 2**20) + DCGM_FB_EXTRA_MIB
        lines.append(
            f'DCGM_FI_DEV_FB_USED{{gpu="{gpu}",UUID="{uuid}",pci_bus_id="00000000:{0x18 + gpu:02X}'
            f':00.0",device="nvidia{gpu}",modelName="NVIDIA H200",Hostname="gpu-node-1",'
            f'DCGM_FI_DRIVER_VERSION="570.124.06",container="ray-worker",namespace="memtrain",'
            f'pod="memtrain-worker-{gpu}"}} {mib}')
    return "\n".join(lines) + "\n"


@pytest.fixture
def dcgm_exporter():
    """A stand-in dcgm-exporter on 127.0.0.1 (the real one needs a GPU and its DCGM daemon)."""
    stats = json.loads(FIXTURE.read_text())["memory_stats"]
    reserved = stats["reserved_bytes.all.current"]
    body = dcgm_text([reserved * 1.0, reserved * 0.7]).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()


@pytest.fixture
def prometheus(ray_cluster, recorded_cuda_exporters: list[int], dcgm_exporter: int,
               tmp_path: Path):
    """Prometheus on 127.0.0.1 scraping the Ray node's endpoint, the recorded exporters and
    the stand-in dcgm-exporter."""
    binary = _need("prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    recorded = ", ".join(f"'127.0.0.1:{p}'" for p in recorded_cuda_exporters)
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{PROMETHEUS_DIR / 'rules.yml'}']\n"
        "scrape_configs:\n"
        "  - job_name: ray\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{ray_cluster.metrics_port}']}}]\n"
        "  - job_name: recorded\n"
        f"    static_configs: [{{targets: [{recorded}]}}]\n"
        "  - job_name: dcgm\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{dcgm_exporter}']}}]\n")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))  # noqa: SIM115
    try:
        wait_for_http(f"http://127.0.0.1:{port}/-/ready", "prometheus",
                      log=tmp_path / "prometheus.log")
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_every_cpu_family_has_series_for_both_ranks(prometheus: int, corpus_dir: Path,
                                                    tmp_path: Path, monkeypatch) -> None:
    from trainer.faults import STALL_SECONDS
    from trainer.launch.ray import launch_ray

    # Log steps only at the first and the last step, and rank 0 held 6 s at the end of step 3
    # (rank 1 waits in the next all-reduce), as a long evaluation or a stuck peer would.
    monkeypatch.setenv("MEMTRAIN_FAULTS", "stall@3:0")
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "run.name=prom",
                                           "train.steps=8", "train.log_every=100",
                                           "train.eval_every=0"))
    started = time.time()
    launch_ray(cfg, run_dir)
    ended = time.time()
    expected = [m for m in METRICS if m.family in ("host", "train")
                and m.name not in ZERO_IN_A_HEALTHY_RUN]
    missing: list[str] = []
    total, all_tokens = -1.0, 8 * cfg.train.global_batch_size * cfg.model.seq_len
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the last publish reaches Prometheus an export later
        missing = []
        for metric in expected:
            name = metric.exposed_name + ("_count" if metric.kind == "histogram" else "")
            ranks = {s["metric"].get("rank") for s in _query(prometheus, f'{name}{{run="prom"}}')}
            if ranks != {"0", "1"}:
                missing.append(f"{name}: ranks {sorted(r for r in ranks if r)}")
        tokens = _query(prometheus, 'sum(ray_memtrain_train_tokens_total{run="prom"})')
        total = float(tokens[0]["value"][1]) if tokens else -1.0
        if not missing and total == all_tokens:
            break
        time.sleep(2)
    assert not missing, missing
    assert total == all_tokens  # every step's tokens, from both ranks
    assert _query(prometheus, 'ray_memtrain_gpu_memory_allocated_bytes{run="prom"}') == []

    # The publisher's timer, not the log steps, moves the counters: during the stall both ranks'
    # token counters read exactly three steps (with log steps alone they jump from 1 to 8).
    per_rank_step = cfg.train.global_batch_size // 2 * cfg.model.seq_len
    for one in _query_range(prometheus, 'ray_memtrain_train_tokens_total{run="prom"}', started,
                            ended, 0.5):
        seen = {round(float(v)) for _, v in one["values"]}
        assert 3 * per_rank_step in seen, (one["metric"]["rank"], sorted(seen))
    # Continuous gauges, every 0.5 s from a series' first sample to its last, through the stall.
    # (Ray 2.60's workers re-export their live gauges every interval, so this holds with or
    # without the timer; it guards Ray's side of the contract.)
    for name in ("ray_memtrain_train_loss", "ray_memtrain_train_run_active",
                 "ray_memtrain_host_rss_bytes"):
        series = _query_range(prometheus, f'{name}{{run="prom"}}', started, ended + 3, 0.5)
        assert {s["metric"]["rank"] for s in series} == {"0", "1"}, name
        for one in series:
            times = [float(t) for t, _ in one["values"]]
            gaps = [(a, b) for a, b in zip(times, times[1:], strict=False) if b - a > 0.51]
            assert not gaps, f"{name} rank {one['metric']['rank']} lapsed: {gaps}"
            assert times[-1] - times[0] > STALL_SECONDS, (name, times)
    # Ray's counter shape, which MemtrainOutOfMemory relies on: a series first appears at its
    # first increment, never at 0.
    for one in _query_range(prometheus, 'ray_memtrain_train_tokens_total{run="prom"}', started,
                            ended, 0.5):
        assert float(one["values"][0][1]) > 0, one["values"][:3]

    # Every dashboard panel's query, variables filled in: it parses (Prometheus answers 400
    # otherwise) and, except for the panels that need CUDA, returns data.
    from monitoring.dashboards import CUDA_PANELS, DASHBOARDS, render
    from tests.conftest import panel_queries

    # The CUDA panels read the allocator statistics recorded on an H200 instead. A counter's
    # rate needs two samples: one published at the run's last log step has one at first, so
    # the panels get a few scrapes (1 s apart) to fill in.
    queries = []
    for name in DASHBOARDS:
        for title, expr in panel_queries(render(name)):
            run = RECORDED_RUN if title in CUDA_PANELS else "prom"
            queries.append((f"{name}: {title}", expr.replace("$run", run).replace("$rank", ".*")
                            .replace("$node", ".*").replace("$__rate_interval", "1m")))
    deadline, empty = time.monotonic() + 30, queries
    while empty and time.monotonic() < deadline:
        empty = [(panel, promql) for panel, promql in empty if not _query(prometheus, promql)]
        if empty:
            time.sleep(2)
    assert not empty, empty
    skew = _query(prometheus, dict(panel_queries(render("memtrain-memory.json")))[
        "Peak memory skew across ranks"].replace("$run", RECORDED_RUN)
        .replace("$rank", ".*").replace("$node", ".*"))
    assert float(skew[0]["value"][1]) == pytest.approx(0.3)  # rank 1 at 70% of rank 0
    # The dcgm join: exactly the run's two GPUs, each 1.5 GiB (to MiB rounding) outside PyTorch.
    outside = _query(prometheus, dict(panel_queries(render("memtrain-memory.json")))[
        "Device memory outside PyTorch's cache, per GPU"].replace("$run", RECORDED_RUN)
        .replace("$rank", ".*").replace("$node", ".*"))
    assert {o["metric"]["gpu_uuid"] for o in outside} == set(RECORDED_UUIDS)
    for one in outside:
        assert DCGM_FB_EXTRA_MIB - 1 <= float(one["value"][1]) / 2**20 <= DCGM_FB_EXTRA_MIB

    # After the run: Ray's agent dropped its gauges (run_active with them) and keeps its
    # counters. A finished run must not page: the no-tokens rule (its window shortened to this
    # test's seconds) is empty, though the token counter is present and flat.
    deadline = time.monotonic() + 30
    while _query(prometheus, 'ray_memtrain_train_run_active{run="prom"}'):
        assert time.monotonic() < deadline, "run_active outlived the run"
        time.sleep(1)
    time.sleep(4)  # the counter flat for a whole window
    assert len(_query(prometheus, 'increase(ray_memtrain_train_tokens_total{run="prom"}[3s]) == 0')
               ) == 2
    assert _query(prometheus, _rule_expr("MemtrainNoTokens").replace("[10m]", "[3s]")) == []


def _ray_endpoint_value(port: int, name: str, run: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{") and f'run="{run}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return None


def test_a_one_sample_peak_survives_rays_export_cycle(ray_cluster) -> None:
    """A spike the allocator holds for one publication (a single step's peak between two
    samples) reaches Ray's node endpoint, exactly, for the tracker's window; then the window
    moves on. The allocator is a scripted stand-in (no CUDA here): the unit under test is the
    tracker, the publisher and Ray's export path."""
    import ray

    @ray.remote(num_cpus=0)
    def publish_a_spike(window: float, seconds: float) -> list[float]:
        import time as clock

        import torch

        from monitoring.memory import worker_labels
        from monitoring.publisher import PeakTracker, Publisher
        from trainer.launch.ray import RaySink

        state = {"peak": 100e6, "published": []}
        peaks = PeakTracker(lambda: state["peak"], lambda: state.update(peak=100e6), window)

        def read() -> dict[str, float]:
            value = peaks.sample()
            state["published"].append(value)
            return {"memtrain_gpu_memory_peak_allocated_bytes": value}

        sink = RaySink(worker_labels("peaks", 0, 0, "n", torch.device("cpu")))
        publisher = Publisher(sink, read, 0.25).start()
        clock.sleep(1.0)
        state["peak"] = 900e6  # one step's peak, seen by exactly one sample, then reset
        clock.sleep(seconds - 1.0)
        publisher.close()
        return state["published"]

    window = 3.0
    running = publish_a_spike.remote(window, 6.5)
    seen: list[tuple[float, float]] = []  # (time, value) of each scrape
    while not ray.wait([running], timeout=0)[0]:
        value = _ray_endpoint_value(ray_cluster.metrics_port,
                                    "ray_memtrain_gpu_memory_peak_allocated_bytes", "peaks")
        if value is not None:
            seen.append((time.monotonic(), value))
        time.sleep(0.3)
    published = ray.get(running)
    assert published.count(900e6) >= window / 0.25 - 2  # the tracker held it for its window
    spike = [t for t, v in seen if v == 900e6]
    assert spike and max(v for _, v in seen) == 900e6, seen  # it reached the scrape, exactly
    # ... for about the window, across several of Ray's 1 s exports (a value the agent got in
    # one export alone stays at most about 1 s), and then the window moved past it.
    assert spike[-1] - spike[0] >= window - 1.2, seen
    assert seen[-1][1] == 100e6, seen
