"""Your own model, exactly as the README describes it, with the shipped demo config; and what a
user sees when a worker fails: one line, the rank and the worker's own message.

The model module lives outside the repository, on ``PYTHONPATH`` as a user's would; the demo
config turns on activation checkpointing and leaves the loss to ``auto``, which such a model
(no ``model.blocks``, no loss of its own) must train with. Both launchers: the local one (2
worker processes) and Ray (the session's cluster, which receives the module's code through
``runtime_env``; its entry point returns a Hugging Face model).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from datapipe.corpus import build_stdlib_corpus
from tests.conftest import REPO
from trainer.config import load_config

pytestmark = pytest.mark.distributed
# The Ray cases run on the session's one cluster, in its xdist worker.
LAUNCHERS = ["local", pytest.param("ray", marks=pytest.mark.xdist_group("ray"))]

USER_MODEL = textwrap.dedent('''
    """A user's model: token ids (B, T) to logits (B, T, V); no blocks, no loss of its own."""
    import torch
    from torch import nn


    class TinyLM(nn.Module):
        def __init__(self, vocab_size, seq_len, n_embd):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, n_embd)
            self.position = nn.Embedding(seq_len, n_embd)
            self.mix = nn.Sequential(nn.LayerNorm(n_embd), nn.Linear(n_embd, n_embd), nn.GELU())
            self.head = nn.Linear(n_embd, vocab_size)

        def forward(self, idx):
            x = self.embed(idx) + self.position(torch.arange(idx.shape[1], device=idx.device))
            return self.head(x + self.mix(x))


    def build(vocab_size, seq_len, n_embd, **unused):
        return TinyLM(vocab_size, seq_len, n_embd)


    def broken(**config):
        raise ValueError("this model needs model.n_embd >= 4096")


    def qwen3(vocab_size, seq_len, **unused):
        """A Hugging Face model returned as it is, built from its config class."""
        from transformers import AutoModelForCausalLM, Qwen3Config

        return AutoModelForCausalLM.from_config(Qwen3Config(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=seq_len))
''')


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's working directory: the demo's dataset where the config expects it, and their
    model module in a folder of its own."""
    root = tmp_path_factory.mktemp("user")
    build_stdlib_corpus(root / "data" / "stdlib", seq_len=256, max_bytes=400_000)
    (root / "code").mkdir()
    (root / "code" / "usermodel.py").write_text(USER_MODEL)
    return root


def memtrain_train(user_dir: Path, launcher: str, model: str, run: str,
                   env: dict[str, str] | None = None, extra: list[str] | None = None
                   ) -> subprocess.CompletedProcess[str]:
    sets = [f"model.name={model}", "train.steps=2", *(extra or [])]
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", "train", "--config",
         str(REPO / "configs" / "demo-cpu.yaml"), "--launcher", launcher, "--run-name", run,
         *[arg for value in sets for arg in ("--set", value)]],
        cwd=user_dir, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": f"{user_dir / 'code'}{os.pathsep}{REPO}",
             **(env or {})})


def ray_env(ray_cluster) -> dict[str, str]:
    """Join the session's cluster (a second one on this machine would collide on ports)."""
    return {"RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}


# Under each launcher, one of the README's two kinds of entry point: a plain nn.Module (no
# blocks, no loss) and a Hugging Face model returned as it is (its decoder layers checkpointed,
# the chunked loss), built by Ray's workers from the shipped module.
ENTRY_POINTS = {"local": "usermodel:build", "ray": "usermodel:qwen3"}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_model_from_the_readme_trains_with_the_demo_config(launcher: str, user_dir: Path,
                                                             request) -> None:
    env = ray_env(request.getfixturevalue("ray_cluster")) if launcher == "ray" else None
    out = memtrain_train(user_dir, launcher, ENTRY_POINTS[launcher], f"own-{launcher}", env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    run_dir = user_dir / "runs" / f"own-{launcher}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 2 and summary["workers"] == 2
    assert summary["final_loss"] is not None
    if launcher == "local":  # Ray's workers log through Ray's own streams
        mode = load_config(REPO / "configs" / "demo-cpu.yaml").memory.activation_checkpointing
        assert f"'{mode}' ignored: it needs the model to expose" in out.stderr
        assert "full logits, then cross-entropy (the model computes no loss of its own)" \
            in out.stderr
    else:  # the transformers model's own parameter names, in the workers' checkpoint

        from trainer.checkpoint.files import read_model_weights

        [checkpoint] = run_dir.glob("checkpoint-*")
        assert "hf.model.layers.1.self_attn.q_norm.weight" in read_model_weights(checkpoint)


@pytest.mark.parametrize("precision, where", [("fp32", "worker"), ("bf16", "driver")])
def test_a_model_error_is_one_line_naming_the_entry_point(user_dir: Path, precision: str,
                                                          where: str) -> None:
    """Local launcher, 2 worker processes; the model's entry point raises. In fp32 the driver
    never builds the model and the workers meet the error: the line names the rank. Under bf16
    the driver probes the model first (``bf16_norm_inputs: auto`` asks the planner), so the
    error comes from there, before any worker starts. Either way the line names the entry
    point, and the exit code is 2 (a model the user must change)."""
    out = memtrain_train(user_dir, "local", "usermodel:broken", f"broken-{precision}",
                         extra=[f"memory.precision={precision}"])
    errors = [line for line in out.stderr.splitlines() if line.startswith("memtrain: error:")]
    assert errors, out.stderr[-3000:]
    expected = "model.name 'usermodel:broken': ValueError: this model needs model.n_embd >= 4096"
    if where == "worker":
        assert re.fullmatch(rf"memtrain: error: rank [01]: {re.escape(expected)}", errors[-1]), \
            errors
    else:
        assert errors[-1] == f"memtrain: error: {expected}", errors
        assert not (user_dir / "runs" / "broken-bf16").exists()  # no worker ever started
    assert out.returncode == 2, out.stderr[-2000:]


@pytest.mark.xdist_group("ray")
def test_under_ray_a_shard_that_vanishes_is_one_line_naming_the_rank(
        ray_cluster, corpus_dir: Path, tmp_path: Path) -> None:
    """Ray wraps a worker's exception in its own types; the user sees the worker's line. The
    shard goes after the driver has checked the dataset: only the workers can meet it."""
    import shutil

    from tests.conftest import tiny_config
    from trainer.launch.prepare import prepare_run
    from trainer.launch.ray import launch_ray
    from trainer.telemetry.worker_errors import WorkerError

    data = tmp_path / "train"
    shutil.copytree(corpus_dir / "train", data)
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, f"data.path={data}",
                                           "train.steps=2", "run.name=vanished",
                                           "parallel.max_failures=0"))  # no retry to wait for
    (data / "shard-00000.arrow").unlink()
    with pytest.raises(WorkerError, match=r"^rank [01]: DatasetError: shard .*shard-00000\.arrow:"
                                          r" missing$") as failed:
        launch_ray(cfg, run_dir)
    assert failed.value.exit_code == 2
