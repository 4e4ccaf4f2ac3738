"""The conversion cache of `pretrained`, bounded: one folder per GGUF file and transformers release under
`$LLM_PACKING_CACHE`, the newest `$LLM_PACKING_CACHE_KEEP` (default 2) kept, older ones pruned after each conversion
and by `llm-packing cache --prune`.

A folder `<file stem>-<16 hex digits>` is complete once its marker `converted_from.json` is in it (written last, then
the folder is renamed into place); the marker names the transformers release it was converted with, and its
modification time is when the folder was last read. Beside each folder, `<folder>.lock` is held exclusively while the
folder is converted, shared while a loader reads it, and taken exclusively without waiting by a prune: a folder whose
lock another process holds is in use and stays. Locks are `fcntl.flock`; without `fcntl` (Windows) nothing can be
told in use, and a prune relies on Windows refusing to rename a folder whose files are open.
"""

import contextlib
import json
import os
import re
import shutil
from typing import NamedTuple

from ..core.checks import check_integer


try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


CACHE_VARIABLE = "LLM_PACKING_CACHE"
KEEP_VARIABLE = "LLM_PACKING_CACHE_KEEP"
DEFAULT_KEEP = 2
MARKER = "converted_from.json"
# `<folder>`, its `.lock`, a conversion's staging folder `.converting-<pid>`, a prune's `.pruning-<pid>`.
_NAME = re.compile(r"(?P<folder>.+-[0-9a-f]{16})(?P<suffix>\.lock|\.converting-\d+|\.pruning-\d+)?")


class CachedFolder(NamedTuple):
    """
    One converted folder of the cache, as `list_cache` finds it.

    Args:
        path (`str`): The folder (it may be missing when only leftovers of a conversion are).
        release (`str`): The transformers release it was converted with; `"unknown"` for folders converted before
            llm_packing recorded it, or incomplete ones.
        size (`int`): Bytes of the folder and its leftovers (staging folders of a conversion that died).
        last_used (`float`): When it was last read (complete) or written (incomplete), in seconds since the epoch.
        complete (`bool`): Its marker is there, so loaders read it.
        in_use (`bool`): Another process holds its lock: converting it, or reading it.
    """

    path: str
    release: str
    size: int
    last_used: float
    complete: bool
    in_use: bool


class PruneResult(NamedTuple):
    """What `prune_cache` did: `removed` folders, `in_use` ones it had to leave, the newest ones `kept`, and old ones
    whose lock file this process may not open (`forbidden`: another user's, in a cache shared between users)."""

    removed: list[CachedFolder]
    in_use: list[CachedFolder]
    kept: list[CachedFolder]
    forbidden: list[CachedFolder]


def cache_root() -> str:
    """The cache folder: `$LLM_PACKING_CACHE`, else `$XDG_CACHE_HOME/llm_packing`, else `~/.cache/llm_packing`."""
    return os.environ.get(CACHE_VARIABLE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "llm_packing")


def kept_from_environment() -> int:
    """
    How many converted folders a prune after a conversion keeps: `$LLM_PACKING_CACHE_KEEP`, default 2.

    Raises:
        `PackingValueError`: the variable is set to something other than a positive integer.
    """
    value = os.environ.get(KEEP_VARIABLE, "").strip()
    if not value:
        return DEFAULT_KEEP
    number = int(value) if value.isdecimal() else value
    check_integer(f"${KEEP_VARIABLE}", number, meaning="newest converted folders the cache keeps",
                  fix=f"Set it to 2, say, or unset it for the default {DEFAULT_KEEP}.")
    return number


def is_complete(folder: str) -> bool:
    """Whether loaders read `folder`: its marker, written last, is there."""
    return os.path.isfile(os.path.join(folder, MARKER))


def write_marker(folder: str, gguf_file: str, release: str) -> None:
    """Complete `folder`: record the GGUF file and transformers release it was converted from."""
    with open(os.path.join(folder, MARKER), "w") as file:
        json.dump({"gguf_file": gguf_file, "transformers": release}, file)


def mark_used(folder: str) -> None:
    """Record that `folder` is read now: the newest folders by last use are the ones a prune keeps."""
    with contextlib.suppress(OSError):  # a read-only cache still loads; it is never pruned by this process anyway
        os.utime(os.path.join(folder, MARKER))


