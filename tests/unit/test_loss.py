"""The chunked output projection + cross-entropy equals the plain one, loss and gradients."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from trainer.batches import IGNORE_INDEX
from trainer.memory.loss import (
    AUTO_LOSS_CHUNK_BYTES,
    _normalise_rows_,
    auto_loss_chunk_tokens,
    linear_cross_entropy_sum,
    observe_chunked_losses,
    set_loss_chunking,
)
from trainer.models.gpt import GPT, GPTConfig
from trainer.telemetry.diagnostics import cpu_peak_bytes


def _plain_and_chunked(dtype: torch.dtype | None, chunk: int):
    torch.manual_seed(0)
    hidden = torch.randn(50, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    targets = torch.randint(0, 300, (50,))
    results = []
    for chunk_tokens in (0, chunk):
        hidden.grad = weight.grad = None
        ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
        with ctx:
            loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_tokens)
        (loss * 0.5).backward()  # a non-unit incoming gradient, as loss scaling gives
        results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
    return results


@pytest.mark.parametrize("chunk", [7, 50, 64])
def test_chunked_equals_plain_in_fp32(chunk: int) -> None:
    (loss_a, gh_a, gw_a), (loss_b, gh_b, gw_b) = _plain_and_chunked(None, chunk)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gh_b, gh_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw_b, gw_a, rtol=1e-5, atol=1e-6)


def test_chunked_follows_autocast_in_bf16() -> None:
    (loss_a, gh_a, gw_a), (loss_b, gh_b, gw_b) = _plain_and_chunked(torch.bfloat16, 16)
    torch.testing.assert_close(loss_b, loss_a, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(gh_b, gh_a, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(gw_b, gw_a, rtol=5e-2, atol=5e-2)


def test_gpt_loss_path_matches_its_logits_path() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, n_embd=32))
    tokens = torch.randint(0, 256, (3, 17))
    logits = model(tokens[:, :-1])
    plain = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    set_loss_chunking(model, 10)
    chunked = model(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("vocab_size, tokens", [
    (50_304, 1024),  # GPT-2: 0.19 GiB of fp32 logits a chunk
    (128_256, 512),  # Llama 3
    (256, 262_144),  # a byte vocabulary: any micro-batch is one chunk
    (10**7, 128),  # never thinner than the floor
])
def test_auto_loss_chunks_are_sized_by_the_vocabulary(vocab_size: int, tokens: int) -> None:
    assert auto_loss_chunk_tokens(vocab_size) == tokens
    assert tokens == 128 or tokens * vocab_size * 4 <= AUTO_LOSS_CHUNK_BYTES < \
        2 * tokens * vocab_size * 4


def test_auto_sets_the_gpts_chunk_from_its_vocabulary() -> None:
    model = GPT(GPTConfig(vocab_size=128_256, seq_len=8, n_layer=1, n_head=1, n_embd=8))
    assert set_loss_chunking(model, "auto") == 512 and model.loss_chunk_tokens == 512

    class OwnLossWithoutVocabulary(torch.nn.Module):
        loss_chunk_tokens = 0

    with pytest.raises(ValueError, match="needs OwnLossWithoutVocabulary to say its vocabulary"):
        set_loss_chunking(OwnLossWithoutVocabulary(), "auto")
    assert set_loss_chunking(torch.nn.Linear(2, 2), "auto") == 0  # no loss of its own: plain


def test_loss_chunking_needs_a_model_that_computes_its_loss() -> None:
    with pytest.raises(ValueError, match="memory.loss_chunk_tokens 4096"):
        set_loss_chunking(torch.nn.Linear(2, 2), 4096)
    set_loss_chunking(torch.nn.Linear(2, 2), 0)  # 0 asks for nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37, 256])
def test_a_chunk_is_normalised_slice_by_slice_to_the_same_bits(dtype, rows: int) -> None:
    """The loss and the logits' gradient, a slice of rows at a time, bit for bit what
    ``F.cross_entropy`` and ``softmax`` of the whole chunk's fp32 logits give (the loss's
    rounding is what the recorded losses of ``test_train_loop`` hold)."""
    torch.manual_seed(rows)
    logits = (torch.randn(rows, 3000) * 4).to(dtype)
    targets = torch.randint(0, 3000, (rows,))
    targets[torch.rand(rows) < 0.3] = IGNORE_INDEX
    full = logits.float()
    loss = F.cross_entropy(full, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    keep = (targets != IGNORE_INDEX).unsqueeze(1)
    grad = full.softmax(dim=-1).mul_(keep)
    grad = grad.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), -keep.float()).to(dtype)

    normalised = logits.clone()
    assert _normalise_rows_(normalised, targets, gradient=True).item().hex() == \
        loss.item().hex()
    assert torch.equal(normalised.view(-1).view(torch.uint8), grad.view(-1).view(torch.uint8))
    untouched = logits.clone()
    assert _normalise_rows_(untouched, targets, gradient=False).item().hex() == loss.item().hex()
    assert torch.equal(untouched, logits)


@pytest.mark.parametrize(("dtype", "tokens", "chunk", "vocab", "width", "trains"), [
    (None, 4096, 1024, 5000, 64, True),  # four chunks: the logits moment sets the peak
    (torch.bfloat16, 4096, 1024, 5000, 64, True),
    (None, 512, 128, 3000, 256, True),  # small chunks, wide: the weight-gradient moment does
    (torch.bfloat16, 512, 128, 3000, 256, True),
    # frozen (LoRA's base): the hidden states' gradient sets it. Not in bf16: there oneDNN packs
    # the product's right operand into scratch of its own (1.6 MB here), which no tensor shows.
    (None, 512, 128, 3000, 512, False),
])
def test_transient_bytes_match_the_cpu_allocator(dtype, tokens, chunk, vocab, width,
                                                 trains) -> None:
    """The planner's formula for the loss's temporaries against the allocator's real peak.

    A chunk's logits take 4 bytes a logit in fp32 here (2 in bf16) and one slice's
    temporaries a sixteenth more; normalised whole, as ``F.cross_entropy`` and ``softmax`` of
    the chunk's fp32 logits, they took 8 bytes a logit at the peak, and this fails on that.
    """
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=trains)
    targets = torch.randint(0, vocab, (tokens,))

    def loss() -> None:
        ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
        with ctx, observe_chunked_losses() as shapes:
            linear_cross_entropy_sum(hidden, weight, targets, chunk)
        observed.extend(shapes)

    observed: list = []
    peak = cpu_peak_bytes(loss, held=(hidden, weight, targets))
    inputs = sum(t.numel() * t.element_size() for t in (hidden, weight, targets))
    saved = 4 * (tokens * width + vocab * width * trains)  # fp32 grad_hidden and grad_weight
    (shape,) = observed
    predicted = inputs + saved + shape.transient_bytes(tokens)
    assert predicted == pytest.approx(peak, rel=0.02)


class _OwnLossWithAModuleNamedModule(torch.nn.Module):
    """A user's model that computes its own loss and has a submodule named ``module``: the
    name DDP's wrapper gives the model inside it, which must not be taken for one."""

    computes_loss = True

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Embedding(16, 16)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            raise TypeError("this model computes its loss: call it with targets")
        return torch.nn.functional.cross_entropy(self.module(idx).flatten(0, 1),
                                                 targets.flatten(), reduction="sum")


