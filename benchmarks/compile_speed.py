"""What `torch.compile(model)` buys a packed training step on this machine's CPU, and what it costs (issue 37).

    python benchmarks/compile_speed.py                       # llama-shaped 4 x 256 model, 2 rows of 1024 tokens
    python benchmarks/compile_speed.py --routes auto --steps 12 --output /tmp/compile.md

Per route (sdpa's varlen and dense routes, eager), the same model and the same packed batches (new document layouts
every step; rows padded to each batch's longest, so lengths change too) train eagerly and compiled, steps taking turns
(a machine whose speed drifts slows both alike). The table: the median step (forward, backward, AdamW) after the
warm-up steps, the first compiled step (tracing and inductor) and the step that recompiles for dynamic shapes, the
compiled frames and graph breaks dynamo counted, and the largest loss difference between the two. Graph breaks are
listed with dynamo's reason: the hook's replacements run outside the graphs (`registry.outside_graphs`), one break per
call. Timing is the process's wall clock on a shared 2-core machine (load average printed): compare the columns.
"""

import argparse
import copy
import datetime
import os
import platform
import random
import statistics
import sys
import time

import torch


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from tiny_models import tiny_model  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from llm_packing import DataCollatorWithPacking  # noqa: E402
from llm_packing.hook.configure import packing_configured  # noqa: E402


OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "compile_speed.md")
ROUTES = {"auto": ("sdpa", "auto"), "dense": ("sdpa", "dense"), "eager": ("eager", "auto")}


def batches(count: int, max_length: int, seed: int = 0) -> list[dict]:
    """Two packed rows a batch, documents of 16 to 400 tokens filling 80-100% of `max_length`."""
    collator, rng, result = DataCollatorWithPacking(), random.Random(seed), []
    for _ in range(count):
        rows = []
        for _ in range(2):
            lengths, fill = [], rng.randint(max_length * 4 // 5, max_length)
            while sum(lengths) < fill:
                lengths.append(min(rng.randint(16, 400), fill - sum(lengths)))
            rows.append({"input_ids": [rng.randint(3, 127) for _ in range(sum(lengths))], "seq_lengths": lengths})
        result.append(collator(rows))
    return result


def run_route(route: str, args) -> dict:
    backend, attention_route = ROUTES[route]
    torch.manual_seed(0)
    shape = {"hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
             "max_position_embeddings": args.max_length}
    eager = tiny_model("llama", backend, **shape).train()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4)
                  for name, model in (("eager", eager), ("compiled", compiled_model))}
    torch._dynamo.reset()
    counters.clear()
    times, losses = {"eager": [], "compiled": []}, {"eager": [], "compiled": []}
    with packing_configured(compiled_model, attention_route=attention_route):
        for batch in batches(args.steps, args.max_length):
            for name, model in (("compiled", compiled), ("eager", eager)):  # compiled first on each new layout
                started = time.perf_counter()
                loss = model(**batch, use_cache=False).loss
                loss.backward()
                optimizers[name].step()
                optimizers[name].zero_grad()
                times[name].append(time.perf_counter() - started)
                losses[name].append(loss.item())
    warm = args.warmup
    breaks = {reason.splitlines()[0][:100]: count for reason, count in counters["graph_break"].items()}
    return {
        "route": f"{backend} / {attention_route}",
        "eager": statistics.median(times["eager"][warm:]),
        "compiled": statistics.median(times["compiled"][warm:]),
        "first": times["compiled"][0],
        "second": times["compiled"][1],
        "frames": counters["frames"]["ok"],
        "breaks": sum(counters["graph_break"].values()),
        "reasons": breaks,
        "loss_difference": max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"], strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians (compiles happen here)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    started = time.perf_counter()
    results = []
    for route in args.routes:
        results.append(run_route(route, args))
        print(results[-1], flush=True)
    lines = [
        "# torch.compile on packed training steps (CPU)",
        "",
        f"`python benchmarks/compile_speed.py {' '.join(sys.argv[1:])}`".replace(" `", "`") + f" on "
        f"{datetime.date.today()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared (load "
        f"average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), {args.threads} torch thread(s), "
        f"torch {torch.__version__}; {time.perf_counter() - started:.0f} s.",
        "",
        f"Llama-shaped model, hidden {args.hidden}, {args.layers} layers, float32; batches of 2 packed rows of up to "
        f"{args.max_length} tokens (documents of 16-400 tokens, a new layout and length every step), forward + "
        f"backward + AdamW. Medians over steps {args.warmup + 1}-{args.steps}; the first compiled step traces and "
        "compiles, the second recompiles with dynamic shapes (a new length), later ones compile nothing.",
        "",
        "| route | eager step | compiled step | speed-up | first compiled step | second | frames compiled | graph "
        "breaks traced | max loss difference |",
        "|---|---|---|---|---|---|---|---|---|",
        *(f"| {r['route']} | {r['eager'] * 1e3:.0f} ms | {r['compiled'] * 1e3:.0f} ms | "
          f"{r['eager'] / r['compiled']:.2f}x | {r['first']:.1f} s | {r['second']:.1f} s | {r['frames']} | "
          f"{r['breaks']} | {r['loss_difference']:.1e} |" for r in results),
        "",
        "Graph breaks by reason (all routes):",
        "",
        *sorted({f"- {reason}" for r in results for reason in r["reasons"]}),
    ]
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
