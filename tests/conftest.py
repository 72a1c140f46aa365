"""Shared fixtures: a small real corpus and a tiny config that trains in seconds on CPU."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from datapipe.corpus import build_stdlib_corpus
from trainer.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 64


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Train/val splits from the standard library: ~400 KB, rows of 65 byte tokens."""
    out = tmp_path_factory.mktemp("corpus")
    build_stdlib_corpus(out, seq_len=SEQ_LEN, max_bytes=400_000, rows_per_shard=1000)
    return out


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the tests that use it, on loopback (it stops after the last).

    ``trainer.launch.ray`` must be the first to import ray: it sets the environment that makes
    Ray use 127.0.0.1, so ray is reached through it here rather than imported directly.
    """
    from trainer.launch import ray as ray_launch
    from trainer.launch.local import free_port

    port = free_port()
    ray_launch.init_ray(num_cpus=2, metrics_export_port=port,
                        _system_config={"metrics_report_interval_ms": 1000})
    ray_launch.ray.metrics_port = port  # for the tests below
    assert ray_launch.ray.util.get_node_ip_address() == "127.0.0.1"
    assert {n["NodeManagerAddress"] for n in ray_launch.ray.nodes()} == {"127.0.0.1"}
    # A job's supervisor finds "its" cluster in /tmp/ray/ray_current_cluster, else takes any
    # GCS running on the machine: with the multi-node test's cluster up beside this one, a job
    # submitted here ran there. `ray start` records the address; ray.init() does not: do it.
    from ray._common.utils import reset_ray_address
    from ray._private.utils import write_ray_address

    write_ray_address(ray_launch.ray.get_runtime_context().gcs_address)

    def stop() -> None:
        ray_launch.ray.shutdown()
        reset_ray_address()

    _RAY_CLUSTER_STOP.append(stop)
    yield ray_launch.ray
    while _RAY_CLUSTER_STOP:
        _RAY_CLUSTER_STOP.pop()()


# The session's Ray cluster stops after the last collected test that uses it, not at the end of
# the session: idle, its processes took about 5.6 CPU-seconds a minute, and under xdist its
# tests (one group) ran first on their worker, leaving it idle for most of the run.
_RAY_CLUSTER_LAST: list[str] = []
_RAY_CLUSTER_STOP: list[Any] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the test's own fixtures first (a module's run on the cluster)
    if _RAY_CLUSTER_LAST == [item.nodeid]:
        while _RAY_CLUSTER_STOP:
            _RAY_CLUSTER_STOP.pop()()


RECORDED_CPU_SPEED = REPO / "tests" / "fixtures" / "cpu_speed_recorded.json"


def recorded_cpu_speed() -> Any:
    """A CPU calibration recorded on a quiet machine (``tests/fixtures/record_cpu_speed.py``
    says which, and how to record it again): the tests of ``auto``'s decisions predict with
    it, so their verdicts hold on every CPU kind and at any load."""
    from trainer.plan.devices import DeviceSpeed

    return DeviceSpeed(**json.loads(RECORDED_CPU_SPEED.read_text())["speed"])


def require_tool(name: str, why: str = "") -> str:
    """The path of a command-line tool the test needs: skipped where it is missing, a failure
    in CI (CI=true), which must install everything the tests use."""
    import shutil

    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is missing{why}")
        pytest.skip(f"{name} not installed{why}")
    return found


def require_root_mount() -> None:
    """Skip (fail in CI) unless this process may mount a tmpfs: root and `mount`."""
    import shutil

    if os.geteuid() != 0 or shutil.which("mount") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("this test mounts a tmpfs and needs root")
        pytest.skip("needs root to mount a tmpfs")


def wait_for_http(url: str, what: str, timeout_seconds: float = 30,
                  log: Path | None = None) -> None:
    """Poll ``url`` until it answers; fail the test, with the server's log tail, if not."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
    pytest.fail(f"{what} did not answer at {url} within {timeout_seconds:.0f} s. {tail}")


