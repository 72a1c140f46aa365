"""The local launcher with 2 real gloo processes: DDP, AMP, activation ckpt, accumulation."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import prepared_local_run, tiny_config
from tests.distributed.rows import recorded_rows, rows_trained, stored_fingerprints
from trainer.checkpoint.files import complete_checkpoints
from trainer.launch.local import launch_local, start_workers
from trainer.launch.prepare import prepare_run

pytestmark = pytest.mark.distributed


def test_two_process_ddp_trains_checkpoints_and_resumes(corpus_dir: Path,
                                                        tmp_path: Path) -> None:
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.launcher=local",
                                           "run.name=ddp"))
    summary = launch_local(cfg, run_dir)
    assert summary["workers"] == 2 and summary["accumulation_steps"] == 2
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    assert [step for step, _ in complete_checkpoints(run_dir)] == [6, 12]
    ranks = sorted(p.name for p in (run_dir / "metrics").iterdir())
    assert ranks == ["rank-0.jsonl", "rank-1.jsonl"]

    more, _ = prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.launcher=local",
                                      "run.name=ddp", "train.steps=16"))
    resumed = launch_local(more, run_dir)
    assert resumed["resumed_from_step"] == 12
    assert resumed["steps_this_run"] == 4 and resumed["final_step"] == 16
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    assert steps[-1] == 16


def test_resume_is_exact_for_a_single_worker(corpus_dir: Path, tmp_path: Path) -> None:
    """12 steps in one go give the same loss as 6 steps, a stop, and 6 more."""
    straight_cfg, straight_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "run.name=straight", "train.eval_every=0"))
    straight = launch_local(straight_cfg, straight_dir)
    first_cfg, split_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "run.name=split", "train.eval_every=0"))
    launch_local(first_cfg, split_dir, until_step=6)  # same 12-step schedule, stopped at 6
    resumed = launch_local(first_cfg, split_dir)
    assert resumed["resumed_from_step"] == 6
    assert resumed["final_loss"] == straight["final_loss"]


def test_resuming_at_other_worker_counts_keeps_the_global_batch_schedule_and_data(
        corpus_dir: Path, tmp_path: Path) -> None:
    """4 workers to step 4, 2 to step 8, 1 to step 12, 2 to step 16 (the local launcher's
    --workers changed between runs): the global batch is kept by the accumulation steps, the
    step count and LR schedule continue, each checkpoint's loader state names the sizes that
    read its epoch so far, and the rows every rank recorded training on (data.record_rows) are
    the rows datapipe/split.py plans for those sizes, none twice (its properties:
    tests/unit/test_split.py)."""
    import torch

    settings = ("parallel.launcher=local", "run.name=resize", "train.steps=16",
                "train.eval_every=0", "train.checkpoint_every=4", "data.record_rows=true")

    def run(workers: int, until: int) -> dict:
        cfg, run_dir = prepared_local_run(tiny_config(corpus_dir, tmp_path, *settings,
                                                      "parallel.workers=2"), workers)
        return launch_local(cfg, run_dir, until_step=until)

    first = run(4, 4)
    assert (first["workers"], first["accumulation_steps"], first["final_step"]) == (4, 1, 4)
    assert run(2, 8)["accumulation_steps"] == 2
    # The 1-worker run in this process, as the local launcher runs one worker, with an
    # exporter to read the resize from.
    from monitoring.memory import worker_labels
    from monitoring.sinks import PrometheusSink
    from trainer.context import LocalContext
    from trainer.loop import train

    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *settings,
                                           "parallel.workers=1"))
    ctx = LocalContext(0, 0, 1, torch.device("cpu"), run_dir)
    ctx.metrics_sink = sink = PrometheusSink(worker_labels("resize", 0, 0, "n", ctx.device))
    third = train(cfg, ctx, until_step=12)
    labels = dict(sink.labels)
    assert sink.registry.get_sample_value("ray_memtrain_train_world_size", labels) == 1
    assert sink.registry.get_sample_value("ray_memtrain_train_world_size_changes_total",
                                          labels) == 1
    assert (third["workers"], third["accumulation_steps"]) == (1, 4)  # 16 = 1 x 4 x 4
    assert (third["resumed_from_step"], third["final_step"]) == (8, 12)
    fourth = run(2, 16)
    assert (fourth["resumed_from_step"], fourth["final_step"]) == (12, 16)
    assert fourth["final_loss"] < first["first_loss"] - 0.5

    run_dir = tmp_path / "resize"
    states = {step: torch.load(path / "state.pt", weights_only=True)
              for step, path in complete_checkpoints(run_dir)}
    assert sorted(states) == [8, 12, 16]  # the three latest kept
    loaders = {step: states[step]["loader"] for step in states}
    # One epoch: 4 ranks read 4 micro-batches each, 2 ranks 8, 1 rank 16, then 2 ranks 8.
    assert loaders[8]["segments"] == [[4, 4, 4]]
    assert (loaders[8]["epoch"], loaders[8]["batch_index"]) == (0, 8)
    assert loaders[12]["segments"] == [[4, 4, 4], [2, 4, 8]]
    assert loaders[12]["batch_index"] == 16
    assert loaders[16]["segments"] == [[4, 4, 4], [2, 4, 8], [1, 4, 16]]
    assert loaders[16]["batch_index"] == 8
    # The rows those reads plan, from the shard layout: none twice.
    planned = rows_trained(corpus_dir / "train", [(4, 4, 4), (2, 4, 8), (1, 4, 16), (2, 4, 8)],
                           seed=loaders[8]["seed"], window=loaders[8]["shuffle_window"])
    assert len(planned) == len(set(planned)) == 4 * 64
    # The rows the ranks trained on, as each recorded them: 16 a step, across the ranks of
    # the run that trained that step, and exactly the planned ones.
    recorded = recorded_rows(run_dir)
    assert sorted(recorded) == list(range(1, 17))
    assert all(len(rows) == 16 for rows in recorded.values())
    assert Counter(row for rows in recorded.values() for row in rows) == \
        Counter(stored_fingerprints(corpus_dir / "train", planned))
    # The schedule is the uninterrupted run's: LambdaLR's step count and the LR at step 16.
    straight_cfg, straight_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1",
        "run.name=straight", "train.eval_every=0", "train.checkpoint_every=16",
        "train.steps=16"))
    launch_local(straight_cfg, straight_dir)
    [(_, straight_ckpt)] = complete_checkpoints(straight_dir)
    straight = torch.load(straight_ckpt / "state.pt", weights_only=True)
    assert states[16]["scheduler"] == straight["scheduler"]
    assert states[16]["step"] == straight["step"] == 16


def _write_environ(rank: int, out: str) -> None:
    Path(out, f"rank-{rank}").write_text(os.environ.get("MEMTRAIN_TEST_VALUE", "unset"))


def test_workers_get_the_environment_of_their_own_launch(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The local launcher's workers fork from a server started by an earlier launch (this one's
    first call, if no test before started it): they still see what the caller set since, as
    spawned workers would (a fault to inject, the allocator setting)."""
    monkeypatch.delenv("MEMTRAIN_TEST_VALUE", raising=False)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    start_workers(_write_environ, (str(tmp_path / "first"),), 2)
    monkeypatch.setenv("MEMTRAIN_TEST_VALUE", "set after the server started")
    start_workers(_write_environ, (str(tmp_path / "second"),), 2)
    assert [(tmp_path / "first" / f"rank-{r}").read_text() for r in range(2)] == ["unset"] * 2
    assert [(tmp_path / "second" / f"rank-{r}").read_text() for r in range(2)] == \
        ["set after the server started"] * 2


