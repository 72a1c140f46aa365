"""The memory strategies beyond the guide, one process on CPU: AdamW's state dtype, the optimizer
step in backward, activation offload and LoRA (trainer/memory/optimizers.py, offload.py,
lora.py): the same arithmetic where the math is the same, the bytes the planner counts, exact
resume, what checkpoints hold, and every refusal. Two ranks (DDP and FSDP):
tests/distributed/test_strategies.py."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.conftest import logged_losses, tiny_config
from trainer.checkpoint.files import STATE_FILE
from trainer.compat import cpu_bf16_support
from trainer.config import ConfigError
from trainer.launch.local import launch_local
from trainer.launch.prepare import prepare_run
from trainer.memory.lora import LoraSettings, apply_lora, merge_adapters
from trainer.memory.loss import summed_loss
from trainer.memory.offload import offload_of
from trainer.memory.optimizers import (
    InBackward,
    MissingExtraError,
    adamw_class,
    held_state_bytes,
    state_bytes,
    trainable,
)
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, build_model, to_bf16
from trainer.models.registry import gpt
from trainer.optim import build_optimizer
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.static import static_bytes
from trainer.step import create_optimizer_state, step_peak_bytes, train_step

pytestmark = pytest.mark.unit
FP32 = precision_policy("fp32", torch.device("cpu"))
NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)
SMALL = partial(gpt, vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=64)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int,
           batch: int = 4, seed: int = 1, seq: int = 32) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens_BT = torch.randint(0, 256, (batch, seq + 1), generator=generator)
        result = train_step(model, optimizer, NO_SCALER, [tokens_BT], 1, FP32, 0.0)
        losses.append(result.loss.item())
    return losses


def test_the_step_in_backward_is_adamw_after_backward_to_the_bit() -> None:
    """Each parameter's step in its post-accumulate hook, with the schedule's learning rate:
    the same weights, bit for bit, as one AdamW step after backward (clipping off in both), and
    the gradients gone when backward ends."""
    models = {}
    for where in (None, InBackward()):
        torch.manual_seed(0)
        model = SMALL()
        optimizer = build_optimizer(model, 1e-3, backward_hooks=where)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
        for _ in range(3):
            _steps(model, optimizer, 1)
            schedule.step()
        assert all(p.grad is None for p in model.parameters())
        models[where] = model
    for a, b in zip(models[None].parameters(), models[InBackward()].parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_low_bit_states_train_as_fp32_adamw_does_in_the_bytes_the_planner_counts() -> None:
    """A convergence check: 50 steps memorising 8 fixed sequences. fp32 AdamW takes the loss
    from ln(256) to under a hundredth of it; bf16, 8-bit and 4-bit moments must take away at
    least 98% of what fp32 takes away. (Quantizing the moments perturbs each update by a block's
    quantization error relative to the moment, not a fixed amount: the check bounds the
    descent, not a step's value.) The moments they hold (torchao's codes, block scales and code
    book; bf16 ones) are the bytes ``state_bytes`` predicts, tensor by tensor (small tensors
    fp32), and 8-bit states cut fp32 AdamW's by at least 70%."""
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(3))
    start, finals = 0.0, {}
    for states in ("fp32", "bf16", "8bit", "4bit"):
        torch.manual_seed(0)
        model = gpt(vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=128)
        optimizer = build_optimizer(model, 3e-3, states=states)
        losses = [train_step(model, optimizer, NO_SCALER, [tokens], 1, FP32, 1.0).loss.item()
                  for _ in range(50)]
        start, finals[states] = losses[0], losses[-1]
        held = held_state_bytes(optimizer)
        assert held == state_bytes(trainable(model), states)
        bound = {"fp32": 1.0, "bf16": 0.55, "8bit": 0.30, "4bit": 0.20}[states]
        assert held <= bound * state_bytes(trainable(model), "fp32")
    assert finals["fp32"] < 0.01 * start
    for states in ("bf16", "8bit", "4bit"):
        assert start - finals[states] >= 0.98 * (start - finals["fp32"]), finals


@pytest.mark.parametrize("ac, mode", [("none", "all"), ("full", "checkpointed"),
                                      ("full", "all")])
