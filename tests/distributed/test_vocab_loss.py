"""The vocabulary-split loss and lookup on real gloo ranks against the whole output layer's
chunked loss and the whole embedding's rows: the same loss and hidden-state gradients on every
rank, for vocabularies the ranks split unevenly, chunked or not, with untrained targets, in fp32
and bf16; the same rows, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.gloo import on_ranks

pytestmark = pytest.mark.distributed

VOCAB, WIDTH, TOKENS = 301, 24, 40  # 301 rows: 151 + 150 on 2 ranks, 101 + 101 + 99 on 3
CASES = [  # (chunk tokens: a round over all the ranks, autocast dtype, FSDP's parameter dtype)
    (0, None, None), (7, None, None), (16, torch.bfloat16, None), (16, None, torch.bfloat16)]


def _case(rank: int, chunk: int, autocast: torch.dtype | None,
          param_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer.batches import IGNORE_INDEX
    from trainer.memory.loss import linear_cross_entropy_sum
    from trainer.parallel import vocab_loss
    from trainer.parallel.vocab_loss import split_lookup, split_summed_loss

    torch.manual_seed(0)
    full = torch.randn(VOCAB, WIDTH) * 2  # the same on every rank
    torch.manual_seed(1 + rank)  # each rank's own tokens
    hidden = torch.randn(TOKENS, WIDTH)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    targets[::5] = IGNORE_INDEX
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    output = torch.nn.Linear(WIDTH, VOCAB, bias=False)
    embedding = torch.nn.Embedding(VOCAB, WIDTH)
    for layer in (output, embedding):
        layer.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]),
                                          requires_grad=False)
    vocab_loss.LOOKUP_ROUND_TOKENS = 6  # several rounds of the lookup, as of the loss
    whole = full.to(param_dtype or full.dtype)
    results = {"lookup": split_lookup(embedding, param_dtype, targets.clamp(min=0).view(4, 10)),
               "lookup_whole": whole[targets.clamp(min=0)].view(4, 10, WIDTH)}
    losses = {"split": lambda h: split_summed_loss(output, param_dtype, h, targets, chunk),
              "whole": lambda h: linear_cross_entropy_sum(h, whole, targets, chunk)}
    for name, loss_of in losses.items():
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = loss_of(h)
        (loss * 0.25).backward()
        results[name] = loss.detach()
        results[f"{name}_grad"] = h.grad
    return results


def _worker(rank: int, out: str) -> None:
    torch.save([_case(rank, *case) for case in CASES], Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3])
def test_the_split_loss_is_the_whole_output_layers_loss(tmp_path: Path, world: int) -> None:
    on_ranks(_worker, world, str(tmp_path))
    for rank in range(world):
        ranks: list[dict[str, Any]] = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for (chunk, autocast, param_dtype), r in zip(CASES, ranks, strict=True):
            low = autocast or param_dtype
            rtol, atol = (2e-2, 5e-2) if low else (1e-5, 1e-5)
            torch.testing.assert_close(r["split"], r["whole"], rtol=rtol, atol=atol,
                                       msg=f"rank {rank}, case {chunk, autocast, param_dtype}")
            torch.testing.assert_close(r["split_grad"], r["whole_grad"], rtol=rtol,
                                       atol=1e-2 if low else 1e-6)
            assert r["whole_grad"].abs().sum() > 0
            assert torch.equal(r["lookup"], r["lookup_whole"])  # one non-zero slice a token


def _sharded_steps(corpus: str, base: str, out: str, precision: str,
                   tokens: list[list[torch.Tensor]]) -> dict[str, Any]:
    """Two accumulated micro-batches of this rank's ``tokens`` through LoRA on 2 FSDP ranks at
    ``precision``: the losses, the adapters' gradients, the largest all-gather FSDP ran, and
    the model (for the whole one's values)."""
    from tests.conftest import tiny_config
    from trainer.parallel.choice import parallelism_for

    cfg = tiny_config(Path(corpus), Path(out), f"model.name=hf:{base}", "model.lora.rank=4",
                      "parallel.strategy=fsdp", "parallel.workers=2",
                      f"memory.precision={precision}", "memory.activation_checkpointing=none",
                      "memory.loss_chunk_tokens=8")
    model: Any = parallelism_for(cfg, 2, precision).build(cfg, torch.device("cpu"),
                                                           lambda m: None)
    gathered: list[int] = []  # the elements of every all-gather FSDP runs
    originals = {name: getattr(dist, name) for name in ("all_gather_single",
                                                       "all_gather_into_tensor")}
    for name, collective in originals.items():

        def spy(output: torch.Tensor, *args: Any, _collective: Any = collective,
                **kwargs: Any) -> Any:
            gathered.append(output.numel())
            return _collective(output, *args, **kwargs)

        setattr(dist, name, spy)
    try:
        losses = []
        for i, batch in enumerate(tokens[dist.get_rank()]):
            model.set_requires_gradient_sync(i == len(tokens[0]) - 1)  # accumulated, as a step
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            losses.append(loss.detach())
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
    grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()
             if p.grad is not None}
    return {"losses": losses, "grads": grads, "gathered": max(gathered),
            "lookup": model.input_lookup is not None, "model": model}


