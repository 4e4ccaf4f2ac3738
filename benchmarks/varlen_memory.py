"""Row-length sweep on sdpa: peak memory and step time of one packed row, dense mask against the varlen route.

    flock /tmp/llm_packing_bench.lock python benchmarks/varlen_memory.py                  # 2k .. 128k, CPU
    python benchmarks/varlen_memory.py --lengths 2048 4096 --dense-max 4096 --output /tmp/sweep   # quick

Each point is one fresh process: a 1-layer tiny Llama (hidden 64, 4/2 heads, vocab 128, fp32, one thread) runs
forward + backward on one packed row of `length` tokens, documents of lognormal lengths (median 128 tokens, sigma 1:
about 165 documents in a 32k row) filling the row (the 32k row of 256 equal documents is tests/test_varlen.py's).
Reported: the rise of peak RSS (ru_maxrss) over the process's RSS before the step, and the wall time of the second step
(the first warms up). The dense route needs
about `length^2 x 5` bytes (bool mask + float scores), so it runs only up to `--dense-max` tokens.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

from publish import publish


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUTES = ("dense", "varlen")


def one_point(length: int, route: str, seed: int) -> dict:
    """Child process: peak RSS rise (MiB) and step seconds of one forward + backward."""
    import resource
    import time

    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llm_packing import configure_packing

    torch.set_num_threads(1)
    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length,
                                  use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = configure_packing(AutoModelForCausalLM.from_config(config), attention_route=route)
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, np.rint(rng.lognormal(np.log(128), 1.0, length)).astype(int))
    ends = np.minimum(np.cumsum(lengths), length)
    ends = ends[: np.searchsorted(ends, length) + 1]
    document = np.searchsorted(ends, np.arange(length), side="right")
    starts = np.concatenate([[0], ends[:-1]])
    attention_mask = torch.from_numpy(document + 1)[None]
    position_ids = torch.from_numpy(np.arange(length) - starts[document])[None]
    input_ids = torch.randint(0, 128, (1, length))
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                 "labels": input_ids.masked_fill(position_ids == 0, -100)}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        model(**batch).loss.backward()
        seconds.append(time.perf_counter() - start)
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return {"rise_mib": rise, "step_s": seconds[-1], "documents": len(ends)}


def plot(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for route in ROUTES:
        measured = [p for p in points if p["route"] == route and "rise_mib" in p]
        lengths = [p["length"] for p in measured]
        axes[0].plot(lengths, [p["rise_mib"] for p in measured], "o-", label=route)
        axes[1].plot(lengths, [p["step_s"] for p in measured], "o-", label=route)
    for ax, label in zip(axes, ("peak RSS rise in the step, MiB", "forward + backward, s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("row length, tokens (one row, documents of median 128 tokens)")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("Packed sdpa, 1-layer tiny Llama on CPU: dense L x L mask vs varlen route", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2**k for k in range(11, 18)])
    parser.add_argument("--dense-max", type=int, default=16384, help="longest row the dense route runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=os.path.join(RESULTS, "varlen_memory"), help="writes OUTPUT.md/.png")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_point(int(args.child[0]), args.child[1], args.seed)))
        return
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    points = []
    for length in args.lengths:
        for route in ROUTES:
            point = {"length": length, "route": route}
            if route == "dense" and length > args.dense_max:
                point["skipped"] = f"above --dense-max {args.dense_max} (~{length**2 * 5 / 2**30:.0f} GiB)"
            else:
                process = subprocess.run([sys.executable, os.path.abspath(__file__), "--seed", str(args.seed),
                                          "--child", str(length), route],
                                         capture_output=True, text=True, env=environment)
                if process.returncode:
                    point["skipped"] = f"exit code {process.returncode}: {process.stderr.strip()[-200:]}"
                else:
                    point.update(json.loads(process.stdout.strip().splitlines()[-1]))
            points.append(point)
            print(point, file=sys.stderr, flush=True)
    lines = ["# varlen_memory\n", f"- command: `{' '.join(['python benchmarks/varlen_memory.py', *sys.argv[1:]])}`",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; machine: {os.cpu_count()} CPUs, "
             f"{platform.platform()}; load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared)",
             "", "| row tokens | documents | route | peak RSS rise MiB | step s |", "|---|---|---|---|---|"]
    for p in points:
        if "skipped" in p:
            lines.append(f"| {p['length']:,} | | {p['route']} | not run: {p['skipped']} | |")
        else:
            lines.append(f"| {p['length']:,} | {p['documents']} | {p['route']} | {p['rise_mib']:,.0f} | "
                         f"{p['step_s']:.2f} |")
    publish(lines, args.output + ".md")
    plot(points, args.output + ".png")


if __name__ == "__main__":
    main()