@contextlib.contextmanager
def folder_lock(folder: str, *, shared: bool = False, wait: bool = True, create: bool = True):
    """
    Hold `<folder>.lock`: exclusively (converting or pruning) or `shared` (reading). Yields `True` once held, or
    `False` when `wait=False` and another process holds it. Raises `OSError` when the lock file cannot be opened
    (`FileNotFoundError` with `create=False` and no lock file).
    """
    path = f"{folder}.lock"
    while True:
        try:
            file = open(path, "a" if create else "r")
        except PermissionError:
            if not shared:
                raise
            file = open(path)  # a cache we may read but not write: a shared lock needs only read access
        with file:
            held = True
            if fcntl is not None:
                try:
                    fcntl.flock(file, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
                except BlockingIOError:
                    held = False
            # A prune removes the lock file it holds: a process that opened it before then locks a file no one else
            # will open, so the lock counts only if it is still the file at `path` (else lock the new one).
            if not held or fcntl is None or _same_file(file, path):
                yield held
                return


def list_cache(root: str | None = None) -> list[CachedFolder]:
    """
    The converted folders under `root` (default `cache_root()`): complete ones newest first by last use, then
    incomplete ones. Only names the cache writes are read; anything else in `root` is left alone.

    Example:
    ```python
    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> folder = os.path.join(root, "model-0123456789abcdef")
    >>> os.mkdir(folder)
    >>> write_marker(folder, "model.gguf", "5.24.0")
    >>> [(os.path.basename(entry.path), entry.release, entry.complete, entry.in_use) for entry in list_cache(root)]
    [('model-0123456789abcdef', '5.24.0', True, False)]

    ```
    """
    root = cache_root() if root is None else os.fspath(root)
    groups = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in os.listdir(root):
            match = _NAME.fullmatch(name)
            if match:
                groups.setdefault(os.path.join(root, match["folder"]), []).append(os.path.join(root, name))
    entries = [_entry(folder, names) for folder, names in groups.items() if _is_ours(folder, names)]
    return sorted(entries, key=lambda entry: (not entry.complete, -entry.last_used, entry.path))


def prune_cache(root: str | None = None, *, keep: int | None = None) -> PruneResult:
    """
    Remove all but the `keep` newest complete folders under `root` (default `cache_root()`), with every incomplete
    one and the leftovers of conversions that died; a folder in use by another process stays. Each removal holds the
    folder's lock, so no process reads or converts it meanwhile.

    Args:
        root (`str`, *optional*): The cache folder; default `cache_root()`.
        keep (`int`, *optional*): Newest complete folders to keep, by last use; default `kept_from_environment()`.

    Example:
    ```python
    >>> import tempfile, time
    >>> root = tempfile.mkdtemp()
    >>> for age, release in enumerate(["5.24.0", "5.23.0", "5.22.0"]):
    ...     folder = os.path.join(root, f"model-{age:016x}")
    ...     os.mkdir(folder)
    ...     write_marker(folder, "model.gguf", release)
    ...     os.utime(os.path.join(folder, MARKER), (time.time() - age, time.time() - age))
    >>> [entry.release for entry in prune_cache(root, keep=2).removed]
    ['5.22.0']
    >>> [entry.release for entry in list_cache(root)]
    ['5.24.0', '5.23.0']

    ```
    """
    keep = kept_from_environment() if keep is None else keep
    check_integer("keep", keep, minimum=0, meaning="newest converted folders to keep")
    removed, in_use, kept, forbidden = [], [], [], []
    complete_seen = 0
    for entry in list_cache(root):
        newest = entry.complete and complete_seen < keep
        complete_seen += entry.complete
        with contextlib.ExitStack() as stack:
            try:
                held = stack.enter_context(folder_lock(entry.path, wait=False))
            except OSError:
                (kept if newest else forbidden).append(entry)
                continue
            if held:  # nothing converts this folder now: its staging folders are leftovers of a conversion that died
                _remove(_names(entry.path, (".converting-", ".pruning-")))
            if newest:
                kept.append(entry)
                continue
            # Renamed first: a removal cut short leaves a name no loader reads, not a folder missing its weights.
            moved = f"{entry.path}.pruning-{os.getpid()}"
            try:
                if held and os.path.isdir(entry.path):
                    os.rename(entry.path, moved)
            except OSError:  # Windows: a file inside is open
                held = False
            if not held:
                in_use.append(entry._replace(in_use=True))
                continue
            _remove([moved])
            # Last, still held: a process waiting on this file finds it gone and locks a new one (`folder_lock`).
            with contextlib.suppress(OSError):
                os.remove(f"{entry.path}.lock")
            removed.append(entry)
    return PruneResult(removed, in_use, kept, forbidden)


def _entry(folder: str, names: list[str]) -> CachedFolder:
    complete = is_complete(folder)
    release = "unknown"
    if complete:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            with open(os.path.join(folder, MARKER)) as file:
                release = str(json.load(file).get("transformers", release))
        last_used = _modified(os.path.join(folder, MARKER))
    else:
        last_used = max(map(_modified, names))
    return CachedFolder(folder, release, sum(_size(name) for name in names if not name.endswith(".lock")), last_used,
                        complete, _held_elsewhere(folder))


def _is_ours(folder: str, names: list[str]) -> bool:
    # A bare `<name>-<16 hex digits>` folder in a shared cache root may be someone else's: it counts with a marker
    # or a lock beside it; staging and pruning names are only ever written by this module and `pretrained`.
    return any(name != folder for name in names) or is_complete(folder)


def _held_elsewhere(folder: str) -> bool:
    try:
        with folder_lock(folder, wait=False, create=False) as held:
            return not held
    except OSError:  # no lock file, so no holder; or one this process may not open, so not ours to judge
        return False


def _same_file(file, path: str) -> bool:
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(file.fileno())
    return (status.st_dev, status.st_ino) == (opened.st_dev, opened.st_ino)


def _names(folder: str, prefixes: tuple[str, ...]) -> list[str]:
    root, stem = os.path.split(folder)
    starts = tuple(stem + prefix for prefix in prefixes)
    return [os.path.join(root, name) for name in os.listdir(root) if name.startswith(starts)]


def _remove(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _modified(path: str) -> float:
    try:
        return os.lstat(path).st_mtime
    except FileNotFoundError:  # removed since it was listed, by a prune of another process
        return 0.0


def _size(path: str) -> int:
    files = [path] if not os.path.isdir(path) else [os.path.join(where, name) for where, _, names in os.walk(path)
                                                     for name in names]
    total = 0
    for name in files:
        with contextlib.suppress(FileNotFoundError):  # removed since it was listed
            total += os.lstat(name).st_size
    return total
