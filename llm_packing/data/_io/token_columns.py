"""Integer list columns of a tokenized Arrow table, read where they lie: row lengths, checked values, and gathers by
token index that touch only the tokens they fetch.

A memory-mapped dataset (`.map`, `load_from_disk`) holds a column as one chunk per 1,000-row record batch, and
`combine_chunks` would copy the whole corpus into fresh memory. Here every chunk's values buffer is addressed from one
base address instead: a token is an index into one numpy view over the address range of all chunks, so one `np.take`
gathers across chunks and only the pages of the fetched tokens are read. Checks run over bounded windows of rows.
"""

import concurrent.futures
import functools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...core.rows import (
    INT32_MAX,
    MASK_COLUMNS,
    invalid_tokens,
    length_error,
    padding_error,
    segment_aranges,
    token_error,
)
from ...errors import PackingTypeError, PackingValueError


_CHECK_WINDOW = 1 << 24  # tokens per checked window: bounds its copy to ~128 MiB
_LABELS_WINDOW = 1 << 22  # tokens compared at a time when deciding whether to store labels: 32 MiB of indices


class TokenColumn:
    """
    One list-of-integers column (`input_ids`, `labels` or a mask), checked, with `row_start[r]` the index of row `r`'s
    first value for [`TokenColumn.take`].

    Args:
        table (`pa.Table`): The tokenized examples, any number of chunks.
        name (`str`): The column.
        lengths (`np.ndarray`, *optional*): The `input_ids` row lengths this column must match.
        pages ([`~llm_packing.data._io.resident_pages.ResidentPages`], *optional*): Checked after each window the
        checks read. checks ([`ValueChecks`], *optional*): Where the values are checked; by default at once, here.

    Example:
    ```python
    >>> import numpy as np, pyarrow as pa
    >>> table = pa.concat_tables([pa.table({"input_ids": [[1, 2], [3]]}), pa.table({"input_ids": [[4, 5, 6]]})])
    >>> column = TokenColumn(table, "input_ids")
    >>> column.lengths.tolist()
    [2, 1, 3]
    >>> column.take(np.concatenate([column.row_start[2] + np.arange(3), column.row_start[:1]])).tolist()
    [4, 5, 6, 1]

    ```
    """

    def __init__(self, table: pa.Table, name: str, lengths: np.ndarray | None = None, pages=None, checks=None):
        column = table.column(name)
        self.name = name
        if len(column) == 0 and pa.types.is_null(column.type):  # `Dataset.from_dict({"input_ids": []})` has no type
            column = pa.chunked_array([], pa.list_(pa.int32()))
        column = variable_lists(column)
        self.lengths = _checked_lengths(column, name, lengths)
        if pa.types.is_null(column.type.value_type):
            column = column.cast(pa.list_(pa.int32()))  # only empty lists: nothing to read, one type to read it as
        if checks is None:
            _check_values(column, name, self.lengths, pages)
        else:
            checks.add(functools.partial(_check_values, column, name, self.lengths, pages))
        self._chunks = column.chunks  # keeps the buffers that `_span` points into alive
        self.bits = pa.types.is_boolean(column.type.value_type)  # Arrow packs booleans 8 to a byte
        dtype = np.dtype(np.uint8 if self.bits else column.type.value_type.to_pandas_dtype())
        self.itemsize = dtype.itemsize  # bytes per value in the input, as `row_start` counts them (not for masks)
        self._span, self.row_start = _span(self._chunks, dtype, self.bits, len(self.lengths))

    def select(self, rows: np.ndarray) -> None:
        """Keep `rows` only, in that order (an indices mapping: `select`, `shuffle`, `filter`); values are not
        moved."""
        self.lengths, self.row_start = self.lengths[rows], self.row_start[rows]

    def take(self, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The values at `index` (built from `row_start`), as `int32` (masks: 0/1 `uint8`), into `out` if given."""
        if self.bits:
            return (self._span.take(index >> 3, mode="clip") >> (index & 7).astype(np.uint8)) & 1
        # In range by construction: "clip" skips the per-index check that "raise" makes (~30%).
        if out is not None and out.dtype == self._span.dtype:
            return np.take(self._span, index, out=out, mode="clip")
        values = self._span.take(index, mode="clip")
        if out is None:
            return values.astype(np.int32, copy=False)
        out[...] = values  # checked to fit int32
        return out


    def copy_runs(self, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray, out_starts: np.ndarray) -> None:
        """Copy the `lengths[i]` values from index `starts[i]` to `out[out_starts[i]:]`, one slice per run (not for
        boolean masks, which are bit-packed)."""
        span = self._span
        for start, length, out_start in zip(starts.tolist(), lengths.tolist(), out_starts.tolist(), strict=True):
            out[out_start : out_start + length] = span[start : start + length]


class ValueChecks:
    """
    The value checks of token columns (every token read once: 0.3 s for 1.6 GB memory-mapped, mostly mapping its
    pages), run in the order they are added on a thread of their own, so that they overlap the planning and the
    gather instead of preceding them. [`ValueChecks.raise_failed`] raises the first failure, as checking the columns
    in turn would have; call it before anything packed is handed out, and at will to stop early.
    """

    def __init__(self):
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llm_packing-checks")
        self._pending = []

    def add(self, check) -> None:
        self._pending.append(self._executor.submit(check))

    def raise_failed(self, wait: bool = True) -> None:
        """Raise the first failed check's error; with `wait=False`, only among the checks done so far."""
        for future in self._pending:
            if not (wait or future.done()):
                return
            future.result()
        if wait:
            self._executor.shutdown()


def row_windows(lengths: np.ndarray, window: int | None = None):
    """`(first_row, last_row)` ranges of about `window` tokens (default `_CHECK_WINDOW`; at least one row each)
    covering every row."""
    window = window or _CHECK_WINDOW
    ends = np.cumsum(lengths)
    first = 0
    while first < len(lengths):
        last = max(int(np.searchsorted(ends, (ends[first - 1] if first else 0) + window, side="right")), first + 1)
        yield first, min(last, len(lengths))
        first = last


def flat_values(column, first: int, last: int) -> np.ndarray:
    """The values of rows `[first, last)`, copied into one numpy array (bounded by the window)."""
    values = pc.list_flatten(column.slice(first, last - first))
    values = values.chunk(0) if values.num_chunks == 1 else values.combine_chunks()
    return values.to_numpy(zero_copy_only=False)


def variable_lists(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """`column` with lists of fixed size (`Sequence(Value("int32"), length=n)`: every row `n` values, no offsets) as
    lists with offsets, which the readers here index; any other column as it is."""
    if pa.types.is_fixed_size_list(column.type):
        return column.cast(pa.list_(column.type.value_type))
    return column


def _checked_lengths(column: pa.ChunkedArray, name: str, lengths: np.ndarray | None) -> np.ndarray:
    value_type = getattr(column.type, "value_type", None)
    is_mask = name in MASK_COLUMNS
    allowed = (pa.types.is_integer, pa.types.is_null, *((pa.types.is_boolean,) if is_mask else ()))  # null: all empty
    if value_type is None or not any(is_type(value_type) for is_type in allowed):
        raise PackingTypeError(
            f"Column {name!r} must hold lists of integers, got Arrow type {column.type}. Tokenize the text and cast "
            "the ids to integers first."
        )
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise PackingValueError(f"Column {name!r} is null in row {row}. Fill or filter that row before packing.")
    column_lengths = pc.list_value_length(column).to_numpy().astype(np.int64)
    if lengths is not None and not np.array_equal(column_lengths, lengths):
        row = int(np.flatnonzero(column_lengths != lengths)[0])
        raise length_error(name, f"Column {name!r} in row {row}", column_lengths[row], lengths[row])
    return column_lengths


def _check_values(column: pa.ChunkedArray, name: str, lengths: np.ndarray, pages) -> None:
    """No null inside a list; ids in [0, INT32_MAX]; labels also -100 (masks: any integer or boolean). Read a window
    at a time, so that `pages` can give back what was read; only a failed check reads the values again, to name the
    first row at fault."""
    flat = pc.list_flatten(column)
    if flat.null_count:
        index = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(np.searchsorted(np.cumsum(lengths), index, side="right"))
        raise PackingValueError(
            f"Column {name!r} in row {row} holds a null value inside its list ({flat.null_count} in the column). "
            "Every token needs an integer: fill or filter that row before packing."
        )
    if name in MASK_COLUMNS:
        return
    lows, highs = [], []
    for first, last in row_windows(lengths):
        extremes = pc.min_max(pc.list_flatten(column.slice(first, last - first))).as_py()  # streams: nothing copied
        if extremes["min"] is not None:
            lows.append(extremes["min"])
            highs.append(extremes["max"])
        _check_pages(pages)
    # Outside [0, INT32_MAX]: a wrong value somewhere, or labels' -100 only. The rows are read to tell, and to name
    # the first row at fault.
    if not lows or (min(lows) >= 0 and max(highs) <= INT32_MAX):
        return
    row_ends = np.cumsum(lengths)
    for first, last in row_windows(lengths):
        values = flat_values(column, first, last)
        _check_pages(pages)
        wrong = invalid_tokens(values, name)
        if wrong.any():
            index = int(np.argmax(wrong)) + (int(row_ends[first - 1]) if first else 0)
            row = int(np.searchsorted(row_ends, index, side="right"))
            raise token_error(name, f"Column {name!r} in row {row}", int(values[np.argmax(wrong)]))


def check_unpadded(column: pa.ChunkedArray, lengths: np.ndarray, pages=None) -> None:
    """Raise [`~llm_packing.core.rows.padding_error`] if a tokenizer's `attention_mask` column holds a 0 (padding).
    One `pc.min` per window of rows (`lengths`: the `input_ids` row lengths), nothing copied; only a window with a 0
    is read again, to name the row. A column that holds no integer lists is not a tokenizer's and is left alone."""
    column = variable_lists(column)
    value_type = getattr(column.type, "value_type", None)
    if value_type is None or not (pa.types.is_integer(value_type) or pa.types.is_boolean(value_type)):
        return
    for first, last in row_windows(lengths):
        window = column.slice(first, last - first)
        low = pc.min(pc.list_flatten(window)).as_py()
        _check_pages(pages)
        if low is None or low > 0:
            continue
        zeros = np.flatnonzero(flat_values(column, first, last) == 0)
        if len(zeros):
            row_ends = np.cumsum(pc.list_value_length(window).fill_null(0).to_numpy(zero_copy_only=False))
            row = first + int(np.searchsorted(row_ends, zeros[0], side="right"))
            raise padding_error(f"Column 'attention_mask' in row {row}")


def _check_pages(pages) -> None:
    if pages is not None:
        pages.check()


def _span(chunks, dtype: np.dtype, bits: bool, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A read-only view from the lowest to the highest address of the chunks' values, and each row's first index in
    it (in bits for booleans). Chunks come from one memory map or from separate allocations: the view spans the gaps
    between them, which are never read."""
    located = []  # per chunk: (address, size, first value's index in the buffer, list offsets), None without values
    for chunk in chunks:
        values = chunk.values
        data = values.buffers()[1] if len(values) else None
        located.append(None if data is None else (data.address, data.size, values.offset, chunk.offsets.to_numpy()))
    row_start = np.zeros(num_rows, np.int64)
    present = [place for place in located if place is not None]
    if not present:
        return np.zeros(1, dtype), row_start
    base = min(address for address, *_ in present)
    end = max(address + size for address, size, *_ in present)
    view = np.asarray(_Memory(base, (end - base) // dtype.itemsize, dtype))
    per_byte = 8 if bits else 1
    first_row = 0
    for chunk, place in zip(chunks, located, strict=True):
        if place is not None:
            address, _, offset, offsets = place
            # Arrow buffers are 64-byte aligned and values are whole elements: every chunk starts at a whole index.
            start = (address - base) * per_byte // dtype.itemsize + offset
            row_start[first_row : first_row + len(chunk)] = offsets[:-1].astype(np.int64) + start  # past int32
        first_row += len(chunk)
    return view, row_start


class _Memory:
    """Exposes `count` values of `dtype` at `address` to numpy without copying (`np.asarray(_Memory(...))`)."""

    def __init__(self, address: int, count: int, dtype: np.dtype):
        self.__array_interface__ = {"data": (address, True), "shape": (count,), "typestr": dtype.str, "version": 3}


def labels_say_more(input_ids: TokenColumn, others: list[TokenColumn], pages=None) -> bool:
    """Whether the `labels` / mask columns leave out or change a token other than a row's first: otherwise the
    collator's labels (the ids, -100 at each document start) are the same and none are stored."""
    for first, last in row_windows(input_ids.lengths, _LABELS_WINDOW):
        lengths = input_ids.lengths[first:last]
        rows = np.flatnonzero(lengths) + first
        if not len(rows):
            continue
        lengths = lengths[lengths > 0]
        ids = input_ids.take(segment_aranges(input_ids.row_start[rows], lengths))
        differs = np.zeros(len(ids), bool)
        for column in others:
            values = column.take(segment_aranges(column.row_start[rows], lengths))
            differs |= (values != ids) if column.name == "labels" else (values == 0)
        if pages is not None:
            pages.check()
        differs[np.cumsum(lengths) - lengths] = False
        if differs.any():
            return True
    return False
