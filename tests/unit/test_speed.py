"""The planner's time model: operators counted as the step runs them, a calibration cached per
machine, step times composed from them, and ``auto`` choosing by predicted tokens/s, checked
against measured steps."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.conftest import recorded_cpu_speed
from tests.unit.plan_baseline import choose_plan
from trainer.models.build import MemoryTransforms
from trainer.models.gpt import GPT, GPTConfig
from trainer.parallel.fsdp import FsdpSettings
from trainer.plan import calibrate as calibration
from trainer.plan import measure as plan_measure
from trainer.plan import work as plan_work
from trainer.plan.devices import DeviceSpeed, gpu_speed
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.speed import (
    LoaderCost,
    SpeedModel,
    fsdp_seconds,
    measure_loader,
    step_time,
)
from trainer.plan.static import static_bytes
from trainer.plan.work import StepWork, Work, record_work

CFG = GPTConfig(seq_len=64, n_layer=2, n_head=2, n_embd=32, vocab_size=256)


def _matmul_flops(work: Work) -> float:
    return sum(v for k, v in work.amount.items() if k.startswith("matmul:"))


@pytest.mark.parametrize("batch", [1, 2])
def test_the_step_is_counted_operator_by_operator(batch: int) -> None:
    """Every matrix product of forward and backward, to the FLOP: 6 x tokens x the weights'
    elements (forward 2, backward 4); full checkpointing adds the blocks' forward again, but
    for each block's last product (the MLP's output projection): torch's non-reentrant
    checkpoint stops recomputing once it has every tensor backward needs."""
    L, C, V, T = CFG.n_layer, CFG.n_embd, CFG.vocab_size, CFG.seq_len
    tokens = batch * T
    blocks = 12 * L * C * C  # qkv 3C^2, projection C^2, MLP 8C^2 per block
    plain = MemoryTransforms("none", loss_chunk_tokens=0)
    work = record_work(partial(GPT, CFG), plain, T, V, "fp32")
    assert _matmul_flops(work.forward_backward(batch)) == 6 * tokens * (blocks + V * C)
    full = record_work(partial(GPT, CFG), plain.replace(activation_checkpointing="full"), T, V,
                       "fp32")
    assert _matmul_flops(full.forward_backward(batch)) \
        == 6 * tokens * (blocks + V * C) + 2 * tokens * (blocks - L * 4 * C * C)
    assert work.forward_backward(batch).amount["attention:fp32"] > 0
    # bf16 autocast: the products run in bf16, and the casts are counted as conversions.
    bf16 = record_work(partial(GPT, CFG), plain, T, V, "bf16").forward_backward(batch)
    assert _matmul_flops(bf16) == _matmul_flops(work.forward_backward(batch))
    assert all(":bf16" in k for k in bf16.amount if k.startswith("matmul:"))
    assert bf16.amount["convert:fp32"] > 0


def test_the_optimizer_step_moves_every_parameter() -> None:
    work = record_work(partial(GPT, CFG), MemoryTransforms("none"), CFG.seq_len,
                       CFG.vocab_size, "fp32")
    n = sum(p.numel() for p in {id(p): p for p in GPT(CFG).parameters()}.values())
    assert work.grad_bytes == 4 * n
    moved = sum(work.optimizer.amount.values())
    # AdamW reads and writes the weight, its gradient and two moments: well over 16 B each.
    assert 16 * n < moved < 200 * n


def _device(**op_seconds: float) -> DeviceSpeed:
    return DeviceSpeed("test", {"matmul:fp32": 1e9, "memory:fp32": 1e9},
                       {"matmul": 0.0, "memory": 0.0, "view": 0.0, **op_seconds}, 1e9)


def test_a_step_is_accumulation_forward_backwards_an_optimizer_step_and_the_all_reduce() -> None:
    fb1 = Work({"matmul:fp32": 10}, {"matmul:fp32": 1e9})  # 1 s a sample
    fb2 = Work({"matmul:fp32": 10}, {"matmul:fp32": 2e9})
    work = StepWork(fb1, fb2, Work({"memory:fp32": 1}, {"memory:fp32": 5e8}), int(2e9), 100)
    device = _device()
    one = step_time(work, device, micro_batch=4, accumulation=2)
    assert one.seconds == pytest.approx(2 * 4 + 0.5) and one.allreduce == 0
    assert one.tokens_per_s == pytest.approx(8 * 100 / 8.5)
    # Two ranks: a ring all-reduce moves 2 x (n-1)/n of the gradients, 2 s at 1 GB/s, hidden
    # behind 2/3 of the last micro-batch's forward and backward (4 s) where DDP overlaps it.
    overlapped = step_time(work, device, 4, 2, world_size=2)
    assert overlapped.allreduce == 0 and overlapped.tokens_per_s == pytest.approx(
        2 * one.tokens_per_s)
    exposed = step_time(work, device, 4, 2, world_size=2, overlap_allreduce=False)
    assert exposed.allreduce == pytest.approx(2.0)
    # A fixed cost per operator makes small micro-batches slower per token.
    slow_ops = _device(matmul=0.1)
    assert step_time(work, slow_ops, 1, 8).tokens_per_s < step_time(work, slow_ops, 8, 1
                                                                    ).tokens_per_s
    # The loader gathers on the training thread: on CPU its cost adds to the step, per batch
    # and per sample; on a GPU only what exceeds the device's work counts.
    loader = LoaderCost(per_batch=0.25, per_sample=0.5)
    fed = step_time(work, device, 4, 2, loader=loader)
    assert fed.data == pytest.approx(2 * (0.25 + 4 * 0.5))
    assert fed.seconds == pytest.approx(8.5 + 4.5)
    gpu = dataclasses.replace(device, asynchronous=True)
    assert step_time(work, gpu, 4, 2, loader=loader).data == 0
    assert step_time(work, gpu, 4, 2, loader=LoaderCost(0.0, 2.0)).data \
        == pytest.approx(16 - 8.5)


def test_fsdp_steps_count_their_collectives_and_offload_copies() -> None:
    """2 GB of fp32 parameters on 4 ranks at 1 GB/s: each micro-batch all-gathers 3/4 of them
    for forward and again for backward, the gradients are reduce-scattered once; 2/3 of the
    micro-batches' compute hides them. Each setting moves what it says."""
    fb = Work({"matmul:fp32": 10}, {"matmul:fp32": 1e9})  # 1 s a sample
    work = StepWork(fb, Work({"matmul:fp32": 10}, {"matmul:fp32": 2e9}),
                    Work({"memory:fp32": 1}, {"memory:fp32": 5e8}), int(2e9), 100)
    device = dataclasses.replace(_device(), gather_bytes_per_s=1e9)

    def comm(**settings: object) -> float:
        fsdp = FsdpSettings(**settings)  # type: ignore[arg-type]
        return fsdp_seconds(work.grad_bytes, device, fsdp, 4, accumulation=2)

    assert comm() == pytest.approx((2 * 2 * 1.5e9 + 1.5e9) / 1e9)  # 7.5 s
    assert comm(reshard_after_forward=False) == pytest.approx((2 * 1.5e9 + 1.5e9) / 1e9)
    assert comm(reshard_after_forward=False) < comm(reshard_after_forward=2) < comm()
    assert comm(param_dtype="bf16") == pytest.approx((2 * 2 * 0.75e9 + 1.5e9) / 1e9)
    assert comm(param_dtype="bf16", reduce_dtype="bf16") == pytest.approx(3.75)
    assert comm(offload="cpu") == comm()  # a CPU: host and device are the same memory
    gpu = dataclasses.replace(device, host_link_bytes_per_s=0.5e9)
    offloaded = fsdp_seconds(work.grad_bytes, gpu, FsdpSettings(offload="cpu"), 4, 2)
    # 5 copies of a 0.5 GB shard: 4 before the gathers, 1 of the gradients back.
    assert offloaded == pytest.approx(comm() + 5 * 0.5e9 / 0.5e9)
    step = step_time(work, device, 4, 2, world_size=4, fsdp=FsdpSettings())
    assert step.allreduce == pytest.approx(7.5 - 2 * 4 * 2 / 3)
    assert step.seconds == pytest.approx(8 + 0.5 + step.allreduce)


