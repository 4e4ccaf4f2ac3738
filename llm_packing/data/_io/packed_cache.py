"""Where packed rows go: an Arrow file in the `datasets` cache, written chunk by chunk, or a table kept in memory.

The rules are those of `Dataset.map`: an input with cache files gets its output beside them, named by a fingerprint
of the input's fingerprint and the packing options, and a later call with the same ones loads that file instead of
packing again; `keep_in_memory=True` keeps the rows in memory; `cache_file_name` names the file; an in-memory input
without `cache_file_name` stays in memory; with caching disabled (`datasets.disable_caching()`) files go to a
temporary directory and are never reloaded. `LAYOUT_VERSION` is part of the fingerprint and of the file name, so a
file written with another column layout is never read as this one.
"""

import concurrent.futures
import contextlib
import dataclasses
import glob
import json
import logging
import mmap
import os
import re
import socket
import tempfile
import threading

import datasets
import pyarrow as pa
from datasets.fingerprint import Hasher

from ...core.stats import PackingStats
from .direct_writes import BLOCK, DirectFile, aligned, write_all


logger = logging.getLogger(__name__)

LAYOUT_VERSION = 2  # 1: input_ids, labels, position_ids, seq_lengths always, in memory; 2: lean columns, cached
_METADATA_KEY = b"llm_packing"
_ROWS_PER_RECORD_BATCH = 1000  # as `.map` writes them
_WRITER_THREADS = 2
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an IPC stream's closing marker: continuation, length 0
_DROP_BEHIND_BYTES = 64 << 20  # written pages further behind the newest chunk than this leave the page cache


@dataclasses.dataclass(frozen=True)
class Destination:
    """The file the packed rows go to (`None`: kept in memory), and whether an existing one may be loaded."""

    path: str | None
    fingerprint: str
    load_from_cache_file: bool


def destination(dataset: datasets.Dataset, options: dict, *, keep_in_memory: bool, cache_file_name: str | None,
                load_from_cache_file: bool | None) -> Destination:
    """Where to pack `dataset` with `options` (every option that changes the rows), following `Dataset.map`."""
    fingerprint = Hasher.hash((LAYOUT_VERSION, dataset._fingerprint, dataset.split, sorted(options.items())))
    caching = datasets.is_caching_enabled()
    load = caching if load_from_cache_file is None else load_from_cache_file
    if keep_in_memory:
        return Destination(None, fingerprint, False)
    if cache_file_name is not None:
        return Destination(cache_file_name, fingerprint, load)
    if not dataset.cache_files:
        return Destination(None, fingerprint, False)
    if not caching:
        directory = datasets.fingerprint.get_temporary_cache_files_directory()
        name = f"cache-{datasets.fingerprint.generate_random_fingerprint()}.arrow"  # never reloaded, as in `.map`
        return Destination(os.path.join(directory, name), fingerprint, False)
    directory = os.path.dirname(dataset.cache_files[0]["filename"])
    name = f"cache-llm_packing-v{LAYOUT_VERSION}-{fingerprint}.arrow"
    return Destination(os.path.join(directory, name), fingerprint, load)


def shard_paths(path: str, num_shards: int) -> list[str]:
    """The files of a packed split written by `num_shards` processes, as `Dataset.map(num_proc=...)` names them.

    Example:
    ```python
    >>> shard_paths("/cache/packed.arrow", 2)
    ['/cache/packed_00000_of_00002.arrow', '/cache/packed_00001_of_00002.arrow']

    ```
    """
    stem, extension = os.path.splitext(path)
    return [f"{stem}_{rank:05d}_of_{num_shards:05d}{extension}" for rank in range(num_shards)]


def load_cached(target: Destination, split) -> tuple[datasets.Dataset, PackingStats] | None:
    """The packed dataset and its stats from `target.path` (or the shards of it that several processes wrote), if it
    may be loaded and was written by this layout from the same input and options (`target.fingerprint`)."""
    if not (target.load_from_cache_file and target.path):
        return None
    paths = [target.path] if os.path.exists(target.path) else existing_shards(target.path)
    if not paths:
        return None
    table = _memory_mapped(paths)
    metadata = json.loads((table.schema.metadata or {}).get(_METADATA_KEY, b"{}"))
    if metadata.get("layout") != LAYOUT_VERSION:  # a file of another layout under a name given by the user
        return None
    if metadata.get("fingerprint", target.fingerprint) != target.fingerprint:
        # A `cache_file_name` given again for another dataset, `max_length` or option: its rows are not these.
        logger.warning("The packed file %s was written from another dataset or other packing options; packing again "
                       "and overwriting it.", paths[0] if len(paths) == 1 else f"{len(paths)} shards of {target.path}")
        return None
    logger.info("Loading cached packed dataset at %s", paths[0] if len(paths) == 1 else f"{len(paths)} shards of "
                f"{target.path}")
    stats = PackingStats(**metadata["stats"])
    return _dataset(table, split, target.fingerprint), stats


