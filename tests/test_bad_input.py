"""Bad input fails loudly and leaves nothing behind.

Every case raises a specific `llm_packing.errors` type whose message names the parameter and shows the value; after
it, the next valid call behaves exactly as before and the hook is neither half-applied nor half-removed. Cases that the
module-level test files already pin (test_binpack, test_dataset, test_collator, test_masks, test_patch) are not
repeated here; this file adds the missing ones and runs them over every container and entry point.

Token ids: `pack_dataset` and the collator refuse negative `input_ids` (they index the embedding matrix; on GPU a
negative id is a device-side assert, not an exception) and `labels` other than -100 below 0 (the loss's `ignore_index`
is -100 only). Ids at or above the vocabulary size cannot be checked without the model's vocabulary; the embedding
layer refuses them, and `pack_dataset` and the collator refuse ids that do not fit int32 (`pack_dataset`'s columns).
"""

import json
import logging
import re
import subprocess
import sys
import warnings

import datasets
import numpy as np
import pytest
import torch
import transformers.masking_utils as masking_utils
import transformers.modeling_flash_attention_utils as flash_utils
from datasets import Dataset, DatasetDict
from tiny_models import tiny_config, tiny_model
from transformers.models.llama import modeling_llama

from llm_packing import (
    ContaminationError,
    DataCollatorWithPacking,
    PackingError,
    PackingTypeError,
    PackingValueError,
    SequenceTooLongError,
    UnsupportedSetupError,
    configure_packing,
    get_seqlens_in_batch,
    get_unpad_data,
    is_indexed_packed_mask,
    is_packing_configured,
    pack_dataset,
    pack_sequences,
    unconfigure_packing,
    verify_packing,
)
from llm_packing._compat import MASK_BUILDER_NAMES
from llm_packing.batches import collator as collator_module
from llm_packing.data import pack as dataset_module
from llm_packing.data._io import split_documents
from llm_packing.hook import builders, guards
from llm_packing.hook.mixers import MIXERS


SMALL = {"input_ids": [[1, 2, 3], [4, 5], [6]]}
SMALL_PACKED = {"input_ids": [[1, 2, 3, 6], [4, 5]], "seq_lengths": [[3, 1], [2]]}  # the collator derives the rest
ROWS = [
    {"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, -100, 4, 5], "seq_lengths": [2, 3]},
    {"input_ids": [6, 7], "seq_lengths": [2]},
]
PACKED = {
    "input_ids": torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]),
    "attention_mask": torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]),
    "position_ids": torch.tensor([[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 1, 2]]),
}
# The labels a collator makes for PACKED: -100 at each document's first token and on padding.
PACKED_LABELS = torch.tensor([[-100, 6, -100, 8, 9, -100], [-100, -100, 13, -100, 15, 16]])


def shown(value) -> str:
    """`repr(value)` as a regex, for matching the bad value an error message shows."""
    return re.escape(repr(value))


def hook_state():
    """Everything the hook may replace, plus whether it says it is applied: compared by identity."""
    mapping = masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
    return (
        is_packing_configured(),
        *(getattr(masking_utils, name) for name in MASK_BUILDER_NAMES),
        modeling_llama.create_causal_mask,
        flash_utils._get_unpad_data,
        *(mapping[key] for key in sorted(mapping)),
    )


def assert_same_hook_state(before):
    after = hook_state()
    assert len(after) == len(before)
    half_done = "an error left the hook half-applied or half-removed"
    assert all(a is b for a, b in zip(after, before, strict=True)), half_done


@pytest.fixture
def model():
    model = tiny_model("llama", attn_implementation="sdpa")
    yield model
    unconfigure_packing()


@pytest.fixture(scope="module")
def bailing_hybrid():
    return tiny_model("bailing_hybrid", attn_implementation="sdpa")


@pytest.fixture(scope="module")
def doge():
    return tiny_model("doge", attn_implementation="eager")


class TestPackSequences:
    def test_uint64_lengths_beyond_int64(self):
        with pytest.raises(PackingValueError, match=r"`lengths` holds 9223372036854775809, beyond int64"):
            pack_sequences(np.array([2**63 + 1, 3], dtype=np.uint64), 8)
        assert pack_sequences(np.array([5, 3], dtype=np.uint64), 8).bins == [[0, 1]]

    @pytest.mark.parametrize("capacity", [float("nan"), float("inf"), np.float64(8)])
    def test_float_capacity(self, capacity):
        with pytest.raises(PackingValueError, match=rf"`capacity` must be a positive integer .* got "
                                                    rf"{shown(capacity)}"):
            pack_sequences([3], capacity)


# ---------------------------------------------------------------------------------------------------------------------
# pack_dataset over every container: map-style, a split of a DatasetDict, and a stream.

CONTAINERS = ("dataset", "dataset_dict", "iterable")


def pack(container, columns, **kwargs):
    """`pack_dataset` on `columns` held by `container`; streams are consumed, so errors surface here."""
    ds = Dataset.from_dict(columns)
    kwargs = {"max_length": 4, **kwargs}
    if container == "dataset":
        return pack_dataset(ds, **kwargs).to_dict()
    if container == "dataset_dict":
        return {split: d.to_dict() for split, d in
                pack_dataset(DatasetDict({"train": Dataset.from_dict(SMALL), "bad": ds}), **kwargs).items()}
    return list(pack_dataset(ds.to_iterable_dataset(), **kwargs))


