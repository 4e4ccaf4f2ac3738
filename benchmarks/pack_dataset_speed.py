"""`pack_dataset` end to end against TRL's `pack_dataset(strategy="bfd")`, each run in a fresh process, paired.

    python benchmarks/pack_dataset_speed.py --data /tmp/corpus-1m                  # make it once, then: ours vs TRL
    python benchmarks/pack_dataset_speed.py --data /tmp/corpus-1m --quick          # 100k rows, 2 pairs
    python benchmarks/pack_dataset_speed.py --data /tmp/corpus-10m --rows 10000000 --only ours --repeats 1
    python benchmarks/pack_dataset_speed.py --data /tmp/corpus-1m --in-memory      # the old, convenient case
    python benchmarks/pack_dataset_speed.py --data /tmp/corpus-1m-mask --attention-mask  # a tokenizer's mask too

Prints a markdown report; `--output FILE` also writes it there.

The dataset is what users pack: a tokenized `datasets` cache file (what `.map` writes) of 1,000-row record batches,
memory-mapped with `Dataset.from_file`, lognormal lengths (median 250, sigma 1) clipped to [1, max_length] and random
int32 ids (with `--attention-mask`, also the all-ones int8 `attention_mask` a tokenizer's `.map` writes, which
`pack_dataset` checks for padding). It is written block by block (bounded memory) under `--data` unless already there.
With `--in-memory` the same table is read into memory first (one chunk, outside the timing), as the README's earlier
numbers had it.

Every run is a fresh process (`--child`) that loads the dataset, then times the pack call alone. Caching is off in
both (`datasets.disable_caching()`: outputs go to a temporary directory and nothing is reloaded), so each run packs.
Runs alternate ours, TRL, ours, TRL... and the speed-up is the ratio of medians (and of each pair). CPU is the
process's user and system time during the call, all threads: on virtual machines that return freed memory to the
host, system time is mostly page faults on memory the process touches first (`benchmarks/first_touch.py`).
Memory: the rise of
the peak resident set (VmHWM) over the resident set just before the call; it counts pages of the memory-mapped input
and output that the process touched, which the kernel can drop at will, so the peak rise of anonymous memory
(RssAnon, sampled every 20 ms) is given too. Each output is checked after the timing: every token of the input there
once (count, `seq_lengths` and int64 sum of the ids agree), no row over `max_length`, rows over the lower bound.
That check reads every packed row once, and its time is reported as the first read of the output: what reading the
packed rows costs the first epoch, from the page cache (TRL's output) or from disk (ours is written past the page
cache, see `PackedWriter`).
"""

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
VOCAB_SIZE = 151_936  # Qwen2's: any size works, the ids only need to be int32 and distinguishable for the checksum
BLOCK_ROWS = 100_000  # rows generated at a time: ~160 MB of tokens
NAMES = {"ours": "llm_packing.pack_dataset (global BFD)", "trl": "trl.data_utils.pack_dataset bfd (per 1000 rows)"}


def make_corpus(path: str, rows: int, max_length: int, attention_mask: bool = False, seed: int = 20240611) -> None:
    """A `datasets` cache file of `rows` tokenized rows in 1,000-row record batches, written a block at a time."""
    import datasets

    columns = {"input_ids": datasets.List(datasets.Value("int32"))}
    if attention_mask:
        columns["attention_mask"] = datasets.List(datasets.Value("int8"))
    features = datasets.Features(columns)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with pa.OSFile(path + ".tmp", "wb") as sink, pa.ipc.new_stream(sink, features.arrow_schema) as writer:
        for block, first in enumerate(range(0, rows, BLOCK_ROWS)):
            rng = np.random.default_rng([seed, block])
            n = min(BLOCK_ROWS, rows - first)
            lengths = np.clip(np.rint(rng.lognormal(np.log(250), 1.0, n)), 1, max_length).astype(np.int64)
            offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            tokens = pa.array(rng.integers(0, VOCAB_SIZE, int(lengths.sum()), dtype=np.int32))
            arrays = [pa.ListArray.from_arrays(offsets, tokens)]
            if attention_mask:
                arrays.append(pa.ListArray.from_arrays(offsets, pa.array(np.ones(len(tokens), dtype=np.int8))))
            table = pa.Table.from_arrays(arrays, schema=features.arrow_schema)
            writer.write_table(table, max_chunksize=1000)
    os.replace(path + ".tmp", path)


