"""Loss masks and packed documents: what a batch trains, that masked tokens carry no gradient in
the plain and the chunked loss, and that attention keeps to each document (memtrain's GPT, a
Hugging Face Llama)."""

from __future__ import annotations

import pytest
import torch

from trainer.batches import IGNORE_INDEX, TokenBatch
from trainer.memory.loss import linear_cross_entropy_sum, set_loss_chunking, summed_loss
from trainer.memory.precision import PrecisionPolicy
from trainer.models.gpt import GPT, GPTConfig, document_mask
from trainer.step import evaluate, step_tokens

pytestmark = pytest.mark.unit
FP32 = PrecisionPolicy("fp32", None, False)


def packed_row() -> TokenBatch:
    """One row of 9 tokens: document 0 (a prompt of 3, an answer of 2), then document 1 (a
    prompt of 2, an answer of 1), then one padding token."""
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 0]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 1, 0]], dtype=torch.uint8)
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2]], dtype=torch.int32)
    return TokenBatch(tokens, mask, docs)


def test_a_packed_row_trains_its_answers_only_and_restarts_positions() -> None:
    batch = packed_row()
    assert batch.targets.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 8, 9, IGNORE_INDEX,
                                       IGNORE_INDEX, 12, IGNORE_INDEX]]
    assert int(batch.trained_tokens()) == 3
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    # A boundary alone (no loss mask) drops the target across it: token 10 after token 9.
    unmasked = TokenBatch(batch.tokens, None, batch.document_ids)
    assert unmasked.targets[0, 4].item() == IGNORE_INDEX
    assert int(unmasked.trained_tokens()) == 6
    halves = TokenBatch(batch.tokens.repeat(4, 1), batch.loss_mask.repeat(4, 1),
                        batch.document_ids.repeat(4, 1)).chunk(2)
    assert [int(h.trained_tokens()) for h in halves] == [6, 6]
    # A plain batch: every target trained, counted without a tensor.
    assert TokenBatch(batch.tokens).trained_tokens() == 8


@pytest.mark.parametrize("chunk", [0, 3, 64])
def test_an_ignored_target_adds_nothing_to_the_loss_or_any_gradient(chunk: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(12, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    targets = torch.randint(0, 300, (12,))
    targets[[1, 4, 5, 11]] = IGNORE_INDEX
    loss = linear_cross_entropy_sum(hidden, weight, targets, chunk)
    loss.backward()
    keep = targets != IGNORE_INDEX
    reference = torch.nn.functional.cross_entropy(
        hidden[keep].detach() @ weight.detach().t(), targets[keep], reduction="sum")
    torch.testing.assert_close(loss.detach(), reference, rtol=1e-5, atol=1e-4)
    assert hidden.grad[~keep].abs().max() == 0  # no gradient from an ignored position
    assert hidden.grad[keep].abs().max() > 0
    # The output weight's gradient is that of the kept rows alone.
    kept_hidden = hidden[keep].detach().clone().requires_grad_()
    kept_weight = weight.detach().clone().requires_grad_()
    linear_cross_entropy_sum(kept_hidden, kept_weight, targets[keep], chunk).backward()
    torch.testing.assert_close(weight.grad, kept_weight.grad, rtol=1e-5, atol=1e-5)


def gpt(chunk: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32))
    set_loss_chunking(model, chunk)
    return model


def loss_and_grads(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = summed_loss(model, batch, FP32)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def two_documents(second: list[int]) -> TokenBatch:
    """Document 0 trained on its answer; document 1 (``second``) wholly masked."""
    first = [3, 4, 5, 6, 7, 8]
    tokens = torch.tensor([first + second])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1] + [0] * len(second)], dtype=torch.uint8)
    docs = torch.tensor([[0] * len(first) + [1] * len(second)], dtype=torch.int32)
    return TokenBatch(tokens, mask, docs)


@pytest.mark.parametrize("chunk", [0, 4])
def test_masked_tokens_carry_no_gradient_in_memtrains_gpt(chunk: int) -> None:
    """A masked document's tokens change: the loss and every gradient stay the same, since
    they are neither targets nor attended to across the boundary."""
    model = gpt(chunk)
    loss_a, grads_a = loss_and_grads(model, two_documents([9, 10, 11, 12, 13]))
    loss_b, grads_b = loss_and_grads(model, two_documents([40, 41, 42, 43, 44]))
    assert loss_a > 0
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=0, atol=0, msg=name)
    # Without document ids the second document attends to the first and the first's last
    # target is the second's first token: attention reads across, so the gradients move.
    plain = two_documents([9, 10, 11, 12, 13])
    crossing = TokenBatch(plain.tokens, torch.ones_like(plain.loss_mask))
    other = TokenBatch(two_documents([40, 41, 42, 43, 44]).tokens,
                       torch.ones_like(plain.loss_mask))
    assert not torch.equal(loss_and_grads(model, crossing)[0], loss_and_grads(model, other)[0])


def test_a_packed_document_sees_what_it_would_see_alone() -> None:
    model = gpt(0).eval()
    alone = torch.tensor([[20, 21, 22, 23]])
    packed = torch.tensor([[3, 4, 5, 20, 21, 22, 23]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        expected = model(alone)
        got = model(packed, position_ids=positions)[:, 3:]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    mask = document_mask(positions)[0, 0]
    assert mask[3, :3].sum() == 0 and mask[3, 3] and not mask[2, 3]


def test_a_hf_llama_keeps_packed_documents_apart() -> None:
    transformers = pytest.importorskip("transformers")
    from trainer.models.hf import HFCausalLM

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa")).eval()
    alone = torch.tensor([[20, 21, 22, 23]])
    packed = torch.tensor([[3, 4, 5, 20, 21, 22, 23]])
    with torch.no_grad():
        expected = model(alone)
        got = model(packed, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))[:, 3:]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    loss_a, _ = loss_and_grads(model, two_documents([9, 10, 11, 12, 13]))
    loss_b, _ = loss_and_grads(model, two_documents([40, 41, 42, 43, 44]))
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)


def test_the_step_divides_by_the_trained_tokens_and_evaluation_counts_them() -> None:
    model = gpt(0)
    batch = packed_row()
    tokens = step_tokens([batch, batch])
    assert float(tokens.divisor) == 6 and float(tokens.trained) == 6
    expected = float(summed_loss(model, batch, FP32).detach()) / 3
    got = evaluate(model, iter([batch, batch]), 2, FP32)
    assert got == pytest.approx(expected, rel=1e-6)
    plain = step_tokens([TokenBatch(batch.tokens)])
    assert plain.divisor == 8 and plain.trained is None
