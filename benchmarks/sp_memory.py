"""Peak memory per rank of one packed row cut across N processes (Ulysses sequence parallelism) against one process.

    flock /tmp/llm_packing_bench.lock python benchmarks/sp_memory.py                  # 32k row, N = 1, 2, 4
    python benchmarks/sp_memory.py --length 4096 --sizes 1 2 --output /tmp/sp        # quick

Each N is N fresh processes on gloo (127.0.0.1): the 1-layer tiny Llama of `varlen_memory.py` (hidden 64, 4/2 heads,
vocab 128, fp32, one thread each) runs forward + backward, twice, on its piece of one packed row of `length` tokens
(documents of lognormal lengths, median 128 tokens, as there: about 165 documents in a 32k row), cut by
`shard_packed_batch`; N = 1 is the same row in one process on the hook's varlen route. Reported per rank: the rise of
peak RSS (ru_maxrss) over the process's RSS before the steps, and the wall time of the second step. The figure that
matters is the largest rank's rise against N = 1's.
"""

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys

from publish import publish


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_rank(length: int, size: int, rank: int, port: int, seed: int) -> dict:
    """Child process: peak RSS rise (MiB) and step seconds of one rank's forward + backward."""
    import resource
    import time

    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from llm_packing import configure_packing, configure_sequence_parallel, shard_packed_batch

    torch.set_num_threads(1)
    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length,
                                  use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, np.rint(rng.lognormal(np.log(128), 1.0, length)).astype(int))
    ends = np.minimum(np.cumsum(lengths), length)
    ends = ends[: np.searchsorted(ends, length) + 1]
    document = np.searchsorted(ends, np.arange(length), side="right")
    input_ids = torch.from_numpy(rng.integers(0, 128, length))[None]
    attention_mask = torch.from_numpy(document + 1)[None]
    starts = np.concatenate([[0], ends[:-1]])
    labels = input_ids.masked_fill(torch.from_numpy(np.arange(length) == starts[document])[None], -100)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if size == 1:
        configure_packing(model, attention_route="varlen")
        piece = {**batch, "position_ids": torch.from_numpy(np.arange(length) - starts[document])[None]}
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        configure_sequence_parallel(model, size)
        piece = shard_packed_batch(batch, rank, size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        model(**piece).loss.backward()
        seconds.append(time.perf_counter() - start)
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    if size > 1:
        dist.destroy_process_group()
    return {"rise_mib": rise, "step_s": seconds[-1], "documents": len(ends), "tokens": piece["input_ids"].shape[1]}


def run_size(length: int, size: int, seed: int) -> list[dict]:
    """The N processes of one group size, started together; one result per rank."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    processes = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--seed", str(seed), "--child",
                                   str(length), str(size), str(rank), str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
                 for rank in range(size)]
    results = []
    for rank, process in enumerate(processes):
        out, err = process.communicate()
        if process.returncode:
            results.append({"rank": rank, "skipped": f"exit code {process.returncode}: {err.strip()[-300:]}"})
        else:
            results.append({"rank": rank, **json.loads(out.strip().splitlines()[-1])})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=os.path.join(RESULTS, "sp_memory"), help="writes OUTPUT.md")
    parser.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_rank(*args.child, seed=args.seed)))
        return
    rows, single = [], None
    for size in args.sizes:
        results = run_size(args.length, size, args.seed)
        print(size, results, file=sys.stderr, flush=True)
        failed = [r for r in results if "skipped" in r]
        if failed:
            rows.append(f"| {size} | | | not run: {failed[0]['skipped']} | | |")
            continue
        largest = max(r["rise_mib"] for r in results)
        single = largest if size == 1 else single
        ratio = f"{largest / single:.2f}x" if single else ""
        rises = ", ".join(f"{r['rise_mib']:,.0f}" for r in results)
        rows.append(f"| {size} | {results[0]['tokens']:,} | {results[0]['documents']} | {rises} | {ratio} | "
                    f"{max(r['step_s'] for r in results):.2f} |")
    lines = ["# sp_memory\n", f"- command: `{' '.join(['python benchmarks/sp_memory.py', *sys.argv[1:]])}`",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; machine: {os.cpu_count()} CPUs, "
             f"{platform.platform()}; load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared)",
             f"- one packed row of {args.length:,} tokens; N processes on gloo, one thread each",
             "", "| N | tokens per rank | documents | peak RSS rise per rank, MiB | largest vs N = 1 | step s |",
             "|---|---|---|---|---|---|", *rows]
    publish(lines, args.output + ".md")


if __name__ == "__main__":
    main()