def assert_packs_normally(container):
    out = pack(container, SMALL)
    if container == "dataset":
        assert out == SMALL_PACKED
    elif container == "dataset_dict":
        assert out["train"] == out["bad"] == SMALL_PACKED
    else:
        assert out == [dict(zip(SMALL_PACKED, row, strict=True)) for row in zip(*SMALL_PACKED.values(), strict=True)]


class TestPackDatasetBadData:
    @pytest.mark.parametrize("container", CONTAINERS)
    @pytest.mark.parametrize(
        "columns, error, match",
        [
            ({"text": ["a"]}, PackingValueError, r"no 'input_ids'.*\['text'\]"),
            ({"input_ids": [[1], [1, 2]], "labels": [[1], [1]]}, PackingValueError,
             r"'labels'.* 1 values.*'input_ids' has 2"),
            ({"input_ids": [[1, -1]]}, PackingValueError, r"'input_ids'.*-1"),
            ({"input_ids": [[-100, 1]]}, PackingValueError, r"'input_ids'.*-100"),
            ({"input_ids": [[1, 2**31]]}, PackingValueError, r"'input_ids'.*2147483648"),
            ({"input_ids": [[1, 2**40]]}, PackingValueError, r"'input_ids'.*1099511627776"),
            ({"input_ids": [[1, 2]], "labels": [[1, -5]]}, PackingValueError, r"'labels'.*-5.*-100"),
            ({"input_ids": [[1, 2]], "labels": [[1, -101]]}, PackingValueError, r"'labels'.*-101"),
            ({"input_ids": [[1, 2]], "labels": [[1, 2**31]]}, PackingValueError, r"'labels'.*2147483648"),
            ({"input_ids": [[1.5]]}, PackingTypeError, r"'input_ids'.*integers"),
            ({"input_ids": [[True, False]]}, PackingTypeError, r"'input_ids'.*integers"),
            ({"input_ids": [[1, 2, 3, 4, 5]]}, SequenceTooLongError,
             r"longer than `max_length`=4.*5 tokens \(row 0\).*overflow='split'"),
        ],
    )
    def test_refused_and_the_next_call_is_normal(self, container, columns, error, match):
        with pytest.raises(error, match=match) as caught:
            pack(container, columns)
        if container == "dataset_dict":
            assert str(caught.value).startswith("Split 'bad': ")
        assert_packs_normally(container)

    def test_the_input_dataset_is_left_untouched(self):
        ds = Dataset.from_dict({"input_ids": [[1, 2], [3, 4, 5, 6, 7]]}).with_format("numpy")
        fingerprint = ds._fingerprint
        with pytest.raises(SequenceTooLongError):
            pack_dataset(ds, 4)
        assert (ds._fingerprint, ds.format["type"], ds.column_names) == (fingerprint, "numpy", ["input_ids"])
        assert pack_dataset(ds, 4, overflow="drop")["input_ids"][0].tolist() == [1, 2]