def test_offload_keeps_the_gradients_and_moves_what_the_planner_counts(ac: str,
                                                                       mode: str) -> None:
    """The saved tensors go through the offload's copies and come back: gradients equal to
    the bit to those without offload; the bytes it moved are the planner's host bytes (its
    probe on fake tensors), and with checkpointing only the checkpointed blocks' inputs."""
    tokens_BT = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    grads = {}
    for offload in ("none", mode):
        transforms = MemoryTransforms(ac, loss_chunk_tokens=16, activation_offload=offload)
        model = build_model(SMALL, transforms)
        summed_loss(model, tokens_BT, FP32).backward()
        grads[offload] = [p.grad for p in model.parameters()]
        hooks = offload_of(model)
        if offload == "none":
            assert hooks is None
            continue
        assert hooks is not None
        profile = profile_activations(SMALL, transforms, 32, 256, "fp32")
        assert hooks.bytes_this_forward == profile.offload.host_bytes(4) > 0
        if mode == "checkpointed":  # two blocks' inputs: 4 x 32 x 64 fp32 each
            assert hooks.bytes_this_forward == 2 * 4 * 32 * 64 * 4
    for a, b in zip(grads["none"], grads[mode], strict=True):
        assert torch.equal(a, b)


STRATEGY_PEAKS = [  # (checkpointing, offload, states, in backward)
    ("none", "none", "fp32", True),
    ("full", "checkpointed", "fp32", False),
    ("full", "none", "8bit", False),
    ("full", "none", "4bit", True),
]


@pytest.mark.slow
@pytest.mark.parametrize("ac, offload, states, in_backward", STRATEGY_PEAKS)
def test_the_planner_predicts_each_strategys_step_peak(ac: str, offload: str, states: str,
                                                       in_backward: bool) -> None:
    """The planner's device peak against the allocator's record of a real step, within 5%
    (activation offload on CPU: its copies share the one memory, so the measured peak also
    holds what a GPU would hold on the host, at the moment they are alive: less the host bytes
    the planner puts off the device, bounded by them)."""
    factory = partial(gpt, vocab_size=512, seq_len=128, n_layer=4, n_head=4, n_embd=256)
    transforms = MemoryTransforms(ac, loss_chunk_tokens=64, activation_offload=offload)
    model = build_model(factory, transforms)
    optimizer = build_optimizer(model, 1e-3, states=states,
                                backward_hooks=InBackward() if in_backward else None)
    create_optimizer_state(optimizer)
    tokens_BT = torch.randint(0, 512, (4, 129), generator=torch.Generator().manual_seed(0))
    step_peak_bytes(model, optimizer, NO_SCALER, tokens_BT, FP32, 0.0)  # compiles torchao's
    measured = step_peak_bytes(model, optimizer, NO_SCALER, tokens_BT, FP32, 0.0)
    profile = profile_activations(factory, transforms, 128, 512, "fp32")
    row = plan_row(static_bytes(model, states=states, in_backward=in_backward,
                                step_device="cpu"), profile, 4, 1)
    assert row.predicted_peak_bytes == pytest.approx(measured, rel=0.05)
    if offload != "none":
        assert row.host_bytes == profile.offload.host_bytes(4) > 0