def summary(table) -> dict:
    """Rows, tokens, int64 sum of the ids and longest row of an `input_ids` list column, chunk by chunk."""
    column = table.column("input_ids")
    lengths = pc.list_value_length(column)
    return {"rows": len(column), "tokens": int(pc.sum(lengths).as_py() or 0),
            "id_sum": int(pc.sum(pc.list_flatten(column)).as_py() or 0),
            "longest": int(pc.max(lengths).as_py() or 0)}


def child(args) -> None:
    """One timed pack in this process; prints a JSON line."""
    import datasets
    from trl.data_utils import pack_dataset as trl_pack_dataset

    import llm_packing

    datasets.disable_caching()
    datasets.disable_progress_bars()
    dataset = datasets.Dataset.from_file(args.data)
    if args.in_memory:
        table = dataset.data.table.combine_chunks()
        dataset = datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint=f"in-memory-{args.rows}")
    if args.child == "ours":
        pack = lambda ds: llm_packing.pack_dataset(ds, args.max_length, num_proc=args.num_proc)  # noqa: E731
    else:
        pack = lambda ds: trl_pack_dataset(ds, args.max_length, strategy="bfd")  # noqa: E731
    pack(datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}))  # imports and first-call costs, out of the timing
    sampler = _AnonSampler()
    before = _status("VmRSS")
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    packed = pack(dataset)
    wall = time.perf_counter() - start
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    peak = _status("VmHWM")
    sampler.stop()
    start = time.perf_counter()
    out = summary(packed.data.table)
    read_back = time.perf_counter() - start
    seq_tokens = int(pc.sum(pc.list_flatten(packed.data.table.column("seq_lengths"))).as_py() or 0)
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)  # num_proc's processes: CPU, largest peak RSS
    print(json.dumps({"wall": wall, "user": cpu.ru_utime - cpu_before.ru_utime + workers.ru_utime,
                      "sys": cpu.ru_stime - cpu_before.ru_stime + workers.ru_stime, "rss_rise": peak - before,
                      "worker_rss": workers.ru_maxrss * 1024,
                      "anon_rise": sampler.peak - sampler.start,
                      "read_back": read_back,
                      "out": out, "seq_tokens": seq_tokens, "columns": packed.column_names,
                      "on_disk": bool(packed.cache_files)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the corpus cache file (made there if missing)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="documents in the corpus, if it is made")
    parser.add_argument("--max-length", type=int, default=4096, help="tokens per packed row")
    parser.add_argument("--quick", action="store_true", help="100k rows, 2 pairs")
    parser.add_argument("--repeats", type=int, default=3, help="runs per packer")
    parser.add_argument("--only", choices=["ours", "trl"], help="run one packer only")
    parser.add_argument("--in-memory", action="store_true", help="read the corpus into memory before timing")
    parser.add_argument("--attention-mask", action="store_true",
                        help="make the corpus with a tokenizer's all-ones `attention_mask` column too")
    parser.add_argument("--num-proc", type=int, help="`num_proc` of our pack_dataset (its processes' CPU counts too)")
    parser.add_argument("--output", help="also write the report to this file")
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats = 100_000, 2
    if args.child:
        return child(args)
    import datasets

    if not os.path.exists(args.data):
        start = time.perf_counter()
        make_corpus(args.data, args.rows, args.max_length, args.attention_mask)
        print(f"made {args.data} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    corpus = datasets.Dataset.from_file(args.data)
    source = summary(corpus.data.table)
    lower_bound = -(-source["tokens"] // args.max_length)
    packers = [args.only] if args.only else ["ours", "trl"]
    lines = [
        f"# pack_dataset_speed ({'in-memory' if args.in_memory else 'memory-mapped'} input)\n",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        (f"- machine: {os.cpu_count()} CPUs, {_memory_gib():.0f} GiB, {platform.platform()}, Python "
         f"{platform.python_version()}, NumPy {np.__version__}, pyarrow {pa.__version__}, datasets "
         f"{datasets.__version__}"),
        f"- load average at start: {_load()} (shared with other sessions: compare the paired ratios)",
        (f"- dataset: {source['rows']:,} rows, {source['tokens']:,} tokens "
         f"({os.path.getsize(args.data) / 2**30:.1f} GiB file, 1,000-row record batches, columns "
         f"{', '.join(corpus.column_names)}), "
         f"{'read into memory before timing' if args.in_memory else 'memory-mapped'}; max_length {args.max_length}, "
         f"lower bound (LB) {lower_bound:,} rows"),
        "",
    ]
    print("\n".join(lines), flush=True)
    runs = run_packers(args, packers)
    lines += result_lines(runs, source, lower_bound, args)
    report = "\n".join(lines) + "\n"
    print("\n".join(lines[lines.index("") + 1 :]))
    if args.output:
        with open(args.output, "w") as f:
            f.write(report)


def run_packers(args, packers: list[str]) -> dict[str, list[dict]]:
    """Each packer `args.repeats` times, interleaved, each run in a fresh process; their reports by packer."""
    runs = {name: [] for name in packers}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    for _ in range(args.repeats):
        for name in packers:
            command = [sys.executable, os.path.abspath(__file__), "--child", name, "--data", args.data,
                       "--rows", str(args.rows), "--max-length", str(args.max_length)]
            command += ["--in-memory"] if args.in_memory else []
            command += ["--num-proc", str(args.num_proc)] if args.num_proc else []
            result = subprocess.run(command, capture_output=True, text=True, env=env)
            if result.returncode:
                sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
            runs[name].append(json.loads(result.stdout.strip().splitlines()[-1]))
            run = runs[name][-1]
            print(f"  {name}: {run['wall']:.2f} s (CPU {run['user']:.2f} s user, {run['sys']:.2f} s sys), peak RSS"
                  f" rise {run['rss_rise'] / 2**30:.2f} GiB, anonymous "
                  f"{run['anon_rise'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    return runs


def result_lines(runs: dict[str, list[dict]], source: dict, lower_bound: int, args) -> list[str]:
    """The results table and the notes under it."""
    lines = [
        ("| packer | time (median) | runs | CPU user + sys (median) | tokens/s | peak RSS rise | peak anon rise "
         "| packed rows | over LB | every token kept | output | first read of the output | speed-up vs TRL |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    walls = {name: [run["wall"] for run in done] for name, done in runs.items()}
    median = {name: statistics.median(times) for name, times in walls.items()}
    for name, done in runs.items():
        last = done[-1]
        rows = last["out"]["rows"]
        speed_up = f"{median['trl'] / median[name]:.1f}x" if "trl" in median else "-"
        label = NAMES[name] + (f", num_proc={args.num_proc}" if name == "ours" and args.num_proc else "")
        lines.append(
            f"| {label} | {median[name]:.2f} s ({', '.join(f'{r_wall:.2f}' for r_wall in walls[name])}) "
            f"| {len(done)} | {statistics.median(r['user'] for r in done):.2f} s + "
            f"{statistics.median(r['sys'] for r in done):.2f} s "
            f"| {source['tokens'] / median[name] / 1e6:.0f} M | {max(r['rss_rise'] for r in done) / 2**30:.2f} GiB "
            f"| {max(r['anon_rise'] for r in done) / 2**30:.2f} GiB | {rows:,} "
            f"| {rows - lower_bound:,} ({(rows - lower_bound) / lower_bound:+.4%}) | {_kept(last, source, args)} "
            f"| {', '.join(last['columns'])}{' (file)' if last['on_disk'] else ' (memory)'} "
            f"| {statistics.median(r['read_back'] for r in done):.2f} s | {speed_up} |"
        )
    if args.num_proc and "ours" in runs:
        lines.append(f"\n- num_proc={args.num_proc}: CPU counts its processes; the peak RSS rise is the calling "
                     "process's; the largest of its processes peaked at "
                     f"{max(r['worker_rss'] for r in runs['ours']) / 2**30:.2f} GiB RSS (pages shared with the "
                     "caller counted again)")
    if len(runs) == 2:
        pairs = [t["wall"] / o["wall"] for o, t in zip(runs["ours"], runs["trl"], strict=True)]
        lines.append(f"\n- speed-up per pair: {', '.join(f'{p:.1f}x' for p in pairs)}")
    lines.append(f"- load average at end: {_load()}")
    return lines


def _kept(run: dict, source: dict, args) -> str:
    out, problems = run["out"], []
    if out["tokens"] != source["tokens"] or run["seq_tokens"] != source["tokens"]:
        problems.append(f"{out['tokens'] - source['tokens']:+,} tokens")
    if out["id_sum"] != source["id_sum"]:
        problems.append("id sum differs")
    if out["longest"] > args.max_length:
        problems.append(f"a row of {out['longest']:,}")
    return "; ".join(problems) or "yes"


class _AnonSampler:
    """Peak anonymous resident memory (RssAnon), sampled every 20 ms on a thread."""

    def __init__(self):
        self.start = self.peak = _status("RssAnon")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._done.wait(0.02):
            self.peak = max(self.peak, _status("RssAnon"))

    def stop(self):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def _status(field: str) -> int:
    """A memory figure of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
