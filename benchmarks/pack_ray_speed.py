"""`pack_dataset_on_ray` against the single-process `pack_dataset` on one machine: what Ray costs where it cannot help.

    python benchmarks/pack_ray_speed.py --data /tmp/corpus-1m                 # 1M rows (made if missing)
    python benchmarks/pack_ray_speed.py --data /tmp/corpus-10m --rows 10000000

The corpus is `pack_dataset_speed.py`'s: a tokenized `datasets` cache file of 1,000-row record batches, lognormal
lengths (median 250), max_length 4096. Each packer runs in a fresh process, caching off, output to a temporary
directory on the same disk:
- `pack_dataset`: the file memory-mapped (`Dataset.from_file`), one process;
- `pack_dataset_on_ray`: a local Ray cluster with the machine's CPUs, started (and its workers warmed by a 2-row pack)
  before the clock; the call reads the file's record batches into Ray's object store as blocks of 100,000 rows,
  counts and checks them (a task per block), plans on the driver, and gathers and writes one Arrow shard per CPU.
Wall time of the call, and the rise of the process's peak RSS (the driver only for Ray: its workers and object store
are other processes; the object store holds a copy of the input). Both outputs are compared row for row.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow.compute as pc


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pack_dataset_speed import make_corpus, summary  # noqa: E402


def child(args) -> None:
    import datasets

    datasets.disable_caching()
    datasets.disable_progress_bars()
    output = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(args.data)), prefix="pack_ray_speed-")
    if args.child == "ray":
        import ray

        from llm_packing.data.on_ray import pack_dataset_on_ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 object_store_memory=args.object_store_gib << 30 if args.object_store_gib else None)
        warm = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]})
        pack_dataset_on_ray(warm, 4, os.path.join(output, "warm-up"))  # workers started, out of the timing
        pack = lambda: pack_dataset_on_ray(args.data, args.max_length, os.path.join(output, "rows"))  # noqa: E731
    else:
        from llm_packing.data.pack import pack_dataset

        dataset = datasets.Dataset.from_file(args.data)
        pack = lambda: pack_dataset(dataset, args.max_length, cache_file_name=os.path.join(  # noqa: E731
            output, "rows.arrow"))
    before = _status("VmRSS")
    start = time.perf_counter()
    packed = pack()
    wall = time.perf_counter() - start
    peak = _status("VmHWM")
    table = packed.data.table
    files = sorted(packed.cache_files[i]["filename"] for i in range(len(packed.cache_files)))
    if args.digest:  # rows compared by digest, the output removed now: 10M rows are 15 GiB a copy
        np.savez(args.digest, **digest(table))
        del packed, table
        subprocess.run(["rm", "-rf", output], check=True)
        table = None
    print(json.dumps({"wall": wall, "rss_rise": peak - before, "files": files, "output": output}))


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def digest(table) -> dict:
    """Every row's int64 sum of ids, its tokens, and every `seq_lengths` value, a record batch at a time."""
    sums, tokens, seq_lengths = [], [], []
    for batch in table.to_batches():
        ids = batch.column(batch.schema.get_field_index("input_ids"))
        offsets = ids.offsets.to_numpy().astype(np.int64)
        values = ids.values.to_numpy().astype(np.int64)
        sums.append(np.add.reduceat(values, offsets[:-1]) if len(values) else np.zeros(len(ids), np.int64))
        tokens.append(np.diff(offsets))
        seq_lengths.append(pc.list_flatten(batch.column(batch.schema.get_field_index("seq_lengths"))).to_numpy())
    return {name: np.concatenate(parts) if parts else np.zeros(0, np.int64)
            for name, parts in (("sums", sums), ("tokens", tokens), ("seq_lengths", seq_lengths))}


def datasets_table(paths: list[str]):
    import datasets

    return datasets.concatenate_datasets([datasets.Dataset.from_file(path) for path in paths]).data.table


