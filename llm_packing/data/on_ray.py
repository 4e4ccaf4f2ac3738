"""`pack_dataset_on_ray`: `pack_dataset` for corpora beyond one machine, on Ray Data (`pip install llm_packing[ray]`).

The same three steps as on one machine, each where it belongs on a cluster:
1. the lengths: one Ray task per input block reads its list offsets and checks its token columns (the checks and
   errors of `pack_dataset`);
2. the plan: one [`~llm_packing.core.plan.plan_rows`] call on the driver, over every document (~17 bytes a document
   at its peak: 100M documents in 1.6 GiB);
3. the gather: one Ray task per output shard, a contiguous range of the packed rows, reading its documents by
   (block, row) from the blocks it needs and writing its Arrow (or Parquet) file under a temporary name, renamed
   once complete.
Rows, tokens and `seq_lengths` are those of `pack_dataset` on the same rows in the same order (the blocks
concatenated) with the same options. Ray is imported when called, never by `import llm_packing`.
"""

import dataclasses
import glob
import os
import uuid

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..core.checks import check_choice, check_integer
from ..core.overflow import OverflowPolicy, check_max_length, check_overflow_policy, cut_pieces
from ..core.plan import plan_rows
from ..core.stats import PackingStats
from ..errors import PackingError, PackingTypeError, PackingValueError
from ._io.gather_processes import row_ranges
from ._io.packed_cache import LAYOUT_VERSION, Destination, existing_shards, load_cached, load_files, shard_paths
from ._io.shards import TOKEN_COLUMNS, ShardSpec, block_lengths, write_shard
from ._io.split_documents import GATHER_CHUNK_TOKENS, group_tokens, packed_schema
from .metadata import record_packing


__all__ = ["load_packed", "pack_dataset_on_ray", "read_packed_on_ray"]

OUTPUT_FORMATS = ("arrow", "parquet")
_STEM = "packed"  # shards are packed_00000_of_00004.arrow, ..., as `Dataset.map(num_proc=4)` names its files
_BLOCK_ROWS = 100_000  # rows per block of a `datasets.Dataset` or an Arrow file sent to the cluster


