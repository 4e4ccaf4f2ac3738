import pickle

import numpy as np
import pytest
import torch
from datasets import Dataset
from hypothesis import given, settings, strategies as st

from llm_packing.batches.collator import DataCollatorWithPacking
from llm_packing.data.pack import pack_dataset
from llm_packing.errors import ContaminationError, PackingTypeError, PackingValueError, SequenceTooLongError
from llm_packing.hook import configure as patch


# Two packed rows: documents [1, 2] + [3, 4, 5], and [6, 7] alone; row 1 carries its own labels.
ROWS = [
    {"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, -100, 4, 5], "seq_lengths": [2, 3]},
    {"input_ids": [6, 7], "seq_lengths": [2]},
]


@pytest.fixture
def configured(monkeypatch):
    monkeypatch.setattr(patch, "is_packing_configured", lambda: True)


@pytest.fixture
def unconfigured(monkeypatch):
    monkeypatch.setattr(patch, "is_packing_configured", lambda: False)


def assert_batch(batch, expected):
    assert sorted(batch) == sorted(expected)
    for key, value in expected.items():
        if isinstance(value, int):
            assert batch[key] == value and type(batch[key]) is int, key
        else:
            assert torch.equal(batch[key], torch.tensor(value, dtype=batch[key].dtype)), (key, batch[key])
            assert batch[key].dtype == (torch.int32 if key.startswith("cu_seq_lens") else torch.int64), key


class TestPackedRows:
    def test_default_emits_indexed_mask(self, configured):
        batch = DataCollatorWithPacking(pad_token_id=0)(ROWS)
        assert_batch(batch, {
            "input_ids": [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]],
            "labels": [[-100, 2, -100, 4, 5], [-100, 7, -100, -100, -100]],
            "position_ids": [[0, 1, 0, 1, 2], [0, 1, 0, 0, 0]],
            "attention_mask": [[1, 1, 2, 2, 2], [1, 1, 0, 0, 0]],
        })

    def test_pad_to_multiple_of(self, configured):
        batch = DataCollatorWithPacking(pad_token_id=9, pad_to_multiple_of=4)(ROWS)
        assert_batch(batch, {
            "input_ids": [[1, 2, 3, 4, 5, 9, 9, 9], [6, 7, 9, 9, 9, 9, 9, 9]],
            "labels": [[-100, 2, -100, 4, 5, -100, -100, -100], [-100, 7, -100, -100, -100, -100, -100, -100]],
            "position_ids": [[0, 1, 0, 1, 2, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]],
            "attention_mask": [[1, 1, 2, 2, 2, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]],
        })

    def test_padding_free_flattens_without_mask(self, unconfigured):
        batch = DataCollatorWithPacking(padding_free=True, pad_to_multiple_of=4)(ROWS)
        assert_batch(batch, {
            "input_ids": [[1, 2, 3, 4, 5, 6, 7, 0]],
            "labels": [[-100, 2, -100, 4, 5, -100, 7, -100]],
            "position_ids": [[0, 1, 0, 1, 2, 0, 1, 0]],
        })

    def test_flash_attn_kwargs_count_each_rows_padding_once(self, unconfigured):
        batch = DataCollatorWithPacking(return_flash_attn_kwargs=True, pad_to_multiple_of=4)(ROWS)
        assert_batch(batch, {
            "input_ids": [[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 0, 0, 0, 0, 0, 0]],
            "labels": [[-100, 2, -100, 4, 5, -100, -100, -100], [-100, 7, -100, -100, -100, -100, -100, -100]],
            "position_ids": [[0, 1, 0, 1, 2, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]],
            "cu_seq_lens_q": [0, 2, 5, 8, 10, 16],
            "cu_seq_lens_k": [0, 2, 5, 8, 10, 16],
            "max_length_q": 6,
            "max_length_k": 6,
        })

    def test_flash_attn_kwargs_padding_free(self, unconfigured):
        batch = DataCollatorWithPacking(padding_free=True, return_flash_attn_kwargs=True)(ROWS)
        assert_batch(batch, {
            "input_ids": [[1, 2, 3, 4, 5, 6, 7]],
            "labels": [[-100, 2, -100, 4, 5, -100, 7]],
            "position_ids": [[0, 1, 0, 1, 2, 0, 1]],
            "cu_seq_lens_q": [0, 2, 5, 7],
            "cu_seq_lens_k": [0, 2, 5, 7],
            "max_length_q": 3,
            "max_length_k": 3,
        })

    def test_accepts_tensors_and_numpy(self, configured):
        rows = [{key: torch.tensor(value) for key, value in ROWS[0].items()},
                {key: np.array(value) for key, value in ROWS[1].items()}]
        expected = DataCollatorWithPacking()(ROWS)
        batch = DataCollatorWithPacking()(rows)
        assert all(torch.equal(batch[key], expected[key]) for key in expected)

    def test_many_documents_per_row(self, configured):
        batch = DataCollatorWithPacking()([{"input_ids": list(range(300)), "seq_lengths": [1] * 300}])
        assert batch["attention_mask"].tolist() == [list(range(1, 301))]
        assert batch["position_ids"].tolist() == [[0] * 300]
        assert batch["labels"].tolist() == [[-100] * 300]