@pytest.mark.slow
@pytest.mark.parametrize("states", ["8bit", "4bit"])
def test_the_planner_predicts_a_bf16_weights_step_peak(states: str) -> None:
    """``model.dtype: bf16`` with the step in backward and full checkpointing (the bench's
    largest-model path): weights, gradients and small tensors' moments at 2 bytes, predicted
    within 5% of the allocator's record where bf16 is native. Where it is emulated the
    planner's per-sample workspace estimate errs high: measured +11% (8-bit) and +15% (4-bit)
    with oneDNN capped at AVX512_CORE on a Zen 5, so there up to 16% over, never 5% under."""
    factory = partial(gpt, vocab_size=512, seq_len=128, n_layer=4, n_head=4, n_embd=256)

    def bf16_factory() -> torch.nn.Module:
        return to_bf16(factory())

    transforms = MemoryTransforms("full", loss_chunk_tokens=64)
    model = build_model(bf16_factory, transforms)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    optimizer = build_optimizer(model, 1e-3, states=states, backward_hooks=InBackward())
    assert getattr(optimizer, "bf16_stochastic_round", False)
    create_optimizer_state(optimizer)
    assert held_state_bytes(optimizer) == state_bytes(list(model.parameters()), states)
    bf16 = precision_policy("bf16", torch.device("cpu"))
    tokens_BT = torch.randint(0, 512, (4, 129), generator=torch.Generator().manual_seed(0))
    step_peak_bytes(model, optimizer, NO_SCALER, tokens_BT, bf16, 0.0)  # compiles torchao's
    measured = step_peak_bytes(model, optimizer, NO_SCALER, tokens_BT, bf16, 0.0)
    profile = profile_activations(bf16_factory, transforms, 128, 512, "bf16")
    static = static_bytes(model, states=states, in_backward=True, step_device="cpu")
    fp32 = static_bytes(build_model(factory, transforms), states=states, in_backward=True)
    assert static.params * 2 == fp32.params
    row = plan_row(static, profile, 4, 1)
    over = 0.05 if cpu_bf16_support() == "native" else 0.16
    assert -0.05 <= row.predicted_peak_bytes / measured - 1 <= over


def test_lora_trains_only_its_adapters_and_merges_into_the_same_logits() -> None:
    """PEFT's adapters on the GPT's blocks: the base frozen (and unchanged by training), only
    the adapters in the optimizer; merged back, the plain model gives the trained logits."""
    torch.manual_seed(0)
    model = apply_lora(SMALL(), LoraSettings(rank=4, dropout=0.0))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    optimizer = build_optimizer(model, 1e-2)
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(trained)
    losses = _steps(model, optimizer, 5)
    assert losses[-1] < losses[0]
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base.items())
    tokens_BT = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        adapted = model(tokens_BT)
        merged = merge_adapters(model)
        assert not any(".lora_" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(tokens_BT), adapted, rtol=1e-5, atol=1e-5)


def test_lora_refuses_the_output_layer_and_a_target_that_matches_nothing() -> None:
    with pytest.raises(ValueError, match="lm_head.*output layer"):
        apply_lora(SMALL(), LoraSettings(targets=("qkv", "lm_head")))
    with pytest.raises(ValueError, match=r"model.lora.targets \['nothing_here'\]"):
        apply_lora(SMALL(), LoraSettings(targets=("nothing_here",)))


@pytest.mark.parametrize("overrides", [
    ("memory.optimizer_states=8bit",),
    ("memory.optimizer_states=bf16",),
    ("memory.optimizer_in_backward=true", "train.grad_clip=0", "train.micro_batch_size=16"),
    ("memory.activation_offload=checkpointed",),
    ("model.lora.rank=4",),
], ids=["8bit", "bf16", "in-backward", "offload", "lora"])
@pytest.mark.slow
def test_each_strategy_resumes_exactly(overrides: tuple[str, ...], corpus_dir: Path,
                                       tmp_path: Path) -> None:
    """8 steps straight, and 4, a stop and 4 more: the same losses to the bit (the moments'
    dtype survives the checkpoint: torch's load would cast bf16 moments to fp32). A LoRA run's
    checkpoint holds its adapters alone."""
    settings = ("parallel.launcher=local", "parallel.workers=1", "train.eval_every=0",
                "train.log_every=1", "train.steps=8", "train.checkpoint_every=4", *overrides)
    runs = {}
    for name in ("straight", "split"):
        cfg, run_dir = prepare_run(tiny_config(corpus_dir, tmp_path, *settings,
                                               f"run.name={name}"))
        if name == "split":
            launch_local(cfg, run_dir, until_step=4)
        summary = launch_local(cfg, run_dir)
        runs[name] = run_dir
    assert summary["resumed_from_step"] == 4
    assert logged_losses(runs["split"]) == logged_losses(runs["straight"])
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(runs["split"] / "checkpoint-00000008")).read_metadata()
    model_state = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    adapters_only = all(".lora_A." in k or ".lora_B." in k for k in model_state)
    assert adapters_only == ("model.lora.rank=4" in overrides)
    assert (runs["split"] / "checkpoint-00000008" / STATE_FILE).is_file()


