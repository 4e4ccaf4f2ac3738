"""`pack_dataset_on_ray` on a local Ray cluster (2 CPUs, one per module): the rows of `pack_dataset`, a task that dies
mid-write, empty inputs, bad ids. Slow: starting Ray and its workers takes 20-60 s on a loaded 2-core machine."""

import glob
import os

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm_packing.data.pack import pack_dataset
from llm_packing.errors import PackingError, PackingValueError


ray = pytest.importorskip("ray", reason="pack_dataset_on_ray needs the extra: pip install 'llm_packing[ray]'")
# One cluster for the module: under `pytest -n 2 --dist loadgroup` every test here runs in the same worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

from llm_packing.data.on_ray import pack_dataset_on_ray, read_packed_on_ray  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def blocks(sizes=(70, 0, 45, 25), seed=0, max_length=40):
    """Tokenized blocks: ids, labels with -100 in places and a completion mask, lengths 0 to 1.5 x max_length."""
    rng = np.random.default_rng(seed)
    tables = []
    for size in sizes:
        lengths = rng.integers(0, max_length * 3 // 2, size)
        ids = [rng.integers(0, 1000, n).astype(np.int32) for n in lengths]
        labels = [np.where(rng.random(n) < 0.2, -100, row) for n, row in zip(lengths, ids, strict=True)]
        mask = [(rng.random(n) < 0.8).astype(np.int8) for n in lengths]
        tables.append(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())),
                                "labels": pa.array(labels, pa.list_(pa.int32())),
                                "completion_mask": pa.array(mask, pa.list_(pa.int8()))}))
    return tables


def single_machine(tables, max_length, **options):
    return pack_dataset(datasets.Dataset(datasets.table.InMemoryTable(pa.concat_tables(tables))), max_length,
                        return_stats=True, **options)


def shards(directory):
    return sorted(glob.glob(os.path.join(directory, "*")))


def test_rows_equal_pack_dataset_and_load_as_datasets_and_ray(tmp_path):
    tables = blocks()
    options = {"overflow": "split", "return_position_ids": True}
    expected, expected_stats = single_machine(tables, 40, **options)
    packed, stats = pack_dataset_on_ray(ray.data.from_arrow(tables), 40, str(tmp_path), num_shards=3,
                                        return_stats=True, **options)
    assert packed.num_rows > 30 and set(packed.column_names) == {"input_ids", "labels", "position_ids", "seq_lengths"}
    assert packed.features == expected.features
    assert packed.to_dict() == expected.to_dict()
    assert stats == expected_stats and stats.split_sequences > 0
    paths = shards(tmp_path)
    assert [os.path.basename(path) for path in paths] == [f"packed_{k:05d}_of_00003.arrow" for k in range(3)]
    loaded = datasets.load_dataset("arrow", data_files=paths, split="train")
    assert loaded.to_dict() == expected.to_dict()
    assert read_packed_on_ray(str(tmp_path)).take_all() == expected.to_list()


def test_parquet_files_in_parquet_shards_out_seeded(tmp_path, monkeypatch):
    # Not through ray.data.read_parquet: its file listing imports fsspec's HTTP filesystem on several threads of a
    # worker at once, and without aiohttp one of them could fail with an ImportError (seen in the suite).
    monkeypatch.setattr(ray.data, "read_parquet", None)
    tables = blocks(sizes=(50, 60), seed=1)
    inputs = tmp_path / "in"
    inputs.mkdir()
    for index, table in enumerate(tables):
        pq.write_table(table, inputs / f"part-{index}.parquet", row_group_size=20)
    options = {"overflow": "truncate", "seed": 5, "strategy": "ffd"}
    expected, _ = single_machine(tables, 40, **options)
    packed = pack_dataset_on_ray(str(inputs), 40, str(tmp_path / "out"), output_format="parquet", **options)
    assert packed.to_dict() == expected.to_dict()
    paths = shards(tmp_path / "out")
    assert paths and all(path.endswith(".parquet") for path in paths)
    assert datasets.load_dataset("parquet", data_files=paths, split="train").to_dict() == expected.to_dict()
    assert read_packed_on_ray(str(tmp_path / "out")).take_all() == expected.to_list()


