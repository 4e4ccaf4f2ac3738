"""Over-long and empty sequences: what `pack_dataset` does with them before any bin is filled.

Works on the lengths alone (numpy, vectorised): every sequence becomes zero or more *pieces*, each a slice
`[start, start + length)` of one source sequence, with `0 < length <= max_length`. Empty sequences become no piece.
Pieces are kept in the narrowest types (4-byte sources, 2-byte lengths below 65,536 tokens, and one shared zero as
the start of pieces that are whole sequences): 6 bytes a document where nothing is split.
"""

import dataclasses
from typing import Literal

import numpy as np

from ..errors import SequenceTooLongError
from .checks import check_choice, check_integer
from .length_sort import CHUNK, id_dtype, length_dtype


OverflowPolicy = Literal["error", "truncate", "split", "drop"]
OVERFLOW_POLICIES = ("error", "truncate", "split", "drop")


@dataclasses.dataclass(frozen=True)
class Pieces:
    """
    The slices of the source sequences that get packed, as parallel arrays.

    `source[i]` is the row the piece comes from (unsigned ids), `start[i]` its first token within that row (int64; a
    read-only view of one zero unless sequences are split), `length[i]` its size (the narrowest unsigned type that
    holds `max_length`).
    The counts are the overflow fields of [`~llm_packing.core.stats.PackingStats`].
    """

    source: np.ndarray
    start: np.ndarray
    length: np.ndarray
    empty_sequences: int = 0
    dropped_sequences: int = 0
    dropped_tokens: int = 0
    truncated_sequences: int = 0
    truncated_tokens: int = 0
    split_sequences: int = 0

    def counts(self) -> dict[str, int]:
        """The overflow counts, as keyword arguments for `dataclasses.replace(stats, **counts)`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.type is int}


def check_overflow_policy(overflow: str) -> None:
    check_choice("overflow", overflow, OVERFLOW_POLICIES, fix=(
        "Use 'error' to be told about over-long sequences, 'truncate' to keep their first `max_length` tokens, "
        "'split' to cut them into `max_length` chunks packed as separate documents, or 'drop' to leave them out."
    ))


def check_max_length(max_length: int) -> None:
    check_integer("max_length", max_length, meaning="tokens per packed row")


def cut_pieces(lengths: np.ndarray, max_length: int, overflow: OverflowPolicy, *, first_row: int = 0) -> Pieces:
    """
    Apply the `overflow` policy to sequence `lengths` and return the pieces to pack.

    Args:
        lengths (`np.ndarray`):
            Token count of each source sequence.
        max_length (`int`):
            Capacity of a packed row.
        overflow (`str`):
            `"error"`, `"truncate"`, `"split"` or `"drop"` for sequences longer than `max_length`.
        first_row (`int`, *optional*, defaults to `0`):
            Row number of `lengths[0]` in the dataset, so that errors name the right row.

    Returns:
        [`Pieces`]: e.g. lengths `[5, 0, 2]` with `max_length=2` and `overflow="split"` give sources `[0, 0, 0, 2]`,
        starts `[0, 2, 4, 0]` and lengths `[2, 2, 1, 2]`, with `empty_sequences=1` and `split_sequences=1`.

    Example:
    ```python
    >>> import numpy as np
    >>> pieces = cut_pieces(np.array([5, 0, 2]), 2, "split")
    >>> pieces.source.tolist(), pieces.start.tolist(), pieces.length.tolist()
    ([0, 0, 0, 2], [0, 2, 4, 0], [2, 2, 1, 2])
    >>> pieces.counts()["split_sequences"], pieces.counts()["empty_sequences"]
    (1, 1)

    ```
    """
    check_overflow_policy(overflow)  # any other value would cut like "truncate" without counting it
    lengths = np.asarray(lengths)
    too_long = lengths > max_length
    num_too_long = int(np.count_nonzero(too_long))
    counts = {"empty_sequences": len(lengths) - int(np.count_nonzero(lengths))}
    if num_too_long and overflow == "error":
        raise _too_long_error(lengths, max_length, num_too_long, first_row)
    if overflow == "split" and num_too_long:
        return _split(lengths.astype(np.int64), max_length, counts, num_too_long)
    keep = None
    if overflow == "drop" and num_too_long:
        keep = (lengths > 0) & ~too_long
        counts.update(dropped_sequences=num_too_long, dropped_tokens=int(lengths[too_long].sum(dtype=np.int64)))
    elif overflow == "truncate" and num_too_long:
        counts.update(truncated_sequences=num_too_long,
                      truncated_tokens=int(lengths[too_long].sum(dtype=np.int64)) - num_too_long * max_length)
    del too_long
    if counts["empty_sequences"] and keep is None:
        keep = lengths > 0
    source = _kept(keep, len(lengths))
    length = np.empty(len(source), length_dtype(max_length))
    for first in range(0, len(source), CHUNK):  # no int64 copy of the lengths
        picked = lengths[first : first + CHUNK] if keep is None else lengths[source[first : first + CHUNK]]
        np.minimum(picked, max_length, out=length[first : first + CHUNK], casting="unsafe")
    return Pieces(source, np.broadcast_to(np.zeros(1, np.int64), source.shape), length, **counts)


def no_rows_message(source: str, empty: int, dropped: int, overflow: OverflowPolicy) -> str:
    """The warning for examples that made no packed row: every one empty or dropped as over-long.

    Example:
    ```python
    >>> no_rows_message("pack_dataset made no rows from 2 examples", 2, 0, "error").split(": ")[0]
    "pack_dataset made no rows from 2 examples (2 empty, 0 over-long dropped with overflow='error')"

    ```
    """
    return (
        f"{source} ({empty} empty, {dropped} over-long dropped with overflow={overflow!r}): there is nothing to train "
        "on. Check the tokenization (empty `input_ids`) and `overflow`."
    )


def _kept(keep: np.ndarray | None, count: int) -> np.ndarray:
    """The indices where `keep` is true (all of `0..count-1` without it), as 4-byte ids, a chunk at a time."""
    if keep is None:
        return np.arange(count, dtype=id_dtype(count))
    source = np.empty(int(np.count_nonzero(keep)), id_dtype(count))
    done = 0
    for first in range(0, count, CHUNK):
        found = np.flatnonzero(keep[first : first + CHUNK])
        source[done : done + len(found)] = found + first
        done += len(found)
    return source


def _split(lengths: np.ndarray, max_length: int, counts: dict[str, int], num_too_long: int) -> Pieces:
    # Chunk k of a sequence starts at k * max_length; ceil(0 / max_length) = 0 chunks drops empty sequences.
    num_chunks = -(-lengths // max_length)
    source = np.repeat(np.arange(len(lengths), dtype=np.int64), num_chunks)
    first_chunk = np.cumsum(num_chunks) - num_chunks
    start = (np.arange(len(source), dtype=np.int64) - np.repeat(first_chunk, num_chunks)) * max_length
    length = np.minimum(lengths[source] - start, max_length).astype(length_dtype(max_length))
    return Pieces(source.astype(id_dtype(len(lengths))), start, length, split_sequences=num_too_long, **counts)


def _too_long_error(lengths: np.ndarray, max_length: int, num_too_long: int, first_row: int) -> SequenceTooLongError:
    longest = int(np.argmax(lengths))
    return SequenceTooLongError(
        f"{num_too_long} sequence(s) are longer than `max_length`={max_length}; the longest has {lengths[longest]} "
        f"tokens (row {first_row + longest}). Raise `max_length` to at least {lengths[longest]}, or pass "
        "`overflow='split'` (keeps every token, as separate documents), 'truncate' (keeps the first `max_length` "
        "tokens) or 'drop'."
    )
