"""Packing documents into rows of ``seq_len + 1`` tokens, with their boundaries and loss masks.

Fine-tuning data is many short documents (a conversation, an instruction and its answer), each
with a mask of the tokens to train on. Padding each to ``seq_len`` wastes most of a batch;
packing puts several into one row. Each row then has three columns of the same length:

- ``tokens``: the documents' ids, one after another, then padding (the end-of-text id);
- ``loss_mask`` (uint8): 1 where a token is a target to train on (an assistant's answer), 0 for
  prompts and padding;
- ``document_ids`` (uint16): the document each token belongs to within the row (0, 1, ...;
  padding has an id of its own), from which the trainer drops every target across a boundary
  and restarts positions, so that attention keeps to each document (``trainer.batches``).

Documents are placed in input order, greedily: one that does not fit in the row's space left
starts the next row, and the rest of the row is padding. One longer than a row is cut to the
row's length, or dropped (``too_long``); one with no token to train on is dropped. ``Packing``
counts all of it, and the padding's share of the tokens, for the command's report and the
manifest. The same documents give the same rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

TooLong = Literal["cut", "drop"]
Block = dict[str, np.ndarray]
TOKENS, LOSS_MASK, DOCUMENT_IDS = "tokens", "loss_mask", "document_ids"


@dataclass
class Packing:
    """What packing did: documents in, cut, dropped, rows out, and how many tokens padded."""

    documents: int = 0
    packed: int = 0
    cut: int = 0
    dropped_too_long: int = 0
    dropped_untrained: int = 0
    rows: int = 0
    padding: int = 0
    trained: int = 0
    row_len: int = 0
    largest_id: int = 0

    @property
    def padding_share(self) -> float:
        return self.padding / (self.rows * self.row_len) if self.rows else 0.0

    def metadata(self) -> dict[str, str]:
        """The manifest's record of it."""
        return {"packed_documents": str(self.packed), "documents_cut": str(self.cut),
                "documents_dropped": str(self.dropped_too_long + self.dropped_untrained),
                "padding_share": f"{self.padding_share:.4f}",
                "trained_tokens": str(self.trained)}

    def report(self) -> str:
        """One line for the command's output."""
        dropped = self.dropped_too_long + self.dropped_untrained
        return (f"packed {self.packed:,} of {self.documents:,} documents into {self.rows:,} "
                f"rows ({self.packed / max(1, self.rows):.1f} a row); padding "
                f"{100 * self.padding_share:.1f}% of tokens; trained tokens {self.trained:,}; "
                f"{self.cut:,} cut to {self.row_len} tokens, {dropped:,} dropped "
                f"({self.dropped_too_long:,} too long, {self.dropped_untrained:,} with nothing "
                "to train)")


def pack(documents: Iterable[tuple[np.ndarray, np.ndarray]], row_len: int, pad_id: int,
         dtype: str, too_long: TooLong = "cut", stats: Packing | None = None,
         block_rows: int = 4096) -> Iterator[Block]:
    """Blocks of packed rows (``tokens``, ``loss_mask``, ``document_ids``) from ``documents``,
    each ``(ids, mask)``: a document's token ids and its 0/1 loss mask, of one length."""
    if too_long not in ("cut", "drop"):
        raise ValueError(f"--too-long {too_long!r} is not one of cut, drop")
    stats = stats if stats is not None else Packing()
    stats.row_len = row_len
    doc_dtype = np.uint16 if row_len <= 1 << 16 else np.uint32
    rows: dict[str, list[np.ndarray]] = {TOKENS: [], LOSS_MASK: [], DOCUMENT_IDS: []}
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    used = 0

    def close_row() -> None:
        nonlocal used
        tokens = np.full(row_len, pad_id, dtype=dtype)
        mask = np.zeros(row_len, dtype=np.uint8)
        docs = np.full(row_len, len(pieces), dtype=doc_dtype)  # padding: an id of its own
        at = 0
        for number, (ids, trained) in enumerate(pieces):
            tokens[at:at + len(ids)], mask[at:at + len(ids)] = ids, trained
            docs[at:at + len(ids)] = number
            at += len(ids)
        stats.rows += 1
        stats.padding += row_len - at
        for name, array in ((TOKENS, tokens), (LOSS_MASK, mask), (DOCUMENT_IDS, docs)):
            rows[name].append(array)
        pieces.clear()
        used = 0

    for ids, mask in documents:
        stats.documents += 1
        if len(ids) > row_len:
            if too_long == "drop":
                stats.dropped_too_long += 1
                continue
            ids, mask = ids[:row_len], mask[:row_len]
            stats.cut += 1
        # The first token is never a target (nothing before it in its document).
        trained = int(mask[1:].sum())
        if trained == 0:
            stats.dropped_untrained += 1
            continue
        if used + len(ids) > row_len:
            close_row()
            if len(rows[TOKENS]) >= block_rows:
                yield _block(rows)
        pieces.append((ids, mask))
        used += len(ids)
        stats.largest_id = max(stats.largest_id, int(ids.max()))
        stats.packed += 1
        stats.trained += trained
    if pieces:
        close_row()
    if rows[TOKENS]:
        yield _block(rows)


def _block(rows: dict[str, list[np.ndarray]]) -> Block:
    block = {name: np.stack(arrays) for name, arrays in rows.items()}
    for arrays in rows.values():
        arrays.clear()
    return block
