"""``parallel.sequence`` through the loop: the local launcher's 2 gloo ranks, one sequence group
(each rank half of every row's tokens), held against one process on whole rows, and resumed
across degrees; and each refusal of the config in one line.

Tolerance: the split run does the same arithmetic in another order: each loss is a sum of
n = 16 rows x 64 tokens = 1024 token losses, summed per half row on each rank and then over the
ranks; each weight's gradient likewise, reduced by DDP; the linear layers run on half the rows.
A sum of n terms reassociated in fp32 moves by at most (n - 1) x eps of its terms' magnitude,
1023 x 1.19e-7 = 1.2e-4: the first loss, taken before any update, can differ by that much at
worst. Later losses add the weights' difference, which AdamW keeps to lr x the gradients'
relative rounding a step. ``TOLERANCE`` is that worst case, relative to each loss; the largest
difference measured over the 6 losses (4 steps, 2 evaluations) is 1.5e-7, at the rounding of
one sum (the assertion's message prints it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, arithmetic_chats, prepared_local_run, tiny_config
from tests.unit.test_finetune import memtrain, pretrained_llama
from trainer.config import Config, ConfigError, load_config

pytestmark = pytest.mark.distributed

TOLERANCE = 1023 * 1.19e-7  # relative, of each logged loss (the module docstring)
STEPS = 4


def _run(corpus_dir: Path, tmp_path: Path, name: str, workers: int, sequence: int,
         *overrides: str, until: int | None = None) -> list[float]:
    """The training and evaluation losses rank 0 logged, in order (the group's, split)."""
    cfg = tiny_config(
        corpus_dir, tmp_path, f"train.steps={STEPS}", "train.log_every=1",
        "train.checkpoint_every=2", "train.eval_every=2", "train.eval_batches=1",
        "parallel.launcher=local", f"parallel.workers={workers}",
        f"parallel.sequence={sequence}", f"run.name={name}", *overrides)
    return _losses(cfg, workers, until)


def _losses(cfg: Config, workers: int, until: int | None = None) -> list[float]:
    from trainer.launch.local import launch_local

    cfg, run_dir = prepared_local_run(cfg, workers)
    launch_local(cfg, run_dir, until_step=until)
    records = map(json.loads, (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines())
    return [r.get("loss", r.get("eval_loss")) for r in records
            if "loss" in r or "eval_loss" in r]


@pytest.fixture(scope="module")
def whole_rows(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """One process on whole rows: the reference every split run is held against."""
    return _run(corpus_dir, tmp_path_factory.mktemp("whole"), "whole", 1, 1)


def _assert_close(split: list[float], whole: list[float]) -> None:
    assert len(split) == len(whole) == STEPS + STEPS // 2  # a loss a step, an eval every 2
    worst = max(abs(a - b) / abs(b) for a, b in zip(split, whole, strict=True))
    assert worst <= TOLERANCE, f"largest relative difference {worst:.2e}: {split} vs {whole}"


@pytest.mark.parametrize("changes", [["parallel.strategy=ddp"], ["parallel.strategy=fsdp"],
                                     ["parallel.strategy=ddp", "memory.tiled_mlp=2"]],
                         ids=["ddp", "fsdp", "ddp-tiled-mlp"])
def test_two_ranks_splitting_each_row_train_as_one_process(
        corpus_dir: Path, tmp_path: Path, whole_rows: list[float], changes: list[str]) -> None:
    """Under DDP and FSDP, and with the MLP tiled over each rank's slice (exact within the
    same rounding: tests/unit/test_tiled_mlp.py)."""
    split = _run(corpus_dir, tmp_path, "split", 2, 2, *changes)
    _assert_close(split, whole_rows)  # each rank alone logs its half rows' loss: far off
    assert whole_rows[-2] < whole_rows[0]


@pytest.mark.parametrize(("first", "then"), [((2, 2), (1, 1)), ((1, 1), (2, 2))],
                         ids=["sequence-2-then-1", "sequence-1-then-2"])
def test_a_run_resumes_at_another_sequence_degree(
        corpus_dir: Path, tmp_path: Path, whole_rows: list[float], first: tuple[int, int],
        then: tuple[int, int]) -> None:
    """Two steps at one degree, then two more from their checkpoint at the other: the model
    and optimizer are whole on every rank, the loader's position is the data rank's, and one
    data rank either way."""
    _run(corpus_dir, tmp_path, "resumed", *first, until=2)  # checkpoints at step 2
    resumed = _run(corpus_dir, tmp_path, "resumed", *then)
    _assert_close(resumed, whole_rows)


def test_a_resume_into_sequence_groups_reads_each_row_once(corpus_dir: Path,
                                                            tmp_path: Path) -> None:
    """Two steps of DDP over 2 data ranks, then two more with the same 2 workers as one
    sequence group (one data rank): the loader resumes as at another world size, and the rows
    recorded (``data.record_rows``, by the first rank of each group alone) are the global
    batch's 16 a step, none twice."""
    from monitoring.run_files import rank_rows

    settings = ("data.record_rows=true", "train.eval_every=0")
    _run(corpus_dir, tmp_path, "regrouped", 2, 1, *settings, until=2)
    _run(corpus_dir, tmp_path, "regrouped", 2, 2, *settings)
    records = [json.loads(line) for rank in (0, 1) for line in
               (tmp_path / "regrouped" / rank_rows(rank)).read_text().splitlines()]
    steps = sorted((r["step"], r["world_size"]) for r in records)
    assert steps == [(1, 2), (1, 2), (2, 2), (2, 2), (3, 1), (4, 1)]
    rows = [row for r in records for row in r["rows"]]
    assert len(rows) == len(set(rows)) == STEPS * 16


@pytest.mark.xdist_group("hf")
def test_a_llama_on_packed_masked_rows_trains_as_one_process_and_exports_plain(
        tmp_path: Path) -> None:
    """A grouped-query Llama (4 heads on 2 key/value heads) on chat rows packed with a loss
    mask, through transformers' attention interface: the same losses as one process, within
    ``TOLERANCE`` (rows of 128 tokens hold two or three chats, so each rank's half trains
    answers and holds document boundaries); its export names transformers' own attention, not
    the split's."""
    from trainer.checkpoint.export import export_hf
    from trainer.parallel.sequence import HF_ATTENTION

    model = pretrained_llama(tmp_path / "llama")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_chats(60, seed=1)))
    memtrain("data", "write", str(chats), "--format", "chat", "--tokenizer", str(model),
             "--seq-len", "128", "--out", str(tmp_path / "data"))

    def run(name: str, workers: int, sequence: int) -> list[float]:
        return _losses(load_config(REPO / "configs" / "demo-cpu.yaml", [
            f"model.name=hf:{model}", "model.seq_len=128", f"data.path={tmp_path / 'data'}",
            f"data.val_path={tmp_path / 'data'}", f"run.dir={tmp_path}", f"run.name={name}",
            f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=4",
            "train.warmup_steps=1", "train.lr=3e-3", "train.log_every=1",
            "train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=4",
            "memory.precision=fp32", "memory.activation_checkpointing=none",
            "parallel.launcher=local", f"parallel.workers={workers}",
            f"parallel.sequence={sequence}"]), workers)

    _assert_close(run("split", 2, 2), run("whole", 1, 1))
    export_hf(tmp_path / "split", tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert HF_ATTENTION not in json.dumps(exported)


def test_an_oom_in_a_split_step_is_agreed_on_and_retried_at_half_the_micro_batch(
        corpus_dir: Path, tmp_path: Path, whole_rows: list[float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 runs out before step 3's second micro-batch while rank 0, its peer, waits in
    that micro-batch's first all-to-all: both stop there
    (``trainer.parallel.sequence.GroupOOMWatch``), the step is retried in pieces half as
    large, and the run trains as one process on whole rows.
    (Each place in a micro-batch an OOM may strike: tests/distributed/test_sequence_oom.py.)"""
    monkeypatch.setenv("MEMTRAIN_FAULTS", "oom@3:1")
    split = _run(corpus_dir, tmp_path, "oom", 2, 2, "parallel.strategy=ddp",
                 "memory.oom_recovery=true")  # "auto" is off on CPU
    _assert_close(split, whole_rows)
    for rank in (0, 1):
        records = map(json.loads, (tmp_path / "oom" / "metrics" / f"rank-{rank}.jsonl")
                      .read_text().splitlines())
        plans = [(r["micro_batch_size"], r["accumulation_steps"]) for r in records
                 if "loss" in r]
        assert plans == [(4, 4)] * 2 + [(2, 8)] * 2, (rank, plans)


@pytest.mark.parametrize(("overrides", "said"), [
    (["parallel.workers=3"], "parallel.workers 3 is not divisible by parallel.sequence 2: "
                             "the workers form groups of 2 ranks"),
    (["model.seq_len=15"], "model.seq_len 15 is not divisible by parallel.sequence 2: each "
                           "rank of a group holds seq_len / 2 tokens of every row"),
    (["parallel.workers=[2,4]"], "parallel.workers [2, 4] with parallel.sequence 2: elastic "
                                 "workers would take sizes that do not form sequence groups; "
                                 "set parallel.workers to a multiple of 2"),
], ids=["workers", "seq_len", "elastic"])
def test_each_split_the_config_cannot_make_is_refused_in_one_line(
        overrides: list[str], said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["parallel.sequence=2", "parallel.workers=2", *overrides])
    assert str(refused.value).endswith(said) and "\n" not in str(refused.value)