def same_rows(first: list[str], second: list[str]) -> bool:
    """Whether two packed outputs (lists of Arrow files) hold the same rows, read a record batch at a time."""
    import datasets

    left, right = (datasets.Dataset.from_file(path) for path in first), (datasets.Dataset.from_file(path)
                                                                           for path in second)
    left = datasets.concatenate_datasets(list(left)).data.table
    right = datasets.concatenate_datasets(list(right)).data.table
    if left.num_rows != right.num_rows:
        return False
    for name in ("input_ids", "seq_lengths"):
        for start in range(0, left.num_rows, 100_000):
            if not left.column(name).slice(start, 100_000).equals(right.column(name).slice(start, 100_000)):
                return False
    return True


def run_and_compare(args) -> tuple[dict, tuple[bool, int, int, str]]:
    """Each packer in its own process; their outputs compared (whole, or by digest), then removed."""
    results, digests = {}, {}
    scratch = tempfile.mkdtemp()
    for name in ("ours", "ray"):
        command = [sys.executable, os.path.abspath(__file__), "--child", name, "--data", args.data, "--max-length",
                   str(args.max_length), *(["--object-store-gib", str(args.object_store_gib)]
                                           if args.object_store_gib else [])]
        if args.by_digest:
            command += ["--digest", os.path.join(scratch, f"{name}.npz")]
        run = subprocess.run(command, capture_output=True, text=True, check=False)
        if run.returncode:
            sys.exit(f"{name} failed:\n{run.stderr[-4000:]}")
        results[name] = json.loads(run.stdout.strip().splitlines()[-1])
        if args.by_digest:
            digests[name] = dict(np.load(os.path.join(scratch, f"{name}.npz")))
    if args.by_digest:
        equal = all(np.array_equal(digests["ours"][key], digests["ray"][key]) for key in digests["ours"])
        comparison = (equal, len(digests["ours"]["tokens"]), int(digests["ours"]["tokens"].sum()),
                      "same per-row id sums, row tokens and seq_lengths")
    else:
        out = summary(datasets_table(results["ours"]["files"]))
        comparison = (same_rows(results["ours"]["files"], results["ray"]["files"]), out["rows"], out["tokens"],
                      "identical rows, tokens and seq_lengths")
    for result in [*results.values(), {"output": scratch}]:
        subprocess.run(["rm", "-rf", result["output"]], check=True)
    return results, comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the corpus cache file (made there if missing)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--output", help="also write the report to this file")
    parser.add_argument("--by-digest", action="store_true", help="compare digests, each output removed after its "
                        "run (for 10M rows: 15 GiB an output)")
    parser.add_argument("--digest", help=argparse.SUPPRESS)
    parser.add_argument("--object-store-gib", type=int, help="Ray's object store size (default Ray's: 30%% of RAM)")
    parser.add_argument("--child", choices=["ours", "ray"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if not os.path.exists(args.data):
        make_corpus(args.data, args.rows, args.max_length)
    results, (equal, rows, tokens, how) = run_and_compare(args)
    lines = [
        f"# pack_ray_speed: {args.rows:,} memory-mapped rows, max_length {args.max_length}\n",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}, load average {os.getloadavg()[0]:.1f}",
        f"- machine: {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}; one node: "
        "Ray's workers share the same 2 cores and disk",
        f"- Ray's object store: {f'{args.object_store_gib} GiB' if args.object_store_gib else 'Ray default'} (the "
        "input is copied into it; what does not fit is spilled to disk)",
        f"- packed rows: {rows:,} ({tokens:,} tokens); {how}: {equal}\n",
        "| packer | wall | driver peak RSS rise | output files |",
        "|---|---|---|---|",
    ]
    for name, label in (("ours", "`pack_dataset` (one process, memory-mapped)"),
                        ("ray", "`pack_dataset_on_ray` (local cluster, one shard per CPU)")):
        result = results[name]
        lines.append(f"| {label} | {result['wall']:.1f} s | {result['rss_rise'] / 2**30:.2f} GiB "
                     f"| {len(result['files'])} |")
    lines.append(f"\nRay / single process: {results['ray']['wall'] / results['ours']['wall']:.1f}x the time.")
    report = "\n".join(lines)
    print(report)
    if args.output:
        with open(args.output, "w") as file:
            file.write(report + "\n")


if __name__ == "__main__":
    main()