class TestRawExamples:
    def test_packs_within_batch_to_max_length(self, configured):
        examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6], "labels": [-100]}]
        batch = DataCollatorWithPacking(max_length=4)(examples)
        # Best-fit decreasing: [1, 2, 3] then [4, 5] each open a row; [6] fills the first.
        assert_batch(batch, {
            "input_ids": [[1, 2, 3, 6], [4, 5, 0, 0]],
            "labels": [[-100, 2, 3, -100], [-100, 5, -100, -100]],
            "position_ids": [[0, 1, 2, 0], [0, 1, 0, 0]],
            "attention_mask": [[1, 1, 1, 2], [1, 1, 0, 0]],
        })

    def test_without_max_length_one_example_per_row(self, unconfigured):
        batch = DataCollatorWithPacking()([{"input_ids": [1, 2, 3]}, {"input_ids": []}, {"input_ids": [4]}])
        assert_batch(batch, {
            "input_ids": [[1, 2, 3], [4, 0, 0]],
            "labels": [[-100, 2, 3], [-100, -100, -100]],
            "position_ids": [[0, 1, 2], [0, 0, 0]],
            "attention_mask": [[1, 1, 1], [1, 0, 0]],
        })


    @settings(max_examples=40, deadline=None)
    @given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=20), max_length=st.integers(9, 16))
    def test_every_document_once_and_isolated(self, lengths, max_length):
        if not any(lengths):
            return
        examples = [{"input_ids": list(range(100 * i, 100 * i + n))} for i, n in enumerate(lengths)]
        batch = DataCollatorWithPacking(max_length=max_length, check_model_configured=False)(examples)
        assert batch["input_ids"].shape[1] <= max_length
        found = []
        for ids, labels, positions, mask in zip(*(batch[k].tolist() for k in ("input_ids", "labels", "position_ids",
                                                                                "attention_mask")), strict=True):
            for doc in range(1, max(mask) + 1):
                tokens = [t for t, m in enumerate(mask) if m == doc]
                assert tokens == list(range(tokens[0], tokens[-1] + 1))  # contiguous, in order
                assert [positions[t] for t in tokens] == list(range(len(tokens)))
                assert [labels[t] for t in tokens] == [-100] + [ids[t] for t in tokens[1:]]
                found.append([ids[t] for t in tokens])
        assert sorted(found) == sorted(example["input_ids"] for example in examples if example["input_ids"])


