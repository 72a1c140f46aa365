"""The pure parts of sequence parallelism (``trainer.parallel.sequence``): how many copies of each
key and value head the ranks need, swept over every head layout of up to 48 heads and 16 ranks,
and the refusals of a split that does not divide. The all-to-alls and the models on real gloo
groups are ``tests/distributed/test_sequence_parallel.py``."""

from __future__ import annotations

import pytest
import torch

from trainer.parallel.sequence import check_divisible, kv_repeats, sequence_slice

pytestmark = pytest.mark.unit


def _layouts() -> list[tuple[int, int, int]]:
    """(query heads, key/value heads, ranks) where the heads divide among the ranks."""
    return [(heads, kv_heads, size) for heads in range(1, 49) for kv_heads in range(1, heads + 1)
            if heads % kv_heads == 0 for size in range(1, 17) if heads % size == 0]


def test_each_rank_holds_the_keys_of_its_query_heads_with_the_fewest_copies() -> None:
    """With each key/value head repeated ``kv_repeats`` times in place (``repeat_interleave``)
    and both kinds of head cut into equal runs per rank, every query head's key head is on its
    rank, where grouped-query SDPA finds it, and it is the head it reads on one process."""
    for heads, kv_heads, size in _layouts():
        repeats = kv_repeats(heads, kv_heads, size)
        copies = kv_heads * repeats
        assert copies % size == 0 and heads % copies == 0, (heads, kv_heads, size)
        local_heads, local_copies = heads // size, copies // size
        for head in range(heads):
            rank, local = divmod(head, local_heads)
            copy = rank * local_copies + local // (local_heads // local_copies)  # SDPA's choice
            assert copy // repeats == head // (heads // kv_heads), (heads, kv_heads, size, head)
        assert not any(kv_heads * fewer % size == 0 for fewer in range(1, repeats))


def test_a_split_that_does_not_divide_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^model.n_head 6 is not divisible by the "
                                         r"sequence-parallel size 4$"):
        check_divisible("model.n_head", 6, 4)
    with pytest.raises(ValueError, match=r"^seq_len 10 is not divisible by the sequence-parallel "
                                         r"size 4$"):
        sequence_slice(torch.zeros(2, 10), 0, 4)
    with pytest.raises(ValueError, match="num_heads 6 is not a multiple of num_kv_heads 4"):
        kv_repeats(6, 4, 2)
    assert torch.equal(sequence_slice(torch.arange(12).view(1, 12), 2, 3),
                       torch.arange(8, 12).view(1, 4))
