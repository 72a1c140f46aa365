"""Batches: what one micro-batch of a language model holds (``TokenBatch``: its token rows and,
for fine-tuning data, which tokens are trained and where documents begin) and the loader that
reads them (``TokenLoader``). How the global batch divides over ranks and micro-batches is
``trainer.global_batch``.

A dataset row is ``seq_len + 1`` tokens: the inputs are its first ``seq_len``, the targets its
last ``seq_len``. Two optional columns of the same shape change what is trained
(``datapipe.pack`` writes them, docs/data.md "Fine-tuning data"):

- ``loss_mask`` (0 or 1): ``loss_mask[i] = 1`` where token ``i`` is a target to train on (an
  assistant's answer); a prompt's tokens and padding have 0.
- ``document_ids``: the document each token belongs to within its row (rows are packed with
  several short documents). A token is never trained on the one before it across a boundary
  (its target is dropped), and a model that takes ``position_ids`` sees positions that restart at
  0 with each document: memtrain's GPT then masks attention to its own document, and Hugging
  Face models detect the packed sequences from the positions (their SDPA, eager and flash
  attention all do).

A target that is not trained is ``IGNORE_INDEX`` (-100, as PyTorch's and Hugging Face's losses
take it), so every loss, plain or chunked, skips it the same way. ``TokenLoader`` reads the
columns of a dataset in lockstep: one ``BatchLoader`` per column, whose reading order is a pure
function of (seed, epoch, rank, world size, batch size), so row ``k`` of each is the same row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from datapipe.loader import BatchLoader
from datapipe.pack import DOCUMENT_IDS, LOSS_MASK

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenBatch:
    """Rows of ``seq_len + 1`` tokens ``(B, T + 1)``, with their optional loss mask and document
    ids of the same shape (the module docstring)."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    @property
    def masked(self) -> bool:
        """Whether some targets may be left out of the loss (a mask, or document boundaries)."""
        return self.loss_mask is not None or self.document_ids is not None

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[:, :-1].long()

    @property
    def targets(self) -> torch.Tensor:
        """The next-token targets ``(B, T)``, ``IGNORE_INDEX`` where not trained."""
        targets = self.tokens[:, 1:].long()
        trained = self.trained()
        return targets if trained is None else targets.masked_fill(~trained, IGNORE_INDEX)

    def trained(self) -> torch.Tensor | None:
        """``(B, T)`` bool: whether each target is trained (None: every one is)."""
        trained = None
        if self.loss_mask is not None:
            trained = self.loss_mask[:, 1:].bool()
        if self.document_ids is not None:
            same = self.document_ids[:, 1:] == self.document_ids[:, :-1]
            trained = same if trained is None else trained & same
        return trained

    def trained_tokens(self) -> torch.Tensor | int:
        """How many targets are trained: an int where all are, else a device tensor (counting
        needs no host sync)."""
        trained = self.trained()
        if trained is None:
            return self.tokens[:, 1:].numel()
        return trained.sum()

    @property
    def position_ids(self) -> torch.Tensor | None:
        """``(B, T)`` positions of the inputs within their documents (0 at each document's
        first token); None without document ids."""
        if self.document_ids is None:
            return None
        ids = self.document_ids[:, :-1]
        T = ids.shape[1]
        index = torch.arange(T, device=ids.device).expand_as(ids)
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        return index - first

    def chunk(self, pieces: int) -> list[TokenBatch]:
        """The rows in ``pieces`` smaller batches (views, no copies), as ``Tensor.chunk``."""
        parts = [t.chunk(pieces) if t is not None else None
                 for t in (self.tokens, self.loss_mask, self.document_ids)]
        tokens, mask, docs = parts
        assert tokens is not None
        return [TokenBatch(t, mask[i] if mask is not None else None,
                           docs[i] if docs is not None else None)
                for i, t in enumerate(tokens)]


class RowSlice(NamedTuple):
    """A rank's slice ``(B, seq_len / N)`` of a micro-batch's rows, where each row's tokens are
    split over ``N`` ranks (sequence parallelism, ``trainer.parallel.sequence.row_slice``): what
    a ``TokenBatch`` gives a model and its loss, for this rank's tokens alone."""

    inputs: torch.Tensor
    targets: torch.Tensor  # IGNORE_INDEX where not trained, decided over the whole rows
    position_ids: torch.Tensor | None  # packed documents' positions in their rows (None: unpacked)
    masked: bool = False  # as ``TokenBatch.masked``

    @property
    def device(self) -> torch.device:
        return self.inputs.device

    def trained_tokens(self) -> torch.Tensor | int:
        """How many of the slice's targets are trained, as ``TokenBatch.trained_tokens``."""
        if not self.masked:
            return self.targets.numel()
        return (self.targets != IGNORE_INDEX).sum()


Rows = TokenBatch | RowSlice  # what a loss is taken over: whole rows, or a rank's slice of them


def as_batch(batch: TokenBatch | torch.Tensor) -> TokenBatch:
    """A plain ``(B, T + 1)`` tensor of tokens (the benches', the planner's probes) as a batch in
    which every target is trained."""
    return batch if isinstance(batch, TokenBatch) else TokenBatch(batch)


def dataset_columns(path: str | Path, column: str) -> list[str]:
    """The columns a run reads from the dataset at ``path``: ``column`` (the tokens), then the
    loss mask and document ids where the dataset has them."""
    from datapipe.manifest import read_manifest

    names = {c.name for c in read_manifest(path).columns}
    return [column, *(name for name in (LOSS_MASK, DOCUMENT_IDS) if name in names)]


class TokenLoader:
    """Batches (``TokenBatch``) of a dataset's token column and, where it has them, its loss
    mask and document ids: one ``BatchLoader`` per column, in lockstep (the module docstring).
    Everything else a loader answers (position, state, skipped shards) is the token loader's."""

    def __init__(self, path: str | Path, column: str, **kwargs: Any):
        self.columns = dataset_columns(path, column)
        self.loaders: list[BatchLoader] = []
        try:
            for name in self.columns:
                self.loaders.append(BatchLoader(path, name, **kwargs))
        except BaseException:
            self.close()
            raise
        self.tokens = self.loaders[0]

    def __getattr__(self, name: str) -> Any:
        if name in ("loaders", "tokens"):  # not set yet: __init__ failed
            raise AttributeError(name)
        return getattr(self.tokens, name)

    @property
    def masked(self) -> bool:
        return len(self.columns) > 1

    def __len__(self) -> int:
        return len(self.tokens)

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> TokenBatch:
        tensors = dict(zip(self.columns, (next(loader) for loader in self.loaders), strict=True))
        return TokenBatch(tensors[self.columns[0]], tensors.get(LOSS_MASK),
                          tensors.get(DOCUMENT_IDS))

    @property
    def pinned_bytes(self) -> int:
        return sum(loader.pinned_bytes for loader in self.loaders)

    def state_dict(self) -> dict[str, Any]:
        return self.tokens.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for loader in self.loaders:
            loader.load_state_dict(state)

    def rewind(self) -> None:
        for loader in self.loaders:
            loader.rewind()

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
