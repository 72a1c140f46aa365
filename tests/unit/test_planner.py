from __future__ import annotations

import dataclasses
import logging
import re
from functools import partial

import pytest
import torch

from tests.unit.plan_baseline import choose_plan
from trainer.config import Config
from trainer.memory.loss import ChunkedLossShape
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, build_model, compile_model
from trainer.models.gpt import GPT, GPTConfig
from trainer.parallel.fsdp import FsdpSettings
from trainer.plan.candidates import choose_norm_inputs, feasible_plans
from trainer.plan.peak import PlanRow, plan_row
from trainer.plan.probe import measure_saved_bytes, probe_batch, profile_activations
from trainer.plan.profile import ActivationProfile
from trainer.plan.static import ParameterBytes, StaticBytes, static_bytes
from trainer.plan.terms.blocks import BlockBackward
from trainer.plan.terms.checkpointing import Recompute
from trainer.step import create_optimizer_state, step_peak_bytes, train_step

CFG = GPTConfig(seq_len=64, n_layer=4, n_head=2, n_embd=64)


def plain(mode: str) -> MemoryTransforms:
    """Checkpointing ``mode`` and nothing else (no loss chunking, no bf16 norm inputs)."""
    return MemoryTransforms(mode, bf16_norm_inputs=False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_probe_predicts_saved_bytes_at_a_larger_batch_within_5_percent(precision: str,
                                                                       mode: str) -> None:
    profile = profile_activations(partial(GPT, CFG), plain(mode), CFG.seq_len, CFG.vocab_size,
                                  precision)
    model = build_model(partial(GPT, CFG), plain(mode))
    measured, _sizes = measure_saved_bytes(model, torch.randint(0, 256, (8, CFG.seq_len + 1)),
                                      precision)
    assert profile.saved_bytes(8) == pytest.approx(measured, rel=0.05)


# Shapes whose peaks come from different moments: activations (a small vocabulary: backward
# start, or forward end under autocast), the chunked loss (a large vocabulary, four chunks) and
# the plain loss on the same large vocabulary (memory.loss_chunk_tokens: 0, the full logits).
STEP_SHAPES = {
    "activations": (GPTConfig(vocab_size=256, seq_len=256, n_layer=4, n_head=4, n_embd=128), 8,
                    512),
    "loss": (GPTConfig(vocab_size=8192, seq_len=128, n_layer=4, n_head=4, n_embd=128), 8, 256),
    "plain-loss": (GPTConfig(vocab_size=8192, seq_len=128, n_layer=4, n_head=4, n_embd=128), 8,
                   0),
}


@pytest.mark.parametrize("shape", sorted(STEP_SHAPES))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_predicted_step_peak_matches_the_cpu_allocator(shape: str, precision: str,
                                                       mode: str) -> None:
    """The whole prediction (static, saved, transients) against a real step's peak on CPU.

    The peak is the CPU allocator's record of the trainer's own ``train_step`` (forward,
    backward, clipping, AdamW), with the optimizer state created beforehand (byte for byte what
    a first training step leaves, at none of its cost: bf16 steps are slow where emulated). The
    model applied is the one for this machine's CPU: where bf16 is emulated
    (``trainer.compat.cpu_bf16_support``) it includes the emulated kernels' measured workspace.
    """
    cfg, micro, chunk = STEP_SHAPES[shape]
    device = torch.device("cpu")
    transforms = MemoryTransforms(mode, 2, chunk)  # the trainer's defaults: bf16 norm inputs
    model = build_model(partial(GPT, cfg), transforms)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    policy = precision_policy(precision, device, warn=False)
    scaler = policy.grad_scaler(device)
    tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1))
    create_optimizer_state(optimizer)
    measured = step_peak_bytes(model, optimizer, scaler, tokens, policy)

    profile = profile_activations(partial(GPT, cfg), transforms, cfg.seq_len, cfg.vocab_size,
                                  precision)
    row = plan_row(static_bytes(GPT(cfg)), profile, micro, 1)
    assert row.peak_moment != "optimizer step"  # (CPU AdamW's temporaries differ from CUDA's)
    if shape == "plain-loss":  # the full logits' gradients set the peak, before any block's
        assert row.peak_moment == "loss backward", row
    assert row.predicted_peak_bytes == pytest.approx(measured, rel=0.08), row


