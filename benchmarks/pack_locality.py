"""How much of the input a group of packed rows reads, in the engine's row order and in `local_order`'s.

    python benchmarks/pack_locality.py                      # 1M lognormal lengths (median 250), max_length 4096
    python benchmarks/pack_locality.py --rows 10000000

`pack_dataset` reads the packed rows a group at a time from a memory-mapped input (a 48th of the tokens, from 8M to
32M: 8M here). A page fault maps
the 64 KiB of page cache around the page it touches (the kernel's fault-around), and the pages mapped are given back
when they add up, so every 64 KiB window of the input that a group touches is mapped (and later unmapped) once for
that group. Printed per order: the windows mapped summed over the groups (the input itself is the floor), the
spread of the documents of a tenth of the rows over the input (5th to 95th percentile of their addresses, median
over the ten tenths), and how long reordering took. Lengths only: no corpus is read. `pack_dataset` orders by
document index, not token address (`plan_rows`): the same order for any engine that numbers the documents alike.
"""

import argparse
import time

import numpy as np

from llm_packing.core.binpack import pack_sequences
from llm_packing.core.locality import local_order
from llm_packing.core.plan import plan_rows
from llm_packing.data._io.split_documents import group_tokens


WINDOW = 64 << 10  # bytes mapped around a faulting page
TOKEN_BYTES = 4


def windows_mapped(order, lengths, starts) -> int:
    """Bytes of 64 KiB windows of the input touched by each group of rows, summed over the groups."""
    doc_start = np.concatenate([[0], np.cumsum(lengths[order])])[:-1]
    group = doc_start // group_tokens(int(lengths.sum()))
    total = 0
    for number in np.unique(group):
        docs = order[group == number]
        first = starts[docs] * TOKEN_BYTES // WINDOW
        last = ((starts[docs] + lengths[docs]) * TOKEN_BYTES - 1) // WINDOW
        spans = last - first + 1  # documents are shorter than a window or two: count each window they cover
        covered = np.repeat(first, spans) + np.arange(int(spans.sum())) - np.repeat(np.cumsum(spans) - spans, spans)
        total += len(np.unique(covered))
    return total * WINDOW


def tenth_spread(order, bin_offsets, starts) -> float:
    rows = len(bin_offsets) - 1
    tenth = np.repeat(np.arange(rows) * 10 // rows, np.diff(bin_offsets))
    spreads = [np.subtract(*np.percentile(starts[order[tenth == part]], [95, 5])) for part in range(10)]
    return float(np.median(spreads)) / starts.max()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--max-length", type=int, default=4096)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(250), 1.0, args.rows)), 1, args.max_length).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    plan = pack_sequences(lengths, args.max_length)
    start = time.perf_counter()
    order, bin_offsets = local_order(plan.order, plan.bin_offsets, lengths, starts)
    took = time.perf_counter() - start
    start = time.perf_counter()
    rows_plan = plan_rows(lengths.astype(np.uint16), args.max_length)
    planned = time.perf_counter() - start
    input_bytes = int(lengths.sum()) * TOKEN_BYTES
    print(f"# pack_locality: {args.rows:,} documents, {input_bytes / 2**30:.2f} GiB of int32 ids, "
          f"max_length {args.max_length}, groups of {group_tokens(int(lengths.sum())):,} tokens\n")
    print("| row order | windows mapped, summed over groups | spread of a tenth of the rows | reorder time |")
    print("|---|---|---|---|")
    for name, (rows, offsets), seconds in (
        ("engine (`pack_sequences`)", (plan.order, plan.bin_offsets), None),
        ("`local_order` by token address", (order, bin_offsets), took),
        ("`plan_rows` (`pack_dataset`): by document index; time includes the plan",
         (rows_plan.order, rows_plan.bin_offsets), planned),
    ):
        mapped = windows_mapped(rows, lengths, starts)
        print(f"| {name} | {mapped / 2**30:.2f} GiB ({mapped / input_bytes:.1f}x the input) "
              f"| {tenth_spread(rows, offsets, starts):.2f} of the input "
              f"| {'-' if seconds is None else f'{seconds:.3f} s'} |")


if __name__ == "__main__":
    main()
