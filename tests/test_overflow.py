import numpy as np
import pytest

from llm_packing.core.overflow import cut_pieces
from llm_packing.errors import PackingValueError


@pytest.mark.parametrize("overflow", ["wrap", "Split", None])
def test_cut_pieces_refuses_an_unknown_policy(overflow):
    # Without its own check, an unknown policy fell through to "truncate" and cut tokens without counting them.
    with pytest.raises(PackingValueError, match=rf"`overflow` must be one of .*got {overflow!r}"):
        cut_pieces(np.array([5, 2]), 4, overflow)


def test_cut_pieces_by_hand():
    pieces = cut_pieces(np.array([5, 0, 2]), 4, "truncate")
    assert (pieces.source.tolist(), pieces.start.tolist(), pieces.length.tolist()) == ([0, 2], [0, 0], [4, 2])
    assert (pieces.truncated_sequences, pieces.truncated_tokens, pieces.empty_sequences) == (1, 1, 1)
