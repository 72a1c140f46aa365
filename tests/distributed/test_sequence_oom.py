"""An out-of-memory error inside a split micro-batch, on real gloo ranks: 4 ranks in 2 sequence
groups of 2 under DDP, rank 1 (group 0) running out at each place its peer may be waiting in a
different meeting (before the forward, in a block's MLP forward, in a block's MLP backward, in
the embedding's gradient after the last all-to-all). Every rank of both groups raises
``StepOutOfMemory`` at the step's agreement, none waits in an unmatched all-to-all (gloo's
timeout would end the test), nothing of the failed attempt is kept, and the step retried at half
the micro-batch leaves the weights exactly as a run that never ran out does.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.gloo import on_ranks
from trainer.batches import TokenBatch
from trainer.memory.precision import PrecisionPolicy
from trainer.models.gpt import GPT, GPTConfig
from trainer.oom import OOMAgreement, StepOutOfMemory
from trainer.parallel.ddp import DataParallel
from trainer.parallel.mesh import Mesh
from trainer.step import train_step

pytestmark = pytest.mark.distributed

WORLD, SEQUENCE, FAILING = 4, 2, 1
POINTS = ("before", "forward", "backward", "end")
_T = 16
_GPT = GPTConfig(vocab_size=64, seq_len=_T, n_layer=2, n_head=4, n_embd=32)
FP32 = PrecisionPolicy("fp32", None, False)
NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)


def _batch(packed: bool) -> TokenBatch:
    """Each data rank's 4 rows; packed: documents crossing the ranks' slices (the positions are
    then gathered over the group: one meeting more, first in the forward)."""
    generator = torch.Generator().manual_seed(dist.get_rank() // SEQUENCE)
    tokens = torch.randint(0, 64, (4, _T + 1), generator=generator)
    if not packed:
        return TokenBatch(tokens)
    documents = torch.tensor([[0] * 5 + [1] * 12] * 4)
    return TokenBatch(tokens, torch.ones_like(tokens, dtype=torch.uint8), documents)


def _oom_at(model: GPT, point: str) -> torch.utils.hooks.RemovableHandle:
    """Make ``model`` raise an OOM at ``point`` (the module docstring's places)."""
    def oom(*_: Any) -> None:
        raise torch.OutOfMemoryError(f"out of memory (the test's, {point})")

    if point == "before":
        return model.register_forward_pre_hook(oom)
    if point == "forward":
        return model.blocks[1].mlp.register_forward_hook(oom)
    if point == "backward":
        return model.blocks[0].mlp.register_full_backward_hook(oom)
    return model.wte.weight.register_hook(oom)  # the last gradient: all-to-alls all done


def _trained(mesh: Mesh, packed: bool, faults: bool) -> dict[str, Any]:
    """One step a place (each tried once with ``faults`` on the failing rank, then retried at
    half the micro-batch); the errors each attempt raised, the losses and the final weights."""
    torch.manual_seed(0)
    model = GPT(_GPT)
    parallel = DataParallel(mesh)
    parallel.split_sequences(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped = parallel.wrap(model, optimizer)
    batch = _batch(packed)

    def step(splits: int) -> float:
        agreement = OOMAgreement(torch.device("cpu"))
        result = train_step(wrapped, optimizer, NO_SCALER, [batch], splits, FP32, 1.0,
                            agreement, parallel)
        return float(result.loss)

    errors: dict[str, str] = {}
    losses = []
    for point in POINTS:
        if faults:
            handle = _oom_at(model, point) if dist.get_rank() == FAILING else None
            try:
                step(1)
                errors[point] = "no error"
            except StepOutOfMemory as err:
                errors[point] = str(err)
                errors[point + " grads"] = str(any(p.grad is not None
                                                   for p in model.parameters()))
            if handle is not None:
                handle.remove()
        losses.append(step(2))
    return {"errors": errors, "losses": losses,
            "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def _worker(rank: int, out: str) -> None:
    mesh = Mesh.of(WORLD, rank, sequence=SEQUENCE)
    result = {packed: {"clean": _trained(mesh, packed, faults=False),
                       "faulty": _trained(mesh, packed, faults=True)}
              for packed in (False, True)}
    torch.save(result, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[bool, Any]]:
    out = tmp_path_factory.mktemp("sequence-oom")
    # an unmatched all-to-all fails in 30 s, in the default group and the sequence groups
    on_ranks(_worker, WORLD, str(out), timeout=timedelta(seconds=30))
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_an_oom_anywhere_in_a_split_micro_batch_is_agreed_on_by_every_rank(
        ranks: list[dict[bool, Any]], packed: bool) -> None:
    for rank, result in enumerate(ranks):
        errors = result[packed]["faulty"]["errors"]
        for point in POINTS:
            said = errors[point]
            if rank == FAILING:
                assert said == f"out of memory (the test's, {point})", (rank, point, said)
            elif rank // SEQUENCE == FAILING // SEQUENCE:  # its peer stopped where they met
                assert said == "a peer rank of this sequence group ran out of memory in this " \
                               "step", (rank, point, said)
            else:  # the other group finished its micro-batch and learned it at the agreement
                assert said == "a peer rank ran out of memory in this step", (rank, point, said)
            assert errors[point + " grads"] == "False", (rank, point)  # the attempt dropped


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_the_retried_steps_train_exactly_as_a_run_that_never_ran_out(
        ranks: list[dict[bool, Any]], packed: bool) -> None:
    for result in ranks:
        clean, faulty = result[packed]["clean"], result[packed]["faulty"]
        assert faulty["losses"] == clean["losses"]
        for name, weight in clean["weights"].items():
            assert torch.equal(faulty["weights"][name], weight), name
    # DDP kept the ranks' weights equal, and the steps trained
    first = ranks[0][packed]["faulty"]["weights"]
    assert all(torch.equal(r[packed]["faulty"]["weights"][k], v)
               for r in ranks[1:] for k, v in first.items())
    losses = ranks[0][packed]["clean"]["losses"]
    assert losses[-1] < losses[0]
