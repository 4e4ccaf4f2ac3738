"""`pack_dataset` at corpus scale: memory-mapped input read in place, lean output columns, the datasets-style cache."""

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets import Dataset, DatasetDict
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from llm_packing.batches.collator import DataCollatorWithPacking
from llm_packing.core.stats import PackingStats
from llm_packing.data import pack as dataset_module
from llm_packing.data._io import packed_cache, split_documents, token_columns
from llm_packing.data.pack import PackedDatasetEpochs, pack_dataset
from llm_packing.errors import PackingError, PackingValueError


def random_columns(num_rows=60, seed=0, labels=True, masks=True):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 30, num_rows)
    columns = {"input_ids": [rng.integers(0, 1000, n).tolist() for n in lengths]}
    if labels:
        columns["labels"] = [np.where(rng.random(n) < 0.3, -100, ids).tolist()
                             for n, ids in zip(lengths, columns["input_ids"], strict=True)]
    if masks:
        columns["completion_mask"] = [(rng.random(n) < 0.8).astype(int).tolist() for n in lengths]
        columns["assistant_masks"] = [(rng.random(n) < 0.9).tolist() for n in lengths]  # booleans: Arrow packs bits
    columns["text"] = ["x"] * num_rows
    return columns


def mapped(tmp_path, columns, rows_per_batch=7, name="documents.arrow") -> Dataset:
    """`columns` as a memory-mapped cache file of `rows_per_batch`-row record batches, as `.map` writes them."""
    table = Dataset.from_dict(columns).data.table
    path = str(tmp_path / name)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=rows_per_batch)
    return Dataset.from_file(path)