def pack_dataset_on_ray(
    dataset,
    max_length: int,
    output_dir: str,
    *,
    strategy: str = "bfd",
    seed: int | None = None,
    overflow: OverflowPolicy = "error",
    max_docs_per_bin: int | None = None,
    return_position_ids: bool = False,
    num_shards: int | None = None,
    output_format: str = "arrow",
    max_retries: int = 3,
    address: str | None = None,
    return_stats: bool = False,
    _fault: tuple[int, str] | None = None,
):
    """
    Pack a tokenized Ray dataset into rows of at most `max_length` tokens, written as shards under `output_dir`.

    Runs on the Ray cluster already initialised, or calls `ray.init(address=address)` (`None`: the cluster
    `RAY_ADDRESS` names, or a new one on this machine). Every worker needs `llm_packing` importable (e.g.
    `ray.init(runtime_env={"pip": ["llm_packing[ray]"]})`) and `output_dir` on a filesystem that all nodes and the
    driver share.

    Args:
        dataset (`ray.data.Dataset`, `datasets.Dataset`, `str` or `list[str]`):
            Tokenized rows with `input_ids` (and optionally `labels`, `completion_mask`, `assistant_masks`), as for
            [`~llm_packing.data.pack.pack_dataset`]; a `datasets.Dataset` (sent to the cluster in blocks of
            100,000 rows); or Parquet / Arrow files (or directories of them) read by Ray, rows
            numbered in the order of the files.
        max_length, strategy, seed, overflow, max_docs_per_bin, return_position_ids:
            As for `pack_dataset`; the rows are the same.
        output_dir (`str`):
            Where the shards go (`packed_00000_of_00004.arrow`, ...). Must hold no shards already.
        num_shards (`int`, *optional*):
            Output shards, each written by one task; defaults to the cluster's CPUs.
        output_format (`str`, *optional*, defaults to `"arrow"`):
            `"arrow"` (Arrow IPC streams, memory-mapped by `datasets` without a copy) or `"parquet"`.
        max_retries (`int`, *optional*, defaults to `3`):
            Times Ray retries a task whose worker died (a lost node); a task that raises is not retried.
        address (`str`, *optional*):
            The cluster to join if Ray is not initialised yet, as `ray.init(address=...)` takes it.
        return_stats (`bool`, *optional*, defaults to `False`):
            Also return the [`~llm_packing.core.stats.PackingStats`].

    Returns:
        [`~datasets.Dataset`]: the packed rows read from the shards (memory-mapped Arrow, or Parquet loaded by
        `datasets`), or `(packed, stats)`. For Ray Train, read them with [`read_packed_on_ray`].

    Raises:
        [`~llm_packing.errors.PackingError`]: A task failed, named with its block or shard; no shard of the run is
        left in `output_dir`. The input's errors are those of `pack_dataset`, with the block named.
    """
    ray = _import_ray()
    check_max_length(max_length)
    check_overflow_policy(overflow)
    check_choice("output_format", output_format, OUTPUT_FORMATS, fix="'arrow' is memory-mapped by datasets as is.")
    check_integer("num_shards", num_shards, optional=True, meaning="one per CPU of the cluster")
    stale = _shards_in(output_dir)
    if stale:
        raise PackingValueError(
            f"`output_dir`={output_dir!r} already holds {len(stale)} packed shard(s), e.g. {stale[0]!r}: a later load "
            "would mix them with this run's. Pass an empty directory, or delete them."
        )
    if not ray.is_initialized():
        ray.init(address=address)
    blocks = _input_blocks(ray, dataset)
    counted = _wait_all(ray, [_remote(ray, _count_block).remote(block) for block in blocks], _block_names(blocks))
    block_rows = np.array([len(lengths) for lengths, _, _ in counted], np.int64)
    block_starts = np.concatenate([[0], np.cumsum(block_rows)])
    lengths = np.concatenate([lengths for lengths, _, _ in counted]) if counted else np.zeros(0, np.int64)
    present = {name for _, _, names in counted for name in names}
    keeps_labels = any(says_more for _, says_more, _ in counted)
    columns = tuple(name for name in TOKEN_COLUMNS if name in present and (name == "input_ids" or keeps_labels))
    del counted
    pieces = cut_pieces(lengths, max_length, overflow)
    del lengths
    plan = plan_rows(pieces.length, max_length, strategy=strategy, seed=seed, max_docs_per_bin=max_docs_per_bin)
    stats = dataclasses.replace(plan.stats, **pieces.counts())
    num_tokens = int(plan.tokens_per_bin.sum())
    schema = packed_schema(num_tokens, keeps_labels, return_position_ids)
    ranges = row_ranges(plan.tokens_per_bin, num_shards or max(1, int(ray.cluster_resources().get("CPU", 1))))
    paths = shard_paths(os.path.join(output_dir, f"{_STEM}.{output_format}"), max(len(ranges), 1))
    # Not a process id after the prefix: the writers' rule for orphans (a dead pid) does not apply across machines.
    prefix = f"tmp-llm_packing-ray-{uuid.uuid4().hex[:12]}-"
    writes = []
    for index, ((first, last), path) in enumerate(zip(ranges or [(0, 0)], paths, strict=True)):
        offsets = plan.bin_offsets[first : last + 1]
        ids = plan.order[offsets[0] : offsets[-1]]
        source = pieces.source[ids].astype(np.int64)
        block = np.searchsorted(block_starts, source, side="right") - 1
        needed = np.unique(block)
        concat_start = np.concatenate([[0], np.cumsum(block_rows[needed])[:-1]])
        spec = ShardSpec(
            path=path, output_format=output_format, schema=schema, stats=stats.to_dict(), columns=columns,
            row=source - block_starts[block] + concat_start[np.searchsorted(needed, block)],
            start=np.asarray(pieces.start[ids], np.int64), length=pieces.length[ids],
            bin_offsets=offsets - offsets[0], chunk_tokens=GATHER_CHUNK_TOKENS,
            group_tokens=group_tokens(int(plan.tokens_per_bin[first:last].sum())), temporary_prefix=prefix,
            fault=_fault[1] if _fault is not None and _fault[0] == index else None,
        )
        task = _remote(ray, _write_shard).options(max_retries=max_retries)
        writes.append(task.remote(spec, *[blocks[k] for k in needed.tolist()]))
    shard_names = [f"Shard {index} of {len(paths)} ({path})" for index, path in enumerate(paths)]
    _wait_all(ray, writes, shard_names, cleanup=lambda: _remove(paths, os.path.join(output_dir, prefix)))
    packed = _load(paths, output_format, (LAYOUT_VERSION, paths, max_length, strategy, seed, overflow,
                                          max_docs_per_bin, return_position_ids))
    record_packing(packed, max_length)
    return (packed, stats) if return_stats else packed