def test_gpus_are_planned_from_their_peaks() -> None:
    h200 = gpu_speed("NVIDIA H200")
    assert h200.rate("matmul:bf16:k256") == pytest.approx(989e12 * 0.7)
    assert h200.rate("matmul:bf16:k256") > 10 * h200.rate("matmul:fp32")
    assert gpu_speed("a100-sxm4-80gb").name == "A100"
    with pytest.raises(ValueError, match="'MI300X' has no peak figures; known: h200"):
        gpu_speed("MI300X")
    # A GPU overlaps launching with computing: a step costs the larger of the two.
    work = Work({"matmul:bf16": 1000}, {"matmul:bf16": 1e9})
    assert h200.seconds(work) == pytest.approx(1000 * 6e-6)


def test_the_calibration_is_measured_once_per_machine(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path))
    calls = []
    fake = DeviceSpeed("cpu", {"matmul:fp32": 1e11, "memory:fp32": 1e10}, {"matmul": 1e-5},
                       1e9, source="measured")

    def calibrate() -> DeviceSpeed:
        calls.append(1)
        return fake

    monkeypatch.setattr(calibration, "calibrate_cpu", calibrate)
    assert calibration.cpu_speed() == fake and calibration.cpu_speed() == fake
    assert len(calls) == 1
    [cached] = tmp_path.glob("cpu-speed-*.json")
    assert json.loads(cached.read_text())["rates"] == fake.rates
    cached.write_text("{not json")  # a damaged cache is measured again, not an error
    assert calibration.cpu_speed() == fake and len(calls) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another thread count: its own
    calibration.cpu_speed()
    assert len(calls) == 3 and len(list(tmp_path.glob("cpu-speed-*.json"))) == 2
    calibration.cpu_speed(refresh=True)  # `memtrain plan --calibrate`: measured again, cached
    assert len(calls) == 4 and calibration.cpu_speed() == fake and len(calls) == 4


