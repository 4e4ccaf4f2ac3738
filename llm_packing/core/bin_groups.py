"""The decreasing strategies' bins grouped by contents ([`BinGroups`]): runs of identical bins move as one while
packing, so `pack_sequences` costs O(distinct lengths x bin groups), not O(items x bins)."""

import heapq
from bisect import bisect_left, insort
from itertools import chain

import numpy as np

from .length_sort import id_dtype, length_dtype
from .templates import Templates


# Segments of more items than this are copied with one slice each, smaller ones all at once.
_SLICE_MIN_ITEMS = 128


class BinGroups:
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
    >>> plan = BinGroups(capacity=5, max_docs=8, smallest=2)
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