class TestMemoryMappedInput:
    @pytest.mark.parametrize("chunk", [5, 1 << 20])
    def test_same_rows_as_in_memory(self, tmp_path, monkeypatch, chunk):
        # `chunk` 5: every row its own written chunk (rows are longer), so chunk bounds are exercised.
        monkeypatch.setattr(split_documents, "GATHER_CHUNK_TOKENS", chunk)
        columns = random_columns()
        ds = mapped(tmp_path, columns)
        assert ds.data.table.column("input_ids").num_chunks == 9 and ds.cache_files
        for overflow in ("split", "truncate", "drop"):
            expected = pack_dataset(Dataset.from_dict(columns), 20, overflow=overflow, seed=3,
                                    return_position_ids=True)
            packed = pack_dataset(ds, 20, overflow=overflow, seed=3, return_position_ids=True)
            assert packed.column_names == ["input_ids", "labels", "position_ids", "seq_lengths"]
            assert packed.to_dict() == expected.to_dict()
            assert packed.cache_files and expected.cache_files == []

    def test_labels_and_masks_are_applied(self, tmp_path):
        ds = mapped(tmp_path, {"input_ids": [[1, 2, 3], [4, 5]], "labels": [[1, -100, 3], [4, 5]],
                               "assistant_masks": [[True, True, False], [True, True]]}, rows_per_batch=1)
        assert pack_dataset(ds, 5).to_dict()["labels"] == [[-100, -100, -100, -100, 5]]

    def test_fixed_size_token_lists_pack_as_lists(self, tmp_path):
        """`Sequence(Value, length=n)` columns are Arrow lists of a fixed size, without offsets (a raw
        `AttributeError` before); packed as the same rows given as lists."""
        fixed = datasets.Sequence(datasets.Value("int32"), length=3)
        columns = {"input_ids": [[1, 2, 3], [4, 5, 6], [7, 8, 9]], "labels": [[1, -100, 3], [4, 5, 6], [7, 8, 9]],
                   "attention_mask": [[1, 1, 1]] * 3}
        features = datasets.Features(dict.fromkeys(columns, fixed))
        for dataset in (Dataset.from_dict(columns, features=features),
                        mapped(tmp_path, columns, rows_per_batch=1).cast(features)):
            assert pack_dataset(dataset, 7).to_dict() == pack_dataset(Dataset.from_dict(columns), 7).to_dict()

    def test_the_token_column_is_not_copied(self, tmp_path):
        # combine_chunks of the tokens would hold 4 bytes per token from Arrow's pool; the lengths take 8 per row.
        ds = mapped(tmp_path, {"input_ids": [list(range(500))] * 400}, rows_per_batch=10)
        before = pa.total_allocated_bytes()
        documents = dataset_module.SplitDocuments(ds, 500, "error")
        assert pa.total_allocated_bytes() - before < 500 * 400 * 4 // 10
        assert documents.input_ids.take(np.array([documents.input_ids.row_start[399] + 7])).tolist() == [7]

    def test_errors_name_the_row_across_chunks(self, tmp_path):
        columns = {"input_ids": [[1, 2]] * 20, "labels": [[1, 2]] * 19 + [[1, -7]]}
        with pytest.raises(PackingValueError, match=r"'labels' in row 19 holds -7"):
            pack_dataset(mapped(tmp_path, columns, rows_per_batch=3), 4)

    def test_values_checked_while_packing_stop_it_and_leave_no_file(self, tmp_path, monkeypatch):
        # The values are checked on a thread while the rows are gathered: the gather asks between groups (one per
        # chunk here) and stops once a check failed; nothing is written, and the error is the one a check in turn
        # raised.
        monkeypatch.setattr(split_documents, "GATHER_CHUNK_TOKENS", 4)
        monkeypatch.setattr(split_documents, "_GROUP_TOKENS", 4)
        asked = []
        real = split_documents.write_rows
        monkeypatch.setattr(split_documents, "write_rows", lambda *args, between_groups, **kwargs: real(
            *args, between_groups=lambda: (asked.append(1), between_groups())[-1], **kwargs))
        ds = mapped(tmp_path, {"input_ids": [[1, 2]] * 39 + [[2**31, 2]]}, rows_per_batch=3, name="bad.arrow")
        with pytest.raises(PackingValueError, match=r"Column 'input_ids' in row 39 holds 2147483648"):
            pack_dataset(ds, 4, cache_file_name=str(tmp_path / "packed.arrow"))
        assert [path.name for path in tmp_path.iterdir()] == ["bad.arrow"]
        assert asked

    @pytest.mark.parametrize("column, bad", [("input_ids", -5), ("input_ids", 2**31), ("input_ids", None),
                                             ("labels", -7), ("labels", None)])
    def test_a_bad_value_names_its_row_across_chunks_and_windows(self, tmp_path, monkeypatch, column, bad):
        """The windows' min/max says only that a value is wrong; the row is found after, and only then."""
        monkeypatch.setattr(token_columns, "_CHECK_WINDOW", 5)
        rows = [[1, 2]] * 20 + [[3, bad]] + [[4, 2**31 if column == "input_ids" else -9]] + [[5, 6]] * 8
        columns = {"input_ids": rows} if column == "input_ids" else {"input_ids": [[1, 2]] * 30, "labels": rows}
        shown = "a null value" if bad is None else bad
        with pytest.raises(PackingValueError, match=rf"Column '{column}' in row 20 holds {shown}"):
            pack_dataset(mapped(tmp_path, columns, rows_per_batch=3), 4)

    def test_value_checks_raise_the_first_failure_and_only_what_is_done_unless_waiting(self):
        checks, release = token_columns.ValueChecks(), threading.Event()
        checks.add(lambda: None)
        checks.add(lambda: (release.wait(), _raise(PackingValueError("second")))[0])
        checks.add(lambda: _raise(PackingValueError("third")))
        checks.raise_failed(wait=False)  # the second is still running: nothing to raise yet
        release.set()
        with pytest.raises(PackingValueError, match="second"):
            checks.raise_failed()


def _has_direct_io(directory) -> bool:
    """Whether the filesystem of `directory` takes O_DIRECT writes (Linux's ext4 and xfs do)."""
    import os

    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        (directory / "probe").unlink(missing_ok=True)


def _raise(error):
    raise error