@pytest.mark.parametrize("mode", ["none", "full"])
def test_packed_documents_masks_are_in_the_predicted_peak(mode: str) -> None:
    """A fine-tuning dataset's rows (a loss mask, two documents a row): the probe carries them,
    so the GPT's B x T x T attention mask and the masked attention's saved tensors are in the
    prediction, which is as close to a real packed step's peak as a plain prediction is to a
    plain step's (on this shape: to 0.1% without checkpointing; +15-20% with full, the
    planner's margin for recomputation, packed or not)."""
    cfg = GPTConfig(vocab_size=256, seq_len=256, n_layer=2, n_head=2, n_embd=64)
    device, micro = torch.device("cpu"), 8
    transforms = MemoryTransforms(mode, 2, 0)
    policy = precision_policy("fp32", device, warn=False)

    def measured(packed: bool) -> int:
        model = build_model(partial(GPT, cfg), transforms)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        create_optimizer_state(optimizer)
        return step_peak_bytes(model, optimizer, policy.grad_scaler(device),
                               probe_batch(micro, cfg.seq_len, cfg.vocab_size, device, packed),
                               policy)

    def predicted(packed: bool) -> int:
        profile = profile_activations(partial(GPT, cfg), transforms, cfg.seq_len,
                                      cfg.vocab_size, "fp32", packed=packed)
        return plan_row(static_bytes(GPT(cfg)), profile, micro, 1).predicted_peak_bytes

    ratio = {packed: predicted(packed) / measured(packed) for packed in (False, True)}
    assert ratio[True] == pytest.approx(ratio[False], abs=0.08), ratio
    if mode == "none":
        assert ratio[True] == pytest.approx(1, abs=0.08), ratio
    assert predicted(True) - predicted(False) >= micro * cfg.seq_len ** 2  # the mask at least


@pytest.mark.slow
def test_predicted_step_peak_holds_for_a_compiled_model() -> None:
    """``train.compile`` compiles each block (inductor on CPU here): its graphs may save other
    tensors than eager autograd does, so the planner, which probes the eager model, is checked
    against a compiled step's peak too (by hand, fp32, six cases: compiled peaks at or below
    eager's, the prediction +2.9% to -1.2% off them; docs/benchmarks.md)."""
    cfg, micro, chunk = STEP_SHAPES["activations"]
    transforms = MemoryTransforms("full", 2, chunk)  # every block checkpointed: one graph
    model = build_model(partial(GPT, cfg), transforms)
    compile_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    policy = precision_policy("fp32", torch.device("cpu"), warn=False)
    scaler = policy.grad_scaler(torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1))
    train_step(model, optimizer, scaler, [tokens], 1, policy, 1.0)  # compiles
    measured = step_peak_bytes(model, optimizer, scaler, tokens, policy)
    profile = profile_activations(partial(GPT, cfg), transforms, cfg.seq_len, cfg.vocab_size,
                                  "fp32")
    row = plan_row(static_bytes(GPT(cfg)), profile, micro, 1)
    assert row.predicted_peak_bytes == pytest.approx(measured, rel=0.08), row


@pytest.mark.slow
def test_onednns_bf16_emulation_is_exercised_on_every_avx512_cpu() -> None:
    """The bf16 step-peak cases again, in a process whose oneDNN is capped at AVX512_CORE: a CPU
    with native bf16 then runs oneDNN's emulated kernels, and the planner must know it
    (``trainer.compat.cpu_bf16_support`` follows the cap) and predict their workspace. On an
    AVX-512 CPU without bf16 this is the in-process run again."""
    import os
    import re
    import subprocess
    import sys

    from tests.conftest import REPO
    from trainer.compat import cpu_bf16_support

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    if cpu_bf16_support({}) == "emulated":
        pytest.skip("this CPU has no AVX-512: oneDNN has no bf16 kernels here to emulate with, "
                    "and ONEDNN_MAX_CPU_ISA only caps what the CPU has")
    kind = subprocess.run([sys.executable, "-c", "from trainer.compat import cpu_bf16_support; "
                           "print(cpu_bf16_support())"], cwd=REPO, env=env, check=True,
                          capture_output=True, text=True).stdout.strip()
    assert kind == "onednn-emulated"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "0", f"{__file__}::test_predicted_step_peak_matches_the_cpu_"
                          "allocator", "-k", "bf16"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert re.search(r"\b9 passed\b", out.stdout), out.stdout[-1000:]