class TestRawExampleColumns:
    """TRL's mask columns and a tokenizer's `attention_mask` on raw examples, which the collator packs itself."""

    EXAMPLES = [
        {"input_ids": [5, 6, 7, 8, 9], "completion_mask": [0, 0, 0, 1, 1]},
        {"input_ids": [10, 11, 12, 13], "assistant_masks": [False, False, True, True]},
        {"input_ids": [14, 15, 16], "labels": [14, -100, 16], "completion_mask": [1, 1, 0]},
        {"input_ids": [17, 18], "completion_mask": [1, 1], "assistant_masks": [1, 0]},
    ]
    COLUMNS = {  # the same examples as dataset columns (a missing mask is all ones, missing labels the ids)
        "input_ids": [[5, 6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16], [17, 18]],
        "labels": [[5, 6, 7, 8, 9], [10, 11, 12, 13], [14, -100, 16], [17, 18]],
        "completion_mask": [[0, 0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 0], [1, 1]],
        "assistant_masks": [[1, 1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1], [1, 0]],
    }

    def test_mask_columns_set_labels_as_pack_dataset_does(self):
        collator = DataCollatorWithPacking(max_length=16, check_model_configured=False)
        packed = pack_dataset(Dataset.from_dict(self.COLUMNS), 16)
        assert packed["seq_lengths"] == [[5, 4, 3, 2]]  # one row, documents in input order, as the collator's
        expected = [[-100, -100, -100, 8, 9, -100, -100, 12, 13, -100, -100, -100, -100, -100]]
        assert collator([packed[0]])["labels"].tolist() == expected
        assert collator(self.EXAMPLES)["labels"].tolist() == expected

    def test_mask_columns_on_packed_rows(self):
        row = {"input_ids": [1, 2, 3, 4, 5], "completion_mask": [1, 1, 1, 0, 1], "seq_lengths": [2, 3]}
        labels = DataCollatorWithPacking(check_model_configured=False)([row])["labels"]
        assert labels.tolist() == [[-100, 2, -100, -100, 5]]

    @pytest.mark.parametrize("name", ["completion_mask", "assistant_masks"])
    def test_mask_of_another_length(self, name):
        with pytest.raises(PackingValueError, match=rf"'{name}' of feature 1 has 2 values, but 'input_ids' has 3"):
            DataCollatorWithPacking()([{"input_ids": [1]}, {"input_ids": [1, 2, 3], name: [1, 1]}])

    @pytest.mark.parametrize("mask", [[1, 1, 0], [0, 1, 1], torch.tensor([0, 1, 1])])  # right, left padding
    def test_padded_tokenization_is_refused(self, mask):
        examples = [{"input_ids": [5, 6], "attention_mask": [1, 1]}, {"input_ids": [0, 7, 8], "attention_mask": mask}]
        with pytest.raises(PackingValueError, match=r"'attention_mask' of feature 1 holds 0: the examples were "
                                                    r"tokenized with padding.*`padding=False`"):
            DataCollatorWithPacking(max_length=8, check_model_configured=False)(examples)

    def test_unpadded_attention_mask_is_ignored(self, configured):
        examples = [{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]}, {"input_ids": [4, 5],
                                                                            "attention_mask": [1, 1]}]
        expected = DataCollatorWithPacking(max_length=8)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
        batch = DataCollatorWithPacking(max_length=8)(examples)
        assert all(torch.equal(batch[key], expected[key]) for key in expected)


class TestMismatches:
    def test_unconfigured_model_is_refused(self, unconfigured):
        with pytest.raises(ContaminationError, match=r"configure_packing\(model\)"):
            DataCollatorWithPacking()(ROWS)

    def test_unconfigured_check_can_be_turned_off(self, unconfigured):
        batch = DataCollatorWithPacking(check_model_configured=False)(ROWS)
        assert batch["attention_mask"].tolist() == [[1, 1, 2, 2, 2], [1, 1, 0, 0, 0]]

    def test_one_document_per_row_needs_no_hook(self, unconfigured):
        batch = DataCollatorWithPacking()([ROWS[1]])
        assert batch["attention_mask"].tolist() == [[1, 1]]

    def test_labels_length_mismatch(self):
        with pytest.raises(PackingValueError, match=r"'labels' of feature 1 has 2 values, but 'input_ids' has 3"):
            DataCollatorWithPacking()([{"input_ids": [1]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}])

    def test_mixed_packed_and_raw(self):
        with pytest.raises(PackingValueError, match=r"Features \[1\] have no 'seq_lengths'"):
            DataCollatorWithPacking()([ROWS[0], {"input_ids": [1, 2]}])

    def test_row_longer_than_max_length(self):
        with pytest.raises(SequenceTooLongError, match=r"Feature 0 has a row of 5 tokens.*`max_length`=4"):
            DataCollatorWithPacking(max_length=4)(ROWS)

    def test_document_longer_than_max_length(self):
        with pytest.raises(SequenceTooLongError, match=r"Feature 1 has a document of 3 tokens.*`max_length`=2"):
            DataCollatorWithPacking(max_length=2)([{"input_ids": [1]}, {"input_ids": [1, 2, 3]}])

    def test_seq_lengths_must_sum_to_row(self):
        with pytest.raises(PackingValueError, match=r"`seq_lengths`=\[2, 2\].*sum to its 5 'input_ids'"):
            DataCollatorWithPacking()([{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 2]}])

    def test_float_ids(self):
        with pytest.raises(PackingTypeError, match=r"'input_ids' of feature 0 must be a flat list of integers"):
            DataCollatorWithPacking()([{"input_ids": [1.5, 2.0]}])

    @pytest.mark.parametrize("nested", [[[1, 2], [3]], [[1, 2], [3, 4]]], ids=["ragged", "even"])
    def test_nested_ids_say_to_flatten(self, nested):
        """Lists of lists (one per turn, say): numpy's own `ValueError` for ragged ones before."""
        with pytest.raises(PackingTypeError, match=r"'input_ids' of feature 0 .*flatten the inner lists"):
            DataCollatorWithPacking()([{"input_ids": nested}])

    @pytest.mark.parametrize("option", [{"max_length": 0}, {"pad_to_multiple_of": -8}, {"return_tensors": "np"}])
    def test_bad_options(self, option):
        with pytest.raises(PackingValueError, match=next(iter(option))):
            DataCollatorWithPacking(**option)

    @pytest.mark.parametrize("name", ["padding_free", "return_flash_attn_kwargs", "check_model_configured",
                                      "assistant_only_loss"])
    @pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
    def test_boolean_options_take_bools_only(self, name, value):
        with pytest.raises(PackingTypeError, match=rf"`{name}` must be a bool \(True or False\), got {value!r} of "
                                                   rf"type {type(value).__name__}. Pass `{name}=True` or"):
            DataCollatorWithPacking(**{name: value})