class TestLeanColumns:
    @pytest.mark.parametrize(
        "extra, kept",
        [
            ({"labels": [[1, 2, 3], [4, 5]]}, False),  # the ids themselves
            ({"labels": [[-100, 2, 3], [-100, 5]]}, False),  # -100 on each first token: what the collator sets
            ({"completion_mask": [[0, 1, 1], [1, 1]]}, False),
            ({"labels": [[1, -100, 3], [4, 5]]}, True),
            ({"labels": [[1, 2, 9], [4, 5]]}, True),
            ({"assistant_masks": [[1, 1, 1], [1, 0]]}, True),
        ],
    )
    def test_labels_only_when_they_say_more(self, extra, kept):
        packed = pack_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], **extra}), 8)
        assert ("labels" in packed.column_names) == kept

    @pytest.mark.parametrize("padding_free", [False, True])
    def test_collators_derive_what_is_left_out(self, padding_free):
        columns = random_columns(labels=False, masks=False)
        ds = Dataset.from_dict({"input_ids": [ids for ids in columns["input_ids"] if ids]})
        lean = pack_dataset(ds, 40).to_list()
        full = [{**row, "labels": row["input_ids"][:]} for row in pack_dataset(ds, 40, return_position_ids=True)]
        for row in full:
            for start in np.cumsum([0, *row["seq_lengths"][:-1]]):
                row["labels"][start] = -100
        assert lean[0].keys() == {"input_ids", "seq_lengths"}
        collators = [DataCollatorWithPacking(padding_free=padding_free, check_model_configured=False)]
        if padding_free:  # TRL's other layout ignores `seq_lengths`: one document would attend to the next
            collators.append(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True))
        for collator in collators:
            ours, theirs = collator(lean), collator(full)
            assert ours.keys() == theirs.keys()
            for key in ours:
                assert torch.equal(torch.as_tensor(ours[key]), torch.as_tensor(theirs[key])), key
            assert ours["position_ids"][0, : len(full[0]["position_ids"])].tolist() == full[0]["position_ids"]

    def test_streams_follow_their_declared_features(self):
        stream = Dataset.from_dict({"input_ids": [[1, 2], [3]]}).to_iterable_dataset()
        assert list(pack_dataset(stream, 4)) == [{"input_ids": [1, 2, 3], "seq_lengths": [2, 1]}]
        labelled = Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1, 2]]}).to_iterable_dataset()
        assert list(pack_dataset(labelled, 4))[0]["labels"] == [-100, 2]

_STATS = PackingStats.from_bin_token_counts([2], num_sequences=1, capacity=4)