def test_a_submodule_named_module_is_not_taken_for_a_wrapped_model() -> None:
    from trainer.memory.loss import summed_loss
    from trainer.memory.precision import precision_policy

    loss = summed_loss(_OwnLossWithAModuleNamedModule(), torch.randint(0, 16, (2, 9)),
                       precision_policy("fp32", torch.device("cpu")))
    assert loss.ndim == 0 and float(loss) > 0


class _SavesThenFailsInBackward(torch.autograd.Function):
    saved: list = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        kept = x * 2  # an activation saved for backward
        _SavesThenFailsInBackward.saved.append(weakref.ref(kept))
        ctx.save_for_backward(kept)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise torch.OutOfMemoryError("out of memory (raised in backward by the test)")


def test_an_oom_in_backward_leaves_no_activation_alive_while_it_is_recovered() -> None:
    """The step that ran out of memory in backward raises ``StepOutOfMemory``; while the
    loop handles it (the memory report, ``empty_cache``, the retry), the failed micro-batch's
    saved activations are gone already."""
    from trainer.memory.precision import precision_policy
    from trainer.oom import OOMAgreement, StepOutOfMemory
    from trainer.step import train_step

    class Failing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.out(_SavesThenFailsInBackward.apply(self.emb(idx)))

    model = Failing()
    policy = precision_policy("fp32", torch.device("cpu"))
    with pytest.raises(StepOutOfMemory):
        try:
            train_step(model, torch.optim.AdamW(model.parameters()),
                       policy.grad_scaler(torch.device("cpu")), [torch.randint(0, 16, (2, 9))],
                       1, policy, 1.0, OOMAgreement(torch.device("cpu")))
        except StepOutOfMemory:
            gc.collect()
            assert _SavesThenFailsInBackward.saved[-1]() is None
            raise


def test_which_layers_fsdp_splits_by_vocabulary() -> None:
    """A frozen output layer or plain embedding is split (never gathered) where a round of
    tokens holds no more than one gathered copy of the layer; a trained, biased, subclassed,
    renormalising or offloaded one, a round too large, or a rank left without rows is not."""
    from trainer.parallel.vocab_loss import LOOKUP_ROUND_TOKENS, splits_the_vocabulary

    def frozen(layer: torch.nn.Module) -> torch.nn.Module:
        return layer.requires_grad_(False)

    output = frozen(torch.nn.Linear(64, 32_000, bias=False))
    embedding = frozen(torch.nn.Embedding(32_000, 64))
    assert splits_the_vocabulary(output, 2, False, 2048)
    assert splits_the_vocabulary(embedding, 8, False, LOOKUP_ROUND_TOKENS)
    # a round's hidden states and fp32 gradient (8 bytes a value) against one fp32 copy
    assert splits_the_vocabulary(output, 2, False, 16_000)
    assert not splits_the_vocabulary(output, 2, False, 16_001)
    assert not splits_the_vocabulary(output, 2, False, 0)  # the plain loss: one unbounded round
    assert not splits_the_vocabulary(output, 2, True, 2048)  # offloaded
    assert not splits_the_vocabulary(torch.nn.Linear(64, 32_000, bias=False), 2, False, 2048)
    assert not splits_the_vocabulary(frozen(torch.nn.Linear(64, 32_000)), 2, False, 2048)
    assert not splits_the_vocabulary(frozen(torch.nn.Embedding(32_000, 64, max_norm=1.0)), 2,
                                     False, 64)

    class Scaled(torch.nn.Embedding):
        pass

    assert not splits_the_vocabulary(frozen(Scaled(32_000, 64)), 2, False, 64)
    tiny = frozen(torch.nn.Embedding(5, 64))  # over 4 ranks: 2, 2, 1 and none
    assert splits_the_vocabulary(tiny, 3, False, 1) and not splits_the_vocabulary(tiny, 4, False, 1)