def test_auto_loss_chunks_keep_a_large_vocabularys_peak_near_an_explicit_small_chunk() -> None:
    """At Llama 3's vocabulary (128,256), sequence 1,024, micro-batch 4, fp32: ``auto`` plans
    within 5% of 512-token chunks and under a third of the plain loss's peak (the logits and
    their gradients, 2 GiB each, would be the step's largest tensors)."""
    cfg = GPTConfig(vocab_size=128_256, seq_len=1024, n_layer=2, n_head=2, n_embd=64)
    static = static_bytes(GPT(cfg))

    def peak(chunk: int | str) -> int:
        profile = profile_activations(partial(GPT, cfg), MemoryTransforms("none", 2, chunk),
                                      cfg.seq_len, cfg.vocab_size, "fp32")
        return plan_row(static, profile, 4, 1).predicted_peak_bytes

    auto, explicit, plain = peak("auto"), peak(512), peak(0)
    assert auto == pytest.approx(explicit, rel=0.05)
    assert auto < plain / 3, (auto, plain)


def test_checkpointing_and_bf16_save_less() -> None:
    def per_sample(precision: str, mode: str) -> int:
        return profile_activations(partial(GPT, CFG), plain(mode), CFG.seq_len,
                                   CFG.vocab_size, precision).per_sample_bytes

    base = per_sample("fp32", "none")
    assert per_sample("fp32", "selective") < base
    assert per_sample("fp32", "full") < 0.5 * base
    assert per_sample("bf16", "none") < 0.8 * base


def test_static_bytes_count_tied_weights_once_and_shard_under_fsdp() -> None:
    model = GPT(CFG)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    ddp = static_bytes(model)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * n, 4 * n, 8 * n)
    fsdp = static_bytes(model, "fsdp", world_size=2)
    assert fsdp.total == pytest.approx(ddp.total / 2, abs=3)


def test_feasible_plans_keep_the_global_batch_and_fit() -> None:
    model = GPT(CFG)
    static = static_bytes(model)
    profiles = [profile_activations(partial(GPT, CFG), plain(m), CFG.seq_len, CFG.vocab_size,
                                    "bf16")
                for m in ("none", "full")]
    budget = static.total + profiles[1].saved_bytes(16) * 2  # too small for "none" at 16
    rows = feasible_plans(static, profiles, global_batch_size=64, data_ranks=2,
                          device_memory_bytes=budget, headroom=1.0)
    assert rows, "at least one configuration must fit"
    for row in rows:
        assert row.micro_batch_size * row.accumulation_steps * 2 == 64
        assert row.predicted_peak_bytes <= budget
    by_mode = {r.activation_checkpointing: r for r in rows}
    assert by_mode["full"].micro_batch_size >= by_mode.get("none", by_mode["full"]).micro_batch_size


def _live_tensors() -> int:
    import gc

    from trainer.telemetry.diagnostics import live_tensor_count

    gc.collect()
    return live_tensor_count()


def test_probes_leave_no_tensors_behind() -> None:
    """A probe's saved tensors must die with it (a pack hook returning them leaked them all)."""
    model = GPT(CFG)
    tokens = torch.randint(0, 256, (2, CFG.seq_len + 1))
    measure_saved_bytes(model, tokens, "fp32")  # warm up lazy state
    before = _live_tensors()
    for _ in range(3):
        measure_saved_bytes(model, tokens, "fp32")
    assert _live_tensors() == before


def _profile(mode: str, per_sample: int, recompute: float) -> ActivationProfile:
    # The output head's gradients are all the gradients here (the "model" has no blocks).
    return ActivationProfile(precision="bf16", activation_checkpointing=mode,
                             per_sample_bytes=per_sample, fixed_bytes=0, seq_len=64,
                             recompute=Recompute(fraction=recompute),
                             parameters=ParameterBytes(outside_blocks_grad_bytes=100))