@contextlib.contextmanager
def running_s3_server(patch: pytest.MonkeyPatch, bucket: str) -> Iterator[Any]:
    """moto's S3 server on 127.0.0.1 with ``bucket`` created; ``patch`` sets the AWS environment
    that points this process (pyarrow's ``FileSystem.from_uri``) at it. Yields an admin
    ``pyarrow.fs.S3FileSystem`` on the same endpoint, given explicitly: a bare
    ``S3FileSystem()`` ignores ``AWS_ENDPOINT_URL`` and would look for AWS."""
    import subprocess

    from pyarrow import fs

    from trainer.launch.local import free_port

    port = free_port()
    process = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H",
                                "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/", "moto's S3 server")
        for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                           "AWS_ACCESS_KEY_ID": "memtrain-test",
                           "AWS_SECRET_ACCESS_KEY": "memtrain-test",
                           "AWS_REGION": "us-east-1"}.items():
            patch.setenv(key, value)
        admin = fs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http",
                                access_key="memtrain-test", secret_key="memtrain-test",
                                region="us-east-1", allow_bucket_creation=True)
        admin.create_dir(bucket)
        yield admin
    finally:
        process.terminate()
        process.wait(timeout=30)


def tiny_config(corpus_dir: Path, run_dir: Path, *overrides: str) -> Config:
    """A 2-layer GPT with full activation checkpointing and accumulation on, in fp32.

    fp32, not the demo's bf16: on a CPU without native bf16 (most CI runners) autocast
    emulates bf16 at about a third of fp32's speed. Tests about AMP ask for it by name.
    """
    return load_config(REPO / "configs" / "demo-cpu.yaml",
                       tiny_overrides(corpus_dir, run_dir, *overrides))


def prepared_local_run(cfg: Config, workers: int) -> tuple[Config, Path]:
    """``prepare_run(cfg)`` for the local launcher with ``workers`` processes, more than this
    machine's CPUs if asked: ``prepare_run`` refuses that to protect a user's machine, and the
    tests that compare 4-rank arithmetic want 4 processes on 2 cores. ``cfg`` must ask for a
    worker count ``prepare_run`` accepts."""
    from trainer.launch.prepare import prepare_run

    cfg, run_dir = prepare_run(cfg)
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(
        update={"workers": workers})}), run_dir