def existing_shards(path: str) -> list[str]:
    """Every shard of `path` if one complete set of them exists (the most recent), else []."""
    stem, extension = os.path.splitext(path)
    first = sorted(glob.glob(f"{glob.escape(stem)}_00000_of_*{extension}"), key=os.path.getmtime, reverse=True)
    for candidate in first:
        count = candidate[len(stem) + len("_00000_of_") : len(candidate) - len(extension)]
        if count.isdigit() and all(os.path.exists(shard) for shard in shard_paths(path, int(count))):
            return shard_paths(path, int(count))
    return []


def load_files(paths: list[str], split, fingerprint: str) -> datasets.Dataset:
    """The packed dataset made of the files `paths` (one, or the shards of one), in order, memory-mapped."""
    return _dataset(_memory_mapped(paths), split, fingerprint)


def _memory_mapped(paths: list[str]):
    return datasets.table.concat_tables([_open_memory_mapped(path) for path in paths])


def _open_memory_mapped(path: str) -> datasets.table.MemoryMappedTable:
    """
    `MemoryMappedTable.from_file(path)` without reading the rows: only the record batches' headers are read.

    A header read from a mapping faults in the readahead window around it (8 MiB on this project's machines, more
    than a record batch of packed rows), and `pa.memory_map`, which `from_file` uses, asks for more: opening a 1.5
    GiB packed file with `from_file` brought all of it back from disk into the page cache, which `PackedWriter` had
    kept it out of. Here the headers are read from a mapping without readahead (`MADV_RANDOM`), set back to normal
    readahead for the rows read later. A pickled copy (a `DataLoader` worker's) opens it with `from_file`.
    """
    if not hasattr(mmap, "MADV_RANDOM"):  # Windows
        return datasets.table.MemoryMappedTable.from_file(path)
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    mapped.madvise(mmap.MADV_RANDOM)
    table = pa.ipc.open_stream(pa.py_buffer(mapped)).read_all()
    mapped.madvise(mmap.MADV_NORMAL)
    return datasets.table.MemoryMappedTable(table, path)


# A packed file is written under a temporary name holding the writer's host and process id, renamed once complete.
_TEMPORARY_PREFIX = "tmp-llm_packing-"
_TEMPORARY_NAME = re.compile(rf"{_TEMPORARY_PREFIX}(?P<host>[^/]+)-(?P<pid>\d+)-")


