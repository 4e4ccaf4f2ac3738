"""`plan_rows`: the packed rows of a corpus, in the order they are written, at about 10 bytes a document besides its
length.

[`~llm_packing.core.binpack.pack_sequences`] returns a plan in the engine's order with int64 ids and a copy of the
lengths (its contract); `pack_dataset` used to reorder it with `local_order`, and planning 100M documents peaked at
~100 bytes a document. Here the engine's bins are kept as templates (a few bytes a bin, see `templates.py`), the
documents are sorted by length in 4-byte ids by a streamed counting sort (`length_sort.py`), and the rows' documents
are written once, in their final order, a chunk at a time. What a document costs at the peak: its id sorted by
length (4 bytes), its id in the returned order (4 bytes), and the lengths themselves as the caller holds them (2
bytes as uint16); everything else is per bin (about a tenth as many) or per chunk.
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .binpack import Strategy, check_fits, check_lengths, check_options, pack_sequences, run_plan, shuffle_pools
from .length_sort import id_dtype, ids_by_key, length_keys
from .locality import local_rows
from .stats import PackingStats


@dataclass(frozen=True)
class RowPlan:
    """
    Packed rows as document ids: row `i` holds the documents `order[bin_offsets[i]:bin_offsets[i + 1]]`.

    Args:
        order (`np.ndarray`): Document ids row after row, each once, in the narrowest unsigned type (`uint32` up to
            2**32 documents).
        bin_offsets (`np.ndarray`): int64 offsets of the rows in `order` (`num_bins + 1`).
        tokens_per_bin (`np.ndarray`): int64 tokens of each row.
        capacity (`int`): Tokens per row.
    """

    order: np.ndarray
    bin_offsets: np.ndarray
    tokens_per_bin: np.ndarray
    capacity: int

    @property
    def num_bins(self) -> int:
        return len(self.bin_offsets) - 1

    @cached_property
    def stats(self) -> PackingStats:
        return PackingStats.from_bin_token_counts(self.tokens_per_bin, num_sequences=len(self.order),
                                                  capacity=self.capacity)


def plan_rows(lengths, capacity: int, *, strategy: Strategy = "bfd", seed: int | None = None,
              max_docs_per_bin: int | None = None, addresses: np.ndarray | None = None) -> RowPlan:
    """
    The rows `pack_dataset` writes: the bins of [`~llm_packing.core.binpack.pack_sequences`] (same strategies, same
    bins), in the order they are written, with their documents.

    Without a `seed`, the decreasing strategies give the rows in the local order of
    [`~llm_packing.core.locality.local_order`] (runs of rows read one stretch of the input); with a `seed`, the
    documents of each length are paired with the rows' slots at random and the rows come in a random order;
    `"nf"` keeps the input order.

    Args:
        lengths (`np.ndarray`): Positive token counts, best in the narrowest type that holds them (`uint16`): they
            are read in place, never copied.
        capacity, strategy, seed, max_docs_per_bin: As for `pack_sequences`.
        addresses (`np.ndarray`, *optional*): Where each document lies in the input, if not in the order of the ids
            (an indices mapping); by default a document's id is its place.

    Returns:
        [`RowPlan`]: `order` (narrow ids) and `bin_offsets`, with the tokens per row and the stats.

    Example:
    ```python
    >>> plan = plan_rows(np.array([3, 5, 2, 4, 1], np.uint16), 6)
    >>> plan.order.tolist(), plan.bin_offsets.tolist(), plan.tokens_per_bin.tolist()  # bins [0], [1, 4], [3, 2]
    ([0, 1, 4, 3, 2], [0, 1, 3, 5], [3, 6, 6])

    ```
    """
    lengths = check_lengths(lengths)
    check_options(capacity, strategy, seed, max_docs_per_bin)
    longest = check_fits(lengths, capacity)
    count = len(lengths)
    if count == 0:
        return RowPlan(np.zeros(0, id_dtype(0)), np.zeros(1, np.int64), np.zeros(0, np.int64), int(capacity))
    if strategy == "nf":  # the input order already: the engine's plan is the rows
        result = pack_sequences(lengths, capacity, strategy="nf", seed=seed, max_docs_per_bin=max_docs_per_bin)
        return RowPlan(result.order.astype(id_dtype(count)), result.bin_offsets, result.bin_token_counts,
                       int(capacity))
    sizes, counts, keys, histogram = length_keys(lengths, longest)
    max_docs = count + 1 if max_docs_per_bin is None else int(max_docs_per_bin)
    plan = run_plan(sizes, counts, int(capacity), strategy, max_docs)
    templates = plan.templates((lambda flat: flat) if keys is lengths else
                               (lambda flat: np.searchsorted(sizes, flat).astype(keys.dtype)))
    del plan
    if seed is None and templates.num_bins > 1:
        order, bins = local_rows(templates, keys, histogram, addresses)
    else:
        pooled = ids_by_key(keys, histogram)
        bins = np.arange(templates.num_bins)
        if seed is not None:  # random pairings (each length's documents shuffled in place) and a random row order
            rng = np.random.default_rng(seed)
            shuffle_pools(pooled, histogram, rng)
            bins = rng.permutation(templates.num_bins)
        order = np.empty(count, pooled.dtype)
        templates.assign(bins, templates.bin_offsets(bins), pooled, np.cumsum(histogram) - histogram, out=order)
        del pooled
    return RowPlan(order, templates.bin_offsets(bins), templates.tokens_per_bin(bins), int(capacity))
