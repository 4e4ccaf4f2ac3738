"""The token columns of one map-style split, read where they lie, and the packed rows gathered from them.

`SplitDocuments` reads `input_ids` (with `labels` and the mask columns) through the Arrow list offsets of a
memory-mapped table, never copying it whole (see `token_columns.py`), checks their values on a thread, cuts the
pieces `overflow` asks for, plans the rows and writes them a bounded chunk at a time (see `gather.py`,
`packed_cache.py`), in this process or in `num_proc` forked ones (see `gather_processes.py`).
"""

import dataclasses
import functools
import os

import datasets
import numpy as np
import pyarrow as pa
from datasets.utils.tqdm import tqdm

from ...core.overflow import OverflowPolicy, cut_pieces
from ...core.plan import plan_rows
from ...core.rows import MASK_COLUMNS
from ...errors import PackingError, PackingValueError
from .gather import write_rows
from .gather_processes import row_ranges, write_in_processes
from .packed_cache import Destination, PackedWriter, load_files, shard_paths
from .resident_pages import ResidentPages
from .token_columns import TokenColumn, ValueChecks, check_unpadded, labels_say_more


GATHER_CHUNK_TOKENS = 1 << 20  # tokens per written chunk: its buffers (~12 MiB) stay in cache, touched once
# Tokens per group read in input order (see `gather.py`), gathered into one of two buffers: a 48th of the tokens
# packed, from 8M to 32M (two buffers of 32 to 128 MiB of ids). Larger groups map less of the input again, but new
# buffer memory costs a page fault per page: small groups win at 1M rows, large ones at 10M
# (benchmarks/results/pack_dataset_speed_groups_8m.md, _groups_32m.md, _10m.md, _10m_groups_8m.md).
_GROUP_TOKENS = 1 << 25
_MIN_GROUP_TOKENS = 1 << 23
_GROUPS = 48
_MAX_LIST_OFFSET = np.iinfo(np.int32).max  # past this many tokens, a column needs 64-bit (large_list) offsets