def tiny_overrides(corpus_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    """``tiny_config``'s changes to configs/demo-cpu.yaml, as ``--set`` values."""
    return [
        f"data.path={corpus_dir / 'train'}", f"data.val_path={corpus_dir / 'val'}",
        f"run.dir={run_dir}", f"model.seq_len={SEQ_LEN}", "model.n_layer=2",
        "model.n_embd=64", "model.n_head=2", "train.steps=12", "train.global_batch_size=16",
        "train.micro_batch_size=4", "train.warmup_steps=2", "train.log_every=2",
        "train.eval_every=6", "train.eval_batches=2", "train.checkpoint_every=6",
        "train.lr=0.005", "memory.precision=fp32", "memory.activation_checkpointing=full",
        *overrides,
    ]


def logged_losses(run_dir: Path) -> list[float]:
    """Rank 0's logged training losses of a run, in step order (its metrics log)."""
    lines = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def panel_queries(rendered: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of a rendered dashboard."""
    return [(p["title"], t["expr"]) for p in json.loads(rendered)["panels"]
            for t in p.get("targets", [])]


def set_args(overrides: list[str]) -> list[str]:
    """``--set`` options for the CLI, one per override."""
    return [arg for item in overrides for arg in ("--set", item)]


def tiny_train_command(corpus_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    """``memtrain train`` of ``tiny_config`` with the local launcher and one worker."""
    return [sys.executable, "-m", "trainer.cli", "train", "--config",
            str(REPO / "configs" / "demo-cpu.yaml"), "--launcher", "local", "--workers", "1",
            *set_args(tiny_overrides(corpus_dir, run_dir, *overrides))]


TIERS = ("unit", "distributed", "e2e", "deploy")


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist (``make test``), each test process computes on one thread, and so does every
    process it starts (a ``memtrain train`` subprocess, a job's driver; Ray's workers already
    default to their one CPU): two xdist processes keep both cores busy, and a process with
    more threads than free cores spins in OpenMP waiting for them. Measured on 2 cores beside
    one busy process: 20 steps of ``memtrain train --workers 1`` took 62-64 s on torch's
    default 2 threads, 32-34 s on one.

    Each test process starts its fork server for the local launches to come now (it imports
    in the background while tests are collected), with the compile stack: many of the suite's
    launches compile (torchao's low-bit step), and every launch shares the first's server."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        import multiprocessing.forkserver

        import torch.multiprocessing as mp

        from trainer.launch.local import PRELOAD_COMPILE

        mp.set_forkserver_preload(list(PRELOAD_COMPILE))
        multiprocessing.forkserver.ensure_running()
    elif getattr(config.option, "numprocesses", None):
        _calibrate_before_the_workers()


def _calibrate_before_the_workers() -> None:
    """The planner's one-thread CPU calibration, taken by xdist's controller before its workers
    start, on a machine not yet busy with the suite. Left to the tests, the processes that plan
    each measured it (none had finished it when the next began; one taken beside a busy worker
    spreads over 10%, is unstable, and is measured again by the next process): with no cache,
    each of five tests that plan took 60-86 s longer, on a 2-core AVX2 EPYC. Cached in
    ``MEMTRAIN_CACHE_DIR`` (below), so a second run reads it."""
    import subprocess

    code = ("import torch; torch.set_num_threads(1)\n"
            "from trainer.plan.calibrate import cpu_speed\n"
            "cpu_speed().stable or cpu_speed(refresh=True)\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=600,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test carries its tier's marker (the folder it lives in), so ``-m unit`` selects
    exactly tests/unit; ``gpu`` tests skip, saying why, where CUDA is absent. (Tests on the
    session's Ray cluster carry ``xdist_group("ray")`` in their modules: one xdist worker, one
    cluster; two clusters on one machine collide on Ray's fixed agent ports.)"""
    cuda = None
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in TIERS and item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA (a gpu test)"))
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            assert item.get_closest_marker("xdist_group") is not None, \
                f"{item.nodeid} uses the Ray cluster: mark its module xdist_group('ray')"
            _RAY_CLUSTER_LAST[:] = [item.nodeid]


# Ray Train's controller polls its workers every 2 s by default; each test run waits for a few
# polls (start, reports, end). Tests only: production keeps Ray's default.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Ray Train 2.60 starts a preemption watcher actor (a process of its own, about 2.5 s of CPU to
# start) with every worker group; it watches for node drain notices, which no test sends (a
# killed node is a node failure, which Train handles without it). Off in tests only.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# Ray reads this when first imported: with it, Ray on Linux uses 127.0.0.1 as the node IP.
# trainer.launch.ray sets it too; setting it here covers any test that imports ray first.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# The planner's CPU calibration (trainer.plan.calibrate.cpu_speed) is cached here, shared by the
# test processes and kept between runs (keyed by CPU, torch and thread count), not in ~/.cache.
os.environ.setdefault("MEMTRAIN_CACHE_DIR",
                      str(Path(tempfile.gettempdir()) / f"memtrain-test-cache-{os.getuid()}"))
# Inductor's compiled kernels are cached by graph, not by the CPU capability ATen dispatches to:
# a kernel compiled under ATEN_CPU_CAPABILITY=avx2 (the AVX2 kind, simulated) and loaded by a
# process without it aborted in a compiled attention block. One cache per setting, per user.
_CAPABILITY = "-".join(os.environ.get(name, "default") for name in ("ATEN_CPU_CAPABILITY",
                                                                    "ONEDNN_MAX_CPU_ISA"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(
    Path(tempfile.gettempdir()) / f"torchinductor-test-{os.getuid()}-{_CAPABILITY.lower()}"))
# Jobs submitted to the test cluster run `python -m trainer.cli`: make that this interpreter, as
# an activated virtual environment does for a user.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


CHAT_TEMPLATE = (  # ChatML, as Qwen's and many others' tokenizer_config.json have it
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def arithmetic_chats(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Chat rows a small model learns in a few steps: a system prompt, a sum, its answer."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"messages": [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]})
    return rows


def write_chat_tokenizer(directory: Path, texts: list[str], vocab_size: int = 400,
                         template: str | None = CHAT_TEMPLATE) -> Path:
    """A model directory's tokenizer, as Hugging Face saves one: a byte-level BPE
    ``tokenizer.json`` trained on ``texts`` with ChatML's special tokens, and a
    ``tokenizer_config.json`` naming the end-of-text token and (unless None) a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    """A checkpoint directory of ``state`` alone in its ``state.pt``, with the manifest of
    every file there (tests: manifests, ``weights_only``, the single-file format's refusal);
    returns the state file. memtrain writes checkpoints with ``write_states``."""
    import torch

    from trainer.checkpoint.integrity import STATE, describe, write_manifest

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / STATE
    torch.save(state, path)
    write_manifest(directory, state["step"], describe(directory))
    return path
