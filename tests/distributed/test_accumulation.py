"""Gradient accumulation with real gloo process groups: the update and the communication.

- Numerics: (world 1, accumulation 4), (world 2, accumulation 2) and (world 1, one micro-batch of
  the whole global batch) give the same SGD update. SGD, not Adam: Adam's first step is nearly
  sign(grad) and would hide a wrong loss normalisation.
- Communication: a DDP comm hook counts gradient all-reduce calls. With DDP's own path
  (``oom_recovery`` off) one step of 4 micro-batches all-reduces each bucket once, not 4 times;
  with the OOM agreement on, DDP's hook never fires and the gradients are reduced once, after it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.gloo import on_ranks
from trainer.batches import TokenBatch
from trainer.memory.activation_checkpointing import apply_activation_checkpointing
from trainer.memory.precision import precision_policy
from trainer.models.gpt import GPT, GPTConfig
from trainer.oom import OOMAgreement
from trainer.step import train_step

pytestmark = pytest.mark.distributed

CFG = GPTConfig(seq_len=32, n_layer=2, n_head=2, n_embd=32)
GLOBAL_BATCH = 16


def _global_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(42)
    return torch.randint(0, 256, (GLOBAL_BATCH, CFG.seq_len + 1), generator=generator)


def _global_masks() -> tuple[torch.Tensor, torch.Tensor]:
    """A loss mask and packed documents that train far more targets in the first half of the
    global batch (rank 0's share at world 2) than in the second: the ranks' counts differ."""
    generator = torch.Generator().manual_seed(7)
    shape = (GLOBAL_BATCH, CFG.seq_len + 1)
    keep = torch.rand(shape, generator=generator)
    keep[GLOBAL_BATCH // 2:] *= 0.3
    mask = (keep > 0.2).to(torch.uint8)
    documents = (torch.rand(shape, generator=generator) < 0.1).cumsum(dim=1).to(torch.int32)
    return mask, documents


def _one_step(rank: int, world_size: int, micro_batch: int, oom_agreement: bool,
              steps: int = 1, masked: bool = False) -> tuple[dict[str, torch.Tensor], int]:
    """SGD steps on this rank's share of the global batch; returns params and hook calls."""
    torch.manual_seed(0)
    model: torch.nn.Module = GPT(CFG)
    apply_activation_checkpointing(model, "full")
    calls = {"n": 0}
    if world_size > 1:
        model = DDP(model)

        def counting_hook(state, bucket):
            state["n"] += 1
            return allreduce_hook(None, bucket)

        model.register_comm_hook(calls, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    policy = precision_policy("fp32", torch.device("cpu"))
    scaler = policy.grad_scaler(torch.device("cpu"))
    per_rank = GLOBAL_BATCH // world_size
    share = _global_batch()[rank * per_rank: (rank + 1) * per_rank]
    mask, documents = (part[rank * per_rank: (rank + 1) * per_rank] for part in _global_masks())
    for _ in range(steps):
        micro_batches: list = list(share.split(micro_batch))
        if masked:
            micro_batches = [TokenBatch(t, m, d) for t, m, d in zip(
                micro_batches, mask.split(micro_batch), documents.split(micro_batch),
                strict=True)]
        agreement = OOMAgreement(torch.device("cpu")) if oom_agreement else None
        train_step(model, optimizer, scaler, micro_batches, 1, policy, grad_clip=1e9,
                   agreement=agreement)
    unwrapped = model.module if isinstance(model, DDP) else model
    return {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}, calls["n"]


def _worker(rank: int, micro_batch: int, oom_agreement: bool, steps: int, out: str,
            masked: bool) -> None:
    params, calls = _one_step(rank, dist.get_world_size(), micro_batch, oom_agreement, steps,
                              masked)
    if rank == 0:
        torch.save({"params": params, "calls": calls}, out)


def _run_two_ranks(tmp_path: Path, micro_batch: int, oom_agreement: bool, steps: int = 1,
                   masked: bool = False):
    out = tmp_path / f"result-{micro_batch}-{oom_agreement}-{steps}-{masked}.pt"
    on_ranks(_worker, 2, micro_batch, oom_agreement, steps, str(out), masked)
    result = torch.load(out, weights_only=True)
    return result["params"], result["calls"]


@pytest.mark.parametrize("oom_agreement", [False, True], ids=["ddp-path", "agreement-path"])
def test_world_size_and_accumulation_trade_off_exactly(tmp_path: Path,
                                                       oom_agreement: bool) -> None:
    big_batch, _ = _one_step(0, 1, micro_batch=GLOBAL_BATCH, oom_agreement=False)
    accumulated, _ = _one_step(0, 1, micro_batch=4, oom_agreement=False)
    two_ranks, _ = _run_two_ranks(tmp_path, micro_batch=4, oom_agreement=oom_agreement)
    initial = _initial_params()
    moved = 0.0
    for name, reference in big_batch.items():
        torch.testing.assert_close(accumulated[name], reference, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(two_ranks[name], reference, rtol=1e-5, atol=1e-6)
        moved = max(moved, float((reference - initial[name]).abs().max()))
    assert moved > 1e-3  # the step did change the weights: the comparison is not vacuous


def test_a_loss_mask_keeps_the_global_mean_when_ranks_train_different_counts(
        tmp_path: Path) -> None:
    """Rank 0 trains about three times rank 1's targets: each divides by the global count over
    the world size, so two ranks step as one rank on the whole batch, and as accumulation."""
    big_batch, _ = _one_step(0, 1, micro_batch=GLOBAL_BATCH, oom_agreement=False, masked=True)
    accumulated, _ = _one_step(0, 1, micro_batch=4, oom_agreement=False, masked=True)
    two_ranks, _ = _run_two_ranks(tmp_path, micro_batch=4, oom_agreement=False, masked=True)
    unmasked, _ = _one_step(0, 1, micro_batch=GLOBAL_BATCH, oom_agreement=False)
    mask, _ = _global_masks()
    assert mask[:GLOBAL_BATCH // 2].sum() > 2 * mask[GLOBAL_BATCH // 2:].sum()
    differs = 0.0
    for name, reference in big_batch.items():
        torch.testing.assert_close(accumulated[name], reference, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(two_ranks[name], reference, rtol=1e-5, atol=1e-6)
        differs = max(differs, float((reference - unmasked[name]).abs().max()))
    assert differs > 1e-4  # the mask changed the update: the comparison is not the plain one


def _initial_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(CFG).state_dict()


def test_ddp_all_reduces_once_per_step_not_once_per_micro_batch(tmp_path: Path) -> None:
    # 8 rows per rank in micro-batches of 2: accumulation 4. Two optimizer steps.
    _, calls = _run_two_ranks(tmp_path, micro_batch=2, oom_agreement=False, steps=2)
    num_buckets = 1  # the test model's 0.1 MB of gradients fit one 25 MiB bucket
    assert calls == 2 * num_buckets  # without no_sync it would be 2 steps x 4 micro-batches


def test_agreement_path_bypasses_ddp_hooks_and_still_matches(tmp_path: Path) -> None:
    _, calls = _run_two_ranks(tmp_path, micro_batch=2, oom_agreement=True, steps=2)
    assert calls == 0  # every micro-batch ran under no_sync; all_reduce_gradients did the work
