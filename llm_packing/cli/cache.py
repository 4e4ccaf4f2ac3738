"""`llm-packing cache`: the folders the bundled SmolLM2 is converted into (one per transformers release), listed or
pruned.

    llm-packing cache --list
    llm-packing cache --prune --keep 1
    llm-packing cache --list --cache_dir /scratch/llm_packing

`--list` (the default) prints one line per folder: the transformers release it was converted with, its size, when it
was last read, whether another process is using it (converting or reading it), and what the next prune does with it.
`--prune` removes all but the `--keep` newest folders by last use (default `$LLM_PACKING_CACHE_KEEP`, else 2), with
incomplete ones and the leftovers of conversions that died; a folder in use stays. Each conversion prunes the same way
on its own, so the cache stays bounded without this command.
"""

import argparse
import datetime
import os

from ..core.checks import check_integer
from ..demo.conversion_cache import (
    CACHE_VARIABLE,
    KEEP_VARIABLE,
    CachedFolder,
    cache_root,
    kept_from_environment,
    list_cache,
    prune_cache,
)
from ..errors import PackingValueError


def make_parser() -> argparse.ArgumentParser:
    """The flags of `llm-packing cache`."""
    parser = argparse.ArgumentParser(prog="llm-packing cache", allow_abbrev=False, description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--list", action="store_true", help="List the converted folders (the default).")
    action.add_argument("--prune", action="store_true", help="Remove all but the --keep newest folders not in use.")
    parser.add_argument("--keep", help=f"Newest folders to keep (default ${KEEP_VARIABLE}, else 2); 0 removes every "
                        "folder not in use.")
    parser.add_argument("--cache_dir",
                        help=f"The cache folder (default ${CACHE_VARIABLE}, else ~/.cache/llm_packing).")
    return parser


def format_size(size: int) -> str:
    """
    Bytes as MiB, or GiB from 1,024 MiB.

    Example:
    ```python
    >>> format_size(542_113_792), format_size(3 * 2**30)
    ('517.0 MiB', '3.0 GiB')

    ```
    """
    return f"{size / 2**30:,.1f} GiB" if size >= 2**30 else f"{size / 2**20:,.1f} MiB"


def format_listing(entries: list[CachedFolder], keep: int) -> str:
    """One aligned line per folder, newest first: release, size, last used, in use, what the next prune does."""
    rows = [("release", "size", "last used", "in use", "next prune", "folder")]
    complete_seen = 0
    for entry in entries:
        newest = entry.complete and complete_seen < keep
        complete_seen += entry.complete
        if entry.in_use and not newest:
            fate = "leaves (in use)" if entry.complete else "leaves (converting)"
        else:
            fate = "keeps" if newest else "removes" if entry.complete else "removes (incomplete)"
        used = datetime.datetime.fromtimestamp(entry.last_used).strftime("%Y-%m-%d %H:%M:%S")
        rows.append((entry.release, format_size(entry.size), used, "yes" if entry.in_use else "no", fate,
                     os.path.basename(entry.path)))
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    return "\n".join("  ".join(cell.rjust(width) if i == 1 else cell.ljust(width)
                               for i, (cell, width) in enumerate(zip(row, widths, strict=True))).rstrip()
                     for row in rows)


def _keep(value: str) -> int:
    # Parsed here rather than by argparse `type=int`, so that a bad value raises PackingValueError, not SystemExit.
    number = int(value) if value.isdecimal() else value
    check_integer("--keep", number, minimum=0, meaning="newest converted folders to keep",
                  fix="Pass 0 or more, e.g. `--keep 2`.")
    return number


def main(argv: list[str] | None = None) -> list[CachedFolder]:
    """Run `llm-packing cache` with the flags in `argv` (default `sys.argv[1:]`); returns the folders listed, or
    those removed by `--prune`."""
    args = make_parser().parse_args(argv)
    keep = kept_from_environment() if args.keep is None else _keep(args.keep)
    root = cache_root() if args.cache_dir is None else args.cache_dir
    if os.path.exists(root) and not os.path.isdir(root):
        name = "`--cache_dir`" if args.cache_dir is not None else f"`${CACHE_VARIABLE}`"
        raise PackingValueError(f"{name} {root!r} is a file, not a folder. Point it at the cache folder.")
    if args.prune:
        result = prune_cache(root, keep=keep)
        for entry in result.removed:
            print(f"removed {os.path.basename(entry.path)} (transformers {entry.release}, {format_size(entry.size)})")
        for entry in result.in_use:
            print(f"left {os.path.basename(entry.path)} (transformers {entry.release}): in use by another process")
        for entry in result.forbidden:
            print(f"left {os.path.basename(entry.path)} (transformers {entry.release}): its lock file "
                  f"{entry.path}.lock cannot be opened by this user; its owner can prune it")
        freed = format_size(sum(entry.size for entry in result.removed))
        counts = [f"{len(result.removed)} removed ({freed} freed)", f"{len(result.kept)} kept (the newest {keep})",
                  f"{len(result.in_use)} in use"]
        if result.forbidden:
            counts.append(f"{len(result.forbidden)} another user's")
        print(f"pruned {root}: {', '.join(counts)}")
        return result.removed
    entries = list_cache(root)
    if not entries:
        print(f"no converted folders in {root}")
        return entries
    total = format_size(sum(entry.size for entry in entries))
    print(f"{root}: {len(entries)} folder{'s' * (len(entries) != 1)}, {total}; a prune keeps the newest {keep}")
    print(format_listing(entries, keep))
    return entries