def test_choose_plan_prefers_least_recompute_with_a_useful_micro_batch() -> None:
    static = StaticBytes(params=100, grads=100, optimizer=200)  # 400 B
    profiles = [_profile("none", 100, 0.0), _profile("selective", 50, 1 / 6),
                _profile("full", 10, 1 / 3)]
    # Predicted peak (backward start) = params + optimizer + per_sample x micro + grads:
    # 400 + per_sample x micro.
    roomy = choose_plan(static, profiles, global_batch_size=16, data_ranks=1,
                        device_memory_bytes=2000, headroom=1.0)
    assert roomy is not None and roomy.activation_checkpointing == "none"
    tight = choose_plan(static, profiles, global_batch_size=16, data_ranks=1,
                        device_memory_bytes=750, headroom=1.0)  # "none" fits micro 2 only
    assert tight is not None and tight.activation_checkpointing == "selective"
    assert tight.micro_batch_size * tight.accumulation_steps == 16
    assert tight.micro_batch_size >= 4
    assert choose_plan(static, profiles, 16, 1, device_memory_bytes=100, headroom=1.0) is None


def test_choose_plan_with_a_fixed_micro_batch_picks_the_mode() -> None:
    static = StaticBytes(params=100, grads=100, optimizer=200)
    profiles = [_profile("none", 100, 0.0), _profile("full", 10, 1 / 3)]
    plan = choose_plan(static, profiles, 16, 2, device_memory_bytes=1000,
                       micro_batch_size=8, headroom=1.0)
    assert plan is not None
    assert (plan.activation_checkpointing, plan.micro_batch_size, plan.accumulation_steps) \
        == ("full", 8, 1)


