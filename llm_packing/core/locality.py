"""An order of the packed rows in which consecutive rows take their documents from one stretch of the input.

The decreasing strategies of [`~llm_packing.core.binpack.pack_sequences`] make bins by shape: every document of one
length lands in a run of neighbouring bins of the same contents, bound in input order. Gathered in that order, any
run of rows takes its documents from all over the input, so each group that `gather.py` reads maps pages across the
whole of a memory-mapped input, where the bound on resident pages gives them back and the next group maps them
again (benchmarks/results/pack_locality.md measures it).

[`local_order`] keeps every bin's lengths and changes two free choices: the order of the rows, and which of the
documents of one length goes to which slot of that length. Each bin shape's copies are spread evenly over the rows
(the `k`-th of `n` copies at `(k + u) / n`, `u` in [0, 1) a fixed offset per bin, itself spread evenly), then each
length's slots, in row order, take that length's documents in the order they lie in the input; then once more with
the rows in the order of their documents' mean address. A length's documents are then spread over the rows as they
are spread over the input, and a run of rows reads one stretch of it: about a fifth of the page mappings
(`benchmarks/results/pack_locality.md`). Packing is as tight as before (the same bins). What changes is which
documents share a row, which does not change what any of them is trained on (each is trained on alone): a row now
holds documents from nearby parts of the input (as TRL's packing of 1,000 rows at a time does), and the Trainer's
sampler shuffles the rows. With a `seed`, `pack_dataset` pairs documents at random and orders the rows at random
instead (see `plan.py`).

The order is computed on the plan's bin templates ([`~llm_packing.core.templates.Templates`]), a chunk of rows at a
time: besides the document ids sorted by length (4 bytes each) and the order it returns, it holds a few numbers per
bin, not per document.
"""

import numpy as np

from . import length_sort
from .length_sort import ids_by_key, length_keys
from .templates import Templates


_GOLDEN = 0.6180339887498949  # bin b of the engine order is offset by frac(b * golden ratio): evenly spread


