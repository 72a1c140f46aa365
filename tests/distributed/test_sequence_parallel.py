"""Ulysses sequence parallelism on real gloo groups of 2 and 4 ranks, held against one process:
the all-to-alls move heads exactly and their backward is the inverse; memtrain's GPT and a
grouped-query Llama (random weights, nothing downloaded), on plain and packed rows with a loss
mask, give each rank its slice's logits, the same mean loss and, all-reduced over the group,
the same gradients; every refusal is one line. In the "hf" xdist group with the other tests that
import transformers.

Tolerance: the split run does the same arithmetic in another order (each weight's gradient is
summed over a rank's tokens, then over the ranks; the linear layers run on fewer rows), so a
value may differ from one process's by the rounding of reassociated fp32 sums. A sum of n terms
reassociated moves by at most (n - 1) x eps of the terms' magnitudes; here n = B x S = 32 token
terms per weight, 31 x 1.19e-7 = 3.7e-6. ``TOLERANCE`` = 1e-5 of each tensor's largest magnitude
lies above that bound, and 27x above the largest difference measured (3.7e-7, at 4 ranks); each
fault tried (keys repeated in the wrong order, a rank's positions from 0, the document mask
dropped) gives differences of 0.8 to 2 of it, in exactly the cases it concerns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.gloo import on_ranks
from trainer.batches import IGNORE_INDEX, TokenBatch
from trainer.launch.local import PRELOAD
from trainer.models.gpt import GPT, GPTConfig
from trainer.parallel.sequence import (
    apply_sequence_parallel,
    heads_to_seq,
    row_slice,
    seq_to_heads,
)

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("hf")]

TOLERANCE = 1e-5  # of each tensor's largest magnitude (the module docstring)
_B, _T = 2, 16
_GPT = GPTConfig(vocab_size=64, seq_len=_T, n_layer=2, n_head=4, n_embd=32)
# Grouped-query Llamas: 4 query heads on 2 key/value heads (at 4 ranks each is repeated twice,
# as ALST does), and 12 on 3, which divide among neither 2 nor 4 ranks (each is repeated twice
# at 2 ranks, 4 times at 4).
_LLAMAS = {"llama_gqa": (4, 2), "llama_kv3": (12, 3)}
CASES = [(model, packed) for model in ("gpt", *_LLAMAS) for packed in (False, True)]


def _llama(num_heads: int, num_kv_heads: int, **fields: Any) -> nn.Module:
    import transformers

    from trainer.models.hf import HFCausalLM

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=4 * num_heads, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=_T, **fields)
    return HFCausalLM(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def _model(name: str, weights: Path) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(_GPT) if name == "gpt" else _llama(*_LLAMAS[name])
    if weights.is_file():
        model.load_state_dict(torch.load(weights, weights_only=True))
    else:
        torch.save(model.state_dict(), weights)
    return model


def _batch(packed: bool) -> TokenBatch:
    """Rows of ``_T + 1`` tokens; packed: documents whose boundaries fall inside the ranks'
    slices and across them, and a loss mask leaving out about a third of the targets."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (_B, _T + 1), generator=generator)
    if not packed:
        return TokenBatch(tokens)
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 5, [0] * 9 + [1] * 8])
    loss_mask = (torch.rand(_B, _T + 1, generator=generator) > 0.33).to(torch.uint8)
    return TokenBatch(tokens, loss_mask, documents)


def _step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
          position_ids: torch.Tensor | None, group: Any = None) -> dict[str, Any]:
    """Logits of ``inputs``, then the mean loss over the targets of every rank of ``group`` and
    its gradients, summed over the group."""
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    with torch.no_grad():
        logits = model(inputs, **kwargs)
    trained = (targets != IGNORE_INDEX).sum().float()
    if group is not None:
        dist.all_reduce(trained, group=group)
    loss = model(inputs, targets, **kwargs) / trained
    loss.backward()
    loss = loss.detach()
    grads = {name: p.grad for name, p in model.named_parameters()}
    if group is not None:
        dist.all_reduce(loss, group=group)
        for grad in grads.values():
            dist.all_reduce(grad, group=group)
    return {"logits": logits, "loss": loss, "grads": grads}


def _all_to_all(rank: int, size: int, group: Any) -> dict[str, bool]:
    """``seq_to_heads`` of this rank's slice of a known tensor gives the whole rows of its heads
    exactly; ``heads_to_seq`` gives the slice back; each one's backward is the other."""
    generator = torch.Generator().manual_seed(2)
    x_BSHD = torch.randn(2, 4 * size, 2 * size, 3, generator=generator)
    weight_BSHD = torch.randn(x_BSHD.shape, generator=generator)
    tokens, heads = (slice(rank * n, (rank + 1) * n) for n in (4, 2))
    local = x_BSHD[:, tokens].clone().requires_grad_()
    by_heads = seq_to_heads(local, group)
    (by_heads * weight_BSHD[:, :, heads]).sum().backward()
    whole = x_BSHD[:, :, heads].clone().requires_grad_()
    back = heads_to_seq(whole, group)
    (back * weight_BSHD[:, tokens]).sum().backward()
    assert local.grad is not None and whole.grad is not None
    return {"seq_to_heads": torch.equal(by_heads, x_BSHD[:, :, heads]),
            "seq_to_heads_backward": torch.equal(local.grad, weight_BSHD[:, tokens]),
            "heads_to_seq": torch.equal(back, x_BSHD[:, tokens]),
            "heads_to_seq_backward": torch.equal(whole.grad, weight_BSHD[:, :, heads])}