class TestPackDatasetBadOptions:
    @pytest.mark.parametrize("container", CONTAINERS)
    @pytest.mark.parametrize("max_length", [0, -1, 2.5, float("nan"), True, "8", None])
    def test_max_length(self, container, max_length):
        with pytest.raises(PackingValueError, match=rf"`max_length` must be a positive integer.*{shown(max_length)}"):
            pack(container, SMALL, max_length=max_length)
        assert_packs_normally(container)

    @pytest.mark.parametrize("container", CONTAINERS)
    def test_overflow_policy(self, container):
        with pytest.raises(PackingValueError, match=r"`overflow` must be one of \('error', .* got 'wrap'"):
            pack(container, SMALL, overflow="wrap")

    @pytest.mark.parametrize("container", CONTAINERS)
    @pytest.mark.parametrize("name", ["return_position_ids", "keep_in_memory", "return_stats",
                                      "load_from_cache_file"])
    @pytest.mark.parametrize("value", ["no", 0, 1.0])
    def test_boolean_options_take_bools(self, container, name, value):
        """A string such as "no" is true: taken as given it did the opposite of what was asked."""
        with pytest.raises(PackingTypeError, match=rf"`{name}` must be a bool \(True or False\).*got {shown(value)}"):
            pack(container, SMALL, **{name: value})
        assert_packs_normally(container)

    @pytest.mark.parametrize("container", CONTAINERS)
    @pytest.mark.parametrize(
        "options, error, match",
        [
            ({"cache_file_name": 123}, PackingTypeError,
             r"`cache_file_name` must be a path \(str or os.PathLike\) or None, got 123 of type int\. Name the Arrow"),
            ({"cache_file_name": "packed.arrow", "keep_in_memory": True}, PackingValueError,
             r"`cache_file_name`='packed.arrow' with `keep_in_memory=True`: rows kept in memory are never written"),
            ({"strategy": "nope"}, PackingValueError, r"`strategy` must be one of \('bfd', .*got 'nope'"),
            ({"max_docs_per_bin": 0}, PackingValueError, r"`max_docs_per_bin` must be a positive integer or None"),
            ({"seed": -1}, PackingValueError, r"`seed` must be a non-negative integer or None, got -1"),
        ],
        ids=["cache_file_name-int", "cache_file_name-in-memory", "strategy", "max_docs_per_bin", "seed"],
    )
    def test_options_are_checked_before_anything_is_read(self, container, options, error, match, tmp_path,
                                                         monkeypatch):
        monkeypatch.chdir(tmp_path)
        with pytest.raises(error, match=match):
            pack(container, {"input_ids": [[1, 2, 3, 4, 5]]}, **options)  # refused before the over-long row
        assert not (tmp_path / "packed.arrow").exists()
        assert_packs_normally(container)

    @pytest.mark.parametrize("buffer_size", [-1, 1, "x", 2.5])
    def test_buffer_size_is_checked_without_a_stream_too(self, buffer_size):
        with pytest.raises(PackingValueError, match=rf"`buffer_size` must be an integer >= 2 \(sequences per buffer, "
                                                    rf"for streams\), got {shown(buffer_size)}\. Leave it out"):
            pack_dataset(Dataset.from_dict(SMALL), 4, buffer_size=buffer_size)

    @pytest.mark.parametrize(
        "options, match",
        [
            ({"strategy": "nope"}, r"`strategy` must be one of \('bfd', .*got 'nope'"),
            ({"max_docs_per_bin": 0}, r"`max_docs_per_bin` must be a positive integer or None"),
            ({"seed": -1}, r"`seed` must be a non-negative integer \(epoch `e` packs with "
                           r"`seed_from_components\(seed, e\)`\), got -1\. Pass e.g. `seed=0`"),
            ({"seed": None}, r"`seed` must be a non-negative integer .*got None"),
        ],
        ids=["strategy", "max_docs_per_bin", "seed-negative", "seed-None"],
    )
    def test_epochs_options_are_checked_by_the_constructor(self, options, match):
        with pytest.raises(PackingValueError, match=match):
            dataset_module.PackedDatasetEpochs(Dataset.from_dict(SMALL), 4, **options)

    @pytest.mark.parametrize("name", ["return_position_ids", "keep_in_memory", "load_from_cache_file"])
    def test_epochs_boolean_options_take_bools(self, name):
        with pytest.raises(PackingTypeError, match=rf"`{name}` must be a bool \(True or False\).*got 'no'"):
            dataset_module.PackedDatasetEpochs(Dataset.from_dict(SMALL), 4, **{name: "no"})

    @pytest.mark.parametrize("dataset", [[{"input_ids": [1]}], "input_ids", None, datasets.Features()])
    def test_not_a_dataset(self, dataset):
        with pytest.raises(PackingTypeError, match=rf"`dataset` must be a datasets .* got {type(dataset).__name__}"):
            pack_dataset(dataset, 4)

    @pytest.mark.parametrize(
        "dataset, match",
        [
            (DatasetDict({"train": Dataset.from_dict(SMALL)}),
             r"got DatasetDict\. Repack each split on its own, e\.g\. `PackedDatasetEpochs\(dataset\['train'\], "),
            (Dataset.from_dict(SMALL).to_iterable_dataset(), r"got IterableDataset\. A stream is packed as it is "
             r"read, a buffer at a time: pack it once with `pack_dataset\(dataset, max_length\)`, .* new order each "
             r"epoch\), or load it map-style"),
            ([{"input_ids": [1]}], r"got list\. Wrap your examples with `datasets\.Dataset\.from_dict`"),
        ],
        ids=["dataset-dict", "stream", "list"],
    )
    def test_epochs_not_a_dataset_says_what_to_pass(self, dataset, match):
        with pytest.raises(PackingTypeError, match=rf"`dataset` must be a datasets\.Dataset, {match}"):
            dataset_module.PackedDatasetEpochs(dataset, 4)

    @pytest.mark.parametrize("epoch", [1.5, None, "0"])
    def test_epochs_repack_needs_an_integer_epoch(self, epoch):
        epochs = dataset_module.PackedDatasetEpochs(Dataset.from_dict(SMALL), 4)
        with pytest.raises(PackingTypeError, match=rf"takes integers, got {shown(epoch)}"):
            epochs.repack(epoch)
        assert sorted(epochs.repack(0)["seq_lengths"]) == [[2], [3, 1]]


class TestEmpty:
    @pytest.mark.parametrize(
        "make",
        [
            lambda: Dataset.from_dict({"input_ids": []}),  # no rows: Arrow infers no type at all
            lambda: Dataset.from_dict({"input_ids": []}, features=datasets.Features(
                {"input_ids": datasets.List(datasets.Value("int64"))})),
            lambda: Dataset.from_dict({"input_ids": [[], []]}),
            lambda: Dataset.from_dict(SMALL).filter(lambda example: False),
        ],
        ids=["untyped", "typed", "empty_sequences", "filtered"],
    )
    def test_empty_datasets_pack_to_zero_rows_with_the_usual_columns(self, make):
        packed, stats = pack_dataset(make(), 4, return_stats=True)
        assert len(packed) == 0 and stats.num_bins == 0
        assert packed.column_names == ["input_ids", "seq_lengths"]

    def test_examples_that_make_no_rows_are_warned_of(self, caplog):
        """Zero rows from examples given: a trainer would stop at its first batch, far from the cause."""
        with caplog.at_level(logging.WARNING, logger="llm_packing"):
            assert len(pack_dataset(Dataset.from_dict({"input_ids": [[], []]}), 4)) == 0
            assert list(pack_dataset(Dataset.from_dict({"input_ids": [[], []]}).to_iterable_dataset(), 4)) == []
            assert len(pack_dataset(Dataset.from_dict({"input_ids": []}), 4)) == 0  # nothing given: nothing lost
        warnings_logged = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
        assert warnings_logged == [
            "pack_dataset made no rows from 2 examples (2 empty, 0 over-long dropped with overflow='error'): there is "
            "nothing to train on. Check the tokenization (empty `input_ids`) and `overflow`.",
            "pack_dataset (streaming) made no rows from 2 examples (2 empty, 0 over-long dropped with "
            "overflow='error'): there is nothing to train on. Check the tokenization (empty `input_ids`) and "
            "`overflow`.",
        ]

    def test_empty_split_and_empty_stream(self):
        splits = DatasetDict({"train": Dataset.from_dict(SMALL), "test": Dataset.from_dict({"input_ids": []})})
        packed = pack_dataset(splits, 4)
        assert packed["train"].to_dict() == SMALL_PACKED and len(packed["test"]) == 0
        stream = Dataset.from_dict({"input_ids": [[], [7], []]}).to_iterable_dataset()
        assert [row["input_ids"] for row in pack_dataset(stream, 4)] == [[7]]

    @pytest.mark.parametrize(
        "features, error, match",
        [
            ([{"input_ids": []}, {"input_ids": []}], PackingValueError, r"Every example in the batch has empty"),
            ([{"input_ids": [], "seq_lengths": []}], PackingValueError, r"`seq_lengths`=\[\], which must be positive"),
            ([{"input_ids": [1, 2], "seq_lengths": [0, 2]}], PackingValueError, r"`seq_lengths`=\[0, 2\]"),
            ([{"input_ids": [1, 2], "seq_lengths": [3, -1]}], PackingValueError, r"`seq_lengths`=\[3, -1\]"),
            ([], PackingValueError, r"`features` is empty"),
        ],
    )
    def test_collator_refuses_empty_documents_and_batches(self, features, error, match):
        collator = DataCollatorWithPacking(check_model_configured=False)
        with pytest.raises(error, match=match):
            collator(features)
        assert collator(ROWS)["attention_mask"].tolist() == [[1, 1, 2, 2, 2], [1, 1, 0, 0, 0]]


