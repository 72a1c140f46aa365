"""Publishing on a timer, the peak tracker, NVML at its import boundary and the worker's labels.

The Ray side (gauges continuous through a stalled step, a finished run's gauges gone while its
counters stay) is in tests/e2e/test_prometheus.py, on a real Ray cluster.
"""

from __future__ import annotations

import logging
import re
import sys
import time
import types
import urllib.request

import pytest
import torch
from prometheus_client import generate_latest

from monitoring import memory
from monitoring.memory import gpu_uuid, read_device_memory, worker_labels
from monitoring.publisher import PeakTracker, Publisher
from monitoring.sinks import PrometheusSink

pytestmark = pytest.mark.unit
LABELS = worker_labels("r", 0, 0, "n", torch.device("cpu"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Allocator:
    """The allocator's resettable high-water mark: ``allocate`` raises it, ``reset`` drops it to
    the current level, as ``torch.cuda.reset_peak_memory_stats`` does."""

    def __init__(self, current: float) -> None:
        self.current = self.peak = current

    def allocate(self, spike: float) -> None:
        self.peak = max(self.peak, spike)

    def reset(self) -> None:
        self.peak = self.current


def test_peak_tracker_keeps_a_spike_for_its_window_its_interval_and_the_run() -> None:
    clock, alloc = Clock(), Allocator(100)
    peaks = PeakTracker(lambda: alloc.peak, alloc.reset, window_seconds=10, clock=clock)
    assert peaks.sample() == 100
    clock.now = 1
    alloc.allocate(500)  # a one-step spike between two samples
    clock.now = 2
    assert peaks.sample() == 500
    assert alloc.peak == 100  # the tracker reset the allocator's peak
    for t in (5, 9, 12):  # still inside the window of the sample that saw it
        clock.now = t
        assert peaks.sample() == 500, t
    clock.now = 12.5
    assert peaks.sample() == 100  # the window moved past it
    assert peaks.take() == 500  # the log interval since the start saw the spike
    alloc.allocate(300)
    assert peaks.take() == 300  # a new interval
    assert peaks.take() == 100
    assert peaks.overall() == peaks.run_peak == 500


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _value(text: str, name: str) -> float | None:
    found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_publisher_republishes_between_log_steps_and_exactly_once_at_close() -> None:
    sink = PrometheusSink(LABELS)
    port = sink.serve(0)
    state = {"tokens": 0.0, "reads": 0}

    def read() -> dict[str, float]:
        state["reads"] += 1
        return {"memtrain_train_run_active": 1.0, "memtrain_train_loss": 2.0,
                "memtrain_train_tokens_total": state["tokens"]}

    publisher = Publisher(sink, read, interval_seconds=0.05).start()
    try:
        # No log step happens; the counter moves anyway, and the scrape follows it.
        for tokens in (100.0, 250.0):
            state["tokens"] = tokens
            deadline = time.monotonic() + 5
            while _value(_scrape(port), "ray_memtrain_train_tokens_total") != tokens:
                assert time.monotonic() < deadline, "the timer did not republish"
                time.sleep(0.02)
        reads = state["reads"]
        assert reads >= 2
    finally:
        publisher.close({"memtrain_train_run_active": 0.0})
    text = _scrape(port)
    assert _value(text, "ray_memtrain_train_run_active") == 0.0
    assert _value(text, "ray_memtrain_train_tokens_total") == 250.0  # deltas never doubled
    after = state["reads"]
    time.sleep(0.2)
    assert state["reads"] == after  # the thread is gone


def test_a_poke_publishes_at_once() -> None:
    sink = PrometheusSink(LABELS)
    values = {"memtrain_train_loss": 3.0}
    publisher = Publisher(sink, lambda: dict(values), interval_seconds=3600).start()
    try:
        values["memtrain_train_loss"] = 1.5
        publisher.poke()
        deadline = time.monotonic() + 5
        while _value(generate_latest(sink.registry).decode(), "ray_memtrain_train_loss") != 1.5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        publisher.close()


def test_a_failing_read_is_logged_once_and_training_goes_on(caplog) -> None:
    sink = PrometheusSink(LABELS)
    calls = {"n": 0}

    def read() -> dict[str, float]:
        calls["n"] += 1
        if calls["n"] < 4:
            raise OSError("reading /proc failed")
        return {"memtrain_train_loss": 1.0}

    publisher = Publisher(sink, read, interval_seconds=0.01)
    with caplog.at_level(logging.ERROR, logger="memtrain"):
        publisher.start()
        deadline = time.monotonic() + 5
        while calls["n"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        publisher.close()
    assert [r.getMessage() for r in caplog.records].count(
        "publishing metrics failed (logged once; training goes on)") == 1
    assert _value(generate_latest(sink.registry).decode(), "ray_memtrain_train_loss") == 1.0


class _NVMLError(Exception):
    pass


def _stand_in_pynvml(used: int, total: int, known_uuid: str) -> types.ModuleType:
    """nvidia-ml-py's surface that memtrain calls, answering for one GPU UUID."""
    module = types.ModuleType("pynvml")
    module.NVMLError = _NVMLError  # type: ignore[attr-defined]
    module.inits = 0  # type: ignore[attr-defined]

    def init() -> None:
        module.inits += 1  # type: ignore[attr-defined]

    def handle_by_uuid(uuid: str) -> str:
        if uuid != known_uuid:
            raise _NVMLError(f"NVML_ERROR_NOT_FOUND: {uuid}")
        return f"handle:{uuid}"

    def memory_info(handle: str) -> types.SimpleNamespace:
        assert handle == f"handle:{known_uuid}"
        return types.SimpleNamespace(used=used, total=total, free=total - used)

    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByUUID = handle_by_uuid  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = memory_info  # type: ignore[attr-defined]
    return module


@pytest.fixture
def fresh_nvml():
    memory._nvml.cache_clear()
    yield
    memory._nvml.cache_clear()


def test_nvml_reads_the_gpu_by_uuid_and_starts_once(monkeypatch, fresh_nvml) -> None:
    uuid = "GPU-5a7c3b1e-0000-4000-8000-000000000001"
    nvml = _stand_in_pynvml(used=30 * 2**30, total=141 * 2**30, known_uuid=uuid)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: pytest.fail("no fallback"))
    # cuda:1 under CUDA_VISIBLE_DEVICES may be any physical GPU: only the UUID is asked for.
    for _ in range(3):
        assert read_device_memory(torch.device("cuda", 1), uuid) == {
            "memtrain_gpu_device_used_bytes": 30 * 2**30,
            "memtrain_gpu_device_total_bytes": 141 * 2**30}
    assert nvml.inits == 1  # type: ignore[attr-defined]


def test_without_nvml_the_device_family_comes_from_mem_get_info(monkeypatch, fresh_nvml) -> None:
    free_total = (10 * 2**30, 80 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: free_total)
    expected = {"memtrain_gpu_device_used_bytes": 70 * 2**30,
                "memtrain_gpu_device_total_bytes": 80 * 2**30}
    # NVML answers, but not for this UUID (a MIG instance, a stale UUID)
    monkeypatch.setitem(sys.modules, "pynvml", _stand_in_pynvml(1, 2, "GPU-other"))
    assert read_device_memory(torch.device("cuda", 0), "GPU-mine") == expected
    # nvidia-ml-py not installed
    memory._nvml.cache_clear()
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert read_device_memory(torch.device("cuda", 0), "GPU-mine") == expected
    # the driver's library missing: the real nvidia-ml-py raises its NVMLError at init
    memory._nvml.cache_clear()
    failing = _stand_in_pynvml(1, 2, "GPU-mine")

    def no_library() -> None:
        raise _NVMLError("NVML Shared Library Not Found")

    failing.nvmlInit = no_library  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", failing)
    assert read_device_memory(torch.device("cuda", 0), "GPU-mine") == expected
    assert read_device_memory(torch.device("cpu"), "") == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a driver is here: make gpu-check reads it")
def test_the_real_nvidia_ml_py_without_a_driver_falls_back(monkeypatch, fresh_nvml) -> None:
    import pynvml  # noqa: F401 - a dependency (pyproject): the real module, not a stand-in

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1, 3))
    assert read_device_memory(torch.device("cuda", 0), "GPU-x") == {
        "memtrain_gpu_device_used_bytes": 2.0, "memtrain_gpu_device_total_bytes": 3.0}


def test_gpu_uuid_is_nvml_spelling_and_labels_carry_it(monkeypatch) -> None:
    props = types.SimpleNamespace(uuid="5a7c3b1e-0000-4000-8000-000000000001")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert gpu_uuid(torch.device("cuda", 0)) == "GPU-5a7c3b1e-0000-4000-8000-000000000001"
    props.uuid = "MIG-0c2f-..."
    assert gpu_uuid(torch.device("cuda", 0)) == "MIG-0c2f-..."
    labels = worker_labels("r", 3, 1, "node-a", torch.device("cuda", 1))
    assert labels["gpu_uuid"] == "MIG-0c2f-..." and labels["device"] == "cuda:1"
    assert labels["hostname"] and labels["rank"] == "3" and labels["local_rank"] == "1"
    assert worker_labels("r", 0, 0, "n", torch.device("cpu"))["gpu_uuid"] == ""