def _lora_worker(rank: int, corpus: str, base: str, out: str) -> None:
    from tests.conftest import tiny_config
    from trainer.models.hf import HFCausalLM
    from trainer.parallel.strategy import OneProcess

    tokens = [[torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(
        10 * r + i)) for i in range(2)] for r in range(2)]
    runs = {precision: _sharded_steps(corpus, base, out, precision, tokens)
            for precision in ("fp32", "bf16")}
    cfg = tiny_config(Path(corpus), Path(out), f"model.name=hf:{base}", "model.lora.rank=4",
                      "memory.activation_checkpointing=none", "memory.loss_chunk_tokens=8")
    whole = OneProcess().build(cfg, torch.device("cpu"), lambda m: None)
    assert isinstance(whole, HFCausalLM) and whole.input_lookup is None
    with torch.no_grad():  # the sharded build's values (its adapters are seeded apart)
        for name, param in whole.named_parameters():
            param.copy_(runs["fp32"]["model"].get_parameter(name).full_tensor())
    # FSDP averages the ranks' gradients: the whole model's, of the two ranks' losses
    losses = [[whole(t[:, :-1], t[:, 1:]) for t in rank_tokens] for rank_tokens in tokens]
    (sum(sum(rank_losses) for rank_losses in losses) / 2).backward()
    for run in runs.values():
        del run["model"]
    torch.save({"runs": runs, "expected": [loss.detach() for loss in losses[rank]],
                "expected_grads": {n: p.grad for n, p in whole.named_parameters()
                                   if p.grad is not None}},
               Path(out) / f"rank{rank}.pt")


@pytest.mark.xdist_group("hf")
def test_under_fsdp_a_frozen_embedding_and_output_layer_are_never_gathered(
        corpus_dir: Path, tmp_path: Path) -> None:
    """LoRA on an ``hf:`` Llama's frozen base, 2 FSDP ranks, two micro-batches accumulated: no
    all-gather is as large as half the embedding or the output layer (each VOCAB x 20 x 32),
    yet each rank's losses and the adapters' gradients are the whole model's; in bf16 (FSDP's
    mixed precision, which the split layers are sharded without) too, within bf16's rounding."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB * 20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )).save_pretrained(tmp_path / "llama")
    on_ranks(_lora_worker, 2, str(corpus_dir), str(tmp_path / "llama"), str(tmp_path))
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        expected = r["expected_grads"]
        for precision, run in r["runs"].items():
            assert run["lookup"] and run["gathered"] < VOCAB * 20 * 32 // 2, precision
            assert run["grads"].keys() == expected.keys() and expected
            assert all(".lora_" in name for name in expected)
            if precision == "fp32":
                torch.testing.assert_close(run["losses"], r["expected"], rtol=1e-5, atol=1e-5)
                for name, grad in run["grads"].items():
                    torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6)
            else:
                torch.testing.assert_close(run["losses"], r["expected"], rtol=2e-2, atol=0)
                for name, grad in run["grads"].items():
                    if expected[name].norm() > 0:  # lora_A's are zero: lora_B starts at zero
                        assert (grad - expected[name]).norm() < 0.05 * expected[name].norm()