# ---------------------------------------------------------------------------------------------------------------------
# DataCollatorWithPacking


class TestCollator:
    @pytest.mark.parametrize("pad_token_id", [None, -1, -100, True, "0", 1.0])
    def test_pad_token_id(self, pad_token_id):
        with pytest.raises(PackingValueError, match=rf"`pad_token_id` must be a non-negative integer .* got "
                                                    rf"{shown(pad_token_id)}.*tokenizer.pad_token"):
            DataCollatorWithPacking(pad_token_id=pad_token_id)

    @pytest.mark.parametrize(
        "features, error, match",
        [
            ({"input_ids": [[1, 2]]}, PackingTypeError, r"`features` must be a list of dicts .* got dict"),
            ([[1, 2, 3]], PackingTypeError, r"`features` must be a list of dicts .* got a list of \['list'\]"),
            ([{"input_ids": [1, -2]}], PackingValueError,
             r"'input_ids' of feature 0 holds -2: token ids .* must be in \[0, 2147483647\]"),
            ([{"input_ids": [3]}, {"input_ids": [1, 2], "labels": [1, -5]}], PackingValueError,
             r"'labels' of feature 1 holds -5.*-100"),
            ([{"input_ids": np.array([2**63 + 5], np.uint64)}], PackingValueError,
             r"'input_ids' of feature 0 holds 9223372036854775813: token ids .* \[0, 2147483647\]"),
            ([{"input_ids": [1, 2], "seq_lengths": [1.0, 1.0]}], PackingTypeError,
             r"'seq_lengths' of feature 0 must be a flat list of integers, got dtype float64"),
            ([{"input_ids": [1, 2], "seq_lengths": [float("nan")]}], PackingTypeError,
             r"'seq_lengths' of feature 0 must be a flat list of integers"),
            ([{"input_ids": [1, 2], "seq_lengths": None}], PackingTypeError, r"'seq_lengths' of feature 0"),
            ([{"input_ids": None}], PackingTypeError, r"'input_ids' of feature 0 must be a flat list"),
            ([{"input_ids": "hello"}], PackingTypeError, r"'input_ids' of feature 0 .* got dtype <U5"),
            ([{"input_ids": [[1, 2]]}], PackingTypeError, r"'input_ids' of feature 0 .* shape \(1, 2\)"),
            ([{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor([1.0, 2.0])}], PackingTypeError,
             r"'labels' of feature 0 .* got dtype float32"),
            ([{"labels": [1, 2]}], PackingValueError, r"Feature 0 has no 'input_ids' \(keys: \['labels'\]\)"),
        ],
    )
    def test_refused_and_the_next_batch_is_normal(self, features, error, match):
        collator = DataCollatorWithPacking(check_model_configured=False)
        with pytest.raises(error, match=match):
            collator(features)
        assert collator(ROWS)["labels"].tolist() == [[-100, 2, -100, 4, 5], [-100, 7, -100, -100, -100]]

    def test_bad_length_options(self):
        for name, value in (("max_length", float("nan")), ("max_length", 0), ("pad_to_multiple_of", 2.0)):
            with pytest.raises(PackingValueError, match=rf"`{name}` must be a positive integer or None, got "
                                                        rf"{shown(value)}"):
                DataCollatorWithPacking(**{name: value})

    def test_unconfigured_model_is_refused_with_the_real_hook_state(self, model):
        collator = DataCollatorWithPacking()
        before = hook_state()
        with pytest.raises(ContaminationError, match=r"several documents.*configure_packing\(model\)"):
            collator(ROWS)
        assert_same_hook_state(before)
        configure_packing(model)
        batch = collator(ROWS)
        with torch.no_grad():
            model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)
        unconfigure_packing()
        with pytest.raises(ContaminationError):
            collator(ROWS)
        # One document per row needs no hook, and padding-free needs none either.
        assert collator([ROWS[1]])["attention_mask"].tolist() == [[1, 1]]
        assert "attention_mask" not in DataCollatorWithPacking(padding_free=True)(ROWS)


