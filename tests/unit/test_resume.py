"""What a resume changes: every changed key said, those that break exactness refused unless
allowed, the learning rate following the new config without a jump, ``--fresh``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import logged_losses, tiny_config
from trainer.config import ConfigError
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run
from trainer.optim import Schedule


def test_a_changed_step_count_continues_the_decay_from_where_it_was() -> None:
    before = Schedule(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    longer = Schedule(steps=200, warmup_steps=10, min_lr_ratio=0.1).resumed(before, 60)
    assert longer(60) == before(60)  # no jump at the resume
    assert all(longer(s) > longer(s + 1) for s in range(60, 199))
    assert longer(200) == pytest.approx(0.1) and longer(130) > before(100)
    shorter = Schedule(steps=80, warmup_steps=10, min_lr_ratio=0.1).resumed(before, 60)
    assert shorter(60) == before(60) and shorter(80) == pytest.approx(0.1)
    # The same shape: the checkpoint's schedule, anchor and all, runs on.
    assert Schedule(200, 10, 0.1).resumed(longer, 150) == longer
    assert Schedule(100, 20, 0.1).resumed(before, 5) == Schedule(  # in warm-up: it rises on
        100, 20, 0.1, anchor=(5, before(5)), rising=True)
    assert Schedule(100, 10, 0.1).resumed(None, 60) == before  # a checkpoint without one


def _rates(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()
    return {r["step"]: r["lr"] for r in map(json.loads, lines) if "lr" in r}


def test_a_resume_says_what_changed_and_the_new_rate_applies_without_a_jump(
        corpus_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """4 of 8 steps at lr 3e-3 (warm-up 1), then resumed to 12 steps at lr 1e-9: steps 5 to 12
    run at 1e-9 times the factor the first run had reached, falling to the floor at step 12;
    not at the old peak on a cosine stretched over 12 steps, which rose at the resume."""
    common = ("parallel.launcher=local", "parallel.workers=1", "train.warmup_steps=1",
              "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=4",
              "run.name=changes")
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "train.steps=8",
                                           "train.lr=3e-3"))
    launch_local(cfg, run_dir, until_step=4)

    def resume(*changes: str, allow: bool = False):
        return prepare_run(tiny_config(corpus_dir, tmp_path, *common, *changes),
                           allow_changes=allow)

    with pytest.raises(ConfigError, match=r"^model.n_layer: 2 -> 3 on resuming run 'changes' "
                                          r"breaks an exact resume; pass --allow-changes"):
        resume("train.steps=8", "train.lr=3e-3", "model.n_layer=3")
    with pytest.raises(ConfigError, match=r"^data.shuffle_window: .* \(and run.seed\) breaks"):
        resume("train.steps=8", "train.lr=3e-3", "data.shuffle_window=64", "run.seed=1")
    with caplog.at_level(logging.INFO, logger="memtrain"):
        cfg, run_dir = resume("train.steps=12", "train.lr=1e-9")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming")]
    assert said == ["resuming with train.lr changed: 0.003 -> 1e-09",
                    "resuming with train.steps changed: 8 -> 12"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memtrain"):
        summary = launch_local(cfg, run_dir)
    assert summary["resumed_from_step"] == 4
    assert any(r.getMessage().startswith("learning rate: peak 0.003 -> 1e-09; steps, warm-up, "
                                         "floor (8, 1, 0.1) -> (12, 1, 0.1)")
               for r in caplog.records)
    rates = _rates(run_dir)  # the rate the scheduler set after each step, for the next
    old, new = Schedule(8, 1, 0.1), Schedule(12, 1, 0.1, anchor=(4, Schedule(8, 1, 0.1)(4)))
    assert rates[4] == pytest.approx(3e-3 * old(4))  # the first run's last
    assert new(4) == old(4)  # where the resumed curve starts: no jump but the peak's change
    assert [rates[s] for s in range(5, 13)] == pytest.approx([1e-9 * new(s)
                                                              for s in range(5, 13)])
    assert all(rates[s] > rates[s + 1] for s in range(5, 12)), rates
    assert rates[12] == pytest.approx(1e-9 * 0.1)


def test_fresh_moves_the_old_run_aside_and_starts_from_scratch(
        corpus_dir: Path, tmp_path: Path) -> None:
    common = ("parallel.launcher=local", "parallel.workers=1", "train.steps=2",
              "train.eval_every=0", "train.checkpoint_every=2", "run.name=again")
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common))
    launch_local(cfg, run_dir)
    cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "model.n_layer=1"),
                               fresh=True)
    [aside] = run_dir.parent.glob("again.replaced-*")
    assert (aside / "checkpoint-00000002" / "meta.json").is_file()
    assert not run_dir.joinpath("checkpoint-00000002").exists()
    assert launch_local(cfg, run_dir)["resumed_from_step"] is None


def test_a_new_run_starts_from_another_runs_weights(corpus_dir: Path, tmp_path: Path) -> None:
    """``train.init_from``: run A's latest whole checkpoint's weights, at step 0 of run B (its
    optimizer, schedule and data from their start); a path without a checkpoint, or a model
    the weights do not fit, is one line."""
    from trainer.checkpoint.files import CheckpointReadError, load_tensors

    common = ("parallel.launcher=local", "parallel.workers=1", "train.eval_every=0",
              "train.checkpoint_every=2")
    cfg, source = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "train.steps=2",
                                          "run.name=source"))
    launch_local(cfg, source)
    with pytest.raises(ConfigError, match=r"^train.init_from '.*nowhere': no whole checkpoint"):
        prepare_run(tiny_config(corpus_dir, tmp_path, *common, "run.name=b",
                                f"train.init_from={tmp_path / 'nowhere'}"))
    cfg, target = prepare_run(tiny_config(
        corpus_dir, tmp_path, *common, "train.steps=1", "train.lr=1e-12", "run.name=b",
        f"train.init_from={source}"))
    assert cfg.train.init_from == str(source / "checkpoint-00000002")
    assert launch_local(cfg, target)["resumed_from_step"] is None
    names = {k.removeprefix("model."): torch.empty(v.size)  # type: ignore[union-attr]
             for k, v in _metadata(source / "checkpoint-00000002").items()
             if k.startswith("model.")}
    started = load_tensors(source / "checkpoint-00000002", dict(names))
    after = load_tensors(target / "checkpoint-00000001",
                                 {k: torch.empty_like(v) for k, v in names.items()})
    assert all(torch.allclose(after[k], started[k], atol=1e-8) for k in names)
    cfg, wrong = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "train.steps=1",
                                         "model.n_embd=32", "run.name=c",
                                         f"train.init_from={source}"))
    with pytest.raises(CheckpointReadError, match=r"checkpoint .*checkpoint-00000002 does not "
                                                  r"fit the model: .*[Ss]ize mismatch"):
        launch_local(cfg, wrong)


def _metadata(checkpoint: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata


def test_a_new_run_name_resumes_from_another_runs_checkpoint(corpus_dir: Path,
                                                            tmp_path: Path) -> None:
    """``--resume-from PATH`` (``train.resume_from``): a run name with no checkpoint of its
    own takes another's whole state, and ends on the losses of an uninterrupted run; a run
    with checkpoints of its own refuses it in one line."""
    common = ("parallel.launcher=local", "parallel.workers=1", "train.eval_every=0",
              "train.log_every=1", "train.checkpoint_every=2", "train.steps=6")
    cfg, straight = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "run.name=straight"))
    launch_local(cfg, straight)
    cfg, first = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "run.name=first"))
    launch_local(cfg, first, until_step=4)
    cfg, branch = prepare_run(tiny_config(corpus_dir, tmp_path, *common, "run.name=branch",
                                          f"train.resume_from={first}"))
    assert launch_local(cfg, branch)["resumed_from_step"] == 4
    assert logged_losses(branch) == logged_losses(straight)[4:]
    with pytest.raises(ConfigError, match=r"^train.resume_from: run 'branch' has checkpoints "
                                          r"of its own, .* add --fresh$"):
        prepare_run(tiny_config(corpus_dir, tmp_path, *common, "run.name=branch",
                                f"train.resume_from={first}"))


def test_the_run_keeps_as_many_checkpoints_as_it_is_told(corpus_dir: Path,
                                                         tmp_path: Path) -> None:
    from trainer.checkpoint.files import published_checkpoints

    cfg, run_dir = prepare_run(tiny_config(
        corpus_dir, tmp_path, "parallel.launcher=local", "parallel.workers=1", "train.steps=6",
        "train.eval_every=0", "train.checkpoint_every=2", "run.keep_checkpoints=2",
        "run.name=kept"))
    launch_local(cfg, run_dir)
    assert [step for step, _ in published_checkpoints(run_dir)] == [4, 6]


def test_a_resume_inside_the_old_warm_up_with_a_shorter_one_reaches_the_peak() -> None:
    before = Schedule(steps=100, warmup_steps=100, min_lr_ratio=0.1)
    resumed = Schedule(steps=150, warmup_steps=20, min_lr_ratio=0.1).resumed(before, 50)
    assert before(50) < 0.52 and resumed(50) == 1.0  # the new warm-up is over: the peak
    assert all(resumed(s) > resumed(s + 1) for s in range(50, 149))
    assert resumed(150) == pytest.approx(0.1)


def test_a_resume_inside_both_warm_ups_rises_from_where_it_was() -> None:
    before = Schedule(steps=300, warmup_steps=100, min_lr_ratio=0.1)
    resumed = Schedule(steps=300, warmup_steps=200, min_lr_ratio=0.1).resumed(before, 50)
    assert resumed(50) == before(50)  # no jump down to the longer warm-up's 51/200
    assert all(resumed(s) < resumed(s + 1) for s in range(50, 199))
    assert resumed(199) == 1.0 and resumed(200) == 1.0 > resumed(201)


def _factors(schedules: list[tuple[int, Schedule]], steps: int) -> list[float]:
    """The factor each trained step ran at, for a run whose ``schedules`` took over at the
    given steps."""
    return [next(s for start, s in reversed(schedules) if start <= step)(step)
            for step in range(steps)]


@settings(max_examples=600, deadline=None)
@given(steps=st.lists(st.integers(2, 300), min_size=2, max_size=3),
       warmups=st.lists(st.integers(0, 150), min_size=3, max_size=3),
       floors=st.lists(st.sampled_from([0.0, 0.1, 0.5]), min_size=3, max_size=3),
       points=st.lists(st.integers(0, 299), min_size=2, max_size=2))
def test_every_run_of_resumes_reaches_the_peak_once_and_never_past_it(
        steps, warmups, floors, points) -> None:
    """Any old and new warm-up, step count, floor and resume points (one or two resumes):
    the rate never exceeds ``train.lr``, reaches it, and the steps at the peak are one
    stretch (a run does not decay and then climb back to its peak)."""
    shapes = [Schedule(n, min(w, n - 1), f) for n, w, f in zip(steps, warmups, floors,
                                                               strict=False)]
    schedules, at = [(0, shapes[0])], 0
    for new, point in zip(shapes[1:], points, strict=False):
        at = min(max(point, at), schedules[-1][1].steps)
        if at >= new.steps:  # no step left to resume into
            break
        schedules.append((at, new.resumed(schedules[-1][1], at)))
    factors = _factors(schedules, schedules[-1][1].steps)
    assert max(factors) <= 1 + 1e-12
    peaks = [i for i, f in enumerate(factors) if f >= 1 - 1e-9]
    assert peaks, factors
    assert peaks == list(range(peaks[0], peaks[-1] + 1)), peaks


@settings(max_examples=400, deadline=None)
@given(steps=st.tuples(st.integers(2, 400), st.integers(2, 400)),
       warmups=st.tuples(st.integers(0, 120), st.integers(0, 120)),
       floors=st.tuples(st.sampled_from([0.0, 0.1, 0.5]), st.sampled_from([0.0, 0.1, 0.5])),
       at=st.integers(0, 399))
def test_every_resume_of_a_schedule_keeps_its_promises(steps, warmups, floors, at) -> None:
    """Over old and new shapes and resume points: inside the old warm-up, the rate rises
    without a jump to the peak at the new warm-up's end (or takes the peak at once where the
    new warm-up is over), then runs the new cosine; past the peak, the rate does not jump at
    the resume, moves one way only, from the factor reached to the new floor, which it
    reaches at the new last step."""
    before = Schedule(steps[0], min(warmups[0], steps[0] - 1), floors[0])
    new = Schedule(steps[1], min(warmups[1], steps[1] - 1), floors[1])
    at = min(at, before.steps, new.steps - 1)
    runs = new.resumed(before, at)
    after = [runs(s) for s in range(at, new.steps + 1)]
    if before.shape() == new.shape():
        assert runs == before
    elif before.warming_up(at) and before(at) < 1:
        peak = max(at, new.warmup_steps - 1)
        assert after[0] == (before(at) if at < new.warmup_steps - 1 else 1.0)
        assert all(a < b for a, b in zip(after[:peak - at], after[1:peak - at + 1],
                                         strict=True))
        assert runs(peak) == 1.0
        if at < new.warmup_steps - 1:
            assert after[peak - at:] == [new(s) for s in range(peak, new.steps + 1)]
    else:
        assert after[0] == pytest.approx(before(at))
        sign = 1 if before(at) >= new.min_lr_ratio else -1  # a raised floor: the rate rises
        assert all(sign * (a - b) >= -1e-12 for a, b in zip(after, after[1:], strict=False))
        low, high = sorted((new.min_lr_ratio, before(at)))
        assert all(low - 1e-12 <= f <= high + 1e-12 <= 1 + 2e-12 for f in after)
        assert after[-1] == pytest.approx(new.min_lr_ratio)


def test_a_resume_inside_a_warm_up_says_what_the_rate_does() -> None:
    """The line a resume logs names what the rate does inside a warm-up: the peak at once
    where the new warm-up is over, else a rise to it; not a cosine continuing."""
    from trainer.optim import resume_schedule

    def scheduler(schedule: Schedule) -> torch.optim.lr_scheduler.LambdaLR:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    old = scheduler(Schedule(1000, 100, 0.1))
    for _ in range(50):
        old.optimizer.step()
        old.step()
    line = resume_schedule(scheduler(Schedule(1000, 20, 0.1)), old.state_dict())
    assert line is not None and "the new warm-up over at step 50: the peak from there " \
        "(factor 0.51 -> 1), then the cosine" in line and "continuing" not in line
    line = resume_schedule(scheduler(Schedule(1000, 200, 0.1)), old.state_dict())
    assert line is not None and "inside a warm-up at step 50: rising from factor 0.51 to " \
        "the peak at step 199" in line
