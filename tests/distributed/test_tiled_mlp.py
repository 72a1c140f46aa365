"""The tiled MLP under FSDP on 2 gloo ranks: each block's parameters are sharded, freed after its
forward and gathered again for its backward, where the tiles are recomputed; the gradients are
those of one process without tiles (tests/unit/test_tiled_mlp.py derives the tolerance)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.gloo import on_ranks
from trainer.models.build import MemoryTransforms, build_model
from trainer.models.gpt import GPT, GPTConfig
from trainer.parallel.fsdp import FsdpSettings, build_sharded

pytestmark = pytest.mark.distributed

_GPT = GPTConfig(vocab_size=64, seq_len=30, n_layer=2, n_head=2, n_embd=32)
U_FP32 = 2.0**-24


def _loss_and_grads(model: torch.nn.Module, tokens_BT: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(tokens_BT[:, :-1], tokens_BT[:, 1:])
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""):
             p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for name, p in model.named_parameters()}
    return loss.detach(), grads


def _compare(rank: int) -> None:
    """Both ranks train the same batch (FSDP averages their gradients), tiled, with and
    without checkpointing, against this process's untiled model."""
    tokens = torch.randint(0, _GPT.vocab_size, (2, _GPT.seq_len + 1),
                           generator=torch.Generator().manual_seed(5))
    want_loss, want = _loss_and_grads(
        build_model(partial(GPT, _GPT), MemoryTransforms(), seed=3), tokens)
    rtol = 2 * _GPT.seq_len * U_FP32
    for ac in ("none", "full"):
        model = build_sharded(partial(GPT, _GPT), MemoryTransforms(ac, tiled_mlp=4),
                              torch.device("cpu"), 3, FsdpSettings(), model_name="gpt")
        loss, grads = _loss_and_grads(model, tokens)
        assert (loss - want_loss).abs() <= rtol * want_loss.abs(), (ac, loss, want_loss)
        assert grads.keys() == want.keys()
        for name, grad in grads.items():
            assert (grad - want[name]).abs().max() <= rtol * want[name].abs().max(), \
                (rank, ac, name)


def test_fsdp_shards_train_the_tiled_mlp_as_one_process_trains_the_untiled_one() -> None:
    on_ranks(_compare, 2)
