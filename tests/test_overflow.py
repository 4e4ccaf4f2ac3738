"""`cut_pieces`, the overflow policies on the lengths alone: each policy's contract, checked on random lengths
against a one-sequence-at-a-time reading of it (end to end through pack_dataset: tests/test_properties.py)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llm_packing.core.overflow import cut_pieces
from llm_packing.errors import PackingValueError, SequenceTooLongError


@pytest.mark.parametrize("overflow", ["wrap", "Split", None])
def test_cut_pieces_refuses_an_unknown_policy(overflow):
    # Without its own check, an unknown policy fell through to "truncate" and cut tokens without counting them.
    with pytest.raises(PackingValueError, match=rf"`overflow` must be one of .*got {overflow!r}"):
        cut_pieces(np.array([5, 2]), 4, overflow)


def test_cut_pieces_by_hand():
    pieces = cut_pieces(np.array([5, 0, 2]), 4, "truncate")
    assert (pieces.source.tolist(), pieces.start.tolist(), pieces.length.tolist()) == ([0, 2], [0, 0], [4, 2])
    assert (pieces.truncated_sequences, pieces.truncated_tokens, pieces.empty_sequences) == (1, 1, 1)


def expected_pieces(lengths, max_length, overflow):
    """The contract of each policy, one sequence at a time: the (source, start, length) pieces and the counts."""
    pieces, counts = [], dict.fromkeys(("empty", "dropped", "dropped_tokens", "truncated", "truncated_tokens",
                                        "split"), 0)
    for source, n in enumerate(lengths):
        if n == 0:
            counts["empty"] += 1
        elif n <= max_length:
            pieces.append((source, 0, n))
        elif overflow == "drop":
            counts["dropped"] += 1
            counts["dropped_tokens"] += n
        elif overflow == "truncate":
            pieces.append((source, 0, max_length))
            counts["truncated"] += 1
            counts["truncated_tokens"] += n - max_length
        else:  # split: every token kept, in max_length chunks
            pieces += [(source, start, min(max_length, n - start)) for start in range(0, n, max_length)]
            counts["split"] += 1
    return pieces, counts


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), max_size=30), max_length=st.integers(1, 12),
       overflow=st.sampled_from(["error", "truncate", "split", "drop"]))
def test_every_policy_keeps_exactly_what_it_promises(lengths, max_length, overflow):
    lengths = np.array(lengths, dtype=np.int64)
    if overflow == "error" and (lengths > max_length).any():
        with pytest.raises(SequenceTooLongError, match=f"longer than `max_length`={max_length}"):
            cut_pieces(lengths, max_length, overflow)
        return
    pieces = cut_pieces(lengths, max_length, overflow)
    expected, counts = expected_pieces(lengths.tolist(), max_length, overflow)
    assert list(zip(pieces.source.tolist(), pieces.start.tolist(), pieces.length.tolist(), strict=True)) == expected
    assert (pieces.empty_sequences, pieces.dropped_sequences, pieces.dropped_tokens, pieces.truncated_sequences,
            pieces.truncated_tokens, pieces.split_sequences) == tuple(counts.values())
