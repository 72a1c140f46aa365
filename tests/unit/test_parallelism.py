"""Which way of splitting the work a run takes (``parallelism_for``) and what each way answers:
the table the loop, the state and the step read instead of branching on the kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_config
from tests.gloo import one_rank_group
from trainer.memory.optimizers import InBackward
from trainer.parallel.choice import parallelism_for, parallelism_of, runs_fp16
from trainer.parallel.ddp import DataParallel
from trainer.parallel.fsdp import ShardedDataParallel
from trainer.parallel.strategy import OneProcess, Parallelism, precision_route

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("strategy", "workers", "kind"), [
    ("ddp", 1, OneProcess), ("fsdp", 1, OneProcess),
    ("ddp", 2, DataParallel), ("fsdp", 2, ShardedDataParallel),
    ("fsdp", 4, ShardedDataParallel)])
def test_each_config_takes_its_way_and_each_way_answers_for_itself(
        corpus_dir: Path, tmp_path: Path, strategy: str, workers: int, kind: type) -> None:
    """One worker is one process whatever the strategy (FSDP has nothing to shard); several
    take DDP or FSDP. FSDP cannot agree on an OOM (its reduce-scatter runs inside backward),
    attaches the step in backward with the norm over the ranks, and with bf16 parameters
    replaces autocast by its policy; the others autocast."""
    cfg = tiny_config(corpus_dir, tmp_path, f"parallel.strategy={strategy}",
                      "memory.precision=bf16")
    parallel = parallelism_for(cfg, workers, "bf16")
    assert type(parallel) is kind
    assert parallel.agrees_on_oom == (kind is not ShardedDataParallel)
    assert parallel.backward_hooks == {OneProcess: InBackward(),
                                       DataParallel: InBackward(comm_hook=True),
                                       ShardedDataParallel: InBackward(norm_over_ranks=True)
                                       }[kind]
    assert parallel.steady_transients == (kind is not ShardedDataParallel)
    assert ("MixedPrecisionPolicy" in precision_route(parallel)) == \
        (kind is ShardedDataParallel)
    assert (parallel.describe() is not None) == (kind is ShardedDataParallel)
    assert parallel.mesh.data_ranks == workers and parallel.mesh.sizes == {
        "replicate": 1 if kind is ShardedDataParallel else workers,
        "shard": workers if kind is ShardedDataParallel else 1, "sequence": 1}
    assert runs_fp16(cfg) == (strategy != "fsdp")


def test_a_built_model_is_stepped_as_it_is_wrapped(tmp_path: Path) -> None:
    """``train_step`` outside the loop (the planner, the benches) finds the way from the
    model: plain, DDP's wrapper, FSDP's module (one gloo rank)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    with one_rank_group(tmp_path):
        plain = torch.nn.Linear(4, 4)
        assert type(parallelism_of(plain)) is OneProcess
        wrapped = DDP(torch.nn.Linear(4, 4))
        ddp = parallelism_of(wrapped)
        assert type(ddp) is DataParallel and ddp.unwrap(wrapped) is wrapped.module
        assert type(parallelism_of(fully_shard(torch.nn.Linear(4, 4)))) is \
            ShardedDataParallel


def test_a_way_that_leaves_out_what_every_way_answers_cannot_be_made() -> None:
    """The contract is abstract: a way missing a method cannot be instantiated, and one that
    does not state its OOM agreement, backward hooks or heap policy cannot even be defined."""

    class Forgetful(OneProcess):
        total_norm = Parallelism.total_norm  # abstract again

    with pytest.raises(TypeError, match="abstract"):
        Forgetful()  # type: ignore[abstract]
    with pytest.raises(TypeError, match="does not state agrees_on_oom, steady_transients"):
        class Unstated(Parallelism):
            backward_hooks = InBackward()

            def placement(self): ...  # type: ignore[no-untyped-def]
            def shard(self, model, device): ...  # type: ignore[no-untyped-def]
            def wrap(self, model, optimizer): ...  # type: ignore[no-untyped-def]
            def unwrap(self, model): ...  # type: ignore[no-untyped-def]
            def reduction_held(self, model, held): ...  # type: ignore[no-untyped-def]
            def total_norm(self, grad_norm): ...  # type: ignore[no-untyped-def]
            def describe(self): ...  # type: ignore[no-untyped-def]


def test_the_mesh_names_each_rank_s_place() -> None:
    """Rank r of W with sequence groups of N: data rank r // N of W / N, sequence rank r % N;
    the first of each group records its rows (no process group needed at N = 1)."""
    from trainer.parallel.mesh import Mesh

    for world, rank in [(1, 0), (4, 0), (4, 3)]:
        mesh = Mesh.of(world, rank)
        assert (mesh.data_rank, mesh.data_ranks, mesh.sequence_rank) == (rank, world, 0)
        assert mesh.records_rows and mesh.describe() is None
    sharded = Mesh(shard=2, sequence=2, rank=3)
    assert (sharded.data_rank, sharded.data_ranks, sharded.sequence_rank) == (1, 2, 1)
    assert not sharded.records_rows and sharded.world_size == 4
    assert "2 data ranks" in (sharded.describe() or "")
    with pytest.raises(ValueError, match="parallel.workers 6 is not divisible by "
                                         "parallel.sequence 4"):
        Mesh.of(6, 0, sequence=4)
