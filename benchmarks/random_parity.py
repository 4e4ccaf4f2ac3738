"""Issue 25's "done when": every supported type on eager and on both sdpa routes, issue 25's row and 20 layouts drawn
at random (seeds 0-19 of `tests/random_layouts.py`, the parity matrix's), packed logits and per-token losses against
each document run alone, float32 on CPU.

Prints one line per (type, cell) as it goes, then the table: the largest differences over all layouts, how many layouts
exceed 1e-5, and the worst layout; writes the table to `--output`. `--unwrapped-indexers` leaves the sparse key
indexers as transformers has them (the state before `llm_packing/hook/attention/indexers.py`), to show what they leak.

    python benchmarks/random_parity.py                                  # every supported type (~1 h of one CPU core)
    python benchmarks/random_parity.py deepseek_v32 glm_moe_dsa --unwrapped-indexers --output /tmp/before.md
"""

import argparse
import datetime
import os
import platform
import sys
import time

import torch
import transformers


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import test_parity  # noqa: E402  (the matrix's references and comparison, with its tiny models)
from publish import publish  # noqa: E402 -- a sibling under benchmarks/
from random_layouts import ISSUE_25_LAYOUT, draw_layout  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

from llm_packing.hook import indexers  # noqa: E402
from llm_packing.hook.configure import configure_packing, unconfigure_packing  # noqa: E402
from llm_packing.hook.support.architectures import (  # noqa: E402
    REFUSED_BACKENDS,
    backend_available,
    sdpa_route,
    supported_model_types,
)


CELLS = (("eager", "auto"), ("sdpa", "varlen"), ("sdpa", "dense"))
OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "random_parity.md")


def run_type(model_type: str, layouts) -> list[dict]:
    """One result per cell that transformers offers and the hook admits for `model_type`."""
    results, models = [], {}
    for backend, route in CELLS:
        if not backend_available(model_type, backend) or (model_type, backend) in REFUSED_BACKENDS:
            continue
        if backend not in models:
            model = tiny_model(model_type, backend)
            models[backend] = (model, test_parity.References(model, layouts))
        model, references = models[backend]
        if route == "varlen" and sdpa_route(model.config)[0] != "varlen":
            continue
        started = time.perf_counter()
        configure_packing(model, attention_route=route)
        try:
            differences = [(layout, *test_parity.layout_differences(model, references, layout)) for layout in layouts]
        finally:
            unconfigure_packing()
        worst = max(differences, key=lambda difference: max(difference[1:3]))
        results.append({
            "model_type": model_type, "cell": f"{backend}/{route}", "layouts": len(layouts),
            "logits": max(difference[1] for difference in differences),
            "losses": max(difference[2] for difference in differences),
            "failing": sum(max(difference[1:3]) > test_parity.TOLERANCE for difference in differences),
            "worst": worst[0], "seconds": time.perf_counter() - started,
        })
    return results


def table(results: list[dict]) -> list[str]:
    lines = ["| model_type | cell | layouts | max logit diff | max loss diff | layouts > 1e-5 | worst layout |",
             "|---|---|---|---|---|---|---|"]
    for result in results:
        worst = result["worst"]
        name = "issue 25's row" if worst.seed is None else f"draw_layout({worst.seed})"
        lines.append(
            f"| {result['model_type']} | {result['cell']} | {result['layouts']} | {result['logits']:.2e} | "
            f"{result['losses']:.2e} | {result['failing']} | {name} |"
        )
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="default: every supported type")
    parser.add_argument("--layouts", type=int, default=20, help="drawn layouts (seeds 0..N-1), besides issue 25's row")
    parser.add_argument("--unwrapped-indexers", action="store_true")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.unwrapped_indexers:
        indexers.patch_indexers = lambda model_type: None
    model_types = args.model_types or supported_model_types()
    layouts = (ISSUE_25_LAYOUT, *map(draw_layout, range(args.layouts)))
    started, load = time.perf_counter(), os.getloadavg()
    results = []
    for model_type in model_types:
        for result in run_type(model_type, layouts):
            results.append(result)
            print(f"{model_type:24s} {result['cell']:14s} logits {result['logits']:.2e} losses {result['losses']:.2e} "
                  f"failing {result['failing']} ({result['seconds']:.1f} s)", flush=True)
    failing = [result for result in results if result["failing"]]
    lines = [
        "# Random-layout parity" + (" (indexers unwrapped)" if args.unwrapped_indexers else ""),
        "",
        f"`python benchmarks/random_parity.py{' --unwrapped-indexers' if args.unwrapped_indexers else ''}"
        f"{' ' + ' '.join(args.model_types) if args.model_types else ''}` on {datetime.date.today()}: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared (load average "
        f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), one torch thread, torch "
        f"{torch.__version__}, transformers {transformers.__version__}; {time.perf_counter() - started:.0f} s.",
        "",
        f"{len({result['model_type'] for result in results})} model types, {len(results)} cells (eager, sdpa "
        "varlen, sdpa dense, where transformers offers the backend and the hook takes the route), each on issue 25's "
        f"row and {args.layouts} drawn layouts (every third a batch of one document a row, most with trailing padding,"
        " issue 35): logits and per-token losses of every packed document against the "
        f"document run alone, float32. Cells with a layout above 1e-5: {len(failing)}"
        + (f" ({', '.join(sorted({result['model_type'] for result in failing}))})." if failing else "."),
        "",
        *table(results),
    ]
    publish(lines, args.output)


if __name__ == "__main__":
    main()
