"""Bin packing of sequence lengths: `pack_sequences` puts every sequence in a bin of at most `capacity` tokens.

The decreasing strategies work on the length histogram with bins grouped by contents, moving whole groups per step:
the plan costs O(distinct lengths x bin groups), not O(items x bins). `"bfd"`/`"ffd"` give exactly the bins of
per-item best/first-fit decreasing (ties go to the earliest opened bin), `"wfd"` the bin templates of per-item
worst-fit decreasing. Binding item ids costs one stable radix argsort of the lengths and one copy; `"nf"` one
vectorised search and one step per bin. numpy only; no Python loop runs per item.
"""

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from ..errors import PackingTypeError, PackingValueError, SequenceTooLongError
from .bin_groups import BinGroups
from .checks import check_choice, check_integer
from .stats import PackingStats


Strategy = Literal["bfd", "ffd", "wfd", "nf"]
STRATEGIES = ("bfd", "ffd", "wfd", "nf")


def seed_from_components(*components: int) -> int:
    """
    Derive one seed from several integers, identically in every process and on every platform (no `hash()`).

    Args:
        *components (`int`):
            E.g. `(base_seed, epoch, rank, worker)`.

    Returns:
        `int`: a seed in `[0, 2**63)`.

    Example:
    ```python
    >>> seed_from_components(42, 0)
    4644567203592954840
    >>> seed_from_components(42, 1) != seed_from_components(42, 0)
    True

    ```
    """
    for component in components:
        if isinstance(component, bool) or not isinstance(component, (int, np.integer)):
            raise PackingTypeError(
                f"`seed_from_components` takes integers, got {component!r} ({type(component).__name__}). Pass e.g. "
                "`(seed, epoch, rank)` as ints."
            )
    digest = hashlib.blake2b(",".join(str(int(c)) for c in components).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class PackResult:
    """
    A packing plan in CSR form: bin `i` holds the sequences `order[bin_offsets[i]:bin_offsets[i + 1]]`.

    Args:
        order (`np.ndarray`):
            int64 indices into `lengths`, grouped by bin; every index appears exactly once.
        bin_offsets (`np.ndarray`):
            int64 array of `num_bins + 1` offsets into `order`, starting at `0` and ending at `len(lengths)`.
        lengths (`np.ndarray`):
            int64 copy of the packed lengths.
        capacity (`int`):
            Token capacity of a bin.
    """

    order: np.ndarray
    bin_offsets: np.ndarray
    lengths: np.ndarray
    capacity: int

    @property
    def num_bins(self) -> int:
        return len(self.bin_offsets) - 1

    def __len__(self) -> int:
        return self.num_bins

    @property
    def bins(self) -> list[list[int]]:
        """The bins as lists of indices into `lengths` (Python objects: prefer `order`/`bin_offsets` for millions)."""
        flat, bounds = self.order.tolist(), self.bin_offsets.tolist()
        return [flat[start:stop] for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]

    @cached_property
    def bin_token_counts(self) -> np.ndarray:
        """int64 tokens per bin."""
        if self.num_bins == 0:
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(self.lengths[self.order], self.bin_offsets[:-1])

    @property
    def efficiency(self) -> float:
        """Packed tokens / (`num_bins` * `capacity`); `0.0` without bins."""
        return int(self.lengths.sum()) / (self.num_bins * self.capacity) if self.num_bins else 0.0

    @cached_property
    def stats(self) -> PackingStats:
        return PackingStats.from_bin_token_counts(
            self.bin_token_counts, num_sequences=len(self.lengths), capacity=self.capacity
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackResult):
            return NotImplemented
        return self.capacity == other.capacity and all(
            np.array_equal(a, b) for a, b in ((self.order, other.order), (self.bin_offsets, other.bin_offsets),
                                               (self.lengths, other.lengths))
        )

    def __str__(self) -> str:
        return str(self.stats)

    def __repr__(self) -> str:
        s = self.stats
        return (f"PackResult(num_bins={s.num_bins}, num_sequences={s.num_sequences}, num_tokens={s.num_tokens}, "
                f"capacity={s.capacity}, efficiency={s.efficiency:.6f}, lower_bound_bins={s.lower_bound_bins})")


def pack_sequences(
    lengths,
    capacity: int,
    *,
    strategy: Strategy = "bfd",
    seed: int | None = None,
    max_docs_per_bin: int | None = None,
) -> PackResult:
    """
    Pack sequences of the given lengths into as few bins of `capacity` tokens as the strategy finds.

    Args:
        lengths (`Sequence[int]`, `np.ndarray` or `pyarrow.Array`):
            1-D positive integer token counts, e.g. `[3, 5, 2, 4, 1]`.
        capacity (`int`):
            Tokens per bin (the `max_length` of a packed row); every length must be at most this.
        strategy (`str`, *optional*, defaults to `"bfd"`):
            `"bfd"` best-fit decreasing (tightest), `"ffd"` first-fit decreasing, `"wfd"` worst-fit decreasing
            (balances fill across bins), `"nf"` next-fit in input order (order-preserving, for streams).
        seed (`int` or `None`, *optional*, defaults to `None`):
            With a seed, sequences of equal length trade places at random and the bins come in a random order: the
            bin templates (lengths per bin) stay the same, the pairings change. `None` keeps the input order for
            ties and returns bins in the order they were opened.
        max_docs_per_bin (`int` or `None`, *optional*, defaults to `None`):
            At most this many sequences per bin (very many tiny documents per row slow varlen kernels).

    Returns:
        [`PackResult`]: `order` and `bin_offsets` (CSR), with `bins`, `efficiency` and `stats`.

    Example:
    ```python
    >>> result = pack_sequences([3, 5, 2, 4, 1], capacity=6)
    >>> result.bins
    [[1, 4], [3, 2], [0]]
    >>> result.bin_token_counts.tolist(), result.efficiency
    ([6, 6, 3], 0.8333333333333334)
    >>> pack_sequences([3, 5, 2, 4, 1], capacity=6, strategy="nf").bins
    [[0], [1], [2, 3], [4]]

    ```
    """
    lengths = check_lengths(lengths).astype(np.int64, copy=not isinstance(lengths, (list, tuple)))
    check_options(capacity, strategy, seed, max_docs_per_bin)
    longest = check_fits(lengths, capacity)
    max_docs = len(lengths) + 1 if max_docs_per_bin is None else int(max_docs_per_bin)
    capacity = int(capacity)
    rng = None if seed is None else np.random.default_rng(seed)
    if len(lengths) == 0:
        order, bin_offsets = np.zeros(0, np.int64), np.zeros(1, np.int64)
    elif strategy == "nf":
        order, bin_offsets = _next_fit(lengths, capacity, max_docs, rng)
    else:
        sizes, counts, by_length = _length_pools(lengths, longest)
        if rng is not None:
            shuffle_pools(by_length, counts, rng)
        order, bin_offsets = run_plan(sizes, counts, capacity, strategy, max_docs).bind(by_length)
    if rng is not None:
        order, bin_offsets = _shuffle_bins(order, bin_offsets, rng)
    return PackResult(order=order, bin_offsets=bin_offsets, lengths=lengths, capacity=capacity)


def run_plan(sizes: np.ndarray, counts: np.ndarray, capacity: int, strategy: Strategy, max_docs: int) -> BinGroups:
    """The bins of a decreasing `strategy` for `counts[i]` sequences of each length `sizes[i]` (ascending), grouped
    (see [`BinGroups`]); ids are bound by `bind` or left to `templates`."""
    plan = BinGroups(capacity, max_docs, smallest=int(sizes[0]))
    pools = np.cumsum(counts) - counts
    # Largest lengths first; pools[i] is where the sequences of length sizes[i] start among the length-sorted ids.
    steps = zip(sizes[::-1].tolist(), counts[::-1].tolist(), pools[::-1].tolist(), strict=True)
    {"bfd": plan.best_fit, "ffd": plan.first_fit, "wfd": plan.worst_fit}[strategy](steps)
    return plan


def check_lengths(lengths) -> np.ndarray:
    if getattr(lengths, "null_count", 0):
        raise PackingTypeError(f"`lengths` has {lengths.null_count} null values; every sequence needs a length.")
    try:
        array = np.asarray(lengths)
    except (ValueError, TypeError) as error:
        raise PackingTypeError(f"`lengths` must be a 1-D sequence of integers; converting failed: {error}") from None
    if array.ndim != 1:
        raise PackingTypeError(
            f"`lengths` must be 1-D (one length per sequence), got shape {array.shape}. Pass e.g. `[3, 5, 2]`."
        )
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise PackingTypeError(
            f"`lengths` must hold integers, got dtype {array.dtype} (first value {array[0].item()!r}). Pass token "
            "counts as ints, e.g. `np.asarray(lengths, dtype=np.int64)` if they are whole numbers."
        )
    if array.dtype == np.uint64 and array.max() > np.iinfo(np.int64).max:
        raise PackingValueError(
            f"`lengths` holds {int(array.max())}, beyond int64: not a token count. Pass the sequences' lengths."
        )
    if array.min() <= 0:
        bad = array <= 0
        first = int(np.argmax(bad))
        raise PackingValueError(
            f"`lengths` must be positive: {int(bad.sum())} of {len(array)} are <= 0, the first at index {first} "
            f"({int(array[first])}). Remove empty sequences first (`pack_dataset` drops and counts them)."
        )
    return array  # as given (possibly the caller's memory): `pack_sequences` copies it to int64


def check_fits(lengths: np.ndarray, capacity: int) -> int:
    """The longest of `lengths` (0 without any), which must fit `capacity`."""
    longest = int(lengths.max()) if len(lengths) else 0
    if longest > capacity:
        raise SequenceTooLongError(
            f"{int((lengths > capacity).sum())} of {len(lengths)} sequences are longer than `capacity`={capacity} "
            f"(the longest, at index {int(np.argmax(lengths))}, has {longest} tokens). Raise `capacity`, or cut them "
            'first with `pack_dataset(..., overflow="truncate"|"split"|"drop")`.'
        )
    return longest


def check_options(capacity, strategy, seed, max_docs_per_bin) -> None:
    check_integer("capacity", capacity, meaning="tokens per bin")
    check_choice("strategy", strategy, STRATEGIES, fix="'bfd' packs tightest.")
    check_integer("seed", seed, minimum=0, optional=True, fix="Use `seed_from_components(...)` to build one.")
    check_integer("max_docs_per_bin", max_docs_per_bin, optional=True, meaning="no cap")


def _length_pools(lengths: np.ndarray, longest: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct lengths (ascending), their counts, and the item ids stably sorted by length (int64, as `order`:
    `plan_rows` sorts them in 4 bytes each instead, see `length_sort.py`)."""
    if longest < 1 << 16:
        # A 16-bit key makes numpy's stable argsort a radix sort: two counting passes.
        key = lengths.astype(np.uint8 if longest < 1 << 8 else np.uint16)
        by_length = np.argsort(key, kind="stable")
        histogram = np.diff(_first_positions(key, by_length, longest + 1))
        sizes = np.flatnonzero(histogram)
        return sizes, histogram[sizes], by_length
    sizes, counts = np.unique(lengths, return_counts=True)
    return sizes, counts, np.argsort(lengths, kind="stable")


def _first_positions(key: np.ndarray, by_length: np.ndarray, top: int) -> np.ndarray:
    """Where each length `0..top` starts in the length-sorted order: one binary search per length, all at once
    (about log2(N) steps over `top + 1` values), so no second pass over the N items is needed for the histogram."""
    targets = np.arange(top + 1)
    low, high = np.zeros_like(targets), np.full_like(targets, len(by_length))
    while (active := low < high).any():
        middle = (low + high) >> 1
        below = key[by_length[np.minimum(middle, len(by_length) - 1)]] < targets
        low = np.where(active & below, middle + 1, low)
        high = np.where(active & ~below, middle, high)
    return low


def shuffle_pools(by_length: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> None:
    """Shuffle the ids of each length among themselves, in place (one shuffle per distinct length)."""
    stops = np.cumsum(counts)
    for start, stop in zip((stops - counts).tolist(), stops.tolist(), strict=True):
        if stop - start > 1:
            rng.shuffle(by_length[start:stop])


def _shuffle_bins(order: np.ndarray, bin_offsets: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    permutation = rng.permutation(len(bin_offsets) - 1)
    sizes = np.diff(bin_offsets)[permutation]
    new_offsets = np.concatenate([[0], np.cumsum(sizes)])
    # Position p of the new order reads old position p + (old start - new start) of its bin.
    shift = np.repeat(bin_offsets[:-1][permutation] - new_offsets[:-1], sizes)
    return order[shift + np.arange(len(order))], new_offsets


def _next_fit(lengths: np.ndarray, capacity: int, max_docs: int, rng) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(lengths)
    # A bin starting at item p stops before the first item that would overflow it (searched for all p at once).
    stops = np.searchsorted(ends, ends - lengths + capacity, side="right")
    np.minimum(stops, np.arange(max_docs, max_docs + len(lengths)), out=stops)
    starts, position, n = [0], 0, len(lengths)
    stops_view = memoryview(stops)
    while True:  # one step per bin, not per item
        position = stops_view[position]
        if position >= n:
            break
        starts.append(position)
    bin_offsets = np.array([*starts, n], dtype=np.int64)
    if rng is None:
        return np.arange(n, dtype=np.int64), bin_offsets
    # Same templates, new pairings: each item's slot goes to a random item of the same length.
    _, counts, by_length = _length_pools(lengths, int(lengths.max()))
    shuffled = by_length.copy()
    shuffle_pools(shuffled, counts, rng)
    order = np.empty(n, dtype=np.int64)
    order[by_length] = shuffled
    return order, bin_offsets
