"""What first touching memory costs on this machine: why `pack_dataset` is mostly system time here.

    python benchmarks/first_touch.py            # each probe in a fresh process, 3 rounds; prints a markdown table

Virtual machines that hand freed memory back to the host make the next first touch of a page fault on the host too.
Memory freed a moment ago is still warm (the previous probe's file and buffers), so each probe first waits
`--settle` seconds, as long as a Python process that imports torch and datasets takes to start. The probes, each in
its own fresh process (wall and system time of the timed part):
- anon fill: fill 256 MiB of new anonymous memory (numpy), then fill it again;
- file write: `pwrite` 1,600 MiB to a new file, 4 MiB at a time, from one warm buffer (what a cache writer does);
- file write after churn: the same, each write after a 4 MiB anonymous allocation is touched and freed (what a process
  that allocates as it goes, such as TRL's `pack_dataset`, does between writes);
- file write, drop-behind: the same writes, each chunk handed to writeback at once and dropped from the page cache
  64 MiB later, so that later writes reuse its pages (`PackedWriter` without `O_DIRECT`);
- file write, O_DIRECT: the same writes past the page cache (`PackedWriter` where the filesystem takes it).
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from llm_packing.data._io.direct_writes import aligned


CHUNK = 4 << 20
DROP_BEHIND = 64 << 20
PROBES = {"anon fill": "fill 256 MiB of new anonymous memory", "anon refill": "fill the same 256 MiB again",
          "file write": "pwrite 1,600 MiB to a new file, 4 MiB a time",
          "file write after churn": "the same, each write after 4 MiB of anonymous memory touched and freed",
          "file write, drop-behind": ("the same writes, each then handed to writeback and the file's pages over 64 "
                                      "MiB behind dropped (`posix_fadvise(DONTNEED)`), as `PackedWriter` falls back "
                                      "to"),
          "file write, O_DIRECT": "the same writes past the page cache (`O_DIRECT`, aligned), as `PackedWriter` does"}


def timed(function) -> dict:
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    function()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall": time.perf_counter() - start, "sys": after.ru_stime - before.ru_stime}


def probe(name: str, directory: str, settle: float) -> dict:
    time.sleep(settle)
    if name.startswith("anon"):
        memory = np.empty(256 << 20, np.uint8)
        first = timed(lambda: memory.fill(1))
        return first if name == "anon fill" else timed(lambda: memory.fill(2))
    buffer = aligned(CHUNK)
    buffer[:] = 1
    handle, path = tempfile.mkstemp(dir=directory)
    if name.endswith("O_DIRECT"):
        os.close(handle)
        handle = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        def write():
            offset = 0
            for _ in range(400):
                if name == "file write after churn":
                    scratch = np.ones(CHUNK, np.uint8)
                    del scratch
                offset += os.pwrite(handle, buffer, offset)
                if name.endswith("drop-behind"):
                    os.posix_fadvise(handle, offset - CHUNK, CHUNK, os.POSIX_FADV_DONTNEED)
                    if offset > DROP_BEHIND:
                        os.posix_fadvise(handle, offset - CHUNK - DROP_BEHIND, CHUNK, os.POSIX_FADV_DONTNEED)
        return timed(write)
    finally:
        os.close(handle)
        os.remove(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the probe files are written")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds each probe waits before it starts")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(probe(args.child, args.dir, args.settle)))
        return
    runs = {name: [] for name in PROBES}
    for _ in range(args.rounds):
        for name in PROBES:
            command = [sys.executable, os.path.abspath(__file__), "--child", name, "--dir", args.dir,
                       "--settle", str(args.settle)]
            runs[name].append(json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout))
    print(f"# first_touch ({os.cpu_count()} CPUs, {platform.platform()}, load {os.getloadavg()[0]:.2f}, "
          f"settle {args.settle:g} s)\n")
    print("| probe | what | wall (median, min-max) | system time (median) |\n|---|---|---|---|")
    for name, done in runs.items():
        walls = [run["wall"] for run in done]
        print(f"| {name} | {PROBES[name]} | {statistics.median(walls):.3f} s ({min(walls):.3f}-{max(walls):.3f}) "
              f"| {statistics.median(run['sys'] for run in done):.3f} s |")


if __name__ == "__main__":
    main()
