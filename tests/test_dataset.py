import logging

import datasets
import numpy as np
import pytest
from datasets import Dataset, DatasetDict
from hypothesis import HealthCheck, given, settings, strategies as st

from llm_packing.data._io import split_documents, token_columns
from llm_packing.data.pack import PackedDatasetEpochs, pack_dataset
from llm_packing.errors import PackingTypeError, PackingValueError, SequenceTooLongError


SMALL = {"input_ids": [[1, 2, 3], [4, 5], [6]]}
INT32_LISTS = {name: datasets.List(datasets.Value("int32")) for name in ("input_ids", "seq_lengths")}


def documents_out(rows):
    """(tokens, labels after the first) of every packed document; checks the per-row invariants on the way. Rows
    without `labels` train on their `input_ids`, as the collators do; `position_ids` are checked where stored."""
    out = []
    for row in rows:
        bounds = np.cumsum([0, *row["seq_lengths"]])
        labels, positions = row.get("labels", row["input_ids"]), row.get("position_ids")
        assert len(row["input_ids"]) == len(labels) == len(positions or labels) == bounds[-1]
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            assert positions is None or positions[start:end] == list(range(end - start))
            assert "labels" not in row or row["labels"][start] == -100
            out.append((tuple(row["input_ids"][start:end]), tuple(labels[start + 1 : end])))
    return sorted(out)


def documents_expected(input_ids, labels, max_length, overflow):
    """The same, computed from the overflow policy's contract on the raw sequences."""
    expected = []
    for ids, lab in zip(input_ids, labels, strict=True):
        if overflow == "drop" and len(ids) > max_length:
            continue
        stop = min(len(ids), max_length) if overflow == "truncate" else len(ids)
        step = max_length if overflow == "split" else max(stop, 1)
        expected += [(tuple(ids[i : i + step][: stop - i]), tuple(lab[i + 1 : min(i + step, stop)]))
                     for i in range(0, stop, step)]
    return sorted(expected)


class TestPackDataset:
    def test_hand_example(self):
        packed = pack_dataset(Dataset.from_dict(SMALL), 4)
        assert packed.to_dict() == {"input_ids": [[1, 2, 3, 6], [4, 5]], "seq_lengths": [[3, 1], [2]]}
        assert packed.features == datasets.Features(INT32_LISTS)

    def test_masks_become_labels_and_other_columns_are_dropped(self):
        ds = Dataset.from_dict({
            "input_ids": [[1, 2, 3, 4], [5, 6]],
            "completion_mask": [[0, 0, 1, 1], [1, 1]],
            "assistant_masks": [[1, 1, 1, 0], [1, 1]],
            "text": ["a", "b"],
        })
        assert pack_dataset(ds, 6).to_dict()["labels"] == [[-100, -100, 3, -100, -100, 6]]

    def test_labels_column_is_used(self):
        ds = Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[7, -100, 9]]})
        assert pack_dataset(ds, 3)["labels"] == [[-100, -100, 9]]

    def test_more_than_32767_documents_per_row(self):
        ds = Dataset.from_dict({"input_ids": [[i % 100] for i in range(40_000)]})
        packed = pack_dataset(ds, 40_000, return_position_ids=True)
        assert packed.features == datasets.Features({**INT32_LISTS, "position_ids": INT32_LISTS["input_ids"]})
        row = packed.with_format("numpy")[0]
        assert len(row["seq_lengths"]) == 40_000
        assert (row["position_ids"] == 0).all()

    def test_nothing_left(self):
        packed, stats = pack_dataset(Dataset.from_dict({"input_ids": [[], [1, 2, 3]]}), 2, overflow="drop",
                                     return_stats=True)
        assert (len(packed), stats.empty_sequences, stats.dropped_sequences) == (0, 1, 1)
        assert packed.features == datasets.Features(INT32_LISTS)
        assert len(pack_dataset(Dataset.from_dict({"input_ids": [[], []]}), 2)) == 0

    def test_selected_rows_only(self):
        packed = pack_dataset(Dataset.from_dict(SMALL).select([2, 0]), 4)
        assert packed["input_ids"] == [[1, 2, 3, 6]]

    def test_format_is_kept(self):
        packed = pack_dataset(Dataset.from_dict(SMALL).with_format("numpy"), 4)
        assert packed.format["type"] == "numpy" and packed[1]["input_ids"].tolist() == [4, 5]

    def test_dataset_dict_packs_each_split(self):
        splits = DatasetDict({"train": Dataset.from_dict(SMALL), "test": Dataset.from_dict({"input_ids": [[7, 8]]})})
        packed, stats = pack_dataset(splits, 4, return_stats=True)
        assert packed["train"]["seq_lengths"] == [[3, 1], [2]] and packed["test"]["input_ids"] == [[7, 8]]
        assert (stats["train"].num_bins, stats["train"].num_tokens, stats["test"].num_bins) == (2, 6, 1)

    def test_stats_are_logged(self, caplog):
        with caplog.at_level(logging.INFO, logger="llm_packing"):
            pack_dataset(Dataset.from_dict(SMALL), 4)
        assert any(r.name.startswith("llm_packing") and "6 tokens -> 2 bins" in r.getMessage() for r in caplog.records)

    def test_row_offsets_past_int32_use_large_lists(self, monkeypatch):
        monkeypatch.setattr(split_documents, "_MAX_LIST_OFFSET", 4)
        packed = pack_dataset(Dataset.from_dict(SMALL), 4)
        assert packed.features["input_ids"] == datasets.LargeList(datasets.Value("int32"))
        assert packed.features["seq_lengths"] == datasets.List(datasets.Value("int32"))
        assert packed["input_ids"] == [[1, 2, 3, 6], [4, 5]]


