"""Writing a file past the page cache (`O_DIRECT`), in whole aligned blocks, from several threads at once.

`O_DIRECT` moves the bytes from the process's buffers to the disk: no page-cache page is filled, written back and
freed per page of output, which is most of the cost of writing a packed file. It takes whole blocks at aligned
offsets from aligned memory. [`DirectFile`] takes byte ranges in any order: each range's whole blocks are written at
once, straight from its buffer, and the blocks it shares with its neighbours once all their bytes have come.
"""

import os
import threading

import numpy as np


BLOCK = 4096  # bytes: a multiple of every disk's logical block size that `O_DIRECT` asks offsets and sizes to be


class DirectFile:
    """
    An `O_DIRECT` descriptor of a file, written by byte ranges; see [`DirectFile.open`].

    Example:
    ```python
    >>> import os, tempfile
    >>> folder = tempfile.TemporaryDirectory()
    >>> path = os.path.join(folder.name, "direct.bin")
    >>> direct = DirectFile.open(path)
    >>> if direct is not None:  # a filesystem without O_DIRECT (tmpfs before Linux 6.6) has none
    ...     direct.write(b"world", 5); direct.write(b"hello", 0); direct.close(10)
    ...     assert open(path, "rb").read() == b"helloworld"
    >>> folder.cleanup()

    ```
    """

    def __init__(self, fd: int):
        self.fd = fd
        self._partial = {}  # block index -> [aligned block buffer, bytes of it received]
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str) -> "DirectFile | None":
        """`path` (created if missing) opened for `O_DIRECT` writes, or `None` where the platform or the filesystem
        has none (one aligned block is written to find out)."""
        if not hasattr(os, "O_DIRECT"):
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        except OSError:
            return None
        try:
            os.pwrite(fd, aligned(BLOCK), 0)
        except OSError:
            os.close(fd)
            return None
        return cls(fd)

    def write(self, data, offset: int) -> None:
        """Write `data` (a buffer) at `offset`. Its whole blocks are written from `data` itself where it lies at the
        same place within a block in memory as in the file (see [`aligned`]), else from a copy."""
        view = memoryview(data).cast("B")
        end = offset + len(view)
        first_full, last_full = -(-offset // BLOCK) * BLOCK, end // BLOCK * BLOCK
        if first_full < last_full:
            interior = view[first_full - offset : last_full - offset]
            if _address(interior) % BLOCK:
                interior = memoryview(aligned(len(interior), like=interior))
            write_all(self.fd, interior, first_full)
        self._add_partial(view[: min(first_full, end) - offset], offset)
        if end > first_full:
            self._add_partial(view[max(first_full, last_full) - offset :], max(first_full, last_full))

    def _add_partial(self, piece: memoryview, offset: int) -> None:
        """Part of one block: the block is written once all its bytes have come."""
        if not len(piece):
            return
        block, start = divmod(offset, BLOCK)
        with self._lock:
            entry = self._partial.setdefault(block, [aligned(BLOCK), 0])
            entry[0][start : start + len(piece)] = np.frombuffer(piece, np.uint8)
            entry[1] += len(piece)
            complete = entry[1] == BLOCK and self._partial.pop(block)
        if complete:
            write_all(self.fd, complete[0], block * BLOCK)

    def close(self, size: int) -> None:
        """Write the blocks still partial (the last, past `size`, padded with zeros), cut the file at `size`."""
        try:
            for block, (data, _) in sorted(self._partial.items()):
                write_all(self.fd, data, block * BLOCK)
            os.ftruncate(self.fd, size)
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        os.close(self.fd)


def aligned(size: int, offset: int = 0, like=None) -> np.ndarray:
    """A zeroed (or `like`'s bytes) uint8 array of `size` bytes whose first byte's address is `offset` past a
    multiple of `BLOCK`, as a range of a file at `offset` must be to be written straight from it."""
    raw = np.zeros(size + 2 * BLOCK, np.uint8)
    start = (offset - raw.ctypes.data) % BLOCK
    array = raw[start : start + size]
    if like is not None:
        array[:] = np.frombuffer(like, np.uint8)
    return array


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0


def write_all(fd: int, data, offset: int) -> None:
    """Write all of `data` (a buffer) at `offset` of `fd`, however many `pwrite` calls it takes."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
