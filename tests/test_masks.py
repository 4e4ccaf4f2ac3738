import pytest
import torch
import transformers.modeling_flash_attention_utils as flash_utils

from llm_packing import (
    PackingTypeError,
    PackingValueError,
    get_seqlens_in_batch,
    get_unpad_data,
    is_indexed_packed_mask,
)
from llm_packing.hook.masks import document_position_ids


INDEXED = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])


class TestGetUnpadData:
    def test_indexed_mask_gives_one_segment_per_document(self):
        indices, cu_seqlens, max_seqlen = get_unpad_data(INDEXED)
        assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
        assert cu_seqlens.tolist() == [0, 2, 5, 6, 8, 11]
        assert cu_seqlens.dtype == torch.int32
        assert max_seqlen == 3
        assert get_seqlens_in_batch(INDEXED).tolist() == [2, 3, 1, 2, 3]

    @pytest.mark.parametrize(
        "mask",
        [
            [[1, 1, 1, 0], [1, 0, 1, 1]],
            [[0, 0, 0], [1, 1, 1]],
            [[1, 1], [1, 1]],
            [[True, False, True]],
        ],
    )
    def test_plain_mask_matches_transformers(self, mask):
        mask = torch.tensor(mask)
        ours, theirs = get_unpad_data(mask), flash_utils._get_unpad_data(mask)
        assert torch.equal(ours[0], theirs[0])
        assert torch.equal(ours[1], theirs[1])
        assert ours[2] == theirs[2]

    def test_padding_between_documents_and_leading_padding(self):
        _, cu_seqlens, max_seqlen = get_unpad_data(torch.tensor([[0, 1, 1, 0, 2, 0]]))
        assert cu_seqlens.tolist() == [0, 2, 3]
        assert max_seqlen == 2

    def test_result_is_reused_for_the_same_mask_and_recomputed_after_an_in_place_change(self):
        mask = INDEXED.clone()
        first = get_unpad_data(mask)
        assert get_unpad_data(mask) is first
        mask[0, 5] = 2
        assert get_unpad_data(mask)[1].tolist() == [0, 2, 6, 7, 9, 12]

    @pytest.mark.parametrize(
        "mask, match",
        [
            ([[1, 2, 1]], "row 0 has document id 1 at position 2"),
            ([[1, 1, 0, 1, 2]], "never inside a document"),
            ([[2, 2, 3]], "numbered 1, 2, 3"),
            ([[1, 3, 3]], "document id 3 at position 1"),
            ([[1, 2], [-1, 2]], "negative document ids"),
        ],
    )
    def test_malformed_document_ids_raise(self, mask, match):
        with pytest.raises(PackingValueError, match=match):
            get_unpad_data(torch.tensor(mask))

    def test_four_dimensional_mask_raises(self):
        with pytest.raises(PackingTypeError, match="must be 2-D"):
            get_unpad_data(torch.ones(1, 1, 4, 4))


class TestIsIndexedPackedMask:
    @pytest.mark.parametrize(
        "mask, expected",
        [
            (torch.tensor([[1, 1, 2, 0]]), True),
            (torch.tensor([[1, 1, 1, 0]]), False),
            (torch.tensor([[1, 1, 2, 0]], dtype=torch.int32), True),
            (torch.tensor([[True, False]]), False),
            (torch.tensor([[1.0, 2.0]]), False),
            (torch.ones(1, 1, 2, 2, dtype=torch.long) * 2, False),
            (None, False),
        ],
    )
    def test_cases(self, mask, expected):
        assert is_indexed_packed_mask(mask) is expected


def test_document_positions_restart_per_document_and_per_pad_token():
    mask = torch.tensor([[1, 1, 2, 2, 2, 0, 0], [1, 2, 2, 2, 3, 3, 3]])
    assert document_position_ids(mask).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 0, 1, 2]]