@pytest.mark.slow
def test_auto_config_resolves_before_launch_and_says_so_on_the_console(corpus_dir,
                                                                     tmp_path) -> None:
    """``memtrain train`` as a user runs it: micro-batch, checkpointing and precision by
    predicted tokens/s, the choice on the console (stderr) in numbers before the first step;
    the run's config.yaml holds the choice."""
    import subprocess
    import sys

    import yaml

    from tests.conftest import REPO, tiny_overrides

    overrides = [*tiny_overrides(corpus_dir, tmp_path, "train.micro_batch_size=auto",
                                 "memory.precision=auto", "memory.activation_checkpointing=auto",
                                 "memory.device_memory=64MiB", "train.steps=1",
                                 "train.eval_every=0")]
    done = subprocess.run([sys.executable, "-m", "trainer.cli", "train", "-c",
                           str(REPO / "configs" / "demo-cpu.yaml"), "--launcher", "local",
                           "--workers", "1", "--run-name", "auto",
                           *(arg for value in overrides for arg in ("--set", value))],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    written = (tmp_path / "auto" / "config.yaml").read_text()
    assert "micro_batch_size: auto" not in written and "precision: auto" not in written
    cfg = yaml.safe_load(written)
    train, memory = cfg["train"], cfg["memory"]
    assert isinstance(train["micro_batch_size"], int)
    assert memory["activation_checkpointing"] in ("none", "selective", "full")
    assert memory["precision"] in ("fp32", "bf16")
    assert isinstance(memory["bf16_norm_inputs"], bool)  # its "auto" resolved too
    if memory["precision"] == "fp32":
        assert memory["bf16_norm_inputs"] is False  # the copies exist only under bf16
    assert train["global_batch_size"] % train["micro_batch_size"] == 0
    [line] = [line for line in done.stderr.splitlines() if "plans that fit" in line]
    assert (f"auto: precision {memory['precision']}, activation checkpointing "
            f"{memory['activation_checkpointing']}, micro-batch {train['micro_batch_size']}"
            in line), line
    assert re.search(r"predicted [\d,]+ tokens/s \(.+; [\d.]+ ms a step, of which the data "
                     r"loader [\d.]+ ms\), the fastest of \d+ plans that fit; "
                     r"next: (fp32|bf16), checkpointing", line), line
    # The loader was measured on the run's own dataset, and said so before the choice.
    lines = done.stderr.splitlines()
    [loader] = [i for i, text in enumerate(lines) if text.startswith("planner: data loader ")
                and str(corpus_dir) in text]
    assert loader < lines.index(line)


@pytest.mark.slow
def test_auto_on_a_gpu_weighs_compile_and_plans_compiled(corpus_dir, tmp_path, caplog) -> None:
    """On CUDA, ``train.compile: auto`` is decided with the plan: each way's fastest plan,
    compiled (the element-wise work fused, ``GPU_COMPILED_SHARE``) against eager, in numbers;
    not with activation offload, whose hooks run eager only: that run is planned eager."""
    from tests.conftest import tiny_config
    from trainer.plan.auto import resolve_auto

    def resolve(*overrides: str) -> Config:
        return resolve_auto(tiny_config(
            corpus_dir, tmp_path, "parallel.use_gpu=true", "train.micro_batch_size=auto",
            "memory.activation_checkpointing=none", "memory.device_memory=80GiB",
            "memory.precision=bf16", "memory.bf16_norm_inputs=true", *overrides))

    with caplog.at_level("INFO", logger="memtrain"):
        compiled = resolve()
    assert compiled.train.compile is True
    [why] = [r.getMessage() for r in caplog.records if "train.compile" in r.getMessage()]
    numbers = re.search(r"auto: train.compile on \(predicted ([\d,]+) tokens/s compiled, "
                        r"([\d,]+) tokens/s eager, each its fastest plan", why)
    assert numbers, why
    fused, eager = (float(n.replace(",", "")) for n in numbers.groups())
    assert fused > eager
    [chosen] = [r.getMessage() for r in caplog.records if "plans that fit" in r.getMessage()]
    assert f"predicted {numbers.group(1)} tokens/s (H200" in chosen, chosen
    caplog.clear()
    with caplog.at_level("INFO", logger="memtrain"):
        plain = resolve("train.compile=false")  # the user's choice stands, and is planned eager
    assert plain.train.compile is False
    assert not any("train.compile" in r.getMessage() for r in caplog.records)
    assert any(f"predicted {numbers.group(2)} tokens/s (H200" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level("INFO", logger="memtrain"):  # offload's hooks run eager only
        offloaded = resolve("memory.activation_offload=all")
    assert offloaded.train.compile == "auto" and not offloaded.compiles_model("cuda")
    assert not any("train.compile" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_plan_measure_trains_the_configured_optimizer(corpus_dir, tmp_path, monkeypatch
                                                       ) -> None:
    """``plan --measure`` runs each plan with the run's own optimizer (8-bit moments stepping
    in backward here), and with the step in backward at the per-rank batch only, one
    micro-batch a step, as the run must: not plain AdamW at every micro-batch."""
    from rich.console import Console

    from tests.conftest import tiny_config
    from trainer.memory.optimizers import BackwardSteps, state_tensors
    from trainer.plan import measure
    from trainer.plan.auto import probe_config
    from trainer.plan.table import measure_plans

    cfg = tiny_config(corpus_dir, tmp_path, "train.micro_batch_size=8", "train.grad_clip=0",
                      "memory.optimizer_states=8bit", "memory.optimizer_in_backward=true")
    runs: list[measure.PlanRun] = []
    build = measure.PlanRun.__init__

    def kept(run: measure.PlanRun, *args: object, **kwargs: object) -> None:
        build(run, *args, **kwargs)
        runs.append(run)

    monkeypatch.setattr(measure.PlanRun, "__init__", kept)
    static, profiles = probe_config(cfg, ["fp32"], ("none", "full"), work=True)
    console = Console(record=True, width=80)
    measure_plans(console, cfg, static, profiles, 2**30, 4, 1)  # the top 4, of 2 that can run
    assert len(runs) == 2, console.export_text()  # micro-batch 8 with each checkpointing mode
    for run in runs:
        assert [len(run.micro_batches), run.micro_batches[0].shape[0]] == [1, 8]
        assert BackwardSteps.of(run.optimizer) is not None
        moments = [t for t in state_tensors(run.optimizer) if t.dtype == torch.uint8]
        assert moments, "the 8-bit moments were not measured"


class _ConvertingBlock(torch.nn.Module):
    """A block whose bf16 matrix product converts its input to fp32 in a buffer of its own, as
    a kernel that emulates bf16 may: the planner must find that buffer, per sample."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        from torch.profiler import record_function

        y_BTC = self.linear(x_BTC)
        if torch.is_autocast_enabled("cpu"):
            with record_function("aten::mm"):
                buffer = torch.empty((*x_BTC.shape, 16), dtype=torch.float32)  # 64 B an element
                del buffer
        return y_BTC


def test_the_emulated_bf16_workspace_is_measured_per_sample(monkeypatch) -> None:
    from trainer.plan import emulation, probe

    block = _ConvertingBlock(32)
    measured = emulation.emulated_bf16_workspace(block, (16, 32))
    # The buffer (64 B an element of the input) less what this CPU's fp32 kernels take for the
    # same layer: at most a copy of the input. The bf16 kernels' own workspace (native,
    # oneDNN-emulated and ATen-emulated kernels all differ; a native one's is up to 14 KB here,
    # not always the same) is below the buffer, and the largest workspace of a call counts.
    buffer = 16 * 32 * 64
    assert buffer - 16 * 32 * 4 <= measured <= buffer, measured
    assert measured == emulation.emulated_bf16_workspace(block, (16, 32))  # deterministic

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(256, 32)
            self.blocks = torch.nn.ModuleList([_ConvertingBlock(32)])
            self.head = torch.nn.Linear(32, 256)

        def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks[0](self.emb(idx_BT)))

    def profile(kind: str, precision: str = "bf16", target: str = "cpu") -> ActivationProfile:
        monkeypatch.setattr(probe, "cpu_bf16_support", lambda: kind)
        return profile_activations(Model, plain("none"), 16, 256, precision, target=target)

    assert profile("native").emulation_workspace_per_sample_bytes == 0
    assert profile("emulated", "fp32").emulation_workspace_per_sample_bytes == 0
    assert profile("emulated", target="cuda").emulation_workspace_per_sample_bytes == 0
    emulated = profile("onednn-emulated")
    assert emulated.emulation_workspace_per_sample_bytes == measured
    static = StaticBytes(params=0, grads=0, optimizer=0)
    row, native_row = plan_row(static, emulated, 4, 1), plan_row(static, profile("native"), 4, 1)
    assert row.predicted_peak_bytes - native_row.predicted_peak_bytes == 4 * measured


@pytest.mark.slow
@pytest.mark.parametrize("loss_chunk_tokens", [256, 0])
@pytest.mark.parametrize("precision, mode", [("fp32", "none"), ("bf16", "none"),
                                             ("bf16", "selective"), ("fp32", "full")])
def test_a_fake_tensor_probe_saves_the_real_probes_bytes_exactly(
        mode: str, precision: str, loss_chunk_tokens: int) -> None:
    """The planner probes under fake tensors (shapes, no data: GPT-2 in seconds, not minutes);
    every field of the profile equals the real probe's, for both loss paths, both precisions
    and every checkpointing mode, with bf16 norm inputs on (fp16 takes bf16's path; every
    combination matched when run by hand)."""
    cfg = GPTConfig(vocab_size=1024, seq_len=64, n_layer=3, n_head=2, n_embd=64)
    transforms = MemoryTransforms(mode, loss_chunk_tokens=loss_chunk_tokens)

    def probe(fake: bool) -> ActivationProfile:
        return profile_activations(partial(GPT, cfg), transforms, cfg.seq_len, cfg.vocab_size,
                                   precision, target="cuda", fake=fake)

    fake, real = probe(True), probe(False)
    assert fake == real
    assert fake.per_sample_bytes > 0 and (fake.loss_shape is not None)


@pytest.mark.slow
@pytest.mark.parametrize("base_dtype", ["fp32", "bf16"])
def test_a_lora_model_is_probed_on_fake_tensors_as_on_real_ones(
        base_dtype: str, caplog: pytest.LogCaptureFixture) -> None:
    """PEFT moves each adapter it injects to its base layer's device, a move torch cannot make
    on fake parameters: the probe keeps such a module in place, and the profile (and the
    step's operators) are the real probe's, with no fallback to real tensors (which build the
    whole model in the launcher)."""
    from trainer.config import LoraConfig, ModelConfig
    from trainer.models.build import model_factory

    cfg = ModelConfig(name="gpt", vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=32,
                      lora=LoraConfig(rank=4, base_dtype=base_dtype))
    precision = "bf16" if base_dtype == "bf16" else "fp32"

    def probe(fake: bool) -> ActivationProfile:
        return profile_activations(model_factory(cfg, load_weights=False),
                                   MemoryTransforms("full", loss_chunk_tokens=64), 32, 256,
                                   precision, target="cuda", fake=fake, work=fake)

    with caplog.at_level(logging.INFO, logger="memtrain.planner"):
        fake = probe(True)
    assert "real" not in caplog.text, caplog.text
    assert dataclasses.replace(fake, work=None) == probe(False)


@pytest.mark.slow
def test_a_model_that_reads_values_is_probed_for_real(caplog: pytest.LogCaptureFixture) -> None:
    """Fake tensors have no values: a forward that reads one (``.item()``) cannot run on them,
    so the planner says so in one log line and probes with real tensors."""

    class Reads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(256, 32)
            self.head = torch.nn.Linear(32, 256)

        def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
            x_BTC = self.emb(idx_BT)
            if x_BTC.abs().max().item() > 1e6:  # a value read: data-dependent control flow
                raise AssertionError("never")
            return self.head(torch.tanh(x_BTC))

    with caplog.at_level("INFO", logger="memtrain.planner"):
        profile = profile_activations(Reads, plain("none"), 16, 256, "fp32")
    assert [r.getMessage() for r in caplog.records
            if "cannot be probed with fake tensors" in r.getMessage()], caplog.text
    assert profile == profile_activations(Reads, plain("none"), 16, 256, "fp32", fake=False)
    assert profile.per_sample_bytes > 0


def _row(mode: str, micro: int, recompute: float) -> PlanRow:
    return PlanRow("bf16", mode, micro, 16 // micro, 0, 0, 0, 0, recompute)


@pytest.mark.parametrize("without, with_, on, why", [
    (None, _row("none", 8, 0.0), True, "needed to fit"),
    (None, None, True, "nothing fits"),
    (_row("none", 8, 0.0), None, False, "not needed"),
    (_row("selective", 8, 1 / 6), _row("none", 8, 0.0), True, "checkpointing none fits"),
    (_row("none", 2, 0.0), _row("none", 8, 0.0), True, "micro-batch 8 fits with them, 2"),
    (_row("none", 4, 0.0), _row("none", 8, 0.0), False, "not needed: checkpointing none"),
    (_row("none", 16, 0.0), _row("none", 16, 0.0), False, "not needed"),
])
def test_bf16_norm_inputs_are_on_only_when_their_bytes_buy_something(
        without: PlanRow | None, with_: PlanRow | None, on: bool, why: str) -> None:
    chosen, reason = choose_norm_inputs(without, with_, per_rank=16)
    assert chosen is on and why in reason, reason


@pytest.mark.slow
def test_bf16_norm_inputs_auto_resolves_before_launch(corpus_dir, tmp_path, caplog) -> None:
    """``auto`` on the real planner (fake probes) against device budgets on either side of
    what the copies save: off when the configured micro-batch fits without them, on when it
    fits only with them; off without bf16, whatever the budget; on where the budget cannot be
    known (a GPU run planned on a machine without one)."""
    from tests.conftest import tiny_config
    from trainer.config import ConfigError
    from trainer.models.build import MemoryTransforms
    from trainer.plan.auto import device_memory_bytes, probe_config, resolve_auto

    base = ("memory.precision=bf16", "memory.activation_checkpointing=none",
            "memory.bf16_norm_inputs=auto")

    def peak(norm: bool) -> int:
        cfg = tiny_config(corpus_dir, tmp_path, *base, f"memory.bf16_norm_inputs={norm}")
        static, [profile] = probe_config(cfg, ["bf16"], ["none"])
        return plan_row(static, profile, cfg.train.micro_batch(), 2).predicted_peak_bytes

    with_, without = peak(True), peak(False)
    assert with_ < without  # the copies save bytes at this micro-batch

    def resolved(*overrides: str) -> object:
        cfg = resolve_auto(tiny_config(corpus_dir, tmp_path, *base, *overrides))
        return cfg.memory.bf16_norm_inputs

    between = int((with_ + without) / 2 / 0.9)  # the planner fills 90% of the device
    with caplog.at_level("INFO", logger="memtrain"):
        assert resolved(f"memory.device_memory={between}B") is True
    assert "auto: bf16 norm inputs on (needed to fit)" in caplog.text
    assert resolved(f"memory.device_memory={without * 4}B") is False
    assert resolved("memory.precision=fp32", "memory.device_memory=1B") is False
    gpu = ("parallel.use_gpu=true",)
    with pytest.raises(ConfigError):  # no GPU here to read its memory from
        device_memory_bytes(tiny_config(corpus_dir, tmp_path, *gpu))
    if not torch.cuda.is_available():
        assert resolved(*gpu) is True
    # An "auto" that reaches a model unresolved builds it with the copies on.
    assert MemoryTransforms.of(tiny_config(corpus_dir, tmp_path, *base).memory) \
        .bf16_norm_inputs is True


def test_fsdp_settings_move_bytes_between_device_and_host() -> None:
    """One rank's FSDP row for each ``parallel.fsdp`` setting, on a profile with two blocks of
    1,000 B and a 400 B root: CPU offload moves the shards, gradients and AdamW state to the host
    column (and the optimizer step off the device); bf16 parameters halve what is gathered;
    blocks kept after forward add the blocks not already in flight."""
    profile = ActivationProfile(
        precision="bf16", activation_checkpointing="none", per_sample_bytes=100, fixed_bytes=0,
        seq_len=64, parameters=ParameterBytes(outside_blocks_grad_bytes=400,
                                              outside_blocks_param_bytes=400,
                                              block_param_bytes=1000))

    def row(settings: FsdpSettings) -> PlanRow:
        static = StaticBytes(params=1200, grads=1200, optimizer=2400, world_size=2, sharded=True,
                             fsdp=settings, full_param_bytes=2400 + 6000)
        return plan_row(static, profile, 1, 1)

    default, offload = row(FsdpSettings()), row(FsdpSettings(offload="cpu"))
    assert default.host_bytes == 0
    assert offload.host_bytes == 1200 + 1200 + 2400 + 1200  # and AdamW's step temporary
    assert offload.predicted_peak_bytes < default.predicted_peak_bytes - 2400  # at least AdamW
    bf16 = row(FsdpSettings(param_dtype="bf16"))
    assert bf16.predicted_peak_bytes < default.predicted_peak_bytes
    kept, grouped = (row(FsdpSettings(reshard_after_forward=False)),
                     row(FsdpSettings(reshard_after_forward=2)))
    assert default.predicted_peak_bytes < grouped.predicted_peak_bytes \
        < kept.predicted_peak_bytes
    # fp32 rows of a run whose parameters follow the precision ("auto") stay fp32.
    fp32 = dataclasses.replace(profile, precision="fp32")
    static = StaticBytes(params=1200, grads=1200, optimizer=2400, world_size=2, sharded=True,
                         fsdp=FsdpSettings(param_dtype="bf16"), full_param_bytes=8400)
    assert plan_row(static, fp32, 1, 1) == plan_row(dataclasses.replace(
        static, fsdp=FsdpSettings()), fp32, 1, 1)


def test_the_losss_saved_weight_gradient_is_counted_once_at_the_start_of_backward() -> None:
    """The chunked loss computes its output weight's gradient in the forward pass and saves it;
    once its backward has run that tensor is the weight's gradient, already counted with the
    gradients outside the blocks: the start of backward counts it once."""
    vocab, width = 1000, 100
    weight_grad = vocab * width * 4

    def start_of_backward(weight_trains: bool) -> PlanRow:
        shape = ChunkedLossShape(vocab, width, 64, 4, 4, 4, weight_trains=weight_trains)
        profile = ActivationProfile(
            precision="fp32", activation_checkpointing="none", per_sample_bytes=5 * 10**6,
            fixed_bytes=weight_grad, loss_shape=shape, seq_len=64,
            block=BlockBackward(largest_tensor_per_sample_bytes=10**7),
            parameters=ParameterBytes(outside_blocks_grad_bytes=weight_grad))
        return plan_row(StaticBytes(params=10**6, grads=10**6, optimizer=2 * 10**6), profile,
                        1, 1)

    trained, frozen = start_of_backward(True), start_of_backward(False)
    assert trained.peak_moment == frozen.peak_moment == "backward start"
    assert frozen.predicted_peak_bytes - trained.predicted_peak_bytes == weight_grad


def test_the_step_in_backward_holds_one_gradient_in_one_process_and_a_block_under_ddp() -> None:
    """At the end of backward with the step in backward, one process holds only the gradient of
    the parameter stepping now; DDP's buckets (and FSDP's reduce-scatter) a block's at once."""
    profile = ActivationProfile(
        precision="fp32", activation_checkpointing="none", per_sample_bytes=0, fixed_bytes=0,
        seq_len=64, block=BlockBackward(first_block_per_sample_bytes=10**7),
        parameters=ParameterBytes(block_param_bytes=9000, largest_block_param_bytes=3000))

    def end_of_backward(bucketed: bool) -> PlanRow:
        static = StaticBytes(params=10**5, grads=10**5, optimizer=2 * 10**5, in_backward=True,
                             largest_grad=3000, bucketed=bucketed)
        return plan_row(static, profile, 1, 1)

    one, ddp = end_of_backward(False), end_of_backward(True)
    assert one.peak_moment == ddp.peak_moment == "backward end"
    assert ddp.predicted_peak_bytes - one.predicted_peak_bytes == 9000 - 3000
