"""The loss (``memory.loss_chunk_tokens``): its temporaries at the end of the forward pass and,
for the plain loss, its own backward, the first of the backward pass.

The chunked loss holds one chunk's logits in the compute dtype and a slice of them in fp32, and
the output weight's copy in the autocast dtype (``trainer.memory.loss.ChunkedLossShape``); it
computes its output weight's gradient in the forward pass and saves it with the activations.
The plain loss's backward holds the fp32 gradients of the log-probabilities and of the logits
(``trainer.memory.loss.PlainLossShape``). The probe records the loss's shapes; a chunk changes
only the temporaries (what the loss saves for backward is the same), so a row may re-chunk it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.memory.loss import ChunkedLossShape, LossShape


@dataclass(frozen=True)
class LossBytes:
    """The loss's terms at one micro-batch (0 each for a model without a recorded loss)."""

    forward: int = 0  # temporaries at the end of the forward pass
    backward: int = 0  # the plain loss's own backward (0 for the chunked loss)
    weight_grad: int = 0  # the chunked loss's saved output-weight gradient (``loss_weight_grad``)
    chunk_tokens: int = 0  # the chunk planned (0: a plain loss)


def loss_bytes(shape: LossShape | None, tokens: int, loss_chunk_tokens: int | None,
               outside_grads: int) -> LossBytes:
    """The loss of ``shape`` over ``tokens`` tokens, re-chunked to ``loss_chunk_tokens`` where
    given and the loss is chunked; ``outside_grads``: the gradients outside the blocks the
    row holds at the start of backward."""
    if loss_chunk_tokens is not None and isinstance(shape, ChunkedLossShape):
        shape = dataclasses.replace(shape, chunk_tokens=loss_chunk_tokens)
    if shape is None:
        return LossBytes()
    chunk = shape.chunk_tokens if isinstance(shape, ChunkedLossShape) else 0
    return LossBytes(shape.transient_bytes(tokens), shape.backward_bytes(tokens),
                     loss_weight_grad(shape, outside_grads), chunk)


def loss_weight_grad(shape: LossShape, outside_grads: int) -> int:
    """The chunked loss's output-weight gradient, computed in the forward pass and saved with
    the activations: once the loss's backward has run it is that weight's gradient, counted
    with the gradients outside the blocks, not twice."""
    if not isinstance(shape, ChunkedLossShape) or not shape.weight_trains:
        return 0
    return min(shape.vocab_size * shape.width * shape.weight_itemsize, outside_grads)
