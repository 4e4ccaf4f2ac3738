"""Bin packing of sequence lengths: `pack_sequences` puts every sequence in a bin of at most `capacity` tokens.

The decreasing strategies work on the length histogram with bins grouped by contents, moving whole groups per step:
the plan costs O(distinct lengths x bin groups), not O(items x bins). `"bfd"`/`"ffd"` give exactly the bins of
per-item best/first-fit decreasing (ties go to the earliest opened bin), `"wfd"` the bin templates of per-item
worst-fit decreasing. Binding item ids costs one stable radix argsort of the lengths and one copy; `"nf"` one
vectorised search and one step per bin. numpy only; no Python loop runs per item.
"""

import hashlib
import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Literal

import numpy as np

from ..errors import PackingTypeError, PackingValueError, SequenceTooLongError
from .checks import check_choice, check_integer
from .length_sort import id_dtype, length_dtype
from .stats import PackingStats
from .templates import Templates


Strategy = Literal["bfd", "ffd", "wfd", "nf"]
STRATEGIES = ("bfd", "ffd", "wfd", "nf")
# Segments of more items than this are copied with one slice each, smaller ones all at once.
_SLICE_MIN_ITEMS = 128


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


def run_plan(sizes: np.ndarray, counts: np.ndarray, capacity: int, strategy: Strategy, max_docs: int) -> "_Plan":
    """The bins of a decreasing `strategy` for `counts[i]` sequences of each length `sizes[i]` (ascending), grouped
    (see [`_Plan`]); ids are bound by `bind` or left to `templates`."""
    plan = _Plan(capacity, max_docs, smallest=int(sizes[0]))
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