# ---------------------------------------------------------------------------------------------------------------------
# Masks


class TestMasks:
    @pytest.mark.parametrize(
        "mask, error, match",
        [
            ([[1, 2]], PackingTypeError, r"`attention_mask` must be a torch.Tensor .* got list"),
            (np.array([[1, 2]]), PackingTypeError, r"`attention_mask` must be a torch.Tensor .* got ndarray"),
            (torch.tensor([[1.0, 2.0, 2.5]]), PackingTypeError, r"torch.float32 with values other than 0 and 1"),
            (torch.tensor([[1, 1, 2], [2, 2, 1]]), PackingValueError, r"row 1 has document id 2 at position 0"),
            (torch.tensor([[1, 2, 2, 1]]), PackingValueError, r"row 0 has document id 1 at position 3"),
            (torch.tensor([[1, 2, 0, 2]]), PackingValueError, r"row 0 has document id 2 at position 3"),
            (torch.tensor([[1, 1, 3, 3]]), PackingValueError, r"document id 3 at position 2 after \[1, 1\]"),
            (torch.tensor([[0, 2, 2]]), PackingValueError, r"document id 2 at position 1"),
        ],
    )
    def test_malformed_masks(self, mask, error, match):
        for function in (get_unpad_data, get_seqlens_in_batch):
            with pytest.raises(error, match=match):
                function(mask)
        assert get_seqlens_in_batch(torch.tensor([[1, 1, 2, 0]])).tolist() == [2, 1]

    def test_float_zero_one_mask_is_a_plain_padding_mask(self):
        _, cu_seqlens, _ = get_unpad_data(torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
        assert cu_seqlens.tolist() == [0, 2, 5]

    def test_empty_mask_is_not_indexed(self):
        assert is_indexed_packed_mask(torch.zeros(0, 0, dtype=torch.long)) is False
        assert get_unpad_data(torch.zeros(0, 4, dtype=torch.long))[1].tolist() == [0]


# ---------------------------------------------------------------------------------------------------------------------
# More documents in a row than int8 / int16 can number.


@pytest.mark.parametrize("num_documents", [200, 40_000])
def test_more_documents_than_small_integer_types_hold(num_documents):
    lengths = np.random.default_rng(num_documents).integers(1, 3, num_documents)
    ids = [[int(i % 1000) + 1] * int(n) for i, n in enumerate(lengths)]
    packed = pack_dataset(Dataset.from_dict({"input_ids": ids}), int(lengths.sum()))
    assert len(packed) == 1 and len(packed[0]["seq_lengths"]) == num_documents
    batch = DataCollatorWithPacking(check_model_configured=False)([packed[0]])
    mask = batch["attention_mask"]
    assert mask.dtype == torch.int64 and mask.max().item() == num_documents
    assert is_indexed_packed_mask(mask)
    indices, cu_seqlens, max_seqlen = get_unpad_data(mask)
    assert cu_seqlens.dtype == torch.int32 and len(cu_seqlens) == num_documents + 1
    assert torch.equal(cu_seqlens.diff().long(), torch.as_tensor(packed[0]["seq_lengths"]))
    assert torch.equal(indices, torch.arange(int(lengths.sum())))
    assert max_seqlen == int(lengths.max())
    assert (batch["labels"][0, cu_seqlens[:-1].long()] == -100).all()


def test_more_than_127_documents_stay_isolated_in_the_model(model):
    configure_packing(model)
    ids = torch.arange(200)[None] % 120 + 5
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=torch.arange(1, 201)[None],
                       position_ids=torch.zeros(1, 200, dtype=torch.long), use_cache=False).logits[0]
        alone = model(input_ids=ids.T, use_cache=False).logits[:, 0]
    assert (packed - alone).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# configure_packing / verify_packing: refused setups change nothing.