def test_an_unstable_calibration_is_measured_again_at_the_next_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A calibration whose repeats spread beyond the bound (a busy machine) is used by the
    call that took it and measured again by the next process that reads it; the steadier of
    the two is kept, and a stable one is kept until ``refresh``."""
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_TAKEN", {})
    spreads = iter([0.40, 0.55, 0.03])

    def calibrate() -> DeviceSpeed:
        return DeviceSpeed("cpu", {"matmul:fp32": 1e11, "memory:fp32": 1e10}, {"matmul": 1e-5},
                           1e9, source="measured", calibrated_at=1.0, spread=next(spreads))

    monkeypatch.setattr(calibration, "calibrate_cpu", calibrate)
    with caplog.at_level("INFO", logger="memtrain"):
        first = calibration.cpu_speed()
    assert first.spread == 0.40 and not first.stable
    assert any("calibration is unstable (its repeats spread 40%" in r.getMessage()
               for r in caplog.records)
    assert calibration.cpu_speed() == first  # the same process does not measure again
    monkeypatch.setattr(calibration, "_TAKEN", {})  # the next process
    assert calibration.cpu_speed().spread == 0.40  # measured again (0.55): the steadier one kept
    monkeypatch.setattr(calibration, "_TAKEN", {})
    steady = calibration.cpu_speed()
    assert steady.spread == 0.03 and steady.stable
    monkeypatch.setattr(calibration, "_TAKEN", {})
    assert calibration.cpu_speed() == steady  # stable: read from the cache, not measured
    with pytest.raises(StopIteration):
        calibration.cpu_speed(refresh=True)


def test_a_calibration_says_its_age_and_stability() -> None:
    measured = DeviceSpeed("cpu", {"memory:fp32": 1e10}, {}, 1e9, source="measured on this CPU",
                           calibrated_at=1000.0, spread=0.04)
    assert measured.describe(now=1000.0 + 180) == (
        "measured on this CPU, 3 min ago, repeats within 4% (stable)")
    busy = dataclasses.replace(measured, spread=0.31)
    assert busy.describe(now=1000.0 + 5 * 86400).endswith(
        "5 days ago, repeats within 31% (over 10%: unstable, measured again at the next plan)")
    assert gpu_speed("h200").describe() == gpu_speed("h200").source  # datasheet: no age


def test_repeat_spread_weighs_the_longer_steps() -> None:
    """Medians summed over fastest summed: a short step's jitter barely counts."""
    assert calibration.repeat_spread({"a": [0.001, 0.0015, 0.0014], "b": [1.0, 1.3, 1.2, 1.4]}) \
        == pytest.approx((0.0014 + 1.25) / 1.001 - 1)
    assert calibration.repeat_spread({"a": [1.0, 1.01, 1.0]}) == pytest.approx(0.0)
    assert calibration.repeat_spread({}) == 0.0


