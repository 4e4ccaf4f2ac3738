"""Planning alone, no tokens: time and peak memory per document of what `pack_dataset` does before it reads a token.

    python benchmarks/plan_memory.py --documents 100000000                       # plan_rows (this branch)
    python benchmarks/plan_memory.py --documents 10000000 --engine engine        # pack_sequences + local_order
    python benchmarks/plan_memory.py --documents 100000000 --output benchmarks/results/plan_memory_100m.md

The lengths are lognormal (median 250, sigma 1, clipped to [1, max_length]) as in `pack_dataset_speed.py`, drawn in
the parent and handed to each run, a fresh process (`--child`), through a file it memory-maps and copies into
anonymous memory before the clock starts, as the int32 list lengths Arrow gives (`--dtype`). Timed and measured: the
overflow cut (`cut_pieces`, policy "error") and the plan with its row order, i.e.
- `plan`: `plan_rows` (the rows in local order, from bin templates; what `pack_dataset` calls now);
- `engine`: `pack_sequences`, then `local_order` over token addresses (`row_start[source] + start`, the int64 row
  starts a `TokenColumn` holds, made before the clock starts), as `pack_dataset` planned before `plan_rows`. Run
  with another checkout on `PYTHONPATH` to measure that code.
Memory: the peak rise of anonymous resident memory (RssAnon, sampled every 2 ms by a thread) over its level just
before the call, and the peak of memory traced by `tracemalloc` (numpy reports its arrays to it: exact, not sampled).
Both per document. The input itself (`--dtype` bytes a document, and `row_start` for `engine`) is held before and is
not in the rise; the table says so. Bins are checked against the lower bound `ceil(tokens / max_length)`.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc

import numpy as np


def lengths_of(documents: int, max_length: int, seed: int = 20240611) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty(documents, np.int32)
    for first in range(0, documents, 10_000_000):  # bounded temporaries
        n = min(10_000_000, documents - first)
        out[first : first + n] = np.clip(np.rint(rng.lognormal(np.log(250), 1.0, n)), 1, max_length)
    return out


class AnonSampler:
    """The peak of RssAnon, sampled every 2 ms on a thread."""

    def __init__(self):
        self.start = self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_anon())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())
        return self.peak - self.start


def _rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def child(args) -> None:
    from llm_packing.core.overflow import cut_pieces

    lengths = np.array(np.load(args.lengths_file, mmap_mode="r"), dtype=args.dtype)  # anonymous, before the clock
    row_start = None
    if args.engine == "engine":
        from llm_packing.core.binpack import pack_sequences
        from llm_packing.core.locality import local_order

        row_start = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]])
    else:
        from llm_packing.core.plan import plan_rows
    tokens = int(lengths.sum(dtype=np.int64))
    sampler = AnonSampler()
    tracemalloc.start()
    start = time.perf_counter()
    pieces = cut_pieces(lengths, args.max_length, "error")
    if args.engine == "engine":
        plan = pack_sequences(pieces.length, args.max_length)
        addresses = row_start[pieces.source] + pieces.start
        order, bin_offsets = local_order(plan.order, plan.bin_offsets, pieces.length, addresses)
        del addresses
        num_bins = len(bin_offsets) - 1
    else:
        plan = plan_rows(pieces.length, args.max_length)
        order, bin_offsets, num_bins = plan.order, plan.bin_offsets, plan.num_bins
    wall = time.perf_counter() - start
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    anon_rise = sampler.stop()
    assert len(order) == len(lengths) and bin_offsets[-1] == len(lengths)
    print(json.dumps({"wall": wall, "anon_rise": anon_rise, "traced_peak": traced_peak, "bins": int(num_bins),
                      "tokens": tokens, "order_dtype": str(order.dtype),
                      "held_before": lengths.nbytes + (0 if row_start is None else row_start.nbytes)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000_000)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--engine", choices=["plan", "engine"], default="plan")
    parser.add_argument("--dtype", default="int32", help="dtype of the lengths handed in (Arrow list lengths: int32)")
    parser.add_argument("--label", help="what to call the code measured in the table (default: --engine)")
    parser.add_argument("--output", help="also append the table row to this markdown file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lengths-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as directory:
        args.lengths_file = os.path.join(directory, "lengths.npy")
        np.save(args.lengths_file, lengths_of(args.documents, args.max_length))
        command = [sys.executable, os.path.abspath(__file__), "--child", "--lengths-file", args.lengths_file,
                   "--documents", str(args.documents), "--max-length", str(args.max_length), "--engine", args.engine,
                   "--dtype", args.dtype]
        run = subprocess.run(command, capture_output=True, text=True, check=False)
    if run.returncode:
        sys.exit(f"the run failed:\n{run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    n = args.documents
    lower_bound = -(-result["tokens"] // args.max_length)
    gap = result["bins"] / lower_bound - 1
    header = ("| code | documents | plan time | peak RssAnon rise | per document | tracemalloc peak | per document "
              "| held before (input) | bins | lower bound | gap |\n|---|---|---|---|---|---|---|---|---|---|---|")
    row = (f"| {args.label or args.engine} | {n:,} | {result['wall']:.2f} s | {result['anon_rise'] / 2**30:.2f} GiB "
           f"| {result['anon_rise'] / n:.1f} B | {result['traced_peak'] / 2**30:.2f} GiB "
           f"| {result['traced_peak'] / n:.1f} B | {result['held_before'] / n:.0f} B/doc | {result['bins']:,} "
           f"| {lower_bound:,} | {gap:+.4%} |")
    machine = (f"{datetime.datetime.now().isoformat(timespec='seconds')}, {os.cpu_count()} CPUs, "
               f"{platform.platform()}, Python {platform.python_version()}, numpy {np.__version__}, "
               f"load average {os.getloadavg()[0]:.1f}, max_length {args.max_length}, lengths {args.dtype}, "
               f"ids {result['order_dtype']}")
    print(header)
    print(row)
    print(f"\n({machine})")
    if args.output:
        new = not os.path.exists(args.output)
        with open(args.output, "a") as file:
            if new:
                file.write("# plan_memory: planning alone (overflow cut + plan + row order), lognormal lengths\n\n"
                           f"{header}\n")
            file.write(f"{row} <!-- {machine} -->\n")


if __name__ == "__main__":
    main()