class TestRefusedSetups:
    @pytest.fixture(params=[False, True], ids=["unconfigured", "already_configured"])
    def already_configured(self, request, model):
        if request.param:
            configure_packing(model)
        return request.param

    def assert_unchanged_then_normal(self, before, model, already_configured):
        assert_same_hook_state(before)
        assert model.config._attn_implementation == "sdpa"
        if not already_configured:
            configure_packing(model)
        assert verify_packing(model, atol=1e-5) <= 1e-5

    def test_unknown_attn_implementation_on_a_model(self, model, already_configured):
        before = hook_state()
        with pytest.raises(UnsupportedSetupError, match=r"backend 'bogus' \(model_type 'llama'\).*'eager', 'sdpa'.*"
                                                        r"attn_implementation='sdpa'"):
            configure_packing(model, attn_implementation="bogus")
        self.assert_unchanged_then_normal(before, model, already_configured)

    def test_unknown_attn_implementation_on_a_config(self, model, already_configured):
        config = tiny_config("llama")
        config._attn_implementation = "eager"
        before = hook_state()
        with pytest.raises(UnsupportedSetupError, match=r"'paged\|sdpa'"):
            configure_packing(config, attn_implementation="paged|sdpa")
        assert config._attn_implementation == "eager"
        self.assert_unchanged_then_normal(before, model, already_configured)

    def test_attn_implementation_whose_kernel_is_missing(self, model, already_configured):
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            pass
        else:
            pytest.skip("flash-attn is installed: flash_attention_2 is available here")
        before = hook_state()
        with pytest.raises(UnsupportedSetupError, match=r"`attn_implementation`='flash_attention_2' cannot be used "
                                                        r"with model_type 'llama'.*attn_implementation='sdpa'"):
            configure_packing(model, attn_implementation="flash_attention_2")
        self.assert_unchanged_then_normal(before, model, already_configured)

    def test_hybrid_architecture_keeps_its_backend(self, model, bailing_hybrid, already_configured, monkeypatch):
        monkeypatch.delitem(MIXERS, "bailing_hybrid")  # a hybrid whose mixers the table does not isolate
        before = hook_state()
        with pytest.raises(UnsupportedSetupError, match=r"'bailing_hybrid': hybrid.*Supported model types: .*llama"):
            configure_packing(bailing_hybrid, attn_implementation="eager")
        assert bailing_hybrid.config._attn_implementation == "sdpa"
        self.assert_unchanged_then_normal(before, model, already_configured)

    def test_unsupported_architecture(self, model, doge, already_configured):
        before = hook_state()
        with pytest.raises(UnsupportedSetupError, match=r"model_type 'doge': its dynamic mask keeps .* across the "
                                                        r"whole packed row.*Supported model types: .*llama"):
            configure_packing(doge)
        self.assert_unchanged_then_normal(before, model, already_configured)

    def test_supported_type_with_stateful_layers(self, model, already_configured):
        config = tiny_config("llama")
        config.layer_types = ["full_attention", "mamba"]
        before = hook_state()
        with pytest.raises(UnsupportedSetupError, match=r"'llama'.*non-attention layers \['mamba'\]"):
            configure_packing(config)
        self.assert_unchanged_then_normal(before, model, already_configured)

    @pytest.mark.parametrize("thing", ["llama", None, 3])
    def test_not_a_model(self, model, already_configured, thing):
        before = hook_state()
        with pytest.raises(PackingTypeError, match=rf"`model_or_config` must be .* got {type(thing).__name__} "
                                                   rf"\({shown(thing)}\)"):
            configure_packing(thing)
        self.assert_unchanged_then_normal(before, model, already_configured)

    @pytest.mark.parametrize(
        "kwargs, error, match",
        [
            ({"model": "config"}, PackingTypeError, r"`model` must be a transformers model .* got LlamaConfig"),
            ({"atol": -1.0}, PackingValueError, r"`atol` must be a non-negative number or None .* got -1.0"),
            ({"atol": float("nan")}, PackingValueError, r"`atol` .* got nan"),
        ],
    )
    def test_verify_packing_arguments(self, model, already_configured, kwargs, error, match):
        before = hook_state()
        kwargs = {**kwargs, "model": model.config if kwargs.get("model") == "config" else model}
        with pytest.raises(error, match=match):
            verify_packing(**kwargs)
        self.assert_unchanged_then_normal(before, model, already_configured)


# ---------------------------------------------------------------------------------------------------------------------
# Packed forwards the hook refuses: the next valid forward is exact again.


class TestRefusedForwards:
    @pytest.mark.parametrize(
        "change, error, match",
        [
            ({"use_cache": True}, ContaminationError, r"KV cache \(`use_cache=True`, model_type 'llama'\).*"
                                                      r"use_cache=False"),
            ({"attention_mask": torch.zeros(2, 1, 6, 6)}, UnsupportedSetupError,
             r"4-D `attention_mask` of shape \(2, 1, 6, 6\).*indexed 2-D mask"),
            ({"attention_mask": PACKED["attention_mask"].float()}, PackingTypeError,
             r"torch.float32 2-D mask holding document ids up to 3.*attention_mask.long\(\)"),
            ({"attention_mask": torch.tensor([[1, 1, 2, 2, 1, 0], [1, 2, 2, 3, 3, 3]])}, PackingValueError,
             r"row 0 has document id 1 at position 4"),
            ({"attention_mask": torch.tensor([[1, 1, 2, 2, 2, 0], [1, 0, 1, 2, 2, 2]])}, PackingValueError,
             r"row 1 has document id 1 at position 2.*never inside a document"),
            ({"attention_mask": torch.tensor([[2, 2, 3, 3, 3, 0], [1, 2, 2, 3, 3, 3]])}, PackingValueError,
             r"row 0 has document id 2 at position 0"),
            # 0/1 masks of other dtypes with the documents' restarting positions: attention across them (0.21 off)
            ({"attention_mask": PACKED["attention_mask"].bool()}, ContaminationError,
             r"`position_ids` restart inside a row whose `attention_mask` is 0/1 \(row 0, token 2"),
            ({"attention_mask": PACKED["attention_mask"].ne(0).float()}, ContaminationError,
             r"`position_ids` restart inside a row whose `attention_mask` is 0/1 \(row 0, token 2"),
        ],
        ids=["use_cache", "4d_mask", "float_mask", "out_of_order", "non_contiguous", "not_from_1", "bool_0_1_mask",
             "float_0_1_mask"],
    )
    def test_training_forward(self, model, change, error, match):
        configure_packing(model)
        with torch.no_grad():
            expected = model(**PACKED, use_cache=False).logits
        before = hook_state()
        model.train()
        with pytest.raises(error, match=match):
            model(**{**PACKED, "use_cache": False, **change}, labels=PACKED_LABELS)
        model.eval()
        assert_same_hook_state(before)
        with torch.no_grad():
            assert torch.equal(model(**PACKED, use_cache=False).logits, expected)


# ---------------------------------------------------------------------------------------------------------------------
# Deprecation hygiene: pyproject.toml's filterwarnings turns deprecations attributed to llm_packing into errors.


