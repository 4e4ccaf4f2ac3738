"""Document ids sorted by length in 4 bytes an id: a counting sort streamed over chunks of the lengths.

`np.argsort(lengths, kind="stable")` returns 8-byte ids and needs as much again while it sorts: 16 bytes a document
at its peak, and `np.bincount` of a uint16 array makes an 8-byte copy of it first. Here the histogram is counted a
chunk at a time, and each chunk's ids go straight to their place: the ids of one length start where the histogram
puts that length, in input order. Temporaries are one chunk's (`CHUNK` items); the result is the narrowest unsigned
type that holds every id. The same step, [`take_in_turn`], hands documents to the slots of packed rows: the `k`-th
slot of a length, in row order, takes the `k`-th document of that length.
"""

import numpy as np


CHUNK = 1 << 20  # items per streamed step: its int64 temporaries are 8 MiB, small next to 100M documents
_HISTOGRAM_MAX = 1 << 24  # longest length counted in a histogram indexed by length (128 MiB of int64 counts)


def id_dtype(count: int) -> np.dtype:
    """The narrowest unsigned type for ids `0..count-1` (4 bytes up to 2**32 documents).

    Example:
    ```python
    >>> id_dtype(100_000_000), id_dtype(2**33)
    (dtype('uint32'), dtype('uint64'))

    ```
    """
    return np.dtype(np.uint32 if count <= 1 << 32 else np.uint64)


def length_dtype(longest: int) -> np.dtype:
    """The narrowest unsigned type for lengths up to `longest` (2 bytes below 65,536 tokens)."""
    return np.dtype(np.uint16 if longest < 1 << 16 else np.uint32 if longest < 1 << 32 else np.uint64)


def length_keys(lengths: np.ndarray, longest: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """
    The distinct lengths (ascending) and their counts, every document's sort key, and the histogram of the keys.

    Below `_HISTOGRAM_MAX` tokens the key is the length itself (no copy; the histogram, indexed by length, has a zero
    for each absent one); above, it is the index of the length among the distinct ones.

    Example:
    ```python
    >>> sizes, counts, keys, histogram = length_keys(np.array([3, 1, 3], np.uint16), 3)
    >>> sizes.tolist(), counts.tolist(), histogram.tolist()
    ([1, 3], [1, 2], [0, 1, 0, 2])

    ```
    """
    if longest < _HISTOGRAM_MAX:
        histogram = np.zeros(longest + 1, np.int64)
        for start in range(0, len(lengths), CHUNK):
            histogram += np.bincount(lengths[start : start + CHUNK], minlength=longest + 1)
        sizes = np.flatnonzero(histogram)
        return sizes, histogram[sizes], lengths, histogram
    sizes, counts = np.unique(lengths, return_counts=True)  # very long documents: few distinct lengths, rare
    counts = counts.astype(np.int64)
    return sizes, counts, np.searchsorted(sizes, lengths).astype(length_dtype(len(sizes))), counts


def ids_by_key(keys: np.ndarray, histogram: np.ndarray) -> np.ndarray:
    """
    `np.argsort(keys, kind="stable")` in the narrowest id type, streamed: ids grouped by key, ascending, each group
    in input order.

    Example:
    ```python
    >>> keys = np.array([3, 1, 3, 2, 1], np.uint16)
    >>> ids_by_key(keys, np.bincount(keys)).tolist()
    [1, 4, 3, 0, 2]

    ```
    """
    ids = np.empty(len(keys), id_dtype(len(keys)))
    next_place = np.cumsum(histogram) - histogram
    for start in range(0, len(keys), CHUNK):
        chunk = keys[start : start + CHUNK]
        local, place = places(chunk, next_place)
        ids[place] = local + start
    return ids


def take_in_turn(keys: np.ndarray, next_place: np.ndarray, pooled: np.ndarray) -> np.ndarray:
    """
    For slots of the given `keys` (one chunk of a stream, in order), the items of `pooled` whose turn it is: each
    key's items are taken in order from `next_place[key]` on, which advances past them.

    Example:
    ```python
    >>> pooled, next_place = np.array([10, 11, 20, 21, 22]), np.array([0, 0, 2])  # key 1: 10, 11; key 2: 20, 21, 22
    >>> take_in_turn(np.array([2, 1, 2]), next_place, pooled).tolist(), next_place.tolist()
    ([20, 10, 21], [0, 1, 4])
    >>> take_in_turn(np.array([2, 1]), next_place, pooled).tolist()
    [22, 11]

    ```
    """
    local, place = places(keys, next_place)
    taken = np.empty(len(keys), pooled.dtype)
    taken[local] = pooled[place]
    return taken


def places(keys: np.ndarray, next_place: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chunk's positions grouped by key (stable), and the place each takes: its key's `next_place` plus its rank
    among that key's items of the chunk; advances `next_place` past the chunk."""
    local = np.argsort(keys, kind="stable")  # a radix sort for 8- and 16-bit keys
    chunk_counts = np.bincount(keys, minlength=len(next_place))
    first_in_chunk = np.cumsum(chunk_counts) - chunk_counts
    sorted_keys = keys[local]
    place = np.arange(len(keys)) + (next_place - first_in_chunk)[sorted_keys]
    next_place += chunk_counts
    return local, place