def _host() -> str:
    """This machine's name as it goes into a file name (no '-' or '/', which delimit the fields)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _local_temporary_prefix() -> str:
    return f"{_TEMPORARY_PREFIX}{_host()}-{os.getpid()}-"


def remove_orphaned_temporaries(directory: str) -> list[str]:
    """
    Remove the temporary files of packed writes whose process is gone (killed mid-write, e.g. by SIGKILL or the OOM
    killer, which leaves no chance to clean up): a half-written file is never taken for a cache file, since only a
    complete one is renamed to its cache name, but it would keep its disk space. Only this machine's files: on a
    folder several machines share, another machine's process ids mean nothing here. Returns the paths removed.
    """
    removed, host = [], _host()
    for name in os.listdir(directory):
        match = _TEMPORARY_NAME.match(name)
        if match and match["host"] == host and not _process_alive(int(match["pid"])):
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):  # another writer removed it first
                os.remove(path)
                removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class PackedWriter:
    """
    Collects the packed rows chunk by chunk: each chunk is written to `target.path` (through a temporary file, renamed
    when complete, so that an interrupted run leaves no cache file), or kept in memory without `path`. The temporary
    name holds this process's id, unless `temporary_prefix` names it (a Ray task's: a process id means nothing on a
    folder that several machines share, and its run removes its own temporaries).

    The file is the Arrow IPC stream that `pa.ipc.new_stream` would write, byte for byte, but its record batches are
    written by `_WRITER_THREADS` threads at once, each at an offset fixed in order when its chunk is handed over
    (`pa.ipc.get_record_batch_size`), while the next rows are gathered. `write` returns a future, done once the
    chunk's arrays may be reused.

    The output does not go through the page cache, as a streaming writer's should not: a corpus-sized output would
    evict the input it is gathered from, and filling, writing back and freeing a page-cache page per page of output
    is most of what writing costs on virtual machines that return freed memory to the host
    (benchmarks/results/first_touch.md). Where the filesystem takes `O_DIRECT`
    ([`~llm_packing.data._io.direct_writes.DirectFile`]), each chunk goes from the thread's serialisation buffer to
    the disk; elsewhere writes drop behind them: each written chunk is sent to disk at once, and the pages more than
    `_DROP_BEHIND_BYTES` behind the newest chunk leave the page cache once on disk (the kernel keeps any not written
    yet), so that the next chunks reuse them.
    Either way the packed rows are read from disk the first time training reads them.
    """

    def __init__(self, target: Destination, schema: pa.Schema, stats: PackingStats,
                 temporary_prefix: str | None = None):
        self.target = target
        recorded = {"layout": LAYOUT_VERSION, "stats": dataclasses.asdict(stats)}
        if target.fingerprint:  # the input and options the rows were packed from (a Ray shard's has none)
            recorded["fingerprint"] = target.fingerprint
        metadata = {**(schema.metadata or {}), _METADATA_KEY: json.dumps(recorded)}
        self.schema = schema.with_metadata(metadata)
        self._tables = []
        self._written = []  # futures of the chunks handed to the writing threads
        self._fd = None
        if target.path is not None:
            directory = os.path.dirname(os.path.abspath(target.path))
            os.makedirs(directory, exist_ok=True)
            remove_orphaned_temporaries(directory)
            self._fd, self._temporary = tempfile.mkstemp(
                dir=directory, prefix=temporary_prefix or _local_temporary_prefix())
            self._direct = DirectFile.open(self._temporary)
            self._schema_message = self.schema.serialize()
            self._write_range(self._schema_message, 0)
            self._offset = len(self._schema_message)
            self._buffers = threading.local()  # each writing thread's serialization buffer
            self._dropped = 0  # the file's bytes before this may have left the page cache
            self._dropping = threading.Lock()
            self._threads = concurrent.futures.ThreadPoolExecutor(_WRITER_THREADS,
                                                                  thread_name_prefix="llm_packing-writer")

    @property
    def reuses_buffers(self) -> bool:
        """Whether a chunk's arrays may be overwritten once `write` returns (they are on disk, not held)."""
        return self._fd is not None

    def write(self, table: pa.Table) -> concurrent.futures.Future:
        if self._fd is None:
            self._tables.append(table)
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
        batches = table.to_batches(max_chunksize=_ROWS_PER_RECORD_BATCH)
        offsets = [self._offset]
        for batch in batches:
            offsets.append(offsets[-1] + pa.ipc.get_record_batch_size(batch))
        self._offset = offsets[-1]
        self._written.append(self._threads.submit(self._write_batches, batches, offsets))
        return self._written[-1]

    def _write_batches(self, batches: list[pa.RecordBatch], offsets: list[int]) -> None:
        self._write_range(self._serialized(batches, offsets[-1] - offsets[0], offsets[0]), offsets[0])
        if self._direct is not None or not hasattr(os, "posix_fadvise"):  # past the page cache, or no say in it
            return
        # DONTNEED starts writing dirty pages back and drops the clean ones: this chunk is sent to disk, and the
        # pages far enough behind it (on disk by now, unless the disk is slower than the gather) are dropped.
        os.posix_fadvise(self._fd, offsets[0], offsets[-1] - offsets[0], os.POSIX_FADV_DONTNEED)
        with self._dropping:
            start = self._dropped
            end = self._dropped = max(start, offsets[0] - _DROP_BEHIND_BYTES)
        if end > start:
            os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def _write_range(self, data, offset: int) -> None:
        if self._direct is not None:
            self._direct.write(data, offset)
        else:
            write_all(self._fd, data, offset)

    def _serialized(self, batches: list[pa.RecordBatch], size: int, offset: int) -> memoryview:
        """The IPC messages of `batches` (`size` bytes, for `offset` in the file), in this thread's buffer, reused
        from chunk to chunk (a new buffer per batch, as `RecordBatch.serialize` makes, is fresh memory that costs
        page faults every time), placed as `DirectFile` writes them straight from it."""
        header = len(self._schema_message)
        start = (offset - header) % BLOCK  # the messages then lie at `offset`'s place within a block
        buffer = getattr(self._buffers, "array", None)
        if buffer is None or len(buffer) < start + header + size:
            buffer = self._buffers.array = aligned(BLOCK + header + size)
        sink = pa.FixedSizeBufferWriter(pa.py_buffer(buffer[start:]))
        stream = pa.ipc.new_stream(sink, self.schema)  # writes the schema message first: skipped below
        for batch in batches:
            stream.write_batch(batch)
        return memoryview(buffer)[start + header : start + header + size]

    def finish(self, split) -> datasets.Dataset:
        if self._fd is None:
            table = pa.concat_tables(self._tables) if self._tables else self.schema.empty_table()
            return _dataset(datasets.table.InMemoryTable(table.replace_schema_metadata(self.schema.metadata)), split,
                            self.target.fingerprint)
        self.close()
        return load_files([self.target.path], split, self.target.fingerprint)

    def close(self) -> None:
        """Finish the file: wait for every write, close the stream and move the file to `target.path`."""
        self._threads.shutdown()
        try:
            for written in self._written:
                written.result()  # raises the error of a failed write
            self._write_range(_END_OF_STREAM, self._offset)
            if self._direct is not None:
                direct, self._direct = self._direct, None
                direct.close(self._offset + len(_END_OF_STREAM))
        except BaseException:
            self.abort()
            raise
        os.close(self._fd)
        os.replace(self._temporary, self.target.path)

    def abort(self) -> None:
        if self._fd is not None:
            self._threads.shutdown(cancel_futures=True)
            if self._direct is not None:
                self._direct.abort()
            os.close(self._fd)
            os.remove(self._temporary)
            self._fd = None


def _dataset(table, split, fingerprint: str) -> datasets.Dataset:
    info = datasets.DatasetInfo(features=datasets.Features.from_arrow_schema(table.schema))
    # An explicit fingerprint: datasets would otherwise hash every packed token of an in-memory table to make one.
    return datasets.Dataset(table, info=info, split=split, fingerprint=fingerprint)
