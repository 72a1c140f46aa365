"""``parallel.strategy: auto`` and ``parallel.fsdp``'s ``auto`` fields: which candidates each
config allows, and the tiers the decision takes them in (DDP, FSDP on the device, FSDP with
offload). Planned for a GPU from its datasheet figures, so the verdicts hold on any CPU."""

from __future__ import annotations

import logging

import pytest

from trainer.config import Config, ConfigError, load_config
from trainer.plan.auto import decide_sharding, describe, sharding_candidates

# 3.3M parameters: DDP holds 53 MB of weights, gradients and AdamW state on each of 4 GPUs.
SHAPE = ["model.vocab_size=256", "model.seq_len=256", "model.n_layer=4", "model.n_embd=256",
         "model.n_head=4", "parallel.use_gpu=true", "parallel.workers=4",
         "train.global_batch_size=16", "train.micro_batch_size=2", "memory.precision=bf16",
         "memory.activation_checkpointing=none"]


def _cfg(*overrides: str) -> Config:
    return load_config(None, [*SHAPE, *overrides])


def test_each_auto_field_adds_its_candidates() -> None:
    assert [describe(c) for c in sharding_candidates(_cfg())] == ["parallel.strategy ddp"]
    both = sharding_candidates(_cfg("parallel.strategy=auto",
                                    "parallel.fsdp.reshard_after_forward=auto",
                                    "parallel.fsdp.offload=auto"))
    assert [describe(c) for c in both] == [
        "parallel.strategy ddp",
        "parallel.strategy fsdp (reshard_after_forward true, offload none)",
        "parallel.strategy fsdp (reshard_after_forward false, offload none)",
        "parallel.strategy fsdp (reshard_after_forward true, offload cpu)",
        "parallel.strategy fsdp (reshard_after_forward false, offload cpu)"]
    # A CPU run: host and device are the same memory, offload frees nothing.
    on_cpu = sharding_candidates(_cfg("parallel.use_gpu=false", "parallel.strategy=fsdp",
                                      "parallel.fsdp.offload=auto"))
    assert [c.parallel.fsdp.offload for c in on_cpu] == ["none"]
    # fp16 does not run under FSDP, and one worker has nothing to shard.
    for no_fsdp in ("memory.precision=fp16", "parallel.workers=1"):
        only = sharding_candidates(_cfg("parallel.strategy=auto", no_fsdp,
                                        "train.global_batch_size=2"))
        assert [c.parallel.strategy for c in only] == ["ddp"]
    # An explicit strategy is kept as it is, one worker or not.
    one = sharding_candidates(_cfg("parallel.strategy=fsdp", "parallel.workers=1",
                                   "train.global_batch_size=2"))
    assert [c.parallel.strategy for c in one] == ["fsdp"]


def test_a_ddp_candidate_drops_the_fsdp_settings_and_validates_again() -> None:
    """The workers validate the resolved config again, and ddp refuses FSDP settings."""
    cfg = _cfg("parallel.strategy=auto", "parallel.fsdp.reshard_after_forward=false",
               "parallel.fsdp.param_dtype=bf16")
    ddp, fsdp = sharding_candidates(cfg)
    assert ddp.parallel.strategy == "ddp"
    assert Config.model_validate(ddp.model_dump(mode="json")) == ddp
    assert (fsdp.parallel.fsdp.reshard_after_forward, fsdp.parallel.fsdp.param_dtype) \
        == (False, "bf16")


@pytest.mark.parametrize(("budget", "chosen"), [
    ("96MiB", "parallel.strategy ddp"),
    ("52MiB", "parallel.strategy fsdp (reshard_after_forward true, offload none)"),
    ("36MiB", "parallel.strategy fsdp (reshard_after_forward true, offload cpu)"),
])
@pytest.mark.slow
def test_auto_takes_ddp_then_fsdp_then_offload_as_memory_shrinks(
        budget: str, chosen: str, caplog: pytest.LogCaptureFixture) -> None:
    """DDP needs about 69 MiB a GPU here, FSDP on 4 ranks 39, with offload 33 (90% headroom):
    each budget takes the first tier that fits, and the log line names the others."""
    cfg = _cfg("parallel.strategy=auto", "parallel.fsdp.offload=auto",
               f"memory.device_memory={budget}")
    with caplog.at_level(logging.INFO, logger="memtrain"):
        assert describe(decide_sharding(cfg)) == chosen
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "auto: parallel.strategy")]
    assert line.startswith(f"auto: {chosen}: predicted ")
    assert "does not fit" in line or chosen.endswith("ddp")


@pytest.mark.slow
def test_nothing_fitting_under_any_candidate_is_one_line() -> None:
    cfg = _cfg("parallel.strategy=auto", "parallel.fsdp.offload=auto",
               "memory.device_memory=24MiB")
    with pytest.raises(ConfigError, match=r"^nothing fits 24\.0 MiB per device under "
                                          r"parallel\.strategy ddp or .*offload cpu\)") as err:
        decide_sharding(cfg)
    assert "\n" not in str(err.value)
