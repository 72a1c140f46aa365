from __future__ import annotations

import json
import logging
import os
import re
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

import monitoring.memory
from monitoring.memory import CUDA_ALLOCATOR_KEYS, read_cuda_allocator, resident_bytes
from monitoring.metrics import LABELS, METRICS
from monitoring.sinks import PrometheusSink
from tests.conftest import tiny_config
from trainer.context import LocalContext
from trainer.launch.prepare import prepare_run
from trainer.loop import train

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "memory_stats_h200.json"
LABEL_VALUES = {"run": "r", "rank": "0", "local_rank": "0", "node": "n", "device": "cpu",
                "gpu_uuid": "", "hostname": "h"}


def test_contract_names_follow_the_conventions() -> None:
    assert LABELS == ("run", "rank", "local_rank", "node", "device", "gpu_uuid", "hostname")
    for metric in METRICS:
        assert re.fullmatch(r"memtrain_[a-z]+_[a-z_]+", metric.name), metric.name
        assert metric.name.endswith("_total") == (metric.kind == "counter"), metric.name
        assert metric.exposed_name == "ray_" + metric.name
    cuda = {m.name for m in METRICS if m.family == "cuda"}
    assert cuda == set(CUDA_ALLOCATOR_KEYS)


def test_reader_maps_a_recorded_h200_memory_stats_dict() -> None:
    stats = json.loads(FIXTURE.read_text())["memory_stats"]
    values = read_cuda_allocator(stats)
    assert values["memtrain_gpu_memory_allocated_bytes"] == stats["allocated_bytes.all.current"]
    assert values["memtrain_gpu_memory_reserved_bytes"] == stats["reserved_bytes.all.current"]
    assert values["memtrain_gpu_memory_peak_allocated_bytes"] == stats["allocated_bytes.all.peak"]
    assert values["memtrain_gpu_memory_reserved_bytes"] >= \
        values["memtrain_gpu_memory_allocated_bytes"] > 0
    assert values["memtrain_gpu_ooms_total"] == stats["num_ooms"]


def test_resident_memory_counts_the_kernels_page_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """``/proc/self/statm`` counts pages: a 64 KiB-page kernel (aarch64 servers) reads 16 times
    the bytes a 4 KiB one does for the same count of pages."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    page = os.sysconf("SC_PAGE_SIZE")
    assert resident_bytes() == pytest.approx(pages * page, rel=0.05)
    monkeypatch.setattr(monitoring.memory.os, "sysconf",
                        lambda name: 65536 if name == "SC_PAGE_SIZE" else 0)
    assert resident_bytes() == pytest.approx(pages * 65536, rel=0.05)


def test_cuda_family_is_absent_not_zero_on_cpu() -> None:
    assert read_cuda_allocator({}) == {}
    assert read_cuda_allocator(torch.cuda.memory_stats() if torch.cuda.is_available() else {}) \
        or not torch.cuda.is_available()


def test_sink_exposes_the_final_names_with_labels_and_counts_deltas() -> None:
    sink = PrometheusSink(LABEL_VALUES)
    sink.set({"memtrain_train_loss": 2.5, "memtrain_train_tokens_total": 100})
    sink.set({"memtrain_train_tokens_total": 300})  # totals: the sink adds the difference
    sink.observe("memtrain_train_step_seconds", 0.2)
    text = generate_latest(sink.registry).decode()
    labels = 'device="cpu",gpu_uuid="",hostname="h",local_rank="0",node="n",rank="0",run="r"'
    assert f"ray_memtrain_train_loss{{{labels}}} 2.5" in text
    assert f"ray_memtrain_train_tokens_total{{{labels}}} 300.0" in text
    assert ('ray_memtrain_train_step_seconds_bucket{device="cpu",gpu_uuid="",hostname="h",'
            'le="0.25",local_rank="0",node="n",rank="0",run="r"} 1.0') in text
    with pytest.raises(KeyError, match="not in the metrics contract"):
        sink.set({"memtrain_made_up": 1})


def test_training_publishes_the_cpu_families(corpus_dir: Path, tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """The metrics contract's CPU families on the exporter, and rank 0's console line with
    the step total and the time left."""
    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "train.steps=4", "train.eval_every=0", "train.log_every=2", "run.name=metrics"))
    ctx = LocalContext(0, 0, 1, torch.device("cpu"), run_dir)
    ctx.metrics_sink = sink = PrometheusSink(LABEL_VALUES)
    with caplog.at_level(logging.INFO, logger="memtrain"):
        train(cfg, ctx)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert re.fullmatch(r"step +2/4 \| loss .* \| left \d+s", lines[-2]), lines
    assert lines[-1].startswith("step     4/4 |") and lines[-1].endswith("| left 0s"), lines
    port = sink.serve(0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    tokens = 4 * cfg.train.global_batch_size * cfg.model.seq_len
    assert re.search(rf"ray_memtrain_train_tokens_total\{{[^}}]*\}} {tokens}\.0", text)
    assert re.search(r"ray_memtrain_host_rss_bytes\{[^}]*\} [1-9]", text)
    assert re.search(r'ray_memtrain_train_step_seconds_count\{[^}]*\} 4\.0', text)
    assert not re.search(r"ray_memtrain_gpu_memory_allocated_bytes\{", text)  # absent on CPU
    assert re.search(r"ray_memtrain_train_run_active\{[^}]*\} 0\.0", text)  # the run ended


def test_a_metrics_port_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"monitoring.port: cannot serve metrics on "
                                             f"127.0.0.1:{port}"):
            PrometheusSink(LABEL_VALUES).serve(port)


def test_docs_list_every_metric_of_the_contract() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "monitoring.md").read_text()
    missing = [m.exposed_name for m in METRICS if m.exposed_name not in docs]
    assert not missing, f"docs/monitoring.md lacks {missing}"


@pytest.mark.parametrize("first", [True, False])
def test_a_sequence_group_counts_its_rows_once_and_each_rank_its_own_tokens(
        first: bool, tmp_path: Path) -> None:
    """Two ranks share each row at half its tokens: the first counts the rows, both their
    tokens, so the ranks' sums are the group's samples and tokens."""
    from types import SimpleNamespace

    from trainer.telemetry.run_metrics import RunMetrics

    metrics = RunMetrics(LocalContext(0, 0, 1, torch.device("cpu"), tmp_path), "t", 64 * 4, 4,
                         32, counts_rows=first)
    metrics._loader = SimpleNamespace(resized_from=None, skipped_shards=0, pinned_bytes=0)
    metrics._uuid = "cpu"
    metrics.steps_this_run = 3
    values = metrics._current_values()
    assert values["memtrain_train_samples_total"] == (3 * 4 if first else 0)
    assert values["memtrain_train_tokens_total"] == 3 * 4 * 32
    metrics.close()


def test_the_time_left_is_the_steps_to_go_at_the_mean_step_time(tmp_path: Path) -> None:
    from trainer.telemetry.run_metrics import RunMetrics

    metrics = RunMetrics(LocalContext(0, 0, 1, torch.device("cpu"), tmp_path), "t", 1, 1, 1,
                         total_steps=1000)
    assert metrics.time_left(10) == "left -"  # no step timed yet
    metrics.steps_this_run, metrics.step_seconds = 10, 25.0  # 2.5 s a step
    assert metrics.time_left(10) == "left 41m15s"
    assert metrics.time_left(990) == "left 25s"
    metrics.step_seconds = 250.0
    assert metrics.time_left(10) == "left 6h52m30s"
    metrics.close()
