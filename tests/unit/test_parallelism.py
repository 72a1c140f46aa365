"""Which way of splitting the work a run takes (``parallelism_for``) and what each way answers:
the table the loop, the state and the step read instead of branching on the kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import tiny_config
from trainer.memory.optimizers import InBackward
from trainer.parallel.choice import parallelism_for, parallelism_of, runs_fp16
from trainer.parallel.ddp import DistributedDataParallel
from trainer.parallel.fsdp import FullyShardedDataParallel
from trainer.parallel.strategy import Parallelism

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("strategy", "workers", "kind"), [
    ("ddp", 1, Parallelism), ("fsdp", 1, Parallelism),
    ("ddp", 2, DistributedDataParallel), ("fsdp", 2, FullyShardedDataParallel),
    ("fsdp", 4, FullyShardedDataParallel)])
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
    assert parallel.agrees_on_oom == (kind is not FullyShardedDataParallel)
    assert parallel.backward_hooks == {Parallelism: InBackward(),
                                    DistributedDataParallel: InBackward(comm_hook=True),
                                    FullyShardedDataParallel: InBackward(norm_over_ranks=True)
                                    }[kind]
    assert ("MixedPrecisionPolicy" in parallel.precision_route()) == \
        (kind is FullyShardedDataParallel)
    assert (parallel.describe() is not None) == (kind is FullyShardedDataParallel)
    assert runs_fp16(cfg) == (strategy != "fsdp")


def test_a_built_model_is_stepped_as_it_is_wrapped(tmp_path: Path) -> None:
    """``train_step`` outside the loop (the planner, the benches) finds the way from the
    model: plain, DDP's wrapper, FSDP's module (one gloo rank)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        plain = torch.nn.Linear(4, 4)
        assert type(parallelism_of(plain)) is Parallelism
        wrapped = DDP(torch.nn.Linear(4, 4))
        ddp = parallelism_of(wrapped)
        assert type(ddp) is DistributedDataParallel and ddp.unwrap(wrapped) is wrapped.module
        assert type(parallelism_of(fully_shard(torch.nn.Linear(4, 4)))) is \
            FullyShardedDataParallel
    finally:
        dist.destroy_process_group()