@pytest.mark.parametrize("overrides, message", [
    (("memory.optimizer_in_backward=true",), "train.grad_clip 1.0"),
    (("memory.optimizer_in_backward=true", "train.grad_clip=0"),
     "needs one micro-batch per step: train.global_batch_size 16 over "
     "train.micro_batch_size 4"),
    # the sequence groups share rows: the batch divides over the data ranks
    (("memory.optimizer_in_backward=true", "train.grad_clip=0", "parallel.workers=2",
      "parallel.sequence=2", "train.global_batch_size=8", "train.micro_batch_size=4"),
     r"train.micro_batch_size 4 x 1 data ranks \(2 workers / parallel.sequence 2\) "
     "accumulates; set micro_batch_size to global_batch_size / 1"),
    (("memory.optimizer_in_backward=true", "train.grad_clip=0", "memory.precision=fp16"),
     "memory.precision 'fp16'"),
    (("memory.optimizer_in_backward=true", "train.grad_clip=0", "train.micro_batch_size=16",
      "memory.oom_recovery=true"), "memory.oom_recovery true"),
    (("memory.optimizer_in_backward=true", "train.grad_clip=0",
      "train.micro_batch_size=auto"), "train.micro_batch_size 'auto'"),
    (("memory.activation_offload=checkpointed", "memory.activation_checkpointing=none"),
     "nothing is checkpointed"),
    (("memory.activation_offload=all", "train.compile=true"), "train.compile true"),
    (("memory.optimizer_states=8bit", "train.fused_optimizer=true"),
     "train.fused_optimizer true"),
    (("model.lora.base_dtype=bf16",), "model.lora.base_dtype 'bf16'"),
    (("model.dtype=bf16",), "model.dtype 'bf16' with memory.precision 'fp32'"),
    (("model.dtype=bf16", "memory.precision=bf16"),
     "model.dtype 'bf16' with memory.optimizer_states 'fp32'"),
    (("model.dtype=bf16", "memory.precision=bf16", "memory.optimizer_states=8bit",
      "model.lora.rank=4"), "model.dtype 'bf16' with model.lora"),
    # before the optimizer states' refusal, whose fix would not make a LoRA run valid
    (("model.dtype=bf16", "memory.precision=bf16", "model.lora.rank=4",
      "model.lora.base_dtype=nf4"), "model.dtype 'bf16' with model.lora.base_dtype 'nf4': "
     r"base_dtype sets the frozen base's dtype itself \(nf4\) and the adapters train in fp32; "
     "leave model.dtype fp32$"),
    # and before the base dtype's need of bf16 precision, whose fix leads straight to it
    (("model.dtype=bf16", "model.lora.rank=4", "model.lora.base_dtype=nf4"),
     "model.dtype 'bf16' with model.lora"),
    (("model.dtype=bf16", "memory.precision=bf16", "memory.optimizer_states=8bit",
      "parallel.strategy=fsdp", "parallel.fsdp.param_dtype=fp32"),
     "model.dtype 'bf16' with parallel.fsdp.param_dtype 'fp32'"),
])
def test_combinations_a_strategy_cannot_honour_are_refused_in_one_line(
        overrides: tuple[str, ...], message: str, corpus_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        tiny_config(corpus_dir, tmp_path, *overrides)
    assert "\n" not in str(raised.value)


def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'memtrain\[strategies\]'"):
        adamw_class("8bit")
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MissingExtraError, match=r"model.lora needs peft"):
        apply_lora(SMALL(), LoraSettings())


