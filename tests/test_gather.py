"""Packed rows read a group at a time in input order, and the memory-mapped input's pages given back as they add up."""

import numpy as np
import pyarrow as pa
import pytest
from datasets import Dataset

from llm_packing.data import pack as dataset_module
from llm_packing.data._io import gather, resident_pages, split_documents, token_columns
from llm_packing.data._io.resident_pages import ResidentPages
from llm_packing.data.pack import pack_dataset
from llm_packing.errors import PackingValueError


def mapped(tmp_path, columns, rows_per_batch=1000) -> Dataset:
    table = columns if isinstance(columns, pa.Table) else Dataset.from_dict(columns).data.table
    path = str(tmp_path / "documents.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=rows_per_batch)
    return Dataset.from_file(path)


def corpus(num_rows, seed=0, max_length=200):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length, num_rows)
    return [rng.integers(0, 50_000, n).tolist() for n in lengths]


def large_corpus(num_rows=40_000, seed=0):
    """~16 MB of int32 tokens, built in Arrow (a Python list per row would take seconds)."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 200, num_rows))]).astype(np.int32)
    tokens = pa.array(rng.integers(0, 50_000, offsets[-1], dtype=np.int32))
    return pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), tokens)})


@pytest.mark.parametrize("group, chunk", [(7, 5), (300, 100), (1 << 26, 1 << 20)])
@pytest.mark.parametrize("copy_runs_from", [1, 1 << 40], ids=["slice per document", "index per token"])
def test_groups_give_the_rows_of_one_pass(tmp_path, monkeypatch, group, chunk, copy_runs_from):
    # Every group (one row or several chunks) is read in input order and put back in row order, whether documents are
    # copied a slice each or gathered token by token; the reference reads in row order, token by token.
    rng = np.random.default_rng(1)
    ids = corpus(300, max_length=40)
    columns = {"input_ids": ids, "labels": [np.where(rng.random(len(x)) < 0.3, -100, x).tolist() for x in ids],
               "assistant_masks": [(rng.random(len(x)) < 0.9).tolist() for x in ids]}
    monkeypatch.setattr(gather, "_RUN_COPY_MIN_TOKENS", 1 << 40)
    expected = [pack_dataset(Dataset.from_dict(columns), 64, overflow=overflow, seed=2, return_position_ids=True)
                for overflow in ("split", "truncate")]
    monkeypatch.setattr(gather, "_RUN_COPY_MIN_TOKENS", copy_runs_from)
    monkeypatch.setattr(split_documents, "_GROUP_TOKENS", group)
    monkeypatch.setattr(split_documents, "GATHER_CHUNK_TOKENS", chunk)
    monkeypatch.setattr(resident_pages, "RESIDENT_LIMIT", 0)  # the mapped input is read in input order
    for overflow, want in zip(("split", "truncate"), expected, strict=True):
        for ds in (Dataset.from_dict(columns), mapped(tmp_path, columns, rows_per_batch=7)):
            packed = pack_dataset(ds, 64, overflow=overflow, seed=2, return_position_ids=True)
            assert packed.to_dict() == want.to_dict()


def test_in_memory_input_has_nothing_to_give_back():
    pages = ResidentPages(pa.table({"input_ids": [[1, 2]]}), limit=0)
    assert pages.mappings == [] and not pages.bounds  # read in row order


def test_pages_read_are_given_back(tmp_path):
    ds = mapped(tmp_path, large_corpus())
    table = ds.data.table
    pages = ResidentPages(table, limit=1 << 20)
    [(start, end)] = pages.mappings  # the one read-only mapping of the file
    assert end - start >= 15 << 20
    before = resident_pages._rss_file()
    assert sum(int(np.asarray(chunk.values).sum()) for chunk in table.column("input_ids").chunks) > 0
    assert resident_pages._rss_file() - before > 8 << 20
    pages.check()
    assert resident_pages._rss_file() - before < 2 << 20
    assert ds[123]["input_ids"] == table.column("input_ids")[123].as_py()  # still readable: mapped back on demand


@pytest.mark.parametrize("limit", [1 << 20, 1 << 40])
@pytest.mark.parametrize("chunk", [1 << 18, 1 << 20])
def test_packing_keeps_the_mapped_input_bounded(tmp_path, monkeypatch, limit, chunk):
    # `chunk` 1 << 20: one slice of tokens per group, its documents spread over the whole file (the span bound).
    ds = mapped(tmp_path, large_corpus())
    monkeypatch.setattr(resident_pages, "RESIDENT_LIMIT", limit)
    monkeypatch.setattr(split_documents, "_GROUP_TOKENS", 1 << 20)
    monkeypatch.setattr(split_documents, "GATHER_CHUNK_TOKENS", chunk)
    monkeypatch.setattr(token_columns, "_CHECK_WINDOW", 1 << 18)
    seen = []
    real = resident_pages._rss_file
    monkeypatch.setattr(resident_pages, "_rss_file", lambda: seen.append(real()) or seen[-1])
    resident_pages.ResidentPages(ds.data.table, limit=0).check()  # start with nothing of it mapped
    packed = pack_dataset(ds, 256, keep_in_memory=True)
    assert sum(packed["seq_lengths"], []) and len(seen) > 10
    rise = max(seen) - seen[0]
    if limit < 1 << 30:  # a slice's reads map whole page-cache folios: a few MiB past the limit at most
        assert rise < limit + (6 << 20)
    else:  # the whole 16 MB file ends up resident when nothing is given back
        assert rise > 12 << 20


class TestIndicesMapping:
    """`select` / `shuffle` / `filter` leave an indices mapping over the table: read through it, not gathered."""

    def test_same_rows_as_the_flattened_dataset(self, tmp_path):
        rng = np.random.default_rng(3)
        ids = corpus(200, max_length=40)
        columns = {"input_ids": ids, "labels": [np.where(rng.random(len(x)) < 0.3, -100, x).tolist() for x in ids],
                   "completion_mask": [(rng.random(len(x)) < 0.8).astype(int).tolist() for x in ids]}
        ds = mapped(tmp_path, columns, rows_per_batch=7)
        for picked in (ds.shuffle(seed=0), ds.select(range(150, 20, -3)), ds.filter(lambda row: len(row) % 2,
                                                                                     input_columns="input_ids")):
            assert picked._indices is not None
            for overflow in ("split", "drop"):
                expected = pack_dataset(picked.flatten_indices(), 32, overflow=overflow, seed=1)
                assert pack_dataset(picked, 32, overflow=overflow, seed=1).to_dict() == expected.to_dict()

    def test_the_picked_rows_are_not_gathered(self, tmp_path):
        ds = mapped(tmp_path, large_corpus()).shuffle(seed=0)
        before = pa.total_allocated_bytes()
        documents = dataset_module.SplitDocuments(ds, 256, "error")
        assert pa.total_allocated_bytes() - before < (16 << 20) // 10  # a gather would copy 16 MB of tokens
        row = ds[5]["input_ids"]
        assert documents.input_ids.take(documents.input_ids.row_start[5] + np.arange(len(row))).tolist() == row

    def test_labels_are_judged_on_the_picked_rows(self):
        ds = Dataset.from_dict({"input_ids": [[1, 2], [3, 4]], "labels": [[1, 2], [3, -100]]})
        assert pack_dataset(ds.select([0]), 4).column_names == ["input_ids", "seq_lengths"]
        assert pack_dataset(ds.select([1, 0]), 4)["labels"] == [[-100, -100, -100, 2]]

    def test_a_bad_row_left_out_is_no_error_and_a_picked_one_is_named(self, tmp_path):
        ds = mapped(tmp_path, {"input_ids": [[1, 2]] * 9 + [[-5, 2]]}, rows_per_batch=3)
        assert sorted(pack_dataset(ds.select(range(9)), 4)["seq_lengths"]) == [[2]] + [[2, 2]] * 4
        with pytest.raises(PackingValueError, match=r"Column 'input_ids' in row 0 holds -5: token ids"):
            pack_dataset(ds.select([9, 0]), 4)
        labelled = Dataset.from_dict({"input_ids": [[1, 2]] * 4, "labels": [[1, 2]] * 3 + [[1, -7]]})
        with pytest.raises(PackingValueError, match=r"'labels' in row 1 holds -7"):
            pack_dataset(labelled.select([0, 3]), 4)