def test_the_in_model_fit_refits_one_scale_where_the_other_is_held_at_its_bound() -> None:
    """Steps of (fixed, own compute, other compute) seconds: measured as 2x fixed + 1.5x own,
    both scales are found; measured as 2x fixed + 0.8x own (rates faster in the model than
    alone, which the calibration does not allow), the rate scale is held at 1 and the fixed
    scale fitted again with it, so that the smallest step's prediction stays near its time
    (the pair fitted freely, clipped apart, over-predicts every step)."""
    shapes = [(1.0, 0.5, 0.1), (1.0, 4.0, 0.5), (1.0, 16.0, 2.0)]

    def rows(a: float, b: float) -> list[tuple[float, float, float, float]]:
        return [(f, c, o, a * f + b * c + o) for f, c, o in shapes]

    a, b = calibration._fit_scales(rows(2.0, 1.5))
    assert a == pytest.approx(2.0) and b == pytest.approx(1.5)
    a, b = calibration._fit_scales(rows(2.0, 0.8))
    assert b == 1.0 and a < 2.0
    f, c, o, measured = rows(2.0, 0.8)[0]
    assert abs(a * f + b * c + o - measured) / measured < 0.1
    assert calibration._fit_scales(rows(20.0, 1.5))[0] == 8.0  # fixed costs at most 8x alone


def test_this_cpus_calibration_ranks_the_kernels_it_has() -> None:
    """Real figures: every rate positive; an operator's fixed cost under a millisecond; an fp32
    matrix product does more FLOPs a second than GELU moves bytes; and bf16's products are
    faster than fp32's where this CPU has bf16 instructions, slower where ATen emulates them
    (so ``auto`` keeps fp32 there by the calibration alone)."""
    from trainer.compat import cpu_bf16_support

    device = calibration.cpu_speed()
    assert all(rate > 0 for rate in device.rates.values())
    assert 0 < device.op_seconds["memory"] < 1e-3
    assert device.rate("matmul:fp32:k256") > device.rate("math:fp32")
    bf16, fp32 = device.rate("matmul:bf16:k256"), device.rate("matmul:fp32:k256")
    kind = cpu_bf16_support()
    if kind == "native":
        assert bf16 > fp32, (bf16, fp32)
    elif kind == "emulated":  # ATen's fallback kernels: two orders of magnitude slower
        assert bf16 < fp32, (bf16, fp32)
    # oneDNN's emulation: 2.7x slower than fp32 on a 2-core Xeon, about even on an AMD EPYC
    # capped to it (ONEDNN_MAX_CPU_ISA=AVX512_CORE): no order to assert.


DEEP = GPTConfig(seq_len=256, n_layer=8, n_head=2, n_embd=128, vocab_size=256)