class SplitDocuments:
    """The token columns of one split, read in place, and the pieces of them that get packed."""

    def __init__(self, dataset: datasets.Dataset, max_length: int, overflow: OverflowPolicy):
        # An indices mapping (`select`, `shuffle`, `filter`) is read through: the rows it picks, where they lie.
        rows = None if dataset._indices is None else dataset._indices.column(0).to_numpy()
        self._rows = rows
        # The whole table behind a mapping is checked: a bad value may be in a row left out, and an error must name
        # the row as the caller counts it. Then the picked rows alone are checked again (gathered: rare). With no
        # rows, `data.table` may still hold every row behind the mapping.
        self._picked_rows = None if rows is None else (
            lambda: dataset.with_format("arrow")[:] if len(dataset) else dataset.data.table.slice(0, 0))
        try:
            self._read(dataset.data.table, rows)
        except PackingError:
            if rows is None:
                raise
            self._read_picked_rows()
        try:
            self.pieces = cut_pieces(self.input_ids.lengths, max_length, overflow)
        except PackingError:
            self.raise_bad_values()  # a bad value is reported before an over-long row, as when checked first
            raise
        self.max_length = max_length
        # Labels the collator would derive anyway (the ids, -100 at each document start) are not stored.
        self.keeps_labels = bool(self.labels or self.masks) and labels_say_more(
            self.input_ids, [column for column in (self.labels, *self.masks) if column], self.pages)

    def raise_bad_values(self, wait: bool = True) -> None:
        """Raise the error of a failed value check (they run on a thread, see `ValueChecks`); with `wait=False`,
        only of the checks done so far."""
        try:
            self._checks.raise_failed(wait)
        except PackingError:
            if self._picked_rows is None:
                raise
            self._read_picked_rows()
            self._checks.raise_failed()

    def _read_picked_rows(self) -> None:
        picked_rows, self._picked_rows, self._rows = self._picked_rows, None, None
        self._read(picked_rows(), None)

    def _read(self, table: pa.Table, rows: np.ndarray | None) -> None:
        """The token columns of `table`, their lengths checked (their values on a thread), then narrowed to `rows`
        if given."""
        if "input_ids" not in table.column_names:
            raise PackingValueError(
                f"`dataset` has no 'input_ids' column (columns: {table.column_names}). Tokenize it first, e.g. "
                "`dataset.map(lambda ex: tokenizer(ex['text']))`."
            )
        self.pages = ResidentPages(table)  # documents are read all over a memory-mapped input: bound what stays mapped
        self._checks = ValueChecks()
        try:
            self.input_ids = TokenColumn(table, "input_ids", pages=self.pages, checks=self._checks)
            lengths = self.input_ids.lengths
            self.labels = TokenColumn(table, "labels", lengths, self.pages, self._checks) \
                if "labels" in table.column_names else None
            self.masks = [TokenColumn(table, name, lengths, self.pages, self._checks) for name in MASK_COLUMNS
                          if name in table.column_names]
            if "attention_mask" in table.column_names:  # a tokenizer's: a 0 marks padding, which packing would keep
                mask = table.column("attention_mask")
                self._checks.add(functools.partial(check_unpadded, mask, lengths, self.pages))
        except PackingError:
            self._checks.raise_failed()  # an earlier column's bad value first, as when checked in turn
            raise
        if rows is not None:
            for column in (self.input_ids, self.labels, *self.masks):
                if column is not None:
                    column.select(rows)

    def pack(self, target, split, *, strategy, seed, max_docs_per_bin, return_position_ids, num_proc=None):
        # Rows in the local order (see `locality.py`), or at random with a seed; a document's place in the input is
        # its piece's index, or with an indices mapping the row it picks.
        addresses = None if self._rows is None else self._rows[self.pieces.source]
        plan = plan_rows(self.pieces.length, self.max_length, strategy=strategy, seed=seed,
                         max_docs_per_bin=max_docs_per_bin, addresses=addresses)
        del addresses
        stats = dataclasses.replace(plan.stats, **self.pieces.counts())
        num_tokens = int(self.pieces.length.sum())
        schema = self._schema(num_tokens, return_position_ids)
        with tqdm(total=num_tokens, unit="tok", desc="Packing", disable=num_tokens < GATHER_CHUNK_TOKENS) as progress:
            if num_proc and num_proc > 1 and target.path is not None and len(plan.bin_offsets) > 2:
                return self._write_shards(plan, target, schema, stats, num_proc, progress, split), stats
            writer = PackedWriter(target, schema, stats)
            try:
                self._write(plan.order, plan.bin_offsets, writer, progress)
                self.raise_bad_values()
            except BaseException:
                writer.abort()
                raise
        return writer.finish(split), stats

    def _write_shards(self, plan, target, schema, stats, num_proc, progress, split) -> datasets.Dataset:
        """The rows gathered and written by `num_proc` forked processes, a contiguous share each (see
        `gather_processes.py`)."""
        self.raise_bad_values()  # before forking: the checks' thread is not copied into the processes
        doc_start = np.concatenate([[0], np.cumsum(self.pieces.length[plan.order], dtype=np.int64)])
        ranges = row_ranges(np.diff(doc_start[plan.bin_offsets]), num_proc)
        paths = shard_paths(target.path, len(ranges))

        def write_part(first, last, path, part_progress):
            self.pages.restart()
            offsets = plan.bin_offsets[first : last + 1]
            writer = PackedWriter(Destination(path, target.fingerprint, False), schema, stats)
            try:
                self._write(plan.order[offsets[0] : offsets[-1]], offsets - offsets[0], writer, part_progress)
                writer.close()
            except BaseException:
                writer.abort()
                raise

        write_in_processes(write_part, ranges, paths, progress)
        if os.path.exists(target.path):  # an older single file would be loaded before these shards
            os.remove(target.path)
        return load_files(paths, split, target.fingerprint)

    def _schema(self, num_tokens: int, return_position_ids: bool) -> pa.Schema:
        return packed_schema(num_tokens, self.keeps_labels, return_position_ids)

    def _write(self, order: np.ndarray, bin_offsets: np.ndarray, writer: PackedWriter, progress) -> None:
        """Gather the packed rows (see `gather.py`), advancing `progress`, and hand them to `writer`."""
        write_rows(dict(self._columns()), self.pieces, order, bin_offsets, writer, progress,
                   chunk_tokens=GATHER_CHUNK_TOKENS, group_tokens=group_tokens(int(self.pieces.length[order].sum())),
                   pages=self.pages,
                   between_groups=lambda: self.raise_bad_values(wait=False))

    def _columns(self):
        """The columns read when gathering, by name."""
        stored = [self.input_ids, *([self.labels, *self.masks] if self.keeps_labels else [])]
        return [(column.name, column) for column in stored if column is not None]


def packed_schema(num_tokens: int, keeps_labels: bool, return_position_ids: bool) -> pa.Schema:
    """The columns of packed rows holding `num_tokens` tokens in all (64-bit list offsets past int32)."""
    tokens = datasets.Value("int32")
    token_list = datasets.LargeList(tokens) if num_tokens > _MAX_LIST_OFFSET else datasets.List(tokens)
    names = ["input_ids", *(["labels"] if keeps_labels else []), *(["position_ids"] if return_position_ids else [])]
    features = datasets.Features({**dict.fromkeys(names, token_list), "seq_lengths": datasets.List(tokens)})
    return features.arrow_schema


def group_tokens(num_tokens: int) -> int:
    """Tokens per group read in input order when gathering `num_tokens` tokens (see `_GROUP_TOKENS`)."""
    return min(max(num_tokens // _GROUPS, _MIN_GROUP_TOKENS), _GROUP_TOKENS)
