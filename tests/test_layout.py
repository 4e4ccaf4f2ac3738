"""The packed row's rules, from their one home (`llm_packing/core/rows.py`), and the three producers of packed rows
(map-style `pack_dataset`, the stream, the collator given raw examples) applying them alike."""

import numpy as np
import pytest
from datasets import Dataset

from llm_packing import DataCollatorWithPacking, PackingValueError, pack_dataset
from llm_packing.core.rows import INT32_MAX, check_tokens, ignore_document_starts, ignore_masked, position_ids


def test_the_rules_by_hand():
    assert position_ids(np.array([3, 1, 2])).tolist() == [0, 1, 2, 0, 0, 1]
    assert ignore_document_starts(np.array([7, 8, 9, 5, 6, 4]), np.array([3, 1, 2])).tolist() == [
        -100, 8, 9, -100, -100, 4]
    assert ignore_masked(np.array([7, 8, 9]), np.array([True, False, True])).tolist() == [7, -100, 9]


@pytest.mark.parametrize(
    ("name", "values", "bad"),
    [("input_ids", [0, INT32_MAX], None), ("input_ids", [3, -100], -100),
     ("input_ids", [INT32_MAX + 1], INT32_MAX + 1), ("labels", [-100, 0, INT32_MAX], None), ("labels", [5, -5], -5),
     ("labels", [INT32_MAX + 1, 3], INT32_MAX + 1)],
)
def test_one_set_of_bounds(name, values, bad):
    array = np.array(values, np.int64)
    if bad is None:
        check_tokens(array, name, "here")
    else:
        with pytest.raises(PackingValueError, match=rf"^here holds {bad}: .*\[0, {INT32_MAX}\]"):
            check_tokens(array, name, "here")


DOCUMENTS = {
    "input_ids": [[11, 12, 13, 14], [21, 22], [31]],
    "labels": [[11, -100, 13, 14], [21, 22], [31]],
    "assistant_masks": [[1, 1, 1, 0], [0, 1], [1]],
}


def _collated(rows):
    batch = DataCollatorWithPacking(check_model_configured=False)(rows)
    return {key: batch[key].tolist() for key in ("input_ids", "labels", "position_ids")}


def test_every_producer_lays_a_row_out_alike():
    expected = {  # one row of 7 tokens; documents in the engine's order (longest first)
        "input_ids": [[11, 12, 13, 14, 21, 22, 31]],
        "labels": [[-100, -100, 13, -100, -100, 22, -100]],  # starts, the given -100, the mask's 0 on 14
        "position_ids": [[0, 1, 2, 3, 0, 1, 0]],
    }
    dataset = Dataset.from_dict(DOCUMENTS)
    mapped = pack_dataset(dataset, 7, return_position_ids=True)
    streamed = list(pack_dataset(dataset.to_iterable_dataset(), 7, return_position_ids=True))
    for column in ("labels", "position_ids"):  # as stored, before the collator lays the row out again
        assert mapped.to_dict()[column] == [row[column] for row in streamed] == expected[column], column
    assert _collated(mapped.to_list()) == _collated(streamed) == expected
    # Raw examples: the collator masks nothing itself, so give it the labels the mask column leaves.
    raw = [{"input_ids": ids, "labels": ignore_masked(np.array(labels), np.array(mask)).tolist()}
           for ids, labels, mask in zip(*DOCUMENTS.values(), strict=True)]
    assert DataCollatorWithPacking(max_length=7, check_model_configured=False)(raw)["labels"].tolist() == (
        expected["labels"])


@pytest.mark.parametrize("bad", [-3, INT32_MAX + 1])
def test_every_producer_refuses_a_bad_id_alike(bad):
    dataset = Dataset.from_dict({"input_ids": [[1, 2], [3, bad]]})
    message = rf"holds {bad}: token ids index the embedding matrix and must be in \[0, {INT32_MAX}\]"
    with pytest.raises(PackingValueError, match=rf"Column 'input_ids' in row 1 {message}"):
        pack_dataset(dataset, 4)
    with pytest.raises(PackingValueError, match=rf"'input_ids' of example 1 {message}"):
        list(pack_dataset(dataset.to_iterable_dataset(), 4))
    with pytest.raises(PackingValueError, match=rf"'input_ids' of feature 1 {message}"):
        DataCollatorWithPacking(check_model_configured=False)(dataset.to_list())
