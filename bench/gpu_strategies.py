"""gpu-check's memory-strategy rows: the step in backward, activation offload, low-bit AdamW
states, bf16 weights, LoRA and QLoRA (LoRA over an NF4 base), each added alone to bf16 with
full checkpointing, measured and planned.

Each row trains the model with the trainer's own ``train_step`` and records the device's peak
(CUDA's ``max_memory_allocated``; dry, on CPU, the allocator's record of one step) beside the
planner's prediction (``trainer.plan.peak.plan_row``, with offload's host bytes apart: on CUDA
they leave the device, which is what these rows are for; on CPU both are one memory). A row
whose library is not installed (torchao for the low-bit states, PEFT for LoRA) is recorded as
skipped, naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from bench.gpu_fsdp import measured_row, measured_steps
from trainer.memory.lora import LoraSettings, apply_lora
from trainer.memory.optimizers import InBackward, MissingExtraError
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, build_model, to_bf16
from trainer.models.gpt import GPT, GPTConfig
from trainer.optim import build_optimizer
from trainer.plan.peak import plan_row
from trainer.plan.probe import profile_activations
from trainer.plan.static import static_bytes
from trainer.step import create_optimizer_state

# (name, activation offload, AdamW states, step in backward, LoRA's base dtype (None: no
# LoRA), weights' dtype)
CASES = {
    "baseline": ("none", "fp32", False, None, "fp32"),
    "step in backward": ("none", "fp32", True, None, "fp32"),
    "offload checkpointed": ("checkpointed", "fp32", False, None, "fp32"),
    "offload all": ("all", "fp32", False, None, "fp32"),
    "8-bit AdamW": ("none", "8bit", False, None, "fp32"),
    "4-bit AdamW": ("none", "4bit", False, None, "fp32"),
    "bf16 AdamW states": ("none", "bf16", False, None, "fp32"),
    # model.dtype bf16: no fp32 copy; bf16 moments, updates rounded stochastically (torchao)
    "bf16 weights": ("none", "bf16", False, None, "bf16"),
    "LoRA": ("none", "fp32", False, "fp32", "fp32"),
    # the blocks' linear weights in NF4, dequantized a slice at a time in each matmul
    "QLoRA": ("none", "fp32", False, "nf4", "fp32"),
}


def strategy_row(cfg: GPTConfig, name: str, device: torch.device, micro_batch: int,
                 steps: int, warmup: int) -> dict[str, Any]:
    """One strategy's measured step (peak and tokens/s) and the planner's prediction of it."""
    offload, states, in_backward, lora, weights = CASES[name]
    if lora == "nf4" and cfg.n_embd < 128:  # dry mode's width: no weight fills NF4's blocks
        cfg = dataclasses.replace(cfg, n_embd=128)

    def factory() -> torch.nn.Module:
        model = GPT(cfg)
        if weights == "bf16":
            model = to_bf16(model)
        return model if lora is None else apply_lora(model, LoraSettings(rank=8, base_dtype=lora))

    transforms = MemoryTransforms("full", loss_chunk_tokens=1024, bf16_norm_inputs=False,
                                  activation_offload=offload)
    try:
        model = build_model(factory, transforms, device, seed=0)
        optimizer = build_optimizer(model, 3e-4, states=states,
                                    backward_hooks=InBackward() if in_backward else None)
    except MissingExtraError as err:
        return {"strategy": name, "skipped": str(err)}
    create_optimizer_state(optimizer)
    policy = precision_policy("bf16", device, warn=False)
    scaler = policy.grad_scaler(device)
    clip = 0.0 if in_backward else 1.0
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), device=device)
    peak, elapsed = measured_steps(model, optimizer, scaler, tokens, policy, clip, steps, warmup)
    profile = profile_activations(factory, transforms, cfg.seq_len, cfg.vocab_size, "bf16",
                                  device=device)
    plan = plan_row(static_bytes(model, states=states, in_backward=in_backward,
                                 step_device=device.type), profile, micro_batch, 1)
    del model, optimizer
    return {"strategy": name, **measured_row(micro_batch, cfg.seq_len, steps, peak, elapsed,
                                             plan)}
