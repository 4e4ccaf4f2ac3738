"""A packing plan as bin templates: the lengths of each kind of bin, which kind every bin is, and the documents handed
to their slots a chunk of rows at a time.

The decreasing strategies of [`~llm_packing.core.binpack.pack_sequences`] fill whole groups of bins alike: 100M
lognormal documents make about 10M bins of only ~5,500 kinds. A plan kept as templates costs a few bytes a bin;
documents are bound to slots only where the final row order is written, one chunk at a time (see
[`Templates.assign`]): the `k`-th slot of a length, in row order, takes the `k`-th document of that length, so the
plan needs no id array of its own before the one it returns.
"""

from dataclasses import dataclass

import numpy as np

from . import length_sort
from .rows import segment_aranges


@dataclass(frozen=True)
class Templates:
    """
    Bins by kind. Template `t` holds the slots `flat[offsets[t]:offsets[t + 1]]` (their lengths, in slot order;
    `keys` the same slots' keys into the length histogram), and bin `b` of the engine's order is of template
    `of_bin[b]`.

    Example (bins `[3, 1]`, `[3, 1]`, `[2]`: two templates):
    ```python
    >>> import numpy as np
    >>> lengths = np.array([3, 1, 2])
    >>> templates = Templates(lengths, lengths, np.array([0, 2, 3]), np.array([0, 0, 1]))
    >>> bins = np.array([2, 0, 1])
    >>> templates.bin_offsets(bins).tolist(), templates.tokens_per_bin(bins).tolist()
    ([0, 1, 3, 5], [2, 4, 4])

    ```
    """

    flat: np.ndarray
    keys: np.ndarray
    offsets: np.ndarray
    of_bin: np.ndarray

    @property
    def num_bins(self) -> int:
        return len(self.of_bin)

    def widths(self) -> np.ndarray:
        """Slots of each template."""
        return np.diff(self.offsets)

    def bin_offsets(self, bins: np.ndarray) -> np.ndarray:
        """int64 offsets of the slots of `bins`, in that order (`num_bins + 1` values), a chunk of bins at a time."""
        offsets = np.zeros(len(bins) + 1, np.int64)
        widths, total = self.widths(), 0
        for first in range(0, len(bins), length_sort.CHUNK):
            chunk = offsets[first + 1 : first + 1 + length_sort.CHUNK]
            np.cumsum(widths[self.of_bin[bins[first : first + length_sort.CHUNK]]], out=chunk)
            chunk += total
            total = int(chunk[-1])
        return offsets

    def tokens_per_bin(self, bins: np.ndarray) -> np.ndarray:
        """int64 tokens in each of `bins`, in that order."""
        tokens = np.add.reduceat(self.flat.astype(np.int64), self.offsets[:-1]) if len(self.flat) else self.offsets[1:]
        return tokens[self.of_bin[bins]]

    def shapes(self) -> np.ndarray:
        """A 64-bit hash of each template's multiset of lengths (templates with the same lengths hash alike)."""
        return np.add.reduceat(_mixed(self.flat), self.offsets[:-1])

    def assign(self, bins: np.ndarray, offsets: np.ndarray, pooled: np.ndarray, pool_starts: np.ndarray, *,
               out: np.ndarray | None = None, addresses: np.ndarray | None = None) -> np.ndarray | None:
        """
        Hand the documents to the slots of `bins` (in that order): each length's slots, in row order, take that
        length's documents in `pooled` in turn, from `pool_starts[key]` on. One chunk of rows at a time.

        Args:
            bins (`np.ndarray`): Bin indices (engine order) in the order of the rows.
            offsets (`np.ndarray`): Their `bin_offsets(bins)`.
            pooled (`np.ndarray`): Document ids grouped by length key (each group in the order to hand them out).
            pool_starts (`np.ndarray`): Where each key's documents start in `pooled`.
            out (`np.ndarray`, *optional*): Filled with the document of every slot, row after row.
            addresses (`np.ndarray`, *optional*): Where each document lies; the sum of them per row is returned.
                Without, a document's id is its address.

        Returns:
            `np.ndarray` or `None`: With `addresses`, or without `out`, the float64 sum of the addresses per row.
        """
        widths = self.widths()
        next_place = pool_starts.astype(np.int64, copy=True)
        sums = np.zeros(len(bins)) if out is None or addresses is not None else None
        first = 0
        while first < len(bins):
            last = max(int(np.searchsorted(offsets, offsets[first] + length_sort.CHUNK, side="right")) - 1, first + 1)
            kinds = self.of_bin[bins[first:last]]
            slots = segment_aranges(self.offsets[kinds], widths[kinds])
            documents = length_sort.take_in_turn(self.keys[slots], next_place, pooled)
            if out is not None:
                out[offsets[first] : offsets[last]] = documents
            if sums is not None:
                where = documents if addresses is None else addresses[documents]
                row = np.repeat(np.arange(last - first), widths[kinds])
                sums[first:last] = np.bincount(row, weights=where, minlength=last - first)
            first = last
        return sums


def _mixed(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of each value: well-spread 64-bit words, the same on every platform and version."""
    x = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