class TestOverflow:
    DS = {"input_ids": [[1, 2, 3, 4, 5], [], [6, 7], [8, 9, 10, 11, 12, 13, 14]]}

    def test_error_names_count_longest_row_and_fix(self):
        with pytest.raises(SequenceTooLongError, match=r"2 sequence\(s\).*`max_length`=3.*7 tokens \(row 3\).*split"):
            pack_dataset(Dataset.from_dict(self.DS), 3)

    @pytest.mark.parametrize(
        "overflow, counts, num_tokens",
        [
            ("truncate", {"truncated_sequences": 2, "truncated_tokens": 6}, 8),
            ("split", {"split_sequences": 2}, 14),
            ("drop", {"dropped_sequences": 2, "dropped_tokens": 12}, 2),
        ],
    )
    def test_counts(self, overflow, counts, num_tokens):
        _, stats = pack_dataset(Dataset.from_dict(self.DS), 3, overflow=overflow, return_stats=True)
        everything = dict.fromkeys(
            ["dropped_sequences", "dropped_tokens", "truncated_sequences", "truncated_tokens", "split_sequences"], 0
        )
        assert {name: getattr(stats, name) for name in everything} == {**everything, **counts}
        assert (stats.empty_sequences, stats.num_tokens) == (1, num_tokens)

    def test_split_chunks_are_separate_documents(self):
        packed = pack_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5]]}), 2, overflow="split",
                              return_position_ids=True)
        assert sorted(map(tuple, packed["input_ids"])) == [(1, 2), (3, 4), (5,)]
        assert sorted(map(tuple, packed["position_ids"])) == [(0,), (0, 1), (0, 1)]

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        lengths=st.lists(st.integers(0, 12), min_size=1, max_size=30),
        max_length=st.integers(1, 10),
        overflow=st.sampled_from(["truncate", "split", "drop", "error"]),
        with_labels=st.booleans(),
    )
    def test_conservation(self, lengths, max_length, overflow, with_labels):
        rng = np.random.default_rng(sum(lengths) + max_length)
        input_ids = [rng.integers(0, 1000, n).tolist() for n in lengths]
        labels = [np.where(rng.random(n) < 0.3, -100, ids).tolist() for n, ids in zip(lengths, input_ids, strict=True)]
        columns = {"input_ids": input_ids, **({"labels": labels} if with_labels else {})}
        ds = Dataset.from_dict(columns, features=datasets.Features(dict.fromkeys(columns, INT32_LISTS["input_ids"])))
        if overflow == "error" and max(lengths) > max_length:
            with pytest.raises(SequenceTooLongError):
                pack_dataset(ds, max_length, overflow=overflow)
            return
        rows = pack_dataset(ds, max_length, overflow=overflow).to_list()
        assert all(len(row["input_ids"]) <= max_length for row in rows)
        expected = documents_expected(input_ids, labels if with_labels else input_ids, max_length, overflow)
        assert documents_out(rows) == expected