def test_arrow_file_read_in_blocks(tmp_path, monkeypatch):
    # A `datasets` cache file (an Arrow stream of record batches), read by Ray as blocks of whole record batches.
    from llm_packing.data import on_ray

    monkeypatch.setattr(on_ray, "_BLOCK_ROWS", 25)
    table = pa.concat_tables(blocks(sizes=(50, 40), seed=3))
    path = str(tmp_path / "data.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=10)
    assert len(on_ray._file_blocks(ray, [path])) == 4  # whole batches of 10 rows, cut at 25, 50 and 75 rows
    expected, _ = single_machine([table], 40, overflow="drop")
    packed = pack_dataset_on_ray(path, 40, str(tmp_path / "out"), overflow="drop")
    assert packed.to_dict() == expected.to_dict()
    assert pack_dataset(datasets.Dataset.from_file(path), 40, overflow="drop").to_dict() == expected.to_dict()


@pytest.mark.parametrize("fault", ["exit", "raise"])
def test_a_task_dying_mid_write_leaves_no_shard_and_names_it(tmp_path, fault):
    # Shard 1's task writes its rows to its temporary file, then its worker exits (or the task raises) before the
    # rename: no file of the run may remain that a later load would take for a complete shard.
    with pytest.raises(PackingError, match=r"Shard 1 of 2 \(.*packed_00001_of_00002\.arrow\) failed") as caught:
        pack_dataset_on_ray(ray.data.from_arrow(blocks()), 40, str(tmp_path), overflow="drop", num_shards=2,
                            max_retries=0, _fault=(1, fault))
    if fault == "raise":
        assert "RuntimeError: fault injected into this shard's task" in str(caught.value)
    assert shards(tmp_path) == []
    with pytest.raises(PackingValueError, match="holds no complete set of packed shards"):
        read_packed_on_ray(str(tmp_path))


def test_empty_blocks_and_no_documents(tmp_path):
    empty = pa.table({"input_ids": pa.array([[], []], pa.list_(pa.int32()))})
    none = pa.table({"input_ids": pa.array([], pa.list_(pa.int32()))})
    packed, stats = pack_dataset_on_ray(ray.data.from_arrow([empty, none]), 8, str(tmp_path), return_stats=True)
    expected, expected_stats = single_machine([empty, none], 8)
    assert packed.num_rows == 0 and packed.features == expected.features and stats == expected_stats
    assert stats.empty_sequences == 2
    assert [os.path.basename(path) for path in shards(tmp_path)] == ["packed_00000_of_00001.arrow"]


@pytest.mark.parametrize("bad, found", [(-1, "-1"), (2**31, "2147483648")])
def test_bad_ids_refused_as_pack_dataset_refuses_them(tmp_path, bad, found):
    good = pa.table({"input_ids": pa.array([[1, 2], [3]], pa.list_(pa.int64()))})
    wrong = pa.table({"input_ids": pa.array([[4], [5, bad]], pa.list_(pa.int64()))})
    with pytest.raises(PackingValueError) as single:
        single_machine([good, wrong], 8)
    with pytest.raises(PackingValueError, match=rf"Block 1 of 2 .*holds {found}") as distributed:
        pack_dataset_on_ray(ray.data.from_arrow([good, wrong]), 8, str(tmp_path))
    # The same refusal, the row counted within the block.
    assert str(distributed.value).split("holds")[1] == str(single.value).split("holds")[1]
    assert shards(tmp_path) == []


@pytest.mark.parametrize("column, values, found", [
    ("attention_mask", [[1, 1], [0, 1]], r"'attention_mask' in row 1 holds 0: the examples were tokenized"),
    ("seq_lengths", [[1, 1], [1]], r"has a 'seq_lengths' column: its rows are packed already"),
])
def test_padded_or_packed_blocks_refused_as_pack_dataset_refuses_them(tmp_path, column, values, found):
    table = pa.table({"input_ids": pa.array([[1, 2], [3, 4]], pa.list_(pa.int64())), column: values})
    with pytest.raises(PackingValueError, match=found.split(":")[-1].strip()):
        single_machine([table], 8)
    with pytest.raises(PackingValueError, match=found):
        pack_dataset_on_ray(ray.data.from_arrow([table]), 8, str(tmp_path))
    assert shards(tmp_path) == []


def test_refuses_a_directory_with_shards(tmp_path):
    (tmp_path / "packed_00000_of_00001.arrow").write_bytes(b"")
    with pytest.raises(PackingValueError, match=r"already holds 1 packed shard"):
        pack_dataset_on_ray(ray.data.from_arrow(blocks(sizes=(3,))), 40, str(tmp_path))


def test_recipe_key_packing_engine_ray_packs_the_same_rows(tmp_path):
    # `packing_engine: ray` in a recipe: rank 0 packs on the cluster into `packed_dir`, another rank loads the shards.
    from types import SimpleNamespace

    from llm_packing.cli.arguments import PackingArguments
    from llm_packing.cli.train import pack_documents

    documents = datasets.Dataset(datasets.table.InMemoryTable(pa.concat_tables(blocks(sizes=(40, 30), seed=2))))
    local = PackingArguments(overflow="split")
    on_ray = PackingArguments(overflow="split", packing_engine="ray", packed_dir=str(tmp_path / "rows"))
    expected, expected_stats = pack_documents(documents, SimpleNamespace(max_length=40, dataset_num_proc=None), local,
                                              None)
    for rank in (0, 1):
        arguments = SimpleNamespace(max_length=40, output_dir=str(tmp_path), process_index=rank)
        packed, stats = pack_documents(documents, arguments, on_ray, None)
        assert packed.to_dict() == expected.to_dict() and stats == expected_stats