def read_packed_on_ray(output_dir: str):
    """
    The shards that [`pack_dataset_on_ray`] wrote to `output_dir`, as a `ray.data.Dataset`, e.g. for Ray Train:
    Arrow and Parquet shards alike, in blocks of about 100,000 rows (Parquet: whole row groups), in order.
    """
    ray = _import_ray()
    for output_format in OUTPUT_FORMATS:
        paths = existing_shards(os.path.join(output_dir, f"{_STEM}.{output_format}"))
        if paths:
            break
    else:
        raise PackingValueError(f"`output_dir`={output_dir!r} holds no complete set of packed shards "
                                f"({_STEM}_00000_of_N.arrow or .parquet). Pack into it with `pack_dataset_on_ray`.")
    return ray.data.from_arrow_refs(_file_blocks(ray, paths))


def load_packed(output_dir: str, max_length: int) -> tuple[datasets.Dataset, PackingStats]:
    """The Arrow shards [`pack_dataset_on_ray`] wrote to `output_dir`, memory-mapped, and their stats (e.g. on the
    training ranks that did not pack)."""
    loaded = load_cached(Destination(os.path.join(output_dir, f"{_STEM}.arrow"), output_dir, True), None)
    if loaded is None:
        raise PackingValueError(f"`output_dir`={output_dir!r} holds no complete set of Arrow shards of this "
                                "llm_packing version. Pack into it with `pack_dataset_on_ray` first.")
    return record_packing(loaded[0], max_length), loaded[1]


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as error:
        raise PackingError(
            f"`pack_dataset_on_ray` needs Ray Data, which is not installed ({error}). Install it with "
            "`pip install 'llm_packing[ray]'`."
        ) from None
    return ray


_REMOTES = {}


def _remote(ray, function):
    if function not in _REMOTES:
        _REMOTES[function] = ray.remote(function)
    return _REMOTES[function]


def _count_block(table: pa.Table):
    lengths, says_more = block_lengths(table)
    if lengths.max(initial=0) < 1 << 31:  # the driver holds every document's length: 4 bytes each
        lengths = lengths.astype(np.int32)
    return lengths, says_more, [name for name in TOKEN_COLUMNS if name in table.column_names]


def _write_shard(spec: ShardSpec, *tables: pa.Table) -> int:
    from ray.experimental import tqdm_ray

    progress = tqdm_ray.tqdm(total=int(spec.length.sum(dtype=np.int64)), desc=os.path.basename(spec.path), unit="tok")
    try:
        return write_shard(spec, list(tables), progress)
    finally:
        progress.close()


def _read_arrow(path: str, first: int = 0, last: int | None = None) -> pa.Table:
    """Record batches `[first, last)` of an Arrow IPC file (stream or file format), memory-mapped."""
    batches = _arrow_batches(path)
    return pa.Table.from_batches(batches[first:last], schema=batches.schema)


class _Batches(list):
    schema: pa.Schema


def _arrow_batches(path: str) -> _Batches:
    """The record batches of an Arrow IPC file, memory-mapped: only their headers are read."""
    source = pa.memory_map(path)
    try:
        reader = pa.ipc.open_stream(source)
        batches = _Batches(reader)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        batches = _Batches(reader.get_batch(index) for index in range(reader.num_record_batches))
    batches.schema = reader.schema
    return batches


def _read_parquet(path: str, first: int = 0, last: int | None = None) -> pa.Table:
    """Row groups `[first, last)` of a Parquet file."""
    parquet = pq.ParquetFile(path)
    return parquet.read_row_groups(range(first, parquet.num_row_groups if last is None else last))


def _file_blocks(ray, paths: list[str]) -> list:
    """Arrow or Parquet files as blocks of about `_BLOCK_ROWS` rows (whole record batches or row groups), in order,
    each read by a task. Read here rather than by `ray.data.read_parquet`, whose file listing imports fsspec's HTTP
    filesystem on several threads of a worker at once: without aiohttp, one of them could fail with an ImportError
    (a reading in the suite did)."""
    blocks = []
    for path in paths:
        if path.endswith(".parquet"):
            metadata = pq.ParquetFile(path).metadata
            counts = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
            read = _remote(ray, _read_parquet)
        else:
            counts = [batch.num_rows for batch in _arrow_batches(path)]
            read = _remote(ray, _read_arrow)
        bounds = _block_bounds(counts)
        blocks += [read.remote(path, first, last) for first, last in zip(bounds[:-1], bounds[1:], strict=True)]
    return blocks