class TestValidation:
    @pytest.mark.parametrize(
        "columns, kwargs, error, match",
        [
            ({"text": ["a"]}, {}, PackingValueError, r"no 'input_ids' column \(columns: \['text'\]\)"),
            ({"input_ids": [[1], [1, 2]], "labels": [[1], [1]]}, {}, PackingValueError,
             r"'labels' in row 1 has 1 values, but 'input_ids' has 2"),
            ({"input_ids": [[1.5]]}, {}, PackingTypeError, r"'input_ids' must hold lists of integers"),
            ({"input_ids": [[-100, 1]]}, {}, PackingValueError,
             r"Column 'input_ids' in row 0 holds -100: token ids .* \[0, 2147483647\]"),
            ({"input_ids": [[1], [2, -3], [-4]]}, {}, PackingValueError, r"Column 'input_ids' in row 1 holds -3: "),
            ({"input_ids": [[1], None]}, {}, PackingValueError, r"'input_ids' is null in row 1"),
            ({"input_ids": [[1, None]]}, {}, PackingValueError,
             r"'input_ids' in row 0 holds a null value inside its list \(1 in the column\)\. .*fill or filter"),
            ({"input_ids": [[1], [2, None], [None]]}, {}, PackingValueError,
             r"'input_ids' in row 1 holds a null value inside its list \(2 in the column\)"),
            (SMALL, {"max_length": 0}, PackingValueError, r"`max_length` must be a positive integer.*0"),
            (SMALL, {"overflow": "wrap"}, PackingValueError, r"`overflow` must be one of .*'wrap'"),
            (SMALL, {"strategy": "nope"}, ValueError, r"nope"),
        ],
    )
    def test_errors(self, columns, kwargs, error, match):
        kwargs = {"max_length": 4, **kwargs}
        with pytest.raises(error, match=match):
            pack_dataset(Dataset.from_dict(columns), **kwargs)

    def test_not_a_dataset(self):
        with pytest.raises(PackingTypeError, match=r"got dict"):
            pack_dataset(SMALL, 4)


class TestPackedDatasetEpochs:
    def test_same_templates_new_pairings(self):
        # 24 documents of lengths 3 and 1 (each unique): every bin of 4 is [3, 1]; which 3 meets which 1 is the seed's.
        ids = [[100 + i, 200 + i, 300 + i] for i in range(12)] + [[i] for i in range(12)]
        epochs = PackedDatasetEpochs(Dataset.from_dict({"input_ids": ids}), 4, seed=0)
        first, second = epochs.repack(0), epochs.repack(1)
        assert sorted(first["seq_lengths"]) == sorted(second["seq_lengths"]) == [[3, 1]] * 12
        assert sorted(map(tuple, first["input_ids"])) != sorted(map(tuple, second["input_ids"]))
        assert epochs.stats.num_bins == 12
        assert documents_out(first.to_list()) == documents_out(second.to_list())
        assert epochs.repack(0)["input_ids"] == first["input_ids"]

    def test_concatenated_epochs_are_each_epochs_packing_in_turn(self):
        """What one Trainer epoch trains as several: each epoch's rows, one epoch after the other, every document once
        per epoch."""
        ids = [[100 + i, 200 + i, 300 + i] for i in range(12)] + [[i] for i in range(12)]
        epochs = PackedDatasetEpochs(Dataset.from_dict({"input_ids": ids}), 4, seed=0)
        together = epochs.concatenated(3, first_epoch=1)
        assert together.to_list() == [row for epoch in (1, 2, 3) for row in epochs.repack(epoch).to_list()]
        assert documents_out(together.to_list()) == sorted(documents_out(epochs.repack(0).to_list()) * 3)
        with pytest.raises(PackingValueError, match=r"`num_epochs` must be .*0"):
            epochs.concatenated(0)


