"""Best-fit over a bounded buffer: the bins of a stream of documents, packed a buffer at a time.

Documents are read until `buffer_size` of them wait, then packed with `pack_sequences`. Bins at least `MIN_FILL` full
are emitted; the documents of the emptier ones stay in the buffer to meet the next documents (at most half a buffer of
them, so every round makes progress), and only the last round emits whatever is left. Memory is bounded by the buffer:
at most `buffer_size` documents wait, plus the pieces of the example read last. The trade-off: a document only meets
partners within its buffer, so rows are a little less full than with global packing, and their order follows the
stream. A stream of fewer than `buffer_size` documents is packed in one round: the bins of one `pack_sequences` call
over all of them, as a map-style dataset is packed.
"""

from collections.abc import Iterable, Iterator
from typing import TypeVar

import numpy as np

from .binpack import pack_sequences, seed_from_components


__all__ = ["MIN_FILL", "buffered_bins"]

MIN_FILL = 0.99  # a bin this full is emitted rather than offered more partners

Item = TypeVar("Item")


def buffered_bins(
    groups: Iterable[list[tuple[int, Item]]],
    capacity: int,
    *,
    buffer_size: int,
    strategy: str = "bfd",
    seed: int | None = None,
    max_docs_per_bin: int | None = None,
) -> Iterator[list[tuple[int, Item]]]:
    """
    The bins of a stream of documents, lazily, each a list of `(length, item)` in packed order.

    Args:
        groups (`Iterable[list[tuple[int, Item]]]`):
            The documents as `(length, item)` pairs, in groups that enter the buffer together (the pieces of one
            example, as `overflow="split"` cuts it).
        capacity (`int`):
            Tokens per bin.
        buffer_size (`int`):
            Documents packed together (see the module docstring).
        strategy, seed, max_docs_per_bin:
            As for [`~llm_packing.core.binpack.pack_sequences`]; round `r` packs with
            `seed_from_components(seed, r)`.

    Example:
    ```python
    >>> groups = [[(3, "a")], [(2, "b")], [(1, "c")]]
    >>> [[item for _, item in bin] for bin in buffered_bins(groups, 4, buffer_size=10)]
    [['a', 'c'], ['b']]

    ```
    """
    options = {"capacity": capacity, "buffer_size": buffer_size, "strategy": strategy, "seed": seed,
               "max_docs_per_bin": max_docs_per_bin}
    buffer: list[tuple[int, Item]] = []
    rounds = 0
    for group in groups:
        buffer.extend(group)
        if len(buffer) >= buffer_size:
            buffer = yield from _emit(buffer, options, rounds, final=False)
            rounds += 1
    yield from _emit(buffer, options, rounds, final=True)


def _emit(buffer, options, round_index, *, final):
    """Pack `buffer`, yield the full-enough bins (all of them if `final`), return the documents carried over."""
    if not buffer:
        return []
    lengths = np.array([length for length, _ in buffer], dtype=np.int64)
    seed = None if options["seed"] is None else seed_from_components(options["seed"], round_index)
    result = pack_sequences(lengths, options["capacity"], strategy=options["strategy"], seed=seed,
                            max_docs_per_bin=options["max_docs_per_bin"])
    bins = np.split(result.order, result.bin_offsets[1:-1])
    fill = np.asarray(result.bin_token_counts) / options["capacity"]
    carried_bins, carried_documents = set(), 0
    if not final:
        for b in np.argsort(fill, kind="stable"):
            if fill[b] >= MIN_FILL or carried_documents + len(bins[b]) > options["buffer_size"] // 2:
                break
            carried_bins.add(b)
            carried_documents += len(bins[b])
    for b, documents in enumerate(bins):
        if b not in carried_bins:
            yield [buffer[d] for d in documents]
    return [buffer[d] for b in sorted(carried_bins) for d in bins[b]]
