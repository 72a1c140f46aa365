"""A real Prometheus server scrapes a real 2-worker Ray training; rules pass promtool.

Prometheus comes from Debian's `prometheus` package (`.ci/run` installs it). With CI=true these
tests run or fail, never skip.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from monitoring.metrics import METRICS
from tests.conftest import require_tool, tiny_config, wait_for_http
from trainer.launch import prepare_run
from trainer.launch.local import free_port

# One Ray cluster for the session: every test on it runs in one xdist worker.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("ray")]
PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "monitoring" / "prometheus"
# Counters that stay 0 in a healthy CPU run: Ray cannot export a counter before its first
# increment, so they have no series (dashboards use `or vector(0)`).
ZERO_IN_A_HEALTHY_RUN = {"memtrain_train_skipped_steps_total", "memtrain_data_skipped_shards_total"}


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


RECORDED_RUN = "recorded-h200"
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
                               "node": "h200", "device": f"cuda:{rank}"})
        sink.set(values)
        ports.append(sink.serve(0))
    return ports


@pytest.fixture
def prometheus(ray_cluster, recorded_cuda_exporters: list[int], tmp_path: Path):
    """Prometheus on 127.0.0.1 scraping the Ray node's endpoint and the recorded exporters."""
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
        f"    static_configs: [{{targets: [{recorded}]}}]\n")
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
                                                    tmp_path: Path) -> None:
    from trainer.launch.ray import launch_ray

    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "run.name=prom",
                                           "train.steps=8", "train.log_every=2",
                                           "train.eval_every=0"))
    launch_ray(cfg, run_dir)
    expected = [m for m in METRICS if m.family in ("host", "train")
                and m.name not in ZERO_IN_A_HEALTHY_RUN]
    missing: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        missing = []
        for metric in expected:
            name = metric.exposed_name + ("_count" if metric.kind == "histogram" else "")
            ranks = {s["metric"].get("rank") for s in _query(prometheus, f'{name}{{run="prom"}}')}
            if ranks != {"0", "1"}:
                missing.append(f"{name}: ranks {sorted(r for r in ranks if r)}")
        if not missing:
            break
        time.sleep(2)
    assert not missing, missing
    tokens = _query(prometheus, 'sum(ray_memtrain_train_tokens_total{run="prom"})')
    assert float(tokens[0]["value"][1]) == 8 * cfg.train.global_batch_size * cfg.model.seq_len
    assert _query(prometheus, 'ray_memtrain_gpu_memory_allocated_bytes{run="prom"}') == []

    # Every dashboard panel's query, variables filled in: it parses (Prometheus answers 400
    # otherwise) and, except for the panels that need CUDA, returns data.
    from monitoring.dashboards import CUDA_PANELS, DASHBOARDS, panel_queries, render

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