def _block_bounds(counts: list[int]) -> list[int]:
    """Where to cut a file's record batches (or row groups) of `counts` rows into blocks of about `_BLOCK_ROWS`."""
    rows = np.cumsum(counts)
    cuts = np.unique(np.searchsorted(rows, np.arange(_BLOCK_ROWS, int(rows[-1]) if len(rows) else 0, _BLOCK_ROWS),
                                     side="left") + 1)
    return [0, *[int(cut) for cut in cuts if cut < len(rows)], len(rows)]


def _input_blocks(ray, dataset) -> list:
    """The input's blocks (Arrow tables in Ray's object store), in row order."""
    if isinstance(dataset, datasets.Dataset):  # its rows in order, an indices mapping applied, in blocks
        table = dataset.data.table if dataset._indices is None else dataset.with_format("arrow")[:]
        dataset = ray.data.from_arrow([table.slice(first, _BLOCK_ROWS)
                                       for first in range(0, max(table.num_rows, 1), _BLOCK_ROWS)])
    if isinstance(dataset, ray.data.Dataset):
        return dataset.to_arrow_refs()
    paths = [dataset] if isinstance(dataset, (str, os.PathLike)) else list(dataset)
    files = []
    for path in map(os.fspath, paths):
        files += sorted(glob.glob(os.path.join(path, "*.parquet")) + glob.glob(os.path.join(path, "*.arrow"))) \
            if os.path.isdir(path) else [path]
    kinds = {os.path.splitext(path)[1] for path in files}
    if not files or not kinds <= {".parquet", ".arrow"} or len(kinds) > 1:
        raise PackingTypeError(
            f"`dataset` must be a ray.data.Dataset or Parquet or Arrow files (one kind), got {dataset!r} (files with "
            f"suffixes {sorted(kinds)}). Read other formats with ray.data first."
        )
    return _file_blocks(ray, files)  # rows numbered in the order of the files


def _block_names(blocks: list) -> list[str]:
    return [f"Block {index} of {len(blocks)} (rows counted within the block)" for index in range(len(blocks))]


def _wait_all(ray, refs: list, names: list[str], cleanup=None) -> list:
    """The tasks' results in order; on the first failure, the others are cancelled, `cleanup` runs and one
    `PackingError` names the failed task (the input's own errors keep their type)."""
    pending = dict(zip(refs, range(len(refs)), strict=True))
    results = [None] * len(refs)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        index = pending.pop(done[0])
        try:
            results[index] = ray.get(done[0])
        except ray.exceptions.RayError as error:
            for ref in pending:
                ray.cancel(ref, force=True)
            ray.wait(list(pending), num_returns=len(pending), timeout=60)
            if cleanup is not None:
                cleanup()
            raise _failure(error, names[index], cleanup is not None) from None
    return results


def _failure(error, name: str, removed: bool) -> PackingError:
    cause = getattr(error, "cause", None)
    if isinstance(cause, PackingError):
        return type(cause)(f"{name}: {cause}")
    reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(error).strip().splitlines()[0]
    left = " No shard of this run was left behind." if removed else ""
    return PackingError(f"{name} failed: {reason}.{left}")


def _shards_in(output_dir: str) -> list[str]:
    return sorted(path for output_format in OUTPUT_FORMATS
                  for path in glob.glob(os.path.join(glob.escape(output_dir), f"{_STEM}_*_of_*.{output_format}")))


def _remove(paths: list[str], temporary_prefix: str) -> None:
    for path in [*paths, *glob.glob(glob.escape(temporary_prefix) + "*")]:
        if os.path.exists(path):
            os.remove(path)


def _load(paths: list[str], output_format: str, options: tuple) -> datasets.Dataset:
    fingerprint = datasets.fingerprint.Hasher.hash(options)
    if output_format == "arrow":
        return load_files(paths, None, fingerprint)
    return datasets.load_dataset("parquet", data_files=paths, split="train")
