"""Would `num_proc` pay? The gather of one `pack_dataset` call over N forked processes against one process.

Each of the N processes writes its share of the rows to a file of its own.

    python benchmarks/pack_dataset_processes.py --data /tmp/corpus-1m.arrow   # the corpus of pack_dataset_speed.py

Every run is a fresh process (`--child N`): it loads the memory-mapped corpus, then times reading the documents,
packing, and gathering the rows with N writer processes forked after the plan is made (they share it copy-on-write),
each over a contiguous range of rows, plus memory-mapping the N files as one table. Runs alternate N = 1 and N =
`--processes`. This is a prototype of the design "Beyond one machine" describes, built on `pack_dataset`'s internals;
it is not a public API.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np


class _NoProgress:
    def update(self, tokens):
        pass


def child(data: str, processes: int) -> dict:
    import datasets

    import llm_packing
    from llm_packing import dataset as dataset_module
    from llm_packing import packed_cache
    from llm_packing.binpack import pack_sequences

    datasets.disable_caching()
    datasets.disable_progress_bars()
    corpus = datasets.Dataset.from_file(data)
    llm_packing.pack_dataset(datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}), 4096)  # first-call costs
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    documents = dataset_module._Documents(corpus, 4096, "error")
    plan = pack_sequences(documents.pieces.length, 4096)
    schema = documents._schema(int(documents.pieces.length.sum()), False)
    bounds = np.linspace(0, len(plan.bin_offsets) - 1, processes + 1).astype(int)
    directory = tempfile.mkdtemp()
    paths = [os.path.join(directory, f"part-{number}.arrow") for number in range(processes)]
    workers = []
    for first, last, path in zip(bounds[:-1], bounds[1:], paths, strict=True):
        pid = os.fork()
        if pid == 0:
            offsets = plan.bin_offsets[first : last + 1]
            writer = packed_cache.PackedWriter(packed_cache.Destination(path, "", False), schema, plan.stats)
            documents._write(plan.order[offsets[0] : offsets[-1]], offsets - offsets[0], writer, _NoProgress())
            writer.finish(None)
            os._exit(0)
        workers.append(pid)
    failed = [pid for pid in workers if os.waitpid(pid, 0)[1]]
    tables = [datasets.table.MemoryMappedTable.from_file(path) for path in paths]
    rows = sum(len(table) for table in tables)
    after, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(directory)
    return {"processes": processes, "wall": time.perf_counter() - start, "failed": len(failed), "rows": rows,
            "cpu": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime + children.ru_utime
            + children.ru_stime}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a corpus made by benchmarks/pack_dataset_speed.py")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.data, args.child)))
        return
    print(f"# pack_dataset gather in processes ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, {args.data})\n")
    print("| processes | wall | CPU (all processes) | rows |\n|---|---|---|---|")
    for _ in range(args.pairs):
        for processes in (1, args.processes):
            command = [sys.executable, os.path.abspath(__file__), "--data", args.data, "--child", str(processes)]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            run = json.loads(result.stdout.splitlines()[-1])
            if run["failed"]:
                sys.exit(f"{run['failed']} writer processes failed")
            print(f"| {processes} | {run['wall']:.2f} s | {run['cpu']:.2f} s | {run['rows']:,} |", flush=True)


if __name__ == "__main__":
    main()
