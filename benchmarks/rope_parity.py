"""Length-dependent rope on every supported type: each type given `longrope` and then `dynamic` rope parameters that
switch at 16 tokens, a packed batch with documents on both sides of the switch against each document alone, with
`llm_packing.hook.rotary` and without it (the control), on sdpa's default route (eager for the types without sdpa),
float32 on CPU.

Prints one line per (type, rope type) as it goes, then the table; writes it to `--output`. A type whose config has no
`rope_parameters` of its own or for its full-attention layers, or whose tiny model is not built or run with such
parameters (transformers' refusal or this script's rope parameters not fitting the type), gets a row saying why.

    python benchmarks/rope_parity.py                 # every supported type (~20 min on 2 cores)
    python benchmarks/rope_parity.py phi3 llama --output /tmp/rope.md
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

import pytest  # noqa: E402 -- the test helpers below report a missing model type by skipping
import test_parity  # noqa: E402
import test_rotary  # noqa: E402 -- the rope overrides, the straddling layout, the fresh references
from publish import publish  # noqa: E402 -- a sibling under benchmarks/
from tiny_models import tiny_config, tiny_model  # noqa: E402

from llm_packing.hook import rotary  # noqa: E402
from llm_packing.hook.configure import packing_configured  # noqa: E402
from llm_packing.hook.support.architectures import backend_available, supported_model_types  # noqa: E402


ROPE_TYPES = ("longrope", "dynamic")
OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rope_parity.md")


def run(model_type: str, rope_type: str) -> dict:
    row = {"model_type": model_type, "rope_type": rope_type}
    try:
        parameters = tiny_config(model_type).rope_parameters
    except (AttributeError, pytest.skip.Exception):
        return row | {"note": "no rope parameters"}
    if not isinstance(parameters, dict) or not {"rope_type", "full_attention"} & parameters.keys():
        return row | {"note": "no rope parameters of its own or for full attention"}
    try:
        backend = "sdpa" if backend_available(model_type, "sdpa") else "eager"
        row["backend"] = backend
        model = tiny_model(model_type, backend, **test_rotary.length_dependent_rope(model_type, rope_type))
    except Exception as error:  # noqa: BLE001 -- reported as such
        return row | {"note": f"not built with these parameters: {_one_line(error)}"}
    patch = rotary.patch_rotary_embeddings
    try:
        for name, patched in (("control", False), ("packed", True)):
            rotary.patch_rotary_embeddings = patch if patched else (lambda model_or_config: None)
            with packing_configured(model):
                row[name] = max(test_rotary.differences(model, test_rotary.STRADDLING_LAYOUT))
    except Exception as error:  # noqa: BLE001 -- transformers' own forward failing on the config
        return row | {"note": f"transformers' own forward fails: {_one_line(error)}"}
    finally:
        rotary.patch_rotary_embeddings = patch
    return row


def _one_line(error: Exception) -> str:
    """`error` for a table cell: its type and the start of its message, on one line, without `|`."""
    message = " ".join(str(error).replace("|", "/").split())
    return f"{type(error).__name__}: {message[:100]}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="default: every supported type")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    with pytest.MonkeyPatch.context() as monkeypatch:
        test_rotary.fresh_rotary_forward(monkeypatch)
        started, load, rows = time.perf_counter(), os.getloadavg(), []
        for model_type in args.model_types or sorted(supported_model_types()):
            for rope_type in ROPE_TYPES:
                rows.append(run(model_type, rope_type))
                print(rows[-1], flush=True)
    measured = [row for row in rows if "packed" in row]
    leaking = [row for row in measured if row["control"] > test_parity.TOLERANCE]
    lines = [
        "# Length-dependent rope, packed against alone",
        "",
        f"`python benchmarks/rope_parity.py{' ' + ' '.join(args.model_types) if args.model_types else ''}` on "
        f"{datetime.date.today()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (load "
        f"average {load[0]:.1f} at the start), one torch thread, torch {torch.__version__}, transformers "
        f"{transformers.__version__}; {time.perf_counter() - started:.0f} s.",
        "",
        f"Rows of 48 tokens holding documents of {test_rotary.STRADDLING_LAYOUT} tokens, the switch at "
        f"{test_rotary.SWITCH_LENGTH} (on full attention where the rope is per layer type); sdpa's default "
        "route, or eager where the type has no sdpa; the largest logit or per-token loss difference of any "
        f"document against it alone in a fresh rotary module. {len(measured)} (type, rope type) pairs ran: "
        "packed at most "
        f"{max((row['packed'] for row in measured), default=0):.2e}; without `hook/rotary.py`, {len(leaking)} "
        f"above 1e-5 ({min((row['control'] for row in leaking), default=0):.2e} to "
        f"{max((row['control'] for row in leaking), default=0):.2e}).",
        "",
        "| model_type | rope type | backend | packed | without hook/rotary.py | note |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        measured_cells = f"{row['packed']:.2e} | {row['control']:.2e}" if "packed" in row else " | "
        lines.append(
            f"| {row['model_type']} | {row['rope_type']} | {row.get('backend', '')} | {measured_cells} | "
            f"{row.get('note', '')} |"
        )
    publish(lines, args.output)


if __name__ == "__main__":
    main()
