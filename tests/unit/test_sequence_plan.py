"""The planner under ``parallel.sequence``: a rank probed as the run splits it (its tokens,
attention over whole rows, the all-to-alls' bytes), the all-to-alls' time, ``memtrain plan``'s
row per degree, and ``auto``'s refusal naming the degree that would fit. Planned for a GPU from
its datasheet figures, so the verdicts hold on any CPU. The peaks against real 2-rank steps:
``tests/distributed/test_sequence_plan.py``."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest

from trainer.config import Config, ConfigError, load_config
from trainer.models.build import MemoryTransforms
from trainer.models.gpt import GPT, GPTConfig
from trainer.plan.auto import decide, resolve_auto, speed_model
from trainer.plan.devices import gpu_speed
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.profile import ActivationProfile
from trainer.plan.speed import SpeedModel, all_to_all_seconds
from trainer.plan.static import static_bytes
from trainer.plan.table import sequence_table

_GPT = GPTConfig(vocab_size=256, seq_len=256, n_layer=2, n_head=4, n_embd=64)
_PLAIN = MemoryTransforms(activation_checkpointing="none", bf16_norm_inputs=False)

# Rows of 4,096 tokens on 4 GPUs, every memory strategy's field set (nothing for auto to add):
# the smallest plan fits 16 MiB only split over 2 ranks, 12 MiB only over 4, 8 MiB not at all.
SHAPE = ["model.vocab_size=256", "model.seq_len=4096", "model.n_layer=2", "model.n_embd=64",
         "model.n_head=4", "parallel.use_gpu=true", "parallel.workers=4",
         "train.global_batch_size=4", "train.micro_batch_size=auto", "memory.precision=bf16",
         "memory.activation_checkpointing=auto", "train.grad_clip=0",
         "memory.optimizer_states=fp32", "memory.activation_offload=none",
         "memory.optimizer_in_backward=false"]


def _cfg(*overrides: str) -> Config:
    return load_config(None, [*SHAPE, *overrides])


def _profile(seq_len: int, sequence: int = 1, packed: bool = False,
             transforms: MemoryTransforms = _PLAIN) -> ActivationProfile:
    return profile_activations(partial(GPT, _GPT), transforms, seq_len, _GPT.vocab_size,
                               "fp32", packed=packed, sequence=sequence, work=True)


@pytest.mark.slow
def test_a_rank_of_a_split_is_probed_with_its_tokens_and_attention_over_whole_rows() -> None:
    """Each rank holds 128 of a row's 256 tokens: its all-to-alls take in queries, keys, values
    and attention's output, 128 x 64 fp32 values each, a layer; under packed rows its saved
    bytes hold the whole rows' 256 x 256 document mask and attention over whole rows, which
    a probe of 128-token rows alone misses (measured: 33% of its saved bytes packed, 5%
    plain)."""
    split = _profile(256, sequence=2)
    assert split.seq_len == 128 and split.all_to_alls.ranks == 2
    one_input = 128 * 64 * 4
    assert split.all_to_alls.largest_per_sample_bytes == one_input
    assert split.all_to_alls.per_sample_bytes == _GPT.n_layer * 4 * one_input
    packed, per_token = _profile(256, 2, packed=True), _profile(128, packed=True)
    whole_mask_growth = 256 * 256 - 128 * 128  # bool, a sample
    assert packed.per_sample_bytes >= per_token.per_sample_bytes + whole_mask_growth
    assert _profile(128).all_to_alls.per_sample_bytes == 0
    with pytest.raises(ValueError, match="^model.n_head 4 is not divisible by the "
                                         "sequence-parallel size 8$"):
        _profile(256, sequence=8)
    with pytest.raises(ValueError, match="^model.seq_len 256 is not divisible by the "
                                         "sequence-parallel size 3$"):
        _profile(256, sequence=3)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_a_split_plan_counts_its_all_to_alls_bytes_and_time(checkpointing: str) -> None:
    """Forward and backward move each all-to-all's input once each, full checkpointing's
    recomputed forward once more; a rank sends half of it to the other (2 ranks), at the
    GPU's all-reduce bus rate, on top of the step's work."""
    transforms = dataclasses.replace(_PLAIN, activation_checkpointing=checkpointing)
    profile = _profile(256, 2, transforms=transforms)
    speed = SpeedModel(gpu_speed("h100"), world_size=2)
    static = static_bytes(GPT(_GPT), "ddp", 2)
    row = plan_row(static, profile, 2, 3, speed)
    passes = 3 if checkpointing == "full" else 2
    forward = profile.all_to_alls.per_sample_bytes * 2  # micro-batch 2
    assert row.all_to_all_bytes == 3 * passes * forward // 2  # accumulation 3
    unsplit = plan_row(static, dataclasses.replace(profile, all_to_alls=dataclasses.replace(
        profile.all_to_alls, per_sample_bytes=0)), 2, 3, speed)
    assert row.step_seconds - unsplit.step_seconds == pytest.approx(
        3 * all_to_all_seconds(forward, 2, speed.step_device, passes - 2))
    assert row.step_seconds - unsplit.step_seconds == pytest.approx(
        row.all_to_all_bytes / speed.step_device.allreduce_bytes_per_s)


@pytest.mark.slow
def test_memtrain_plan_shows_a_row_per_sequence_degree() -> None:
    """Each degree the 4 workers allow, with its data ranks, a rank's tokens of a row, its
    fastest fitting plan's peak and all-to-all bytes; a degree the heads do not divide into
    is said under the table."""
    cfg = _cfg("model.n_head=2")
    table = sequence_table(cfg, 64 * 2**20, speed_model(cfg), "64MiB")
    columns = {column.header: [str(cell) for cell in column.cells] for column in table.columns}
    assert columns["N"] == ["1", "2"]
    assert columns["data\nranks"] == ["4", "2"]
    assert columns["tokens\na rank"] == ["4,096", "2,048"]
    peaks = [float(cell) for cell in columns["peak\nGiB"]]
    assert all(peak <= 0.9 * 64 / 1024 for peak in peaks)
    sent = [float(cell.replace(",", "")) for cell in columns["all-to-all\nMiB"]]
    assert sent[0] == 0 and sent[1] > 0
    assert table.caption == ("N = 4: model.n_head 2 is not divisible by the sequence-parallel "
                             "size 4")


@pytest.mark.parametrize(("budget", "said"), [
    ("16MiB", "; parallel.sequence 2 (each row split over 2 ranks) would fit, at a predicted "
              "peak of 14.1 MiB per rank; "),
    ("12MiB", "; parallel.sequence 4 (each row split over 4 ranks) would fit, at a predicted "
              "peak of 9.8 MiB per rank; "),  # its fastest fitting plan, selective
    ("8MiB", "; nor with parallel.sequence 2 or 4; "),
])
@pytest.mark.slow
def test_when_a_row_fits_no_rank_auto_says_which_sequence_split_would(budget: str,
                                                                      said: str) -> None:
    """``auto`` never splits rows itself (the config names the degree), but its refusal says
    the smallest ``parallel.sequence`` that fits, or which it tried."""
    with pytest.raises(ConfigError, match="^nothing fits ") as err:
        decide(_cfg(f"memory.device_memory={budget}"))
    assert said in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_with_the_strategy_auto_the_refusal_names_the_split_under_the_sharding_holding_least(
        ) -> None:
    """No sharding candidate fits 16 MiB and auto may add no memory strategy: the refusal
    names the sequence split that would fit under FSDP, the candidate holding least."""
    with pytest.raises(ConfigError, match="^nothing fits 16.0 MiB per device under "
                                          "parallel.strategy ddp or ") as err:
        resolve_auto(_cfg("parallel.strategy=auto", "memory.device_memory=16MiB"))
    assert ("; parallel.sequence 2 (each row split over 2 ranks) would fit under "
            "parallel.strategy fsdp (reshard_after_forward true, offload none), at a predicted "
            "peak of ") in str(err.value)
