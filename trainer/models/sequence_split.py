"""What a model asks of a sequence split over ranks: under sequence parallelism each rank of a
group holds a slice of every row's tokens, and a model needs three answers to stay the model
it is on whole rows: the positions of its tokens within their rows, the attention mask over
whole rows, and attention over the whole sequence for its share of the heads.

A model holds the answer as its ``sequence`` attribute (None: every rank holds whole rows),
set by ``trainer.parallel.sequence.apply_sequence_parallel``. The protocol lives here, beside
the models, so that a model needs nothing from the layer that splits the work.
"""

from __future__ import annotations

from typing import Protocol

import torch

# The keyword a Hugging Face model's forward carries to its attention function, which
# transformers passes through its layers: the ``SequenceSplit`` the function attends with.
HF_SEQUENCE_KWARG = "memtrain_sequence"


class SequenceSplit(Protocol):
    """A row's tokens split over ``size`` ranks, each holding ``seq_len / size`` of them."""

    size: int

    def positions(self, position_ids_BT: torch.Tensor | None, local_len: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(positions, mask)``: the positions of this rank's ``local_len`` tokens within their
        rows (``(1, T)`` or ``(B, T)``), and the attention mask over whole rows ``(B, 1, S, S)``
        (None: causal). ``position_ids_BT``: this rank's slice of packed documents' positions
        (None: one sequence per row)."""
        ...

    def attend(self, q_BTHD: torch.Tensor, k_BTKD: torch.Tensor, v_BTKD: torch.Tensor,
               mask_B1SS: torch.Tensor | None, dropout_p: float = 0.0,
               scale: float | None = None) -> torch.Tensor:
        """Attention of this rank's queries ``(B, T, H, D)`` over the whole row's keys and
        values (``K`` heads, grouped-query where fewer than ``H``), as ``(B, T, H, D)``."""
        ...