class TestStreaming:
    def test_matches_map_style_contract(self):
        rng = np.random.default_rng(0)
        input_ids = [rng.integers(0, 1000, n).tolist() for n in rng.integers(0, 40, 300)]
        stream = Dataset.from_dict({"input_ids": input_ids}).to_iterable_dataset()
        rows = list(pack_dataset(stream, 32, overflow="split", buffer_size=50))
        assert all(len(row["input_ids"]) <= 32 for row in rows)
        assert documents_out(rows) == documents_expected(input_ids, input_ids, 32, "split")

    def test_efficiency_against_global_packing(self, caplog):
        # Lognormal lengths as in the engine benchmark, scaled down: 4,000 sequences, rows of 1,024 tokens.
        lengths = np.clip(np.random.default_rng(0).lognormal(5.0, 1.0, 4000).astype(int), 1, 1024)
        ds = Dataset.from_dict({"input_ids": [[1] * n for n in lengths]})
        _, stats = pack_dataset(ds, 1024, return_stats=True)
        streamed = list(pack_dataset(ds.to_iterable_dataset(), 1024, buffer_size=500))
        streaming_efficiency = sum(map(len, (r["input_ids"] for r in streamed))) / (len(streamed) * 1024)
        print(f"global bfd {stats.efficiency:.4f}, streaming (buffer 500) {streaming_efficiency:.4f}")
        assert streaming_efficiency <= stats.efficiency
        assert streaming_efficiency > stats.efficiency - 0.02

    @pytest.mark.parametrize("input_ids", [[], [[1, 2], [3, 4]]])
    def test_nothing_left_for_the_last_round(self, input_ids):
        def examples():
            yield from ({"input_ids": ids} for ids in input_ids)

        stream = datasets.IterableDataset.from_generator(examples)
        assert [row["input_ids"] for row in pack_dataset(stream, 2, buffer_size=2)] == input_ids

    @pytest.mark.parametrize("workers", [0, 1], ids=["in process", "persistent worker"])
    def test_each_epoch_reshuffles_the_stream_it_packs(self, workers):
        """`Trainer` calls `set_epoch` on the packed stream each epoch: it reaches the shuffled stream under it, so
        each epoch packs the documents in that epoch's order (the same rows every epoch before), in DataLoader workers
        too."""
        import torch

        rng = np.random.default_rng(0)
        lengths = rng.integers(1, 20, 60)
        documents = Dataset.from_dict({"input_ids": [rng.integers(3, 128, n).tolist() for n in lengths]})

        def shuffled():
            return documents.to_iterable_dataset(num_shards=6).shuffle(seed=0, buffer_size=8)

        packed = pack_dataset(shuffled(), 32, buffer_size=16)
        loader = torch.utils.data.DataLoader(packed, batch_size=None, num_workers=workers,
                                             persistent_workers=workers > 0)
        epochs = []
        for epoch in (0, 1, 0):
            packed.set_epoch(epoch)
            epochs.append([[int(token) for token in row["input_ids"]] for row in loader])
        assert epochs[0] != epochs[1]
        assert epochs[2] == epochs[0]
        if not workers:  # `datasets` orders a stream's shards otherwise in a worker process, packed or not
            alone = shuffled()
            alone.set_epoch(1)
            assert epochs[1] == [row["input_ids"] for row in pack_dataset(alone, 32, buffer_size=16)]

    def test_iterable_dataset_dict_packs_each_split(self):
        splits = datasets.IterableDatasetDict({"train": Dataset.from_dict(SMALL).to_iterable_dataset()})
        assert [row["input_ids"] for row in pack_dataset(splits, 4)["train"]] == [[1, 2, 3, 6], [4, 5]]

    def test_errors(self):
        stream = Dataset.from_dict({"input_ids": [[1, 2, 3]]}).to_iterable_dataset()
        with pytest.raises(PackingValueError, match=r"strategy"):
            pack_dataset(stream, 2, strategy="nope")
        with pytest.raises(SequenceTooLongError, match=r"row 0"):
            list(pack_dataset(stream, 2))
        with pytest.raises(PackingValueError, match=r"return_stats"):
            pack_dataset(stream, 2, return_stats=True)
        with pytest.raises(PackingValueError, match=r"`buffer_size` must be an integer >= 2"):
            pack_dataset(stream, 2, buffer_size=1)

    @pytest.mark.parametrize("column", ["labels", "completion_mask", "input_ids"])
    def test_a_null_column_is_refused_as_map_style_refuses_it(self, column):
        """A null `completion_mask` meant "train every token" when streamed, and a null `labels` was a dtype error."""
        dataset = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], column: [[1, 1, 1], None]})
        with pytest.raises(PackingValueError, match=rf"Column '{column}' is null in row 1\. Fill or filter that row"):
            pack_dataset(dataset, 8)
        with pytest.raises(PackingValueError, match=rf"'{column}' of example 1 of the stream is null\. Fill or filter "
                                                    r"that example before packing"):
            list(pack_dataset(dataset.to_iterable_dataset(), 8))