class TestWorkerProcesses:
    """A DataLoader worker started by `spawn` (macOS, Windows) is a fresh process whose hook registry is empty: the
    collator travels pickled with whether packing was configured in the main process when the workers started."""

    def test_configured_when_sent_counts_in_a_worker(self, monkeypatch):
        monkeypatch.setattr(patch, "is_packing_configured", lambda: True)
        collator = pickle.loads(pickle.dumps(DataCollatorWithPacking()))
        monkeypatch.setattr(patch, "is_packing_configured", lambda: False)  # as in a spawned worker
        monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
        assert collator(ROWS)["attention_mask"].tolist() == [[1, 1, 2, 2, 2], [1, 1, 0, 0, 0]]

    def test_the_main_process_checks_at_each_batch(self, monkeypatch):
        monkeypatch.setattr(patch, "is_packing_configured", lambda: True)
        collator = DataCollatorWithPacking()
        monkeypatch.setattr(patch, "is_packing_configured", lambda: False)  # unconfigured since
        with pytest.raises(ContaminationError, match=r"configure_packing\(model\)"):
            collator(ROWS)

    @pytest.mark.parametrize("configured_when_sent", [True, False])
    def test_a_worker_goes_by_the_main_process_when_the_workers_start(self, monkeypatch, configured_when_sent):
        """Not when the collator was built: `PackedSFTTrainer` builds its collator, then configures the model."""
        monkeypatch.setattr(patch, "is_packing_configured", lambda: not configured_when_sent)
        collator = DataCollatorWithPacking()
        monkeypatch.setattr(patch, "is_packing_configured", lambda: configured_when_sent)
        sent = pickle.loads(pickle.dumps(collator))
        monkeypatch.setattr(patch, "is_packing_configured", lambda: False)  # the worker's fresh registry
        monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
        if configured_when_sent:
            assert sent(ROWS)["attention_mask"].tolist() == [[1, 1, 2, 2, 2], [1, 1, 0, 0, 0]]
            return
        with pytest.raises(ContaminationError, match=r"In a DataLoader worker process .* when the workers started"):
            sent(ROWS)

    def test_a_copy_made_while_configured_does_not_speak_for_a_forked_worker(self):
        """`copy.deepcopy` pickles: the copy carries `_configured_when_sent` from the main process. A worker forked
        after `unconfigure_packing()` inherits that copy, and must go by its own (inherited) registry instead."""
        import copy

        from tiny_models import tiny_model

        from llm_packing import configure_packing, unconfigure_packing

        configure_packing(tiny_model("llama"))
        copied = copy.deepcopy(DataCollatorWithPacking())
        unconfigure_packing()
        loader = torch.utils.data.DataLoader(ROWS, batch_size=2, collate_fn=copied, num_workers=1,
                                             multiprocessing_context="fork")
        with pytest.raises(ContaminationError, match=r"DataLoader worker process"):
            next(iter(loader))

    @pytest.mark.slow
    @pytest.mark.parametrize("order", ["configured, built", "built, configured", "configured, built, unconfigured"])
    def test_spawned_worker(self, order):
        from tiny_models import tiny_model

        from llm_packing import configure_packing, unconfigure_packing

        model = tiny_model("llama")
        try:
            if order.startswith("configured"):
                configure_packing(model)
            collator = DataCollatorWithPacking()
            if order == "built, configured":  # PackedSFTTrainer's order
                configure_packing(model)
            if order.endswith("unconfigured"):
                unconfigure_packing()
            loader = torch.utils.data.DataLoader(ROWS, batch_size=2, collate_fn=collator, num_workers=1,
                                                 multiprocessing_context="spawn")
            if not order.endswith("unconfigured"):
                assert next(iter(loader))["attention_mask"].tolist() == [[1, 1, 2, 2, 2], [1, 1, 0, 0, 0]]
            else:
                with pytest.raises(ContaminationError, match=r"DataLoader worker process"):
                    next(iter(loader))
        finally:
            unconfigure_packing()
