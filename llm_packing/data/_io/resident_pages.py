"""Pages of a memory-mapped input that the process has read, given back once they add up to a limit.

Reading a memory-mapped file maps every touched page into the process: it counts in the resident set (RSS) until
unmapped, although it is page cache the kernel could drop. `pack_dataset` reads documents in packed order, all over
the input, so a 15 GiB corpus would end up resident in full. [`ResidentPages`] watches the process's file-backed
resident memory (`RssFile`) and, once it has grown past a limit, unmaps the input's pages with
`madvise(MADV_DONTNEED)`: the data stays in the page cache, and the next read of it maps it back (a minor fault).
Only read-only file mappings are given back: dropping anonymous or written pages would lose their contents. Off
Linux nothing is watched.
"""

import bisect
import ctypes
import ctypes.util
import os
import threading

import pyarrow as pa


RESIDENT_LIMIT = 256 << 20  # bytes of mapped input held before they are given back
_MADV_DONTNEED = 4  # Linux's value on every architecture


class ResidentPages:
    """
    The read-only file mappings that hold the buffers of `table`, and a limit on how much of them stays resident.

    Call [`ResidentPages.check`] after each bounded read: past `limit` bytes of file-backed resident memory above
    where it stood at the start (or at the last release), the mappings are given back.

    Args:
        table (`pa.Table`): The input whose buffers are read.
        limit (`int`, *optional*): Bytes of file-backed memory allowed to accumulate; defaults to `RESIDENT_LIMIT`.

    Example:
    ```python
    >>> import pyarrow as pa
    >>> ResidentPages(pa.table({"input_ids": [[1, 2]]})).mappings  # in memory: nothing to give back
    []

    ```
    """

    def __init__(self, table: pa.Table, limit: int | None = None):
        self.limit = RESIDENT_LIMIT if limit is None else limit
        self.mappings = _read_only_file_mappings(_buffer_addresses(table)) if _LIBC else []
        self._level = _rss_file() if self.mappings else 0
        self._lock = threading.Lock()

    @property
    def bounds(self) -> bool:
        """Whether the mappings are larger than the limit, so that the order of reads decides what stays resident."""
        return sum(end - start for start, end in self.mappings) > self.limit

    def restart(self) -> None:
        """Count from this process's file-backed resident memory now (a forked process starts from its own)."""
        self._level = _rss_file() if self.mappings else 0

    def check(self) -> None:
        """Give the mappings' pages back if the process's file-backed resident memory rose past the limit (from any
        thread: the input's values are checked on one while the rows are gathered on another)."""
        if not self.mappings:
            return
        with self._lock:
            if _rss_file() - self._level > self.limit:
                for start, end in self.mappings:
                    _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
                self._level = _rss_file()  # what is left is not ours to give back: count from here


def _buffer_addresses(table: pa.Table) -> list[int]:
    return [buffer.address for column in table.columns for chunk in column.chunks
            for buffer in chunk.buffers() if buffer is not None and buffer.size]


def _read_only_file_mappings(addresses: list[int]) -> list[tuple[int, int]]:
    """The `(start, end)` of each read-only, file-backed mapping of this process that holds one of `addresses`."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    mappings = []  # (start, end, read-only and file-backed)
    for line in lines:
        fields = line.split(maxsplit=5)
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        path = fields[5] if len(fields) > 5 else ""
        mappings.append((start, end, "w" not in fields[1] and fields[4] != "0" and path.startswith("/")))
    starts = [start for start, _, _ in mappings]
    found = set()
    for address in addresses:
        index = bisect.bisect_right(starts, address) - 1
        if index >= 0 and address < mappings[index][1] and mappings[index][2]:
            found.add(mappings[index][:2])
    return sorted(found)


def _rss_file() -> int:
    """The process's resident file-backed memory in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _libc():
    if not os.path.exists("/proc/self/maps"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_LIBC = _libc()
