"""The two jobs of `pack_dataset_on_ray`'s tasks, plain functions of Arrow tables (no Ray here): the lengths and checks
of one input block, and the gather and write of one output shard.

A block is checked as `pack_dataset` checks a split (the same `TokenColumn` checks, so the same errors), and says
whether its labels say more than the collator derives. A shard is a contiguous range of packed rows: its documents
are read by (block, row) from the blocks it names, with the same gather as one machine's (`gather.py`), into a
temporary file renamed to the shard's name once complete (`PackedWriter`, or [`ParquetShardWriter`]).
"""

import concurrent.futures
import dataclasses
import json
import os
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ...core.overflow import Pieces
from ...core.rows import MASK_COLUMNS, already_packed_error
from ...core.stats import PackingStats
from ...errors import PackingValueError
from .gather import write_rows
from .packed_cache import LAYOUT_VERSION, Destination, PackedWriter
from .resident_pages import ResidentPages
from .token_columns import TokenColumn, check_unpadded, labels_say_more


TOKEN_COLUMNS = ("input_ids", "labels", *MASK_COLUMNS)


def block_lengths(table: pa.Table) -> tuple[np.ndarray, bool]:
    """
    The `input_ids` lengths of one block, its token columns checked as `pack_dataset` checks them (raises its
    errors, rows counted within the block), and whether its labels say more than the collator derives.
    """
    if table.num_rows and "input_ids" not in table.column_names:
        raise PackingValueError(
            f"The block has no 'input_ids' column (columns: {table.column_names}). Tokenize it first, e.g. "
            "`dataset.map(lambda ex: tokenizer(ex['text']))`."
        )
    if "seq_lengths" in table.column_names:
        raise already_packed_error("The block")
    if "input_ids" not in table.column_names:
        return np.zeros(0, np.int64), False
    input_ids = TokenColumn(table, "input_ids")
    if "attention_mask" in table.column_names:
        check_unpadded(table.column("attention_mask"), input_ids.lengths)
    others = [TokenColumn(table, name, input_ids.lengths) for name in TOKEN_COLUMNS[1:] if name in table.column_names]
    return input_ids.lengths, bool(others) and labels_say_more(input_ids, others)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """
    One output shard: rows `bin_offsets` over the documents `(row, start, length)`, `row` counting the rows of the
    blocks handed to the task, concatenated in order.
    """

    path: str
    output_format: str
    schema: pa.Schema
    stats: dict
    columns: tuple[str, ...]
    row: np.ndarray
    start: np.ndarray
    length: np.ndarray
    bin_offsets: np.ndarray
    chunk_tokens: int
    group_tokens: int
    temporary_prefix: str
    fault: str | None = None  # tests only: "raise" or "exit" once the shard's rows are written, before the rename


class _Unchecked:
    """Value checks already made by `block_lengths`: not made again."""

    def add(self, check) -> None:
        pass


def write_shard(spec: ShardSpec, tables: list[pa.Table], progress) -> int:
    """Gather and write one shard from the blocks `tables`; returns its rows. Nothing is left under `spec.path`
    unless the shard is complete."""
    if tables:
        table = pa.concat_tables([block.select(list(spec.columns)) for block in tables], promote_options="permissive")
    else:
        table = pa.table({name: pa.array([], pa.list_(pa.int32())) for name in spec.columns})
    columns = {name: TokenColumn(table, name, checks=_Unchecked()) for name in spec.columns}
    pieces = Pieces(spec.row, spec.start, spec.length)
    stats = PackingStats(**spec.stats)
    destination = Destination(spec.path, "", False)
    writer = (PackedWriter(destination, spec.schema, stats, spec.temporary_prefix) if spec.output_format == "arrow"
              else ParquetShardWriter(destination, spec.schema, stats, spec.temporary_prefix))
    try:
        write_rows(columns, pieces, np.arange(len(spec.row)), spec.bin_offsets, writer, progress,
                   chunk_tokens=spec.chunk_tokens, group_tokens=spec.group_tokens, pages=ResidentPages(table))
        if spec.fault is not None:
            _inject(spec.fault, writer)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return len(spec.bin_offsets) - 1


def _inject(fault: str, writer) -> None:
    """A task dying mid-write (tests only): its rows written to the temporary file, which is never renamed."""
    for written in getattr(writer, "_written", []):
        written.result()
    if fault == "exit":
        os._exit(1)
    raise RuntimeError("fault injected into this shard's task")


class ParquetShardWriter:
    """
    The packed rows of one shard as a Parquet file, with the interface of
    [`~llm_packing.data._io.packed_cache.PackedWriter`] that `write_rows` uses: written to a temporary file in the
    same directory, renamed to `target.path` by `close`, removed by `abort`.
    """

    reuses_buffers = True  # each chunk is written before `write` returns

    def __init__(self, target: Destination, schema: pa.Schema, stats: PackingStats, temporary_prefix: str):
        self.target = target
        self.schema = schema.with_metadata({**(schema.metadata or {}), b"llm_packing": json.dumps(
            {"layout": LAYOUT_VERSION, "stats": dataclasses.asdict(stats)})})
        directory = os.path.dirname(os.path.abspath(target.path))
        os.makedirs(directory, exist_ok=True)
        fd, self._temporary = tempfile.mkstemp(dir=directory, prefix=temporary_prefix)
        os.close(fd)
        self._writer = pq.ParquetWriter(self._temporary, self.schema)

    def write(self, table: pa.Table) -> concurrent.futures.Future:
        self._writer.write_table(table)
        done = concurrent.futures.Future()
        done.set_result(None)
        return done

    def close(self) -> None:
        self._writer.close()
        os.replace(self._temporary, self.target.path)

    def abort(self) -> None:
        self._writer.close()
        if os.path.exists(self._temporary):
            os.remove(self._temporary)