class TestRefusedInput:
    """Input that would pack without an error but train on the wrong tokens: rows packed already, and padding."""

    ALREADY_PACKED = r"'seq_lengths' column: its rows are packed already.*new `max_length`"
    PADDED = r"holds 0: the examples were tokenized with padding.*`padding=False`"

    def test_packed_rows_are_not_packed_again(self):
        once = pack_dataset(Dataset.from_dict(SMALL), 4)
        for again in (lambda: pack_dataset(once, 8), lambda: PackedDatasetEpochs(once, 8),
                      lambda: pack_dataset(once.to_iterable_dataset(), 8)):
            with pytest.raises(PackingValueError, match=r"`dataset` has a " + self.ALREADY_PACKED):
                again()
        with pytest.raises(PackingValueError, match=r"^Split 'train': `dataset` has a " + self.ALREADY_PACKED):
            pack_dataset(DatasetDict({"train": once}), 8)

    def test_packed_rows_of_a_stream_without_features(self):
        def rows():
            yield {"input_ids": [1, 2, 3], "seq_lengths": [2, 1]}

        stream = datasets.IterableDataset.from_generator(rows)
        with pytest.raises(PackingValueError, match=r"Example 0 of the stream has a " + self.ALREADY_PACKED):
            list(pack_dataset(stream, 8))

    @pytest.mark.parametrize("mask", [[[1, 1, 0], [1, 1, 1]], [[1, 1, 1], [0, 1, 1]]])  # right and left padding
    def test_padded_tokenization_is_refused(self, mask):
        ds = Dataset.from_dict({"input_ids": [[5, 6, 0], [0, 7, 8]], "attention_mask": mask})
        row = 0 if 0 in mask[0] else 1
        with pytest.raises(PackingValueError, match=rf"Column 'attention_mask' in row {row} " + self.PADDED):
            pack_dataset(ds, 8)
        with pytest.raises(PackingValueError, match=rf"'attention_mask' of example {row} " + self.PADDED):
            list(pack_dataset(ds.to_iterable_dataset(), 8))

    def test_unpadded_attention_mask_packs_and_is_dropped(self):
        ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]], "attention_mask": [[1, 1, 1], [1, 1], [1]]})
        assert pack_dataset(ds, 4).to_dict() == pack_dataset(Dataset.from_dict(SMALL), 4).to_dict()
        assert [row["input_ids"] for row in pack_dataset(ds.to_iterable_dataset(), 4)] == [[1, 2, 3, 6], [4, 5]]

    def test_padding_is_found_in_any_record_batch_and_named_as_the_caller_counts(self, tmp_path, monkeypatch):
        monkeypatch.setattr(token_columns, "_CHECK_WINDOW", 50)  # many windows, over many chunks
        rows = 3000
        masks = [[1] * 10 for _ in range(rows)]
        masks[2345][7] = 0
        Dataset.from_dict({"input_ids": [[1] * 10] * rows, "attention_mask": masks}).save_to_disk(tmp_path)
        ds = datasets.load_from_disk(tmp_path)  # memory-mapped, one chunk per 1,000 rows
        assert ds.data.table.column("attention_mask").num_chunks > 1
        with pytest.raises(PackingValueError, match=r"Column 'attention_mask' in row 2345 " + self.PADDED):
            pack_dataset(ds, 64)
        with pytest.raises(PackingValueError, match=r"Column 'attention_mask' in row 345 " + self.PADDED):
            pack_dataset(ds.select(range(2000, 3000)), 64)
        assert sum(map(len, pack_dataset(ds.select(range(2000)), 64)["seq_lengths"])) == 2000
