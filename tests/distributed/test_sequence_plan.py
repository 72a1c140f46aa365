"""The planner's per-rank peak under ``parallel.sequence: 2`` against the CPU allocator's record
of a real training step on 2 gloo ranks (one sequence group, DDP over both): plain rows, and
packed rows whose document mask spans the whole row on every rank.

The model is long and narrow (256 tokens a row, width 64), so attention's own tensors (its
scores over whole rows under the document mask) weigh against the rest, and the planner is
held where it differs from a probe of each rank's tokens alone.

Tolerance: one configuration's steps differ from each other, because gloo's threads and DDP's
buckets allocate on their own timing: 5 steps on each rank spread over up to 0.9 MiB (3.85 to
4.73 MiB packed with full checkpointing), about 10% either side of their median, which is what
is compared; the planner itself is within 8% of one process's real peak
(tests/unit/test_planner.py). ``TOLERANCE`` is about their sum, 15%; the measured gaps are in
the test's docstring.
"""

from __future__ import annotations

import statistics
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.gloo import on_ranks
from trainer.memory.precision import precision_policy
from trainer.models.build import MemoryTransforms, build_model
from trainer.models.gpt import GPT, GPTConfig
from trainer.parallel.ddp import DataParallel
from trainer.parallel.mesh import Mesh
from trainer.plan.peak import plan_row
from trainer.plan.probe import probe_batch, profile_activations
from trainer.plan.static import static_bytes
from trainer.step import create_optimizer_state, step_peak_bytes

pytestmark = pytest.mark.distributed

TOLERANCE = 0.15  # relative, of the median step's peak (the module docstring)
_CFG = GPTConfig(vocab_size=256, seq_len=256, n_layer=2, n_head=4, n_embd=64)
_BATCH = 2


def _transforms(checkpointing: str) -> MemoryTransforms:
    return MemoryTransforms(activation_checkpointing=checkpointing, bf16_norm_inputs=False)


def _step_peak(rank: int, packed: bool, checkpointing: str, out: str) -> None:
    """Five steps' allocator peaks on this rank."""
    parallel = DataParallel(Mesh.of(2, rank, sequence=2))
    model = build_model(partial(GPT, _CFG), _transforms(checkpointing), seed=0)
    parallel.split_sequences(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = parallel.wrap(model, optimizer)
    policy = precision_policy("fp32", torch.device("cpu"), warn=False)
    scaler = policy.grad_scaler(torch.device("cpu"))
    torch.manual_seed(1)  # the same rows on both ranks: each trains its half of them
    batch = probe_batch(_BATCH, _CFG.seq_len, _CFG.vocab_size, torch.device("cpu"), packed)
    create_optimizer_state(optimizer)
    peaks = [step_peak_bytes(model, optimizer, scaler, batch, policy, parallel=parallel)
             for _ in range(5)]
    torch.save(peaks, f"{out}.{rank}")


def _planned(packed: bool, checkpointing: str, sequence: int) -> int:
    profile = profile_activations(partial(GPT, _CFG), _transforms(checkpointing), _CFG.seq_len,
                                  _CFG.vocab_size, "fp32", packed=packed, sequence=sequence)
    return plan_row(static_bytes(GPT(_CFG), "ddp", 2), profile, _BATCH, 1).predicted_peak_bytes


@pytest.mark.parametrize(("packed", "checkpointing"),
                         [(False, "none"), (True, "none"), (False, "full"), (True, "full")],
                         ids=["plain", "packed", "plain-full-ac", "packed-full-ac"])
def test_planner_predicts_a_sequence_parallel_rank_peak(tmp_path: Path, packed: bool,
                                                        checkpointing: str) -> None:
    """Each rank's step peak against the planner's for one rank of ``parallel.sequence: 2``,
    and the planner of whole rows (``sequence`` 1, what it planned before it knew the split)
    far above it.

    Seen (the median step in MiB; the planner's; whole rows'): plain 4.65, 4.59, 7.30; packed
    5.73, 5.84, 8.30; full checkpointing 3.65, 3.59, 5.16; full and packed 4.10, 4.40, 5.73:
    -1.6% to +7.3% (the medians moved by up to 0.5 MiB between earlier runs). Counting a
    layer's four all-to-all inputs in flight, in place of one all-to-all's send and receive
    buffers, or no buffer, moves the prediction by 0.125 MiB either way: within the steps'
    spread, so the buffers are counted for the reason they exist (``plan_row``)."""
    out = tmp_path / "peak"
    on_ranks(_step_peak, 2, packed, checkpointing, str(out))
    measured = statistics.median(peak for rank in (0, 1)
                                 for peak in torch.load(f"{out}.{rank}", weights_only=True))
    planned, whole = _planned(packed, checkpointing, 2), _planned(packed, checkpointing, 1)
    print(f"measured {measured / 2**20:.2f} MiB, planned {planned / 2**20:.2f}, "
          f"whole rows {whole / 2**20:.2f}")
    assert planned == pytest.approx(measured, rel=TOLERANCE)
    assert whole > planned * (1 + TOLERANCE)  # the split's saving is what is planned
