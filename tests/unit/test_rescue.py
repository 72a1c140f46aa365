"""What ``auto`` adds when nothing fits with the configured memory strategies
(``trainer.plan.rescue``): which candidates a config allows, tier by tier, and the decision a
tight budget gets. Planned for a GPU from its datasheet figures, so the verdicts hold on any
CPU."""

from __future__ import annotations

import logging

import pytest

from trainer.config import Config, ConfigError, load_config
from trainer.plan.auto import decide, describe, resolve_auto
from trainer.plan.rescue import describe_added, rescue_tiers

# 3.3M parameters on 4 GPUs under DDP: fp32 AdamW holds 53 MB a GPU (16 bytes a parameter),
# 8-bit states 33 MB; the activations at micro-batch 4 are a few MB.
SHAPE = ["model.vocab_size=256", "model.seq_len=256", "model.n_layer=4", "model.n_embd=256",
         "model.n_head=4", "parallel.use_gpu=true", "parallel.workers=4",
         "train.global_batch_size=16", "train.micro_batch_size=auto", "memory.precision=bf16",
         "memory.activation_checkpointing=auto", "train.grad_clip=0"]


def _cfg(*overrides: str) -> Config:
    return load_config(None, [*SHAPE, *overrides])


def _tiers(cfg: Config) -> list[list[str]]:
    return [[describe_added(c) for c in tier] for tier in rescue_tiers(cfg)]


def test_the_tiers_keep_the_arithmetic_first_and_never_touch_a_set_field() -> None:
    in_backward, offload = "memory.optimizer_in_backward true", "memory.activation_offload all"
    eight, four = "memory.optimizer_states 8bit", "memory.optimizer_states 4bit"
    assert _tiers(_cfg()) == [
        [offload, in_backward, f"{in_backward}, {offload}"],
        [eight, f"{offload}, {eight}", f"{in_backward}, {eight}",
         f"{in_backward}, {offload}, {eight}"],
        [four, f"{offload}, {four}", f"{in_backward}, {four}",
         f"{in_backward}, {offload}, {four}"]]
    # The step in backward takes one micro-batch a step: the per-rank batch.
    [stepped] = [c for c in rescue_tiers(_cfg())[0] if c.memory.optimizer_in_backward
                 and c.memory.activation_offload == "none"]
    assert stepped.train.micro_batch_size == 4
    # A field the config sets, even to its default, is kept.
    assert _tiers(_cfg("memory.optimizer_states=fp32", "memory.activation_offload=none",
                       "memory.optimizer_in_backward=false")) == []
    # Clipping (the default 1.0) rules out the step in backward; a CPU run, offload (host and
    # device are one memory there).
    assert _tiers(_cfg("train.grad_clip=1.0", "memory.optimizer_states=fp32")) == [[offload]]
    assert _tiers(_cfg("parallel.use_gpu=false", "memory.optimizer_states=fp32")) == [
        [in_backward]]


def test_the_step_in_backward_takes_the_batch_of_a_data_rank_under_sequence_parallelism(
        ) -> None:
    """4 workers in sequence groups of 2 are 2 data ranks: one micro-batch a step is 8 rows."""
    [stepped] = [c for tier in rescue_tiers(_cfg("parallel.sequence=2",
                                                 "memory.optimizer_states=fp32"))
                 for c in tier if c.memory.optimizer_in_backward
                 and c.memory.activation_offload == "none"]
    assert stepped.train.micro_batch_size == 8


@pytest.mark.parametrize(("budget", "added"), [
    ("80MiB", ""),  # fits as configured: nothing added
    # the step in backward and offload keep the arithmetic: tried before low-bit states
    ("60MiB", "memory.optimizer_in_backward true, memory.activation_offload all"),
    ("56MiB", "memory.optimizer_states 8bit"),  # neither is enough: 8-bit states alone are
])
@pytest.mark.slow
def test_a_budget_that_fits_nothing_as_configured_gets_the_first_tier_that_fits(
        budget: str, added: str, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(f"memory.device_memory={budget}")
    with caplog.at_level(logging.INFO, logger="memtrain"):
        chosen, decision = decide(cfg)
    assert decision is not None and decision.plan is not None
    assert describe_added(chosen) == added
    lines = [r.getMessage() for r in caplog.records if " added " in r.getMessage()]
    assert len(lines) == (1 if added else 0)
    if added:
        assert lines[0].startswith(f"auto: nothing fits {budget[:2]}.0 MiB per device ")
        assert f"added {added}: predicted " in lines[0]
        assert ("that keep the arithmetic" in lines[0]) == ("states" not in added)
    # the rest of auto resolved with it: the step in backward took one micro-batch a step
    assert chosen.memory.activation_checkpointing != "auto"
    if chosen.memory.optimizer_in_backward:
        assert chosen.train.micro_batch_size == 4


@pytest.mark.slow
def test_nothing_fitting_even_with_every_strategy_names_what_was_tried() -> None:
    with pytest.raises(ConfigError, match=r"^nothing fits 30\.0 MiB per device .*; nor with "
                                          r"memory\.activation_offload all, memory\.optimizer_"
                                          r"in_backward true, memory\.optimizer_states 8bit or "
                                          r"4bit; ") as err:
        decide(_cfg("memory.device_memory=30MiB"))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_with_the_strategy_auto_too_they_are_added_to_the_sharding_holding_least(
        caplog: pytest.LogCaptureFixture) -> None:
    """No sharding candidate fits 20 MiB as configured: FSDP (the one holding least) is kept, and
    the memory strategies are planned on it."""
    with caplog.at_level(logging.INFO, logger="memtrain"):
        chosen = resolve_auto(_cfg("parallel.strategy=auto", "memory.device_memory=20MiB"))
    assert describe(chosen) == "parallel.strategy fsdp (reshard_after_forward true, offload none)"
    assert "memory.optimizer_states 8bit" in describe_added(chosen)
    assert any(r.getMessage().startswith("auto: nothing fits 20.0 MiB per device under "
                                         "parallel.strategy ddp or ") for r in caplog.records)