@pytest.mark.slow
def test_auto_takes_no_checkpointing_at_a_smaller_micro_batch_when_it_is_faster() -> None:
    """The case the old rule got wrong: where no checkpointing fits micro-batch 2 only, the
    old rule took full checkpointing at 16 (the least recomputation with a micro-batch of at
    least 4). On a CPU a step of this model is mostly arithmetic, which recomputation adds to
    and a larger micro-batch barely speeds up: the time model takes micro-batch 2 without
    checkpointing, and measured steps agree. Predicted with the recorded calibration
    (``recorded_cpu_speed``), so the decision is the same on every CPU and at any load; the
    measured margin holds on the kinds the suite runs on (26% on an AMD EPYC Genoa, 30% under
    AVX2 kernels, one thread), and the steps are timed in alternation, so that load slows both
    alike. Width 128, not 64: there the operators' fixed costs, the noisiest part of a
    calibration, are a larger share of the step. At one thread, as the suite's processes
    run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _takes_no_checkpointing_at_micro_batch_2()
    finally:
        torch.set_num_threads(threads)


def _takes_no_checkpointing_at_micro_batch_2() -> None:
    factory = partial(GPT, DEEP)
    transforms = MemoryTransforms("none", loss_chunk_tokens=0)
    profiles = [profile_activations(factory, transforms.replace(activation_checkpointing=m),
                                    DEEP.seq_len, DEEP.vocab_size, "fp32", work=True)
                for m in ("none", "full")]
    static = static_bytes(GPT(DEEP))
    none, full = profiles

    def peak(profile, micro):  # noqa: ANN001, ANN202
        return plan_row(static, profile, micro, 16 // micro).predicted_peak_bytes

    budget = peak(full, 16)
    assert peak(none, 2) <= budget < peak(none, 4)  # none fits micro-batch 2 at most
    model = SpeedModel(recorded_cpu_speed())
    old = choose_plan(static, profiles, 16, 1, budget, headroom=1.0)
    new = choose_plan(static, profiles, 16, 1, budget, headroom=1.0, speed=model)
    assert old is not None and new is not None
    assert (old.activation_checkpointing, old.micro_batch_size) == ("full", 16)
    assert (new.activation_checkpointing, new.micro_batch_size) == ("none", 2)

    # Measured: each plan's fastest of 5 steps (noise only slows), the two plans' steps
    # alternating, so that the machine's drift (and the other test process's load) falls on
    # both alike.
    runs = {mode: plan_measure.PlanRun(factory, transforms.replace(activation_checkpointing=mode),
                                DEEP.seq_len, DEEP.vocab_size, "fp32", micro, 16 // micro)
            for mode, micro in (("none", 2), ("full", 16))}
    for run in runs.values():
        run.step()  # warm-up
    steps: dict[str, list[float]] = {mode: [] for mode in runs}
    for _ in range(5):
        for mode, run in runs.items():
            steps[mode].append(run.step())
    assert min(steps["none"]) < min(steps["full"]), steps



def test_the_loader_is_measured_on_the_dataset_itself(corpus_dir: Path) -> None:
    from datapipe.manifest import DatasetError

    cost = measure_loader(str(corpus_dir / "train"), "tokens", world_size=1, batch_size=8,
                          budget_seconds=0.2)
    assert cost.per_batch >= 0 and cost.per_sample >= 0
    assert 0 < cost.seconds(8) < 0.1  # 8 rows of 65 tokens from a local map: well under 0.1 s
    assert "a batch of 1" in cost.source and "of 8" in cost.source
    with pytest.raises(DatasetError):
        measure_loader(str(corpus_dir / "missing"), "tokens", 1, 8)


def test_a_slow_loader_moves_auto_to_larger_micro_batches() -> None:
    transforms = MemoryTransforms(activation_checkpointing="none")
    profile = profile_activations(partial(GPT, CFG), transforms, CFG.seq_len, CFG.vocab_size,
                                  "fp32", work=True)
    static = static_bytes(GPT(CFG))
    fed = SpeedModel(recorded_cpu_speed())
    slow = dataclasses.replace(fed, loader=LoaderCost(per_batch=1.0, per_sample=0.01))
    for micro in (1, 4, 16):
        added = plan_row(static, profile, micro, 16 // micro, slow).step_seconds \
            - plan_row(static, profile, micro, 16 // micro, fed).step_seconds
        assert added == pytest.approx(16 // micro * 1.0 + 16 * 0.01)
    # A second a batch outweighs any difference in compute: one batch of 16 is fastest.
    chosen = choose_plan(static, [profile], 16, 1, 1 << 40, speed=slow)
    assert chosen is not None and chosen.micro_batch_size == 16


def _step_work(chunk: int, batch: int, precision: str) -> Work:
    """One forward and backward of the vocabulary-1,000 GPT, loss in chunks of ``chunk``."""
    from trainer.compat import fake_tensor_mode
    from trainer.memory.loss import summed_loss
    from trainer.memory.precision import precision_policy
    from trainer.models.build import build_model

    cfg = dataclasses.replace(CFG, vocab_size=1000)
    with fake_tensor_mode():
        model = build_model(partial(GPT, cfg), MemoryTransforms("none", loss_chunk_tokens=chunk))
        tokens_BT = torch.zeros(batch, cfg.seq_len + 1, dtype=torch.long)
        policy = precision_policy(precision, torch.device("cpu"), warn=False)
        with plan_work.recording() as work:
            summed_loss(model, tokens_BT, policy).backward()
    return work


def _by_kind(work: Work) -> dict[str, tuple[float, float]]:
    """Operators and amounts by kind and dtype, views left out (a slice more or less moves no
    bytes): a weight gradient's product contracts over the batch's tokens, so its size bucket
    moves with the batch."""
    found: dict[str, tuple[float, float]] = {}
    for key in work.kinds():
        kind = ":".join(key.split(":")[:2])
        if not kind.startswith("view:"):
            ops, amount = found.get(kind, (0.0, 0.0))
            found[kind] = (ops + work.ops.get(key, 0), amount + work.amount.get(key, 0))
    return found


def _assert_same(got: Work, want: Work, *where: object) -> None:
    got_kinds, want_kinds = _by_kind(got), _by_kind(want)
    assert {k for k, v in got_kinds.items() if any(v)} == \
        {k for k, v in want_kinds.items() if any(v)}, where
    for key, (ops, amount) in want_kinds.items():
        assert got_kinds[key][0] == pytest.approx(ops, abs=1e-6), (*where, key)
        assert got_kinds[key][1] == pytest.approx(amount, rel=1e-9, abs=1e-6), (*where, key)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_loss_is_counted_in_whole_chunks_of_any_size(precision: str) -> None:
    """The loss's chunks are whole, so its operators are not linear in the batch: the step's
    work is recorded without it and the loss is counted for the batch's tokens, at the
    probed chunk or another."""
    cfg = dataclasses.replace(CFG, vocab_size=1000)
    work = record_work(partial(GPT, cfg), MemoryTransforms("none", loss_chunk_tokens=48),
                       cfg.seq_len, cfg.vocab_size, precision)
    assert work.loss is not None and work.loss.chunk_tokens == 48
    # The loss alone, from recordings of at most two chunks, against a recording of them all.
    for chunk, tokens in ((48, 192), (48, 320), (48, 30), (128, 1000), (256, 64)):
        shape = dataclasses.replace(work.loss, chunk_tokens=chunk)
        _assert_same(plan_work.loss_work(shape, tokens, work.loss_dtype),
                     plan_work._record_loss(shape, tokens, work.loss_dtype), chunk, tokens)
    # In the step: another chunk changes the step's work as it changes the model's own
    # (compared as sums, predicted(c) + recorded(48) against recorded(c) + predicted(48), so
    # the rest of the step, drawn on a line through 1 and 2 rows, cancels out).
    for chunk, batch in ((128, 3), (256, 5), (16, 2)):
        _assert_same(work.forward_backward(batch, chunk).plus(_step_work(48, batch, precision)),
                     _step_work(chunk, batch, precision).plus(work.forward_backward(batch, 48)),
                     chunk, batch)
    # Five 64-token rows in chunks of 48 are 7 chunks (3 products each), not the 5 a line
    # through 1 and 2 rows (2 and 3 chunks) would give.
    matmuls = _by_kind(work.forward_backward(5, 48))[f"matmul:{precision}"][0]
    assert matmuls == _by_kind(work.forward_backward(5, 320))[f"matmul:{precision}"][0] + 6 * 3


@pytest.mark.slow
def test_auto_chooses_the_loss_chunk_with_the_plan() -> None:
    """Larger chunks are fewer operators and weight-gradient sums, and more logits at once:
    with room, the planner takes the chunk predicted fastest (which of the larger ones depends
    on this CPU's calibrated product sizes: 1,024 where AVX-512 runs them, 512 on AVX2);
    short of room, a smaller chunk that fits."""
    from trainer.plan.candidates import loss_chunk_candidates

    cfg = dataclasses.replace(CFG, vocab_size=8192)
    profile = profile_activations(partial(GPT, cfg), MemoryTransforms(
        "none", loss_chunk_tokens=256), cfg.seq_len, cfg.vocab_size, "fp32", work=True)
    static = static_bytes(GPT(cfg))
    model = SpeedModel(recorded_cpu_speed())
    assert loss_chunk_candidates(profile, 16 * cfg.seq_len) == [128, 256, 512, 1024]
    rows = {chunk: plan_row(static, profile, 16, 1, model, chunk)
            for chunk in (128, 256, 512, 1024)}
    assert rows[1024].tokens_per_s > rows[128].tokens_per_s
    assert rows[1024].predicted_peak_bytes > rows[128].predicted_peak_bytes
    roomy = choose_plan(static, [profile], 16, 1, 1 << 40, micro_batch_size=16, headroom=1.0,
                        speed=model, choose_loss_chunk=True)
    fastest = max(rows.values(), key=lambda row: row.tokens_per_s)
    assert roomy is not None and roomy.loss_chunk_tokens == fastest.loss_chunk_tokens != 128
    tight = rows[128].predicted_peak_bytes
    assert choose_plan(static, [profile], 16, 1, tight, micro_batch_size=16, headroom=1.0,
                       speed=model) is None  # the probed chunk (256) does not fit
    fits = choose_plan(static, [profile], 16, 1, tight, micro_batch_size=16, headroom=1.0,
                       speed=model, choose_loss_chunk=True)
    assert fits is not None and fits.loss_chunk_tokens == 128
