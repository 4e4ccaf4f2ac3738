"""`python -m llm_packing.train --config recipes/X.yaml` (and `accelerate launch -m llm_packing.train ...`): the
training entry point. The flow lives in `llm_packing.cli.train`; this module only speaks first, since torch,
transformers and TRL take seconds to import."""

import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Train from the recipe and flags in `argv` (default `sys.argv[1:]`); a user mistake prints one line and
    returns 1."""
    if os.environ.get("RANK", "0") == "0":
        print("llm_packing.train: loading torch, transformers and TRL...", file=sys.stderr, flush=True)
    from .cli.main import run_command
    from .cli.train import main as train_main

    return run_command("python -m llm_packing.train", train_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