class TestDeprecationsFailTheRun:
    def test_the_filters_are_configured(self, pytestconfig):
        filters = pytestconfig.getini("filterwarnings")
        assert "error::DeprecationWarning:llm_packing.*" in filters
        assert "error::FutureWarning:llm_packing.*" in filters

    @pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
    def test_a_dependency_deprecation_hit_by_our_code_is_an_error(self, monkeypatch, category):
        # What a transformers/torch deprecation looks like: `warnings.warn(..., stacklevel=2)` names the caller, here
        # `llm_packing.data._io.split_documents`, and the filter's module regex matches that caller's `__name__`.
        real = split_documents.plan_rows

        def deprecated(*args, **kwargs):
            warnings.warn("`plan_rows` is deprecated", category, stacklevel=2)
            return real(*args, **kwargs)

        monkeypatch.setattr(split_documents, "plan_rows", deprecated)
        with pytest.raises(category, match="is deprecated"):
            pack_dataset(Dataset.from_dict(SMALL), 4)

    def test_a_deprecation_raised_inside_a_dependency_is_not_ours(self, monkeypatch):
        # Attributed to the dependency itself (stacklevel=1), it stays a warning: the filter only fails our call sites.
        real = collator_module.position_ids

        def deprecated(*args, **kwargs):
            warnings.warn("internal deprecation", DeprecationWarning, stacklevel=1)
            return real(*args, **kwargs)

        monkeypatch.setattr(collator_module, "position_ids", deprecated)
        with warnings.catch_warnings(record=True) as caught:
            DataCollatorWithPacking(check_model_configured=False)(ROWS)
        assert [str(w.message) for w in caught if w.category is DeprecationWarning] == ["internal deprecation"]


# ---------------------------------------------------------------------------------------------------------------------
# Resource bounds


class TestResourceBounds:
    @pytest.mark.parametrize("backend, element_size", [("sdpa", 1), ("eager", 4)])
    def test_dense_mask_warning_is_exactly_past_the_bound(self, model, monkeypatch, backend, element_size):
        model.config._attn_implementation = backend
        configure_packing(model, attention_route="dense")  # sdpa's default varlen route builds no dense mask
        size = 2 * 6 * 6 * element_size  # batch x length^2 x bytes per element (bool for sdpa, float32 for eager)
        monkeypatch.setattr(builders, "_warned_dense_mask", False)
        monkeypatch.setattr(builders, "DENSE_MASK_WARNING_BYTES", size)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            model(**PACKED, use_cache=False)  # at the bound: no warning
        monkeypatch.setattr(builders, "DENSE_MASK_WARNING_BYTES", size - 1)
        with torch.no_grad(), pytest.warns(UserWarning, match=rf"packed {backend} attention mask .* \(2, 6\)"):
            model(**PACKED, use_cache=False)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            model(**PACKED, use_cache=False)  # once per process

    def test_flash_route_hands_the_2d_mask_through(self, model):
        configure_packing(model)
        config = tiny_config("llama")
        config._attn_implementation = "flash_attention_2"
        mask = PACKED["attention_mask"]
        built = masking_utils.create_causal_mask(config=config, inputs_embeds=torch.zeros(2, 6, 8),
                                                 attention_mask=mask, past_key_values=None,
                                                 position_ids=PACKED["position_ids"])
        assert built is mask  # no (batch, 1, length, length) mask is ever built on the varlen path

    def test_varlen_metadata_is_linear_in_tokens(self):
        """Peak resident memory of `get_unpad_data` and of the collator's `return_flash_attn_kwargs=True` path,
        measured in a fresh process (tracemalloc does not see torch's allocator: a 64 MiB `torch.zeros` shows 480
        bytes)."""
        completed = subprocess.run([sys.executable, "-c", PEAK_MEMORY_PROBE], capture_output=True, text=True,
                                   timeout=300, check=False)
        assert completed.returncode == 0, completed.stderr[-3000:]
        measured = json.loads(completed.stdout)
        for length, (tokens, documents, unpad_peak, collator_peak, cu_seq_lens, width) in measured.items():
            # A few int64 arrays per token (plus allocator slack); a quadratic path needs 2 x length^2 bytes or more.
            bound = 64 * tokens + (1 << 20)
            assert unpad_peak <= bound and collator_peak <= bound, (length, unpad_peak, collator_peak, bound)
            assert cu_seq_lens == documents + 1 + int(tokens < 2 * width), length  # one segment for a row's padding


# Rows of 4k, 16k and 64k tokens, two per batch, documents of 1-63 tokens: prints {length: [tokens, documents, peak
# bytes of get_unpad_data, peak bytes of the collator, len(cu_seq_lens_q), collated row width]}. Peaks are the growth
# of the process's high-water RSS (reset through /proc/self/clear_refs) over its RSS just before the call, after a
# small warm-up call (so that no code page loaded on first use counts). The data segment is capped 1 GiB above its size
# at the start, so that a quadratic implementation fails with an allocation error instead of taking 8 GiB of a shared
# machine.
PEAK_MEMORY_PROBE = """
import json, resource
import numpy as np, torch
from llm_packing.batches.collator import DataCollatorWithPacking
from llm_packing.hook.documents import get_unpad_data

def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))

def peak_growth(function):
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = status("VmRSS")
    result = function()
    return status("VmHWM") - before, result

resource.setrlimit(resource.RLIMIT_DATA, (status("VmData") + (1 << 30), resource.RLIM_INFINITY))
collate = DataCollatorWithPacking(return_flash_attn_kwargs=True)
measured = {}
for length in (1 << 12, 1 << 14, 1 << 16):
    rng = np.random.default_rng(length)
    doc_lengths = rng.integers(1, 64, length // 16)
    doc_lengths = doc_lengths[np.cumsum(doc_lengths) <= length - 7]
    row = np.repeat(np.arange(1, len(doc_lengths) + 1), doc_lengths)
    mask = torch.zeros(2, length, dtype=torch.long)
    mask[:, : len(row)] = torch.from_numpy(row)
    features = [{"input_ids": [1] * len(row), "seq_lengths": doc_lengths.tolist()}] * 2
    get_unpad_data(mask[:, :64].clone())
    collate(features[:1])
    unpad_peak, (indices, cu_seqlens, _) = peak_growth(lambda: get_unpad_data(mask))
    assert len(indices) == 2 * len(row) and len(cu_seqlens) == 2 * len(doc_lengths) + 1
    collator_peak, batch = peak_growth(lambda: collate(features))
    measured[length] = [2 * len(row), 2 * len(doc_lengths), unpad_peak, collator_peak, len(batch["cu_seq_lens_q"]),
                        batch["input_ids"].shape[1]]
print(json.dumps(measured))
"""