def local_order(order: np.ndarray, bin_offsets: np.ndarray, lengths: np.ndarray,
                addresses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """
    The bins of a packing plan reordered, and documents of equal length rebound, so that rows follow the input.

    Args:
        order, bin_offsets (`np.ndarray`): A plan of [`~llm_packing.core.binpack.pack_sequences`]: bin `i` holds the
            documents `order[bin_offsets[i]:bin_offsets[i + 1]]`.
        lengths (`np.ndarray`): Every document's length (what the plan packed).
        addresses (`np.ndarray`): Where each document lies in the input (e.g. its first token's index).

    Returns:
        `tuple[np.ndarray, np.ndarray]`: The new `order` and `bin_offsets`: the same bins (each a multiset of
        lengths) in another order, every document once.

    Example:
    ```python
    >>> import numpy as np
    >>> order, offsets = np.array([3, 0, 2, 1]), np.array([0, 2, 4])  # bins [3, 0] and [2, 1]: lengths [2, 3]
    >>> new_order, new_offsets = local_order(order, offsets, np.array([3, 3, 2, 2]), np.arange(4))
    >>> new_order.tolist(), new_offsets.tolist()  # the first row now takes the first document of each length
    ([2, 0, 3, 1], [0, 2, 4])

    ```
    """
    if len(bin_offsets) < 3:
        return order, bin_offsets
    _, _, keys, histogram = length_keys(lengths, int(lengths.max()))
    templates = Templates(lengths[order], keys[order], bin_offsets, np.arange(len(bin_offsets) - 1))
    new_order, bins = local_rows(templates, keys, histogram, addresses)
    return new_order.astype(order.dtype, copy=False), templates.bin_offsets(bins)


def local_rows(templates: Templates, keys: np.ndarray, histogram: np.ndarray,
               addresses: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """
    The rows of a plan given as `templates` in the local order: `(order, bins)`, the documents row after row and the
    rows' bins (engine order).

    Args:
        templates ([`~llm_packing.core.templates.Templates`]): The bins, engine order.
        keys, histogram (`np.ndarray`): Every document's length key and the keys' histogram (see
            [`~llm_packing.core.length_sort.length_keys`]).
        addresses (`np.ndarray`, *optional*): Where each document lies in the input; by default its id (documents
            in input order).
    """
    pooled = by_key_then_address(keys, histogram, addresses)
    pool_starts = np.cumsum(histogram) - histogram
    spread = _spread_shapes(templates)
    # Once more, with the rows in the order of their documents' mean address: each length's documents then lie
    # closer to where the rows around them read (runs of rows spread over a third less of the input).
    sums = templates.assign(spread, templates.bin_offsets(spread), pooled, pool_starts, addresses=addresses)
    widths, chunk = templates.widths(), length_sort.CHUNK
    for first in range(0, len(sums), chunk):
        sums[first : first + chunk] /= widths[templates.of_bin[spread[first : first + chunk]]]
    bins = np.argsort(sums, kind="stable")
    del sums
    for first in range(0, len(bins), chunk):
        bins[first : first + chunk] = spread[bins[first : first + chunk]]
    del spread
    order = np.empty(len(keys), pooled.dtype)
    templates.assign(bins, templates.bin_offsets(bins), pooled, pool_starts, out=order)
    return order, bins


def by_key_then_address(keys: np.ndarray, histogram: np.ndarray, addresses: np.ndarray | None) -> np.ndarray:
    """Document ids sorted by length key, then address (then id), in the narrowest id type."""
    pooled = ids_by_key(keys, histogram)
    if addresses is None or _increasing(addresses):
        return pooled
    stops = np.cumsum(histogram)
    for start, stop in zip((stops - histogram).tolist(), stops.tolist(), strict=True):
        if stop - start > 1:  # one length's documents at a time: temporaries of that size only
            pool = pooled[start:stop]
            pool[:] = pool[np.argsort(addresses[pool], kind="stable")]
    return pooled


def _increasing(addresses: np.ndarray) -> bool:
    step = 1 << 20  # compared a chunk at a time: no bool array of the corpus's size
    for start in range(0, len(addresses) - 1, step):
        stop = min(start + step, len(addresses) - 1)
        if not np.all(addresses[start + 1 : stop + 1] >= addresses[start:stop]):
            return False
    return True


def _spread_shapes(templates: Templates) -> np.ndarray:
    """Bin indices in an order where the copies of each bin shape (its multiset of lengths) are spread evenly: the
    `k`-th of `n` bins of a shape (engine order) at `(k + frac(b * golden ratio)) / n`, `b` its engine index. A chunk
    of bins at a time: the result and the places are the only arrays of a bin's size."""
    _, shape_of_template = np.unique(templates.shapes(), return_inverse=True)  # equal multisets hash alike
    shape_of_template = shape_of_template.astype(length_sort.length_dtype(len(shape_of_template)))
    num_bins, chunk = templates.num_bins, length_sort.CHUNK
    copies = np.zeros(int(shape_of_template.max(initial=0)) + 1, np.int64)
    for first in range(0, num_bins, chunk):
        copies += np.bincount(shape_of_template[templates.of_bin[first : first + chunk]], minlength=len(copies))
    place, seen = np.empty(num_bins), np.zeros_like(copies)
    for first in range(0, num_bins, chunk):
        shape = shape_of_template[templates.of_bin[first : first + chunk]]
        local, ranks = length_sort.places(shape, seen)
        copy = np.empty(len(shape), np.int64)
        copy[local] = ranks  # k: which copy of its shape, in engine order
        place[first : first + len(shape)] = (copy + (np.arange(first, first + len(shape)) * _GOLDEN) % 1.0) / copies[
            shape]
    return np.argsort(place, kind="stable")