def test_a_forward_that_raises_leaves_no_offload_hooks_behind() -> None:
    """An OOM inside the forward (here: a block that raises) must not leave the saved-tensor
    hooks pushed: the next forward offloads as the first would, and code outside the model
    saves its tensors as usual."""
    model = build_model(SMALL, MemoryTransforms("full", loss_chunk_tokens=16,
                                                activation_offload="checkpointed"))
    tokens_BT = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    block = model.blocks[1]
    raising = block.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(
        torch.OutOfMemoryError("injected")))
    with pytest.raises(torch.OutOfMemoryError):
        summed_loss(model, tokens_BT, FP32)
    raising.remove()
    summed_loss(model, tokens_BT, FP32).backward()
    hooks = offload_of(model)
    assert hooks is not None and hooks.tensors_this_forward == 2
    x = torch.ones(4, requires_grad=True)
    (x * x).sum().backward()  # no offload hooks here: its saved tensors stay themselves
    assert torch.equal(x.grad, 2 * torch.ones(4))
    assert hooks._hooks is None and hooks._depth == 0


def test_prepare_names_a_missing_library_and_bf16_weights_auto_cannot_give(
        corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any worker starts: a strategy whose library is not installed is one line naming
    the extra; a LoRA base or a whole model in bf16 where ``auto`` resolves to fp32 (a CPU
    without native bf16, stood in for here: this machine's kind must not decide the test) is
    one line naming both fields."""
    import importlib.util

    import trainer.plan.auto

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"memory.optimizer_states 8bit needs the torchao "
                                          r"package: pip install 'memtrain\[strategies\]'"):
        prepare_run(tiny_config(corpus_dir, tmp_path, "memory.optimizer_states=8bit"))
    monkeypatch.setattr(trainer.plan.auto, "planned_precision", lambda cfg: "fp32")
    with pytest.raises(ConfigError, match="model.lora.base_dtype 'bf16': memory.precision auto "
                                          "resolves to fp32 here"):
        prepare_run(tiny_config(corpus_dir, tmp_path, "model.lora.base_dtype=bf16",
                                "memory.precision=auto"))
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    with pytest.raises(ConfigError, match="model.dtype 'bf16': memory.precision auto resolves "
                                          "to fp32 here"):
        prepare_run(tiny_config(corpus_dir, tmp_path, "model.dtype=bf16",
                                "memory.optimizer_states=bf16", "memory.precision=auto"))


def test_auto_searches_bf16_weights_in_bf16_alone(corpus_dir: Path, tmp_path: Path) -> None:
    """``memory.precision: auto`` lets the time model choose between fp32 and bf16, except
    for bf16 weights (a whole model or a LoRA base), which compute in bf16 only."""
    from trainer.plan.auto import planned_precision, precision_candidates

    plain = tiny_config(corpus_dir, tmp_path, "memory.precision=auto")
    assert sorted(precision_candidates(plain)) == ["bf16", "fp32"]
    assert precision_candidates(plain)[0] == planned_precision(plain)
    for weights in ("model.dtype=bf16", "model.lora.base_dtype=bf16"):
        cfg = tiny_config(corpus_dir, tmp_path, "memory.precision=auto", weights,
                          "memory.optimizer_states=bf16")
        assert precision_candidates(cfg) == [planned_precision(cfg)], weights


def test_the_planner_counts_a_lora_model_by_what_it_trains(corpus_dir: Path,
                                                           tmp_path: Path) -> None:
    """The static bytes of a LoRA model with a bf16 base (built on the meta device, where
    PEFT can inject its adapters): the base's weights at half their fp32 bytes, gradients and
    AdamW state for the adapters alone."""
    from trainer.plan.auto import config_static

    full = config_static(tiny_config(corpus_dir, tmp_path, "memory.precision=bf16"))
    lora = config_static(tiny_config(corpus_dir, tmp_path, "memory.precision=bf16",
                                     "model.lora.rank=4", "model.lora.base_dtype=bf16"))
    # Per block, rank 4 (A: 4 x in, B: out x 4): qkv 64 -> 192, the attention's proj 64 -> 64,
    # fc 64 -> 256, the MLP's proj 256 -> 64.
    adapters = 4 * (64 + 192) + 4 * (64 + 64) + 4 * (64 + 256) + 4 * (256 + 64)
    assert lora.grads == 2 * adapters * 4  # two blocks, fp32
    assert lora.optimizer == 2 * adapters * 8
    assert lora.params == pytest.approx(full.params / 2 + lora.grads, rel=0.01)
