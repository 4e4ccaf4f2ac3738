"""The `llm-packing` console script: `llm-packing <command> [arguments]`.

Each command is a module with a `main(argv)` function, imported only when run (training pulls in TRL and torch).
"""

import importlib
import sys

from .errors import PackingError


COMMANDS = {
    "train": ("llm_packing.train", "fine-tune with packed documents from a YAML recipe (--config recipes/X.yaml)"),
    "stats": ("llm_packing.stats_command", "packing stats of each strategy for a dataset (--max_length 2048)"),
}


def main(argv: list[str] | None = None):
    """Run the command named by the first argument of `argv` (default `sys.argv[1:]`) with the rest."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        usage = "\n".join(f"  {name:<8} {summary}" for name, (_, summary) in COMMANDS.items())
        print(f"usage: llm-packing <command> [arguments]\n\ncommands:\n{usage}", file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}.", file=sys.stderr)
            return 2
        return 0 if argv else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        module.main(argv[1:])
    except PackingError as error:  # a user mistake: the message says what to fix, a traceback would bury it
        print(f"llm-packing {argv[0]}: error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