def _write_imported(rank: int, out: str, names: list[str]) -> None:
    import sys

    Path(out, f"rank-{rank}").write_text(json.dumps([n for n in names if n in sys.modules]))


def test_workers_start_with_the_fork_servers_imports(tmp_path: Path,
                                                     corpus_dir: Path) -> None:
    """A worker starts with what every worker imports already imported (the server did, once),
    torch._dynamo among them: each of them would otherwise import it when it builds its
    optimizer, 0.8 s of CPU apiece. The compile stack is preloaded for launches that compile."""
    from trainer.launch.local import PRELOAD, compiles

    names = list(PRELOAD)
    start_workers(_write_imported, (str(tmp_path), names), 2)
    assert [json.loads((tmp_path / f"rank-{r}").read_text()) for r in range(2)] == [names] * 2
    cfg = tiny_config(corpus_dir, tmp_path)
    assert not compiles(cfg)
    assert compiles(tiny_config(corpus_dir, tmp_path, "memory.optimizer_states=8bit"))
    assert compiles(tiny_config(corpus_dir, tmp_path, "train.compile=true"))


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox", "qwen2", "gpt2"])
def test_an_hf_models_code_is_preloaded_for_its_workers(tmp_path: Path, corpus_dir: Path,
                                                       model_type: str) -> None:
    """For an hf: model the server imports transformers' code for its architecture (and PEFT
    under LoRA), once, instead of every worker importing it: each name must import, since the
    server skips one that does not without a word."""
    import importlib

    from trainer.launch.local import PRELOAD, preload

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": model_type}))
    hf = f"model.name=hf:{tmp_path / 'model'}"
    added = preload(tiny_config(corpus_dir, tmp_path, hf))[len(PRELOAD):]
    assert added == ("transformers.modeling_utils",
                     f"transformers.models.{model_type}.modeling_{model_type}")
    lora = preload(tiny_config(corpus_dir, tmp_path, hf, "model.lora.rank=4"))[len(PRELOAD):]
    assert lora == (*added, "peft")
    for name in lora:
        importlib.import_module(name)
    assert preload(tiny_config(corpus_dir, tmp_path)) == PRELOAD  # memtrain's GPT