def _refusals(size: int, group: Any) -> dict[str, str]:
    """Each refusal's one line (a ValueError's message), or "" where none was raised."""
    heads = size + 1  # divides among no group of 2 or 4
    attempts = {
        "gpt_heads": lambda: apply_sequence_parallel(
            GPT(GPTConfig(vocab_size=8, seq_len=8, n_layer=1, n_head=heads, n_embd=4 * heads)),
            group),
        "llama_heads": lambda: apply_sequence_parallel(_llama(heads, heads), group),
        "seq_len": lambda: row_slice(TokenBatch(torch.zeros(1, 4 * size + 2)), 0, size),
        "all_to_all_heads": lambda: seq_to_heads(torch.zeros(1, 2, heads, 1), group),
        "not_a_model": lambda: apply_sequence_parallel(nn.Linear(2, 2), group),
    }
    said = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            said[name] = ""
        except ValueError as err:
            said[name] = str(err)
    return said


def _worker(rank: int, out: str) -> None:
    size = dist.get_world_size()
    group = dist.new_group(list(range(size)))
    result: dict[str, Any] = {"all_to_all": _all_to_all(rank, size, group),
                              "refusals": _refusals(size, group)}
    for name, packed in CASES:
        model = _model(name, Path(out) / f"{name}.pt")
        apply_sequence_parallel(model, group)
        rows = row_slice(_batch(packed), rank, size)
        result[name, packed] = _step(model, rows.inputs, rows.targets, rows.position_ids, group)
    torch.save(result, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each model's seeded weights, saved once: every process trains the same ones."""
    directory = tmp_path_factory.mktemp("weights")
    for name in ("gpt", *_LLAMAS):
        _model(name, directory / f"{name}.pt")
    return directory


@pytest.fixture(scope="module")
def unsplit(weights: Path) -> dict[Any, dict[str, Any]]:
    """One process's logits, mean loss and gradients on whole rows, for every case."""
    results = {}
    for name, packed in CASES:
        batch = _batch(packed)
        results[name, packed] = _step(_model(name, weights / f"{name}.pt"), batch.inputs,
                                      batch.targets, batch.position_ids)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def split(request: pytest.FixtureRequest, weights: Path) -> list[dict[Any, Any]]:
    """Each rank's results with the rows split over ``request.param`` gloo ranks."""
    size = request.param
    on_ranks(_worker, size, str(weights),
             modules=(*PRELOAD, "transformers.models.llama.modeling_llama"))
    return [torch.load(weights / f"rank{rank}.pt", weights_only=True) for rank in range(size)]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0,
                               atol=TOLERANCE * float(expected.abs().max()), msg=what)


def test_the_all_to_alls_move_heads_exactly_and_each_backward_is_the_other(
        split: list[dict[Any, Any]]) -> None:
    for rank, result in enumerate(split):
        assert all(result["all_to_all"].values()), (rank, result["all_to_all"])


@pytest.mark.parametrize("name,packed", CASES, ids=[f"{m}-{'packed' if p else 'plain'}"
                                                    for m, p in CASES])
def test_split_rows_give_one_process_s_logits_loss_and_gradients(
        split: list[dict[Any, Any]], unsplit: dict[Any, dict[str, Any]], name: str,
        packed: bool) -> None:
    expected = unsplit[name, packed]
    ranks = [result[name, packed] for result in split]
    _close(torch.cat([r["logits"] for r in ranks], dim=1), expected["logits"], "logits")
    for r in ranks:
        _close(r["loss"], expected["loss"], "loss")
        assert r["grads"].keys() == expected["grads"].keys()
        for param, grad in r["grads"].items():
            _close(grad, expected["grads"][param], param)


def test_each_refusal_is_one_line_naming_its_field(split: list[dict[Any, Any]]) -> None:
    size = len(split)
    said = split[0]["refusals"]
    divisor = f"is not divisible by the sequence-parallel size {size}"
    assert said["gpt_heads"] == f"model.n_head {size + 1} {divisor}"
    assert said["llama_heads"] == f"num_attention_heads {size + 1} {divisor}"
    assert said["seq_len"] == f"seq_len {4 * size + 1} {divisor}"
    assert said["all_to_all_heads"] == f"num_heads {size + 1} {divisor}"
    assert said["not_a_model"].startswith("Linear: sequence parallelism needs memtrain's GPT")
    assert all("\n" not in line for line in said.values())
