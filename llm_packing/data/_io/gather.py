"""The packed rows' tokens, read from the token columns a group of rows at a time and in input order.

A packed row takes its documents from all over the input. Read in row order from a memory-mapped input, every
document maps a whole page-cache folio (hundreds of KiB here) into the process, so the input soon becomes resident
in full (15 GiB at 10M rows). Instead the rows are cut into groups of about `group_tokens`; a group's documents are
read in input order, a bounded slice at a time, each slice's tokens put where they go in the group's buffers, and
[`~llm_packing.data._io.resident_pages.ResidentPages`] gives back the pages read so far whenever they add up: a sweep
in input order maps each folio once per group instead of once per document. A group is then handed to the writer (which
writes on its own thread) a chunk of about `chunk_tokens` at a time, while the next group is read into a second set
of buffers; each set is reused once its rows are written (fresh memory costs page faults). An input in memory, or
mapping less than the limit, is read in row order instead, straight into place: nothing there to bound.
"""

import numpy as np
import pyarrow as pa

from ...core.rows import ignore_document_starts, ignore_masked, position_ids, segment_aranges


def write_rows(columns, pieces, order, bin_offsets, writer, progress, *, chunk_tokens, group_tokens, pages,
               between_groups=None) -> None:
    """
    Gather the packed rows and hand them to `writer` (a [`~llm_packing.data._io.packed_cache.PackedWriter`]) a chunk at
    a time.

    Args:
        columns (`dict[str, TokenColumn]`): The columns to read by name (`input_ids`, and `labels` / masks when the
            labels are stored).
        pieces ([`~llm_packing.core.overflow.Pieces`]): The slices of the input rows that are packed, in input order.
        order, bin_offsets (`np.ndarray`): The plan of [`~llm_packing.core.binpack.pack_sequences`] over `pieces`.
        progress: A `tqdm` bar, advanced by the tokens of each group gathered.
        chunk_tokens (`int`): Tokens per written chunk.
        group_tokens (`int`): Tokens per group read in input order.
        pages ([`~llm_packing.data._io.resident_pages.ResidentPages`]): Checked after each slice read.
        between_groups (`Callable[[], None]`, *optional*): Called before each group is read; raises to stop (e.g. a
            failed check of the input's values).
    """
    lengths = pieces.length[order].astype(np.int64)  # narrow lengths would wrap in the offsets below
    doc_start = np.concatenate([[0], np.cumsum(lengths)])
    row_start = doc_start[bin_offsets]
    starts = {name: column.row_start[pieces.source] + pieces.start for name, column in columns.items()}
    chunk_rows = _bounds(row_start, chunk_tokens)
    # Reads in row order gain nothing from groups: a group per chunk keeps buffers (and fresh memory) chunk-sized.
    group_chunks = _bounds(row_start[chunk_rows], group_tokens if pages.bounds else 0)
    group_size = int(np.diff(row_start[chunk_rows[group_chunks]]).max(initial=0))
    reading = _Reader(columns, starts, pieces.length, group_size, chunk_tokens, pages)
    # Two sets of group buffers: one is gathered into while the rows of the other are being written.
    writing = ([], [])
    for number, (first_chunk, last_chunk) in enumerate(zip(group_chunks[:-1], group_chunks[1:], strict=True)):
        for written in writing[number % 2]:
            written.result()
        if between_groups is not None:
            between_groups()
        rows = chunk_rows[first_chunk : last_chunk + 1]
        docs = slice(bin_offsets[rows[0]], bin_offsets[rows[-1]])
        group = reading.read(order[docs], doc_start[docs] - doc_start[docs.start], lengths[docs], number % 2,
                             fresh=not writer.reuses_buffers)
        writing[number % 2][:] = [
            writer.write(_chunk_table(group, row_start, bin_offsets, lengths, first, last, rows[0], writer.schema))
            for first, last in zip(rows[:-1], rows[1:], strict=True)
        ]
        progress.update(int(row_start[rows[-1]] - row_start[rows[0]]))


def _chunk_table(group, row_start, bin_offsets, lengths, first, last, group_row, schema) -> pa.Table:
    """Rows `[first, last)` as a table of `schema`, from the buffers of the group that starts at row `group_row`."""
    tokens = slice(row_start[first] - row_start[group_row], row_start[last] - row_start[group_row])
    docs = slice(bin_offsets[first], bin_offsets[last])
    values = _row_values(group, tokens, lengths[docs], schema.names)
    offset_type = np.int64 if schema.field("input_ids").type == pa.large_list(pa.int32()) else np.int32
    token_offsets = pa.array((row_start[first : last + 1] - row_start[first]).astype(offset_type))
    list_type = pa.LargeListArray if offset_type == np.int64 else pa.ListArray
    arrays = {name: list_type.from_arrays(token_offsets, pa.array(array)) for name, array in values.items()}
    doc_offsets = pa.array((bin_offsets[first : last + 1] - bin_offsets[first]).astype(np.int32))
    arrays["seq_lengths"] = pa.ListArray.from_arrays(doc_offsets, pa.array(lengths[docs].astype(np.int32)))
    return pa.Table.from_arrays([arrays[name] for name in schema.names], schema=schema)