class TestCache:
    def test_second_call_loads_the_cache_file(self, tmp_path, monkeypatch):
        ds = mapped(tmp_path, random_columns())
        packed, stats = pack_dataset(ds, 20, overflow="split", return_stats=True)
        [cache_file] = packed.cache_files
        assert cache_file["filename"].startswith(str(tmp_path / f"cache-llm_packing-v{packed_cache.LAYOUT_VERSION}-"))

        def refuse(*args, **kwargs):
            raise AssertionError("packed again instead of loading the cache")

        monkeypatch.setattr(dataset_module, "SplitDocuments", refuse)
        again, again_stats = pack_dataset(ds, 20, overflow="split", return_stats=True)
        assert again.to_dict() == packed.to_dict() and again_stats == stats
        assert again._fingerprint == packed._fingerprint
        with pytest.raises(AssertionError, match="packed again"):
            pack_dataset(ds, 20, overflow="split", load_from_cache_file=False)
        for changed in ({"max_length": 21}, {"seed": 1}, {"overflow": "drop"}, {"return_position_ids": True},
                        {"max_docs_per_bin": 3}, {"strategy": "ffd"}):
            with pytest.raises(AssertionError, match="packed again"):
                pack_dataset(ds, **{"max_length": 20, "overflow": "split", **changed})

    def test_keep_in_memory_and_in_memory_input_write_no_file(self, tmp_path):
        assert pack_dataset(mapped(tmp_path, random_columns()), 40, keep_in_memory=True).cache_files == []
        assert pack_dataset(Dataset.from_dict(random_columns()), 40).cache_files == []
        assert list(tmp_path.iterdir()) == [tmp_path / "documents.arrow"]

    def test_cache_file_name(self, tmp_path, monkeypatch):
        path = str(tmp_path / "packed.arrow")
        packed = pack_dataset(Dataset.from_dict(random_columns()), 40, cache_file_name=path)
        assert packed.cache_files[0]["filename"] == path
        monkeypatch.setattr(dataset_module, "SplitDocuments", None)  # loading must not read the documents
        assert pack_dataset(Dataset.from_dict(random_columns()), 40, cache_file_name=path).to_dict() == \
            packed.to_dict()
        with pytest.raises(PackingValueError, match=r"`cache_file_name`='x.arrow' names one file.*per split"):
            pack_dataset(DatasetDict({"train": Dataset.from_dict(random_columns())}), 40, cache_file_name="x.arrow")

    def test_a_cache_file_name_given_again_for_other_inputs_is_packed_again(self, tmp_path):
        """`cache_file_name` names the file, not what is in it: the same name given for another `max_length`,
        another dataset or another option packs again (it loaded the first call's rows: rows longer than the new
        `max_length`, another dataset's documents, no `position_ids` when asked for)."""
        path = str(tmp_path / "packed.arrow")
        first = pack_dataset(Dataset.from_dict(random_columns()), 40, cache_file_name=path)
        for dataset, max_length, options in [(random_columns(), 32, {}), (random_columns(seed=1), 40, {}),
                                             (random_columns(), 40, {"return_position_ids": True})]:
            again = pack_dataset(Dataset.from_dict(dataset), max_length, cache_file_name=path, **options)
            expected = pack_dataset(Dataset.from_dict(dataset), max_length, keep_in_memory=True, **options)
            assert again.to_dict() == expected.to_dict() != first.to_dict()

    def test_a_file_of_another_layout_is_never_read(self, tmp_path, monkeypatch):
        ds = mapped(tmp_path, random_columns())
        named = str(tmp_path / "named.arrow")
        monkeypatch.setattr(packed_cache, "LAYOUT_VERSION", 1)
        old = pack_dataset(ds, 40)
        pack_dataset(ds, 40, cache_file_name=named)
        monkeypatch.setattr(packed_cache, "LAYOUT_VERSION", 2)
        calls = []
        real = dataset_module.SplitDocuments
        monkeypatch.setattr(dataset_module, "SplitDocuments", lambda *args: calls.append(args) or real(*args))
        new = pack_dataset(ds, 40)
        assert new.cache_files[0]["filename"] != old.cache_files[0]["filename"] and "-v2-" in \
            new.cache_files[0]["filename"]
        pack_dataset(ds, 40, cache_file_name=named)  # same name, older layout inside: packed again, overwritten
        assert len(calls) == 2

    def test_caching_disabled_packs_to_a_temporary_file(self, tmp_path, monkeypatch):
        ds = mapped(tmp_path, random_columns())
        datasets.disable_caching()
        try:
            first, second = pack_dataset(ds, 40), pack_dataset(ds, 40)
        finally:
            datasets.enable_caching()
        assert first.cache_files[0]["filename"] != second.cache_files[0]["filename"]
        assert not first.cache_files[0]["filename"].startswith(str(tmp_path))
        assert first.to_dict() == second.to_dict()

    @pytest.mark.parametrize("direct", [True, False])
    def test_concurrent_writes_make_the_stream_new_stream_writes(self, tmp_path, monkeypatch, direct):
        # Chunks of 1,500 rows (two record batches each) and of 1 row, written by several threads at offsets fixed
        # in order: the file must be byte for byte what one `pa.ipc.new_stream` writer makes of the same chunks.
        schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("seq_lengths", pa.list_(pa.int32()))])
        rng = np.random.default_rng(0)
        chunks = []
        for rows in (1500, 1, 1500, 7):
            lengths = rng.integers(1, 9, rows)
            chunks.append(pa.table({"input_ids": [rng.integers(0, 99, n).tolist() for n in lengths],
                                    "seq_lengths": [[int(n)] for n in lengths]}, schema=schema))
        if not direct:
            monkeypatch.setattr(packed_cache.DirectFile, "open", lambda path: None)
        target = packed_cache.Destination(str(tmp_path / "packed.arrow"), "fingerprint", False)
        writer = packed_cache.PackedWriter(target, schema, _STATS)
        assert (writer._direct is not None) == (direct and _has_direct_io(tmp_path))
        for chunk in chunks:
            writer.write(chunk)
        packed = writer.finish(None)
        with pa.OSFile(str(tmp_path / "reference.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, writer.schema) as reference:
            for chunk in chunks:
                reference.write_table(chunk, max_chunksize=1000)
        assert (tmp_path / "packed.arrow").read_bytes() == (tmp_path / "reference.arrow").read_bytes()
        assert packed.data.table.equals(pa.concat_tables(chunks).replace_schema_metadata(writer.schema.metadata))
        assert len(list(tmp_path.iterdir())) == 2

    def test_written_pages_are_sent_to_disk_and_dropped_behind_a_window(self, tmp_path, monkeypatch):
        # Every chunk's bytes are handed to the kernel's writeback once written (a DONTNEED on dirty pages starts
        # it), and the bytes more than the window behind the newest chunk are dropped once, never those within it.
        monkeypatch.setattr(packed_cache.DirectFile, "open", lambda path: None)  # no O_DIRECT: the page cache
        monkeypatch.setattr(packed_cache, "_DROP_BEHIND_BYTES", 4096)
        advised = []
        real = packed_cache.os.posix_fadvise
        monkeypatch.setattr(packed_cache.os, "posix_fadvise", lambda fd, offset, length, advice: (
            advised.append((offset, offset + length, advice)), real(fd, offset, length, advice))[-1])
        schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
        target = packed_cache.Destination(str(tmp_path / "packed.arrow"), "fingerprint", False)
        writer = packed_cache.PackedWriter(target, schema, _STATS)
        chunks = []
        for _ in range(20):
            chunks.append((writer._offset, writer.write(pa.table({"input_ids": [list(range(1000))]}, schema=schema))))
            chunks[-1][1].result()  # one at a time: which ranges are dropped is then known
        end = writer._offset
        writer.finish(None)
        assert {advice for _, _, advice in advised} == {packed_cache.os.POSIX_FADV_DONTNEED}
        starts = [start for start, _ in chunks]
        sent = [(a, b) for a, b, _ in advised if a in starts]
        assert sent == list(zip(starts, starts[1:] + [end], strict=True))
        dropped = [(a, b) for a, b, _ in advised if (a, b) not in sent]
        assert dropped[0][0] == 0 and all(b == a for (_, b), (a, _) in itertools.pairwise(dropped))
        assert dropped[-1][1] == starts[-1] - 4096
        assert (tmp_path / "packed.arrow").stat().st_size == end + 8

    def test_packed_files_open_without_reading_the_rows(self, tmp_path):
        # As `MemoryMappedTable.from_file` opens them (same table, path, pickling), but through a mapping without
        # readahead, so that opening does not read back what `PackedWriter` just dropped from the page cache.
        import pickle

        ds = mapped(tmp_path, random_columns(masks=False), rows_per_batch=3)
        path = ds.cache_files[0]["filename"]
        table = packed_cache._open_memory_mapped(path)
        reference = datasets.table.MemoryMappedTable.from_file(path)
        assert table.table.equals(reference.table) and table.path == path
        assert pickle.loads(pickle.dumps(table)).table.equals(reference.table)

    def test_a_failed_write_leaves_no_file(self, tmp_path, monkeypatch):
        def full_disk(*args):
            raise OSError(28, "No space left on device")

        target = packed_cache.Destination(str(tmp_path / "packed.arrow"), "fingerprint", False)
        schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
        writer = packed_cache.PackedWriter(target, schema, _STATS)
        monkeypatch.setattr(packed_cache.os, "pwrite", full_disk)
        writer.write(pa.table({"input_ids": [[1, 2]]}, schema=schema))
        with pytest.raises(OSError, match="No space left"):
            writer.finish(None)
        assert list(tmp_path.iterdir()) == []

    def test_epochs_each_get_a_cache_file(self, tmp_path, monkeypatch):
        """Each epoch's rows are written once, to a file of its own: the same epoch asked again loads that file with
        the same rows (nothing is packed again), and another epoch pairs the same documents anew."""
        epochs = PackedDatasetEpochs(mapped(tmp_path, random_columns()), 40)
        first, second = epochs.repack(0), epochs.repack(1)
        monkeypatch.setattr(split_documents, "plan_rows", _never_called)
        again = epochs.repack(0)
        files = [dataset.cache_files[0]["filename"] for dataset in (first, second, again)]
        assert files[0] == files[2] != files[1]
        assert again["input_ids"] == first["input_ids"] and again["seq_lengths"] == first["seq_lengths"]
        assert first["input_ids"] != second["input_ids"]
        assert sorted(map(len, first["input_ids"])) == sorted(map(len, second["input_ids"]))
        assert _documents(first) == _documents(second)


def _never_called(*args, **kwargs):
    raise AssertionError("packed again instead of loading the epoch's cache file")


def _documents(packed) -> list[tuple[int, ...]]:
    """Every document of the packed rows, as a sorted list of token tuples."""
    found = []
    for ids, lengths in zip(packed["input_ids"], packed["seq_lengths"], strict=True):
        bounds = np.cumsum([0, *lengths])
        found += [tuple(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    return sorted(found)



class _FakeValues:
    offset = 1

    def __init__(self, address, size):
        self._buffer = SimpleNamespace(address=address, size=size)

    def buffers(self):
        return [None, self._buffer]

    def __len__(self):
        return 1


class _FakeChunk:
    """A list chunk whose values buffer lies at `address` (only what `_span` reads)."""

    def __init__(self, address, offsets):
        self.values = _FakeValues(address, 4 * offsets[-1])
        self.offsets = pa.array(np.array(offsets, np.int32))

    def __len__(self):
        return len(self.offsets) - 1


def test_row_starts_past_int32():
    # A 16 GiB corpus: chunks 8 GiB apart put row starts past 2**31 values, while list offsets are int32.
    chunks = [_FakeChunk(1 << 20, [0, 2, 5]), _FakeChunk((1 << 20) + (8 << 30), [0, 3])]
    _, row_start = token_columns._span(chunks, np.dtype(np.int32), False, 3)
    assert row_start.tolist() == [1, 3, (8 << 30) // 4 + 1]


class TestNumProc:
    """`num_proc`: the rows of a split written to a cache file, gathered by forked processes into shard files."""

    def test_same_rows_and_cache_whatever_num_proc(self, tmp_path, monkeypatch):
        monkeypatch.setattr(split_documents, "GATHER_CHUNK_TOKENS", 64)  # many chunks: every process writes several
        ds = mapped(tmp_path, random_columns(num_rows=300))
        expected = pack_dataset(ds, 40, overflow="split", keep_in_memory=True, return_position_ids=True)
        sharded = pack_dataset(ds, 40, overflow="split", num_proc=3, return_position_ids=True)
        assert [file["filename"].rsplit("_", 3)[-3:] for file in sharded.cache_files] == [
            ["00000", "of", "00003.arrow"], ["00001", "of", "00003.arrow"], ["00002", "of", "00003.arrow"]]
        assert sharded.to_dict() == expected.to_dict()
        monkeypatch.setattr(dataset_module, "SplitDocuments", None)  # loading must not read the documents
        assert pack_dataset(ds, 40, overflow="split", return_position_ids=True).to_dict() == expected.to_dict()

    def test_a_single_file_written_later_is_loaded_before_older_shards(self, tmp_path):
        ds = mapped(tmp_path, random_columns())
        pack_dataset(ds, 40, num_proc=2)
        single = pack_dataset(ds, 40, load_from_cache_file=False)
        assert len(single.cache_files) == 1 and pack_dataset(ds, 40).cache_files == single.cache_files
        shards = pack_dataset(ds, 40, num_proc=2, load_from_cache_file=False)  # replaces the single file
        assert pack_dataset(ds, 40).cache_files == shards.cache_files and len(shards.cache_files) == 2

    def test_a_failing_process_leaves_no_shard_and_says_why(self, tmp_path, monkeypatch):
        ds = mapped(tmp_path, random_columns())
        real = packed_cache.PackedWriter.close

        def fail_in_second_shard(self):
            if "_00001_of_" in self.target.path:
                raise OSError(28, "No space left on device")
            real(self)

        monkeypatch.setattr(packed_cache.PackedWriter, "close", fail_in_second_shard)
        with pytest.raises(PackingError, match=r"1 of the 2 `num_proc` packing processes failed(.|\n)*No space left"):
            pack_dataset(ds, 40, num_proc=2)
        assert sorted(path.name for path in tmp_path.iterdir()) == ["documents.arrow"]

    def test_fewer_rows_than_processes(self, tmp_path):
        for rows in ([], [[1, 2]], [[1, 2], [3] * 39]):
            ds = mapped(tmp_path, {"input_ids": rows} if rows else {"input_ids": [[1]]}, name=f"{len(rows)}.arrow")
            ds = ds if rows else ds.select([])
            assert pack_dataset(ds, 40, num_proc=4).to_dict() == pack_dataset(ds, 40, keep_in_memory=True).to_dict()

    def test_in_memory_rows_ignore_num_proc_and_bad_values_are_refused(self, tmp_path):
        columns = random_columns()
        assert pack_dataset(Dataset.from_dict(columns), 40, num_proc=2).to_dict() == \
            pack_dataset(Dataset.from_dict(columns), 40).to_dict()
        with pytest.raises(PackingValueError, match=r"`num_proc` must be a positive integer or None .*got 0"):
            pack_dataset(Dataset.from_dict(columns), 40, num_proc=0)


_KILLED_WRITER = """
import sys, time
import datasets
from llm_packing import pack_dataset
from llm_packing.data._io import packed_cache

write = packed_cache.PackedWriter.write

def write_then_hang(self, table):
    future = write(self, table)
    future.result()
    open(sys.argv[2], "w").close()  # a chunk is on disk: tell the parent, then wait for the kill
    time.sleep(600)

packed_cache.PackedWriter.write = write_then_hang
pack_dataset(datasets.Dataset.from_file(sys.argv[1]), 40)
"""


def test_a_pack_killed_mid_write_leaves_nothing_a_later_call_takes_as_complete(tmp_path):
    """SIGKILL while the cache file is being written (no handler runs): the half-written file never has the cache
    file's name, the next call packs every token and writes a complete file, and the orphaned temporary goes."""
    dataset = mapped(tmp_path, random_columns(num_rows=300))
    started = tmp_path / "chunk-written"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, dataset.cache_files[0]["filename"], str(started)])
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert child.poll() is None and time.monotonic() < deadline, "the writer never wrote a chunk"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    orphans = [path.name for path in tmp_path.iterdir()
               if path.name.startswith("tmp-llm_packing-") and f"-{child.pid}-" in path.name]
    assert len(orphans) == 1 and os.path.getsize(tmp_path / orphans[0]) > 0
    packed = pack_dataset(datasets.Dataset.from_file(dataset.cache_files[0]["filename"]), 40)
    assert _documents(packed) == sorted(tuple(ids) for ids in dataset["input_ids"] if ids)
    assert not (tmp_path / orphans[0]).exists()
    assert pack_dataset(datasets.Dataset.from_file(dataset.cache_files[0]["filename"]), 40)["input_ids"] == (
        packed["input_ids"])  # the complete file is what a later call loads


def test_orphaned_temporaries_of_other_machines_are_left_alone(tmp_path):
    """On a folder several machines share, a temporary named for another host is never removed: its process id
    means nothing here."""
    from llm_packing.data._io import packed_cache

    dead_pid = 2**22 + 12345  # above Linux's default pid_max: no such process
    mine = tmp_path / f"{packed_cache._local_temporary_prefix().rsplit('-', 2)[0]}-{dead_pid}-x"
    theirs = tmp_path / f"tmp-llm_packing-another_node-{dead_pid}-x"
    for path in (mine, theirs):
        path.write_bytes(b"half a file")
    assert packed_cache.remove_orphaned_temporaries(str(tmp_path)) == [str(mine)]
    assert theirs.exists() and not mine.exists()