def test_every_error_is_a_packing_error_and_the_builtin_callers_expect():
    assert issubclass(SequenceTooLongError, PackingValueError) and issubclass(PackingValueError, ValueError)
    assert issubclass(PackingTypeError, TypeError) and issubclass(UnsupportedSetupError, NotImplementedError)
    assert issubclass(ContaminationError, RuntimeError)
    assert all(issubclass(e, PackingError) for e in (PackingTypeError, ContaminationError, UnsupportedSetupError))


def test_packed_labels_that_cross_into_the_next_document_are_refused():
    """A hand-made packed batch whose label at a document's first token is not -100: the model shifts labels by one,
    so the previous document's last token would learn to predict it (in training) or be scored on it (in evaluation).
    Refused in both; a row's first label (never a target) is not checked."""
    model = tiny_model("llama", "sdpa").train()
    configure_packing(model)
    try:
        batch = DataCollatorWithPacking()([{"input_ids": list(range(3, 10)), "seq_lengths": [3, 4]},
                                            {"input_ids": list(range(20, 25)), "seq_lengths": [5]}])
        labels = batch["labels"].clone()
        labels[:, 0] = 7  # the first label of each row: never a target
        crossing = labels.clone()
        crossing[0, 3] = 6  # the second document's first token
        model(**batch | {"labels": labels}, use_cache=False).loss.backward()
        with pytest.raises(ContaminationError, match=r"label 6 at row 0, position 3, the first token of a document"):
            model(**batch | {"labels": crossing}, use_cache=False)
        model.eval()
        with torch.no_grad():
            model(**batch | {"labels": labels}, use_cache=False)
            with pytest.raises(ContaminationError, match=r"label 6 at row 0, position 3"):
                model(**batch | {"labels": crossing}, use_cache=False)
    finally:
        unconfigure_packing()


def test_a_training_step_left_in_eval_mode_needs_its_documents():
    """`from_pretrained` returns an eval-mode model: a hand-written loop that never calls `model.train()` and feeds
    naively collated packed rows (a 0/1 mask, no `position_ids`) trains across documents, through `labels` or a loss
    of its own. Refused at the backward pass. Inference (gradients on but no backward, or none), `verify_packing`'s
    gradients of documents alone and steps that say where documents start still run."""
    model = tiny_model("llama", "sdpa").eval()
    configure_packing(model)
    try:
        input_ids = torch.arange(3, 15).reshape(2, 6)
        naive = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "use_cache": False}
        refused = r"backward pass ran through a forward .* eval mode \(input_ids of shape \(2, 6\).*model\.train\(\)"
        with pytest.raises(ContaminationError, match=refused):
            model(**naive, labels=input_ids).loss.backward()
        with pytest.raises(ContaminationError, match=refused):
            model(**naive).logits.float().logsumexp(-1).mean().backward()  # a loss of the loop's own
        model(**naive, labels=input_ids)  # inference that leaves gradients on
        with torch.no_grad():
            model(**naive, labels=input_ids)
        with guards.unpacked_forwards():
            model(**naive).logits.sum().backward()
        verify_packing(model)
        model(**naive, labels=input_ids, position_ids=torch.arange(6).repeat(2, 1)).loss.backward()
        packed = DataCollatorWithPacking()([{"input_ids": list(range(3, 10)), "seq_lengths": [3, 4]}])
        model(**packed, use_cache=False).loss.backward()
        unconfigure_packing()
        model(**naive, labels=input_ids).loss.backward()
    finally:
        unconfigure_packing()


def test_a_packed_row_past_gpt_neos_causal_buffer_is_refused_with_the_limit():
    """gpt_neo's eager attention slices a causal buffer of `max_position_embeddings` tokens by the row's length: a
    longer packed row of short documents failed with a raw shape error. Refused with the limit; rows within it run."""
    from tiny_models import packed_batch

    from llm_packing.hook.configure import packing_configured

    model = tiny_model("gpt_neo", "eager").eval()
    limit = model.config.max_position_embeddings
    with packing_configured(model), torch.no_grad():
        long = packed_batch(document_lengths=((40,) * 4,), row_length=limit + 32)
        with pytest.raises(UnsupportedSetupError, match=rf"row of {limit + 32} tokens .* `max_length` <= {limit}"):
            model(**{key: long[key] for key in ("input_ids", "attention_mask", "position_ids")}, use_cache=False)
        within = packed_batch(document_lengths=((40,) * 3,), row_length=limit)
        model(**{key: within[key] for key in ("input_ids", "attention_mask", "position_ids")}, use_cache=False)