class _Plan:
    """
    Bins grouped by contents while packing. A group `(first_bin, num_bins, node, free, docs)` is a run of
    consecutive bin ids with identical contents: `docs` items, `free` tokens left. A node `(parent, per_bin, base,
    size)` is the parent's contents plus `per_bin` items of length `size`, bin `b` taking the length-sorted ids from
    `base + b * per_bin` on, so groups that split later still find their items. Groups are plain tuples, read by
    unpacking into those names, and heaps order them by `first_bin`: a NamedTuple made `pack_sequences` 10-30% slower
    (its construction and unpacking run once per group and step).

    Example (lengths `[3, 3, 3, 2, 2]`, capacity 5; ids sorted by length: `[3, 4, 0, 1, 2]`, the 3s from index 2 on):
    ```python
    >>> import numpy as np
    >>> plan = _Plan(capacity=5, max_docs=8, smallest=2)
    >>> plan.best_fit([(3, 3, 2), (2, 2, 0)])  # (length, items, first index in the sorted ids), longest first
    >>> sorted(plan.closed)  # (first_bin, num_bins, node, free, docs)
    [(0, 2, 2, 0, 2), (2, 1, 1, 2, 1)]
    >>> plan.nodes  # (parent, per_bin, base, size): node 1 is one 3 per bin, node 2 is node 1 plus one 2
    [(0, 0, 0, 0), (0, 1, 2, 3), (1, 1, 0, 2)]
    >>> order, bin_offsets = plan.bind(np.array([3, 4, 0, 1, 2]))
    >>> order.tolist(), bin_offsets.tolist()  # bins [0, 3], [1, 4], [2]
    ([0, 3, 1, 4, 2], [0, 2, 4, 5])

    ```
    The three 3s open one group of 3 bins with 2 tokens free (node 1: bin `b` takes sorted id `2 + b`); the two 2s
    then fill the first 2 of them (node 2: bin `b` takes sorted id `0 + b`), which splits the group in two.
    """

    def __init__(self, capacity: int, max_docs: int, smallest: int):
        self.capacity, self.max_docs, self.smallest = capacity, max_docs, smallest
        self.nodes: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)]  # node 0: an empty bin
        self.closed: list[tuple[int, int, int, int, int]] = []
        self.next_bin = 0

    def fill(self, heap: list, size: int, todo: int, pool: int, moved: list) -> tuple[int, int]:
        """Feed `todo` items of `size` to the groups of `heap`, lowest bin id first, each bin as many as fit."""
        nodes, max_docs = self.nodes, self.max_docs
        while todo and heap:
            first, num, node, free, docs = heap[0]
            per_bin = min(free // size, max_docs - docs)
            if num * per_bin <= todo:
                heapq.heappop(heap)
                nodes.append((node, per_bin, pool - first * per_bin, size))
                moved.append((first, num, len(nodes) - 1, free - per_bin * size, docs + per_bin))
                pool, todo = pool + num * per_bin, todo - num * per_bin
                continue
            full, extra = divmod(todo, per_bin)
            if full:
                nodes.append((node, per_bin, pool - first * per_bin, size))
                moved.append((first, full, len(nodes) - 1, free - per_bin * size, docs + per_bin))
            if extra:
                nodes.append((node, extra, pool + full * per_bin - (first + full) * extra, size))
                moved.append((first + full, 1, len(nodes) - 1, free - extra * size, docs + extra))
            taken = full + (extra > 0)
            if taken < num:
                heap[0] = (first + taken, num - taken, node, free, docs)  # still the lowest bin id of the heap
            else:
                heapq.heappop(heap)
            return 0, pool + todo
        return todo, pool

    def open_bins(self, size: int, todo: int, pool: int, moved: list) -> None:
        """Open new bins for `todo` items of `size` that fit nowhere: each takes as many as fit."""
        per_bin = min(self.capacity // size, self.max_docs)
        full, extra = divmod(todo, per_bin)
        for count, num in ((per_bin, full), (extra, 1 if extra else 0)):
            if num:
                self.nodes.append((0, count, pool - self.next_bin * count, size))
                moved.append((self.next_bin, num, len(self.nodes) - 1, self.capacity - count * size, count))
                self.next_bin, pool = self.next_bin + num, pool + num * count

    def best_fit(self, steps) -> None:
        classes: dict[int, list] = {}  # free tokens -> heap of groups
        free_sizes: list[int] = []  # sorted keys of `classes`
        fill, open_bins, closed = self.fill, self.open_bins, self.closed
        smallest, max_docs = self.smallest, self.max_docs
        for size, todo, pool in steps:
            moved: list = []
            i = bisect_left(free_sizes, size)
            while todo and i < len(free_sizes):  # the least room that fits first: that is best fit
                heap = classes[free_sizes[i]]
                todo, pool = fill(heap, size, todo, pool, moved)
                if heap:
                    i += 1
                else:
                    del classes[free_sizes[i]], free_sizes[i]
            if todo:
                open_bins(size, todo, pool, moved)
            for group in moved:
                _, _, _, free, docs = group
                if free < smallest or docs >= max_docs:
                    closed.append(group)
                elif free in classes:
                    heapq.heappush(classes[free], group)
                else:
                    classes[free] = [group]
                    insort(free_sizes, free)
        closed.extend(group for heap in classes.values() for group in heap)

    def first_fit(self, steps) -> None:
        waiting: dict[int, list] = {}  # free tokens -> groups with too little room for the current size
        waiting_sizes: list[int] = []
        fitting: list = []  # heap of the groups with room for the current size, lowest bin id first
        for size, todo, pool in steps:
            while waiting_sizes and waiting_sizes[-1] >= size:
                for group in waiting.pop(waiting_sizes.pop()):
                    heapq.heappush(fitting, group)
            moved: list = []
            todo, pool = self.fill(fitting, size, todo, pool, moved)
            if todo:
                self.open_bins(size, todo, pool, moved)
            for group in moved:
                _, _, _, free, docs = group
                if free < self.smallest or docs >= self.max_docs:
                    self.closed.append(group)
                elif free in waiting:
                    waiting[free].append(group)
                else:
                    waiting[free] = [group]
                    insort(waiting_sizes, free)
        self.closed.extend(fitting)
        self.closed.extend(group for groups in waiting.values() for group in groups)

    def worst_fit(self, steps) -> None:
        heap: list = []  # (-free, group): the roomiest group first, then the lowest bin id
        nodes = self.nodes
        for size, todo, pool in steps:
            while todo and heap and heap[0][1][3] >= size:
                first, num, node, free, docs = heapq.heappop(heap)[1]
                runner_up = heap[0][1][3] if heap else 0
                # Every bin of the group takes `rounds` items before another group is the roomiest.
                rounds = min(free // size, self.max_docs - docs)
                if runner_up >= size:
                    rounds = min(rounds, max(1, (free - runner_up) // size))
                if num * rounds <= todo:
                    nodes.append((node, rounds, pool - first * rounds, size))
                    parts = [(first, num, len(nodes) - 1, free - rounds * size, docs + rounds)]
                    pool, todo = pool + num * rounds, todo - num * rounds
                else:  # the last round reaches only the first `extra` bins
                    full, extra = divmod(todo, num)
                    parts = []
                    if extra:
                        nodes.append((node, full + 1, pool - first * (full + 1), size))
                        parts.append((first, extra, len(nodes) - 1, free - (full + 1) * size, docs + full + 1))
                    if full:
                        nodes.append((node, full, pool + extra - first * full, size))
                        parts.append((first + extra, num - extra, len(nodes) - 1, free - full * size, docs + full))
                    else:
                        parts.append((first + extra, num - extra, node, free, docs))
                    pool, todo = pool + todo, 0
                self._push_worst(heap, parts)
            if todo:
                moved: list = []
                self.open_bins(size, todo, pool, moved)
                self._push_worst(heap, moved)
        self.closed.extend(group for _, group in heap)

    def _push_worst(self, heap: list, groups: list) -> None:
        for group in groups:
            first, _, _, free, docs = group
            if free >= self.smallest and docs < self.max_docs:
                heapq.heappush(heap, ((-free, first), group))
            else:
                self.closed.append(group)

    def templates(self, keys_of) -> Templates:
        """The bins as [`~llm_packing.core.templates.Templates`], one per distinct contents (a node closing a group),
        slots in the order `bind` fills them; `keys_of` maps slot lengths to their histogram keys."""
        groups = sorted(self.closed)
        template_of = {}  # node -> template index
        parts, per_group = [], []
        for _, _, leaf, _, _ in groups:
            if leaf not in template_of:
                template_of[leaf] = len(parts)
                path, node = [], leaf
                while node:
                    node, per_bin, _, size = self.nodes[node]
                    path.append((size, per_bin))
                sizes, counts = np.array(path[::-1], np.int64).reshape(-1, 2).T
                parts.append(np.repeat(sizes, counts))
            per_group.append(template_of[leaf])
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        flat = flat.astype(length_dtype(int(flat.max(initial=0))))  # narrow keys: a radix sort when streaming
        offsets = np.concatenate([[0], np.cumsum([len(part) for part in parts], dtype=np.int64)]).astype(np.int64)
        num_bins = np.array([num for _, num, _, _, _ in groups], np.int64)
        of_bin = np.repeat(np.array(per_group, id_dtype(len(parts))), num_bins)
        return Templates(flat, keys_of(flat), offsets, of_bin)

    def bind(self, by_length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write the item ids of every bin, bins in id order (the order they were opened)."""
        groups = np.fromiter(chain.from_iterable(self.closed), np.int64, 5 * len(self.closed)).reshape(-1, 5)
        first, num, node, _, width = groups[np.argsort(groups[:, 0])].T
        bin_offsets = np.zeros(self.next_bin + 1, dtype=np.int64)
        np.cumsum(np.repeat(width, num), out=bin_offsets[1:])
        start = bin_offsets[first]
        nodes = np.fromiter(chain.from_iterable(self.nodes), np.int64, 4 * len(self.nodes))
        parent, per_bin, base, _ = nodes.reshape(-1, 4).T
        # One segment per (group, node on its path): `num` rows of `per_bin` ids, found level by level.
        seg_group, seg_node, seg_column = [], [], []
        column, current, live = width.copy(), node.copy(), np.flatnonzero(node)
        while live.size:
            here = current[live]
            column[live] -= per_bin[here]
            seg_group.append(live), seg_node.append(here), seg_column.append(column[live])
            current[live] = parent[here]
            live = live[current[live] > 0]
        group, here, column = (np.concatenate(c) for c in (seg_group, seg_node, seg_column))
        rows, cols, stride = num[group], per_bin[here], width[group]
        source, block_start = base[here] + first[group] * cols, start[group]
        order = np.empty(len(by_length), dtype=np.int64)
        # Big segments: one slice copy each; the many small ones: one vectorised scatter for all.
        big = rows * cols > _SLICE_MIN_ITEMS
        segments = (a[big].tolist() for a in (source, block_start, column, rows, cols, stride))
        for src, dst, col, r, c, w in zip(*segments, strict=True):
            if c == w or r == 1:  # whole bins of one length, or one bin: a contiguous copy
                order[dst + col : dst + col + r * c] = by_length[src : src + r * c]
            else:
                block = order[dst : dst + r * w].reshape(r, w)
                block[:, col : col + c] = by_length[src : src + r * c].reshape(r, c)
        small = ~big
        rows, cols, stride = rows[small], cols[small], stride[small]
        # Expand segments to rows, then rows to items (no division per item).
        row_segment = np.repeat(np.arange(len(rows)), rows)
        row_index = np.arange(len(row_segment)) - np.repeat(np.cumsum(rows) - rows, rows)
        row_target = (block_start[small] + column[small])[row_segment] + row_index * stride[row_segment]
        row_source = source[small][row_segment] + row_index * cols[row_segment]
        row_cols = cols[row_segment]
        in_row = np.arange(int(row_cols.sum())) - np.repeat(np.cumsum(row_cols) - row_cols, row_cols)
        order[np.repeat(row_target, row_cols) + in_row] = by_length[np.repeat(row_source, row_cols) + in_row]
        return order, bin_offsets
