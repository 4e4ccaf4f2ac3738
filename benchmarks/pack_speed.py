"""Packing speed and tightness: `pack_sequences` against what users pick instead, on the same length sets.

    python benchmarks/pack_speed.py           # full run: N = 100k, 1M, 10M (several minutes)
    python benchmarks/pack_speed.py --quick   # lognormal C=4096 at N = 10k, 100k (seconds)

Peers: TRL's BFD as `trl.data_utils.pack_dataset(strategy="bfd")` applies it (one `_pack_bfd` per 1,000-row map
batch), the per-1,000-row greedy knapsack other trainers use (re-implemented below), a pure-Python heap worst-fit
decreasing, `seqpacker` when importable, and the floor: one stable `np.argsort` of the lengths as uint16 (radix).
Times are wall-clock from a NumPy int64 array to the packer's own output, minimum of 5 runs under 1 s, of 3 under 5 s;
each run of `pack_sequences` follows one floor run, and 'x floor' divides by the fastest floor run at that size.
A peer is skipped where extrapolation from the previous size (linear) exceeds the budget; the estimate is printed.
"""

import argparse
import bisect
import datetime
import functools
import heapq
import os
import platform
import sys
import time

import numpy as np


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from llm_packing.core.binpack import pack_sequences  # noqa: E402


BATCH_ROWS = 1000  # datasets' default `map` batch size, which TRL and LLaMA-Factory pack within
TRL_MAX_TOKENS = 10**9  # TRL was OOM-killed at 2e9 tokens on this machine kind (prior art); stay clear