# Documents at least this long on average are copied one slice each (a Python loop, ~1 us a document) rather than
# through per-token index arrays (~15 ns a token: two cumsums, a gather and a scatter): 6x faster on a group of
# lognormal documents (median 250 tokens), slower for very short ones.
_RUN_COPY_MIN_TOKENS = 64


class _Reader:
    """Reads a group's documents into one buffer per column, in row order; reads go in input order where the mapped
    input is larger than the resident limit (`pages.bounds`), in row order otherwise. Buffers are reused."""

    def __init__(self, columns, starts, piece_lengths, group_size, slice_tokens, pages):
        self._columns, self._starts, self._pages = columns, starts, pages
        self._slice_tokens = slice_tokens
        self._buffers = [self._allocate(group_size), self._allocate(group_size)]  # untouched memory costs nothing
        slice_size = min(group_size, slice_tokens + int(piece_lengths.max(initial=0)))
        self._source, self._destination = np.empty(slice_size, np.int64), np.empty(slice_size, np.int64)
        self._values = np.empty(slice_size, np.int32)

    def _allocate(self, size):
        return {name: np.empty(size, np.uint8 if column.bits else np.int32) for name, column in self._columns.items()}

    def read(self, ids, positions, lengths, slot, fresh):
        """The tokens of pieces `ids` (row order), each at `positions` in buffer set `slot` (0 or 1)."""
        tokens = int(lengths.sum())
        if fresh:  # the rows are kept in memory, pointing into these buffers
            buffers = self._allocate(tokens)
        else:
            buffers = {name: buffer[:tokens] for name, buffer in self._buffers[slot].items()}
        if self._pages.bounds:
            # In the order the ids lie in the mapped input (an indices mapping may have shuffled the rows), each
            # slice over at most half the resident limit of it: every page read maps a whole page-cache folio (up
            # to 2 MiB), so a slice spread over a large input maps far more than its tokens between two checks of
            # the limit.
            addresses = self._starts["input_ids"][ids]
            order = np.argsort(addresses, kind="stable")
            addresses = addresses[order]
            span = self._pages.limit // 2 // self._columns["input_ids"].itemsize
        else:  # nothing to bound: row order is faster (no scatter)
            order = np.arange(len(ids))
        ends = np.cumsum(lengths[order])
        first = 0
        while first < len(order):
            base = ends[first - 1] if first else 0
            last = int(np.searchsorted(ends, base + self._slice_tokens, side="right"))
            if self._pages.bounds:
                last = min(last, int(np.searchsorted(addresses, addresses[first] + span, side="left")))
            last = max(last, first + 1)
            part = order[first:last]
            self._copy_slice(buffers, ids[part], positions[part], lengths[part], base, int(ends[last - 1] - base))
            self._pages.check()
            first = last
        return buffers

    def _copy_slice(self, buffers, ids, positions, lengths, base: int, size: int) -> None:
        """The tokens of one slice of pieces into `buffers`: run by run where pieces are long, else by a gather of
        token indices (straight into place when the slice lies in row order)."""
        by_runs = size >= _RUN_COPY_MIN_TOKENS * len(ids)
        if by_runs:
            destination = None
        elif self._pages.bounds:
            destination = segment_aranges(positions, lengths, out=self._destination[:size])
        else:
            destination = slice(base, base + size)
        for name, column in self._columns.items():
            if by_runs and not column.bits:
                column.copy_runs(self._starts[name][ids], lengths, buffers[name], positions)
                continue
            if destination is None:
                destination = segment_aranges(positions, lengths, out=self._destination[:size])
            source = segment_aranges(self._starts[name][ids], lengths, out=self._source[:size])
            if column.bits:
                buffers[name][destination] = column.take(source)
            elif isinstance(destination, slice):  # straight into place
                column.take(source, out=buffers[name][destination])
            else:
                buffers[name][destination] = column.take(source, out=self._values[:size])


def _row_values(group, tokens, lengths, names) -> dict[str, np.ndarray]:
    """The token columns of one chunk of rows from its group's buffers: ids, labels and positions as stored."""
    values = {"input_ids": group["input_ids"][tokens]}
    if "labels" in names:
        labels = group["labels"][tokens].copy() if "labels" in group else values["input_ids"].copy()
        for name, mask in group.items():
            if name not in ("input_ids", "labels"):
                ignore_masked(labels, mask[tokens])
        values["labels"] = ignore_document_starts(labels, lengths)
    if "position_ids" in names:
        values["position_ids"] = position_ids(lengths, out=np.empty(int(lengths.sum()), np.int32))
    return values


def _bounds(starts: np.ndarray, size: int) -> np.ndarray:
    """Indices into `starts` (increasing offsets, the last the total) cutting it into spans of at most `size` (or one
    step), from 0 to the last index."""
    bounds, first = [0], 0
    while first < len(starts) - 1:
        last = int(np.searchsorted(starts, starts[first] + size, side="right")) - 1
        first = min(max(last, first + 1), len(starts) - 1)
        bounds.append(first)
    return np.array(bounds)