def test_a_worker_killed_by_a_signal_is_one_line_naming_its_rank(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the kernel's OOM killer would: rank 1 SIGKILLed at step 5, past the step-4
    checkpoint. The workers are children of the fork server, not of the launcher; their exit
    still reaches it, the other rank is stopped, and the error names the rank and the signal.
    The same run, started again, resumes from the checkpoint (a kill fires once per run) and
    names the restart in one line: the killed rank left no error of its own, the launcher
    recorded how it ended."""
    monkeypatch.setenv("MEMTRAIN_FAULTS", "kill@5:1")
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, "parallel.launcher=local",
                                           "parallel.workers=2", "train.steps=8",
                                           "train.checkpoint_every=4", "train.eval_every=4"))
    with pytest.raises(RuntimeError, match=r"^rank 1 exited with code -9 \(signal SIGKILL\)$"):
        launch_local(cfg, run_dir)
    assert (run_dir / ".faults-fired" / "kill@5-1").exists()
    assert not (run_dir / "summary.json").exists()
    summary = launch_local(cfg, run_dir)
    assert (summary["resumed_from_step"], summary["final_step"]) == (4, 8)
    # (The line itself goes to the worker processes' stderr: tests/unit/test_recovery.py
    # checks its words.)
    assert (summary["attempt"], summary["restarts"]) == (2, {"worker_exit": 1})
    assert 0 < summary["recovery_seconds"] < 120
    attempts = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    restart = next(r for r in attempts if r.get("cause"))
    assert (restart["last_step"], restart["resumed_from"]) == (5, 4)
    assert restart["detail"] == "rank 1 exited with code -9 (signal SIGKILL)"  # the launcher's
    assert [r["steps_redone"] for r in attempts if r.get("recovered")] == [1]