def length_sets(sizes: list[int], seed: int = 20240611) -> dict[str, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    draw = np.rint(rng.lognormal(np.log(250), 1.0, max(sizes)))
    return {
        "lognormal (median 250), C=4096": (np.clip(draw, 1, 4096).astype(np.int64), 4096),
        "lognormal (median 250), C=2048": (np.clip(draw, 1, 2048).astype(np.int64), 2048),
        "uniform [1, 4096], C=4096": (rng.integers(1, 4097, max(sizes)).astype(np.int64), 4096),
    }


def greedy_knapsack(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """LLaMA-Factory's rule per 1,000-row batch: sort ascending, fill one bin at a time with the largest item that
    still fits (found by bisect), until nothing fits; then the next bin."""
    bins = []
    for start in range(0, len(lengths), BATCH_ROWS):
        batch = lengths[start : start + BATCH_ROWS].tolist()
        ids = sorted(range(len(batch)), key=batch.__getitem__)
        sizes = [batch[i] for i in ids]
        ids = [start + i for i in ids]
        while sizes:
            current, room = [], capacity
            while True:
                index = bisect.bisect(sizes, room) - 1
                if index < 0:
                    break
                room -= sizes.pop(index)
                current.append(ids.pop(index))
            bins.append(current)
    return bins


def heap_worst_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Pure-Python worst-fit decreasing: a max-heap of free space, one push/pop per item."""
    values = lengths.tolist()
    bins: list[list[int]] = []
    heap: list[tuple[int, int]] = []  # (-free, bin)
    for item in sorted(range(len(values)), key=values.__getitem__, reverse=True):
        size = values[item]
        if heap and -heap[0][0] >= size:
            free, b = heapq.heappop(heap)
            heapq.heappush(heap, (free + size, b))
        else:
            b = len(bins)
            bins.append([])
            heapq.heappush(heap, (size - capacity, b))
        bins[b].append(item)
    return bins


def make_trl(lengths: np.ndarray):
    """An Arrow-backed dataset whose `input_ids` hold only offsets (null values): TRL packs lengths, no payload."""
    import datasets
    import pyarrow as pa

    datasets.disable_progress_bars()
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    column = pa.LargeListArray.from_arrays(offsets, pa.nulls(int(lengths.sum())))
    return datasets.Dataset(datasets.table.InMemoryTable(pa.table({"input_ids": column})))


def run_trl(dataset, capacity: int):
    from trl.data_utils import pack_dataset

    return pack_dataset(dataset, seq_length=capacity, strategy="bfd")


def warm_up_trl() -> bool:
    """Import TRL and run one tiny pack, so that import time is not charged to the first measurement."""
    try:
        run_trl(make_trl(np.array([3, 5, 2])), 8)
    except ImportError:
        return False
    return True


def measure(fn, quick: bool, floor=None, floor_times=None) -> tuple[float, float, object]:
    """Minimum wall and CPU seconds over repeated runs, and the last output. With `floor`, one floor run precedes
    each run and its (wall, cpu) go to `floor_times`, so that both see the same load on a shared machine."""
    walls, cpus = [], []
    while True:
        if floor is not None:
            wall, cpu = time.perf_counter(), time.process_time()
            floor()
            floor_times.append((time.perf_counter() - wall, time.process_time() - cpu))
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        wanted = (3 if walls[0] < 0.5 else 1) if quick else (5 if walls[0] < 1 else 3 if walls[0] < 5 else 1)
        if len(walls) >= wanted:
            return min(walls), min(cpus), out


def bins_of(name: str, out, lengths: np.ndarray, capacity: int, validate: bool) -> np.ndarray:
    """Tokens per bin of a packer's output; checks every item once and no bin over capacity when `validate`."""
    if name.startswith("trl"):
        import pyarrow as pa

        seq_lengths = out.with_format("arrow")["seq_lengths"]
        if isinstance(seq_lengths, pa.ChunkedArray):
            seq_lengths = seq_lengths.combine_chunks()
        flat = seq_lengths.flatten().to_numpy().astype(np.int64)
        counts = np.add.reduceat(flat, seq_lengths.offsets.to_numpy()[:-1].astype(np.int64))
        if validate:
            assert np.array_equal(np.sort(flat), np.sort(lengths)) and counts.max() <= capacity
        return counts
    if name.startswith("pack_sequences"):
        if validate:
            assert np.array_equal(np.sort(out.order), np.arange(len(lengths)))
            assert out.bin_token_counts.max() <= capacity
        return out.bin_token_counts
    flat = np.fromiter((i for b in out for i in b), dtype=np.int64, count=len(lengths))
    counts = np.add.reduceat(lengths[flat], np.concatenate([[0], np.cumsum([len(b) for b in out])[:-1]]))
    if validate:
        assert np.array_equal(np.sort(flat), np.arange(len(lengths))) and counts.max() <= capacity
    return counts


def packers(capacity: int):
    rows = [(f"pack_sequences {s}", lambda x, s=s: pack_sequences(x, capacity, strategy=s))
            for s in ("bfd", "ffd", "wfd", "nf")]
    rows.append(("pack_sequences bfd seed=1", lambda x: pack_sequences(x, capacity, seed=1)))
    rows.append(("trl pack_dataset bfd (per 1000 rows)", None))
    rows.append(("greedy knapsack (per 1000 rows)", lambda x: greedy_knapsack(x, capacity)))
    rows.append(("heap WFD (pure Python)", lambda x: heap_worst_fit(x, capacity)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 10k and 100k only, a few seconds")
    parser.add_argument("--sizes", type=int, nargs="+", help="override the sizes, e.g. --sizes 100000 1000000")
    parser.add_argument("--budget", type=float, help="skip a peer whose extrapolated time exceeds this (seconds)")
    args = parser.parse_args()
    sizes = args.sizes or ([10_000, 100_000] if args.quick else [100_000, 1_000_000, 10_000_000])
    budget = args.budget or (1.0 if args.quick else 120.0)
    sets = length_sets(sizes)
    if args.quick:
        sets = dict(list(sets.items())[:1])
    has_trl = warm_up_trl()

    print(f"# pack_speed ({'quick' if args.quick else 'full'} run)\n")
    print(f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"- machine: {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}, "
          f"NumPy {np.__version__}")
    print(f"- load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (a shared machine: other work "
          "may run at the same time; the cpu column is process CPU time, less sensitive to that)")
    try:
        import seqpacker  # noqa: F401

        print("- seqpacker: installed, but this script has no adapter for its API version")
    except ImportError:
        print("- seqpacker: not installed (no manylinux wheel; its source build needs crates.io)")
    print("- floor: `np.argsort(lengths.astype(np.uint16), kind=\"stable\")` on a pre-converted array; "
          "'x floor' = time / floor time at the same N")

    for set_name, (all_lengths, capacity) in sets.items():
        print(f"\n## {set_name}\n")
        print("| packer | N | time | cpu | x floor (wall / cpu) | bins | efficiency | gap to LB |")
        print("|---|---|---|---|---|---|---|---|")
        last: dict[str, tuple[int, float]] = {}
        for n in sizes:
            lengths = all_lengths[:n]
            lower_bound = -(-int(lengths.sum()) // capacity)
            key = lengths.astype(np.uint16)
            floor = functools.partial(np.argsort, key, kind="stable")
            floor_times: list[tuple[float, float]] = []
            measure(floor, args.quick, floor, floor_times)
            rows = [(name, *_run_cell(name, fn, lengths, capacity, args.quick, budget, last, has_trl, floor,
                                      floor_times)) for name, fn in packers(capacity)]
            floor_wall, floor_cpu = (min(t) for t in zip(*floor_times, strict=True))
            print(f"| floor: stable argsort (uint16) | {n:,} | {_fmt(floor_wall)} | {_fmt(floor_cpu)} | 1.00 / 1.00 "
                  f"| LB {lower_bound:,} | | |")
            for name, note, wall, cpu, num_bins in rows:
                if note:
                    print(f"| {name} | {n:,} | {note} | | | | | |")
                    continue
                efficiency = int(lengths.sum()) / (num_bins * capacity)
                print(f"| {name} | {n:,} | {_fmt(wall)} | {_fmt(cpu)} | {wall / floor_wall:.2f} / "
                      f"{cpu / floor_cpu:.2f} | {num_bins:,} | {efficiency:.4%} | {num_bins / lower_bound - 1:+.4%} |")
    print(f"\n- load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _run_cell(name, fn, lengths, capacity, quick, budget, last, has_trl, floor, floor_times):
    """One packer at one size: (note, wall, cpu, bins), the note saying why it did not run."""
    n = len(lengths)
    if name in last and last[name][1] * n / last[name][0] > budget:
        return f"skip (est {last[name][1] * n / last[name][0]:,.0f} s)", 0.0, 0.0, 0
    if name.startswith("trl"):
        if not has_trl:
            return "not installed", 0.0, 0.0, 0
        if int(lengths.sum()) > TRL_MAX_TOKENS:
            return f"not run ({lengths.sum():.1e} tokens > 1e9: OOM risk)", 0.0, 0.0, 0
        dataset = make_trl(lengths)
        fn = lambda x: run_trl(dataset, capacity)  # noqa: E731
    ours = name.startswith("pack_sequences")
    wall, cpu, out = measure(lambda: fn(lengths), quick, floor if ours else None, floor_times)
    last[name] = (n, wall)
    return "", wall, cpu, len(bins_of(name, out, lengths, capacity, validate=n <= 1_000_000))


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


if __name__ == "__main__":
    main()
