"""`pack_dataset(..., num_proc=N)`: the packed rows gathered by N forked processes, each writing one shard file.

The plan (which document goes to which row) is made once, in the calling process; the rows are then cut into N
contiguous ranges of about equal tokens, and each range is gathered and written by a process forked from the caller,
which shares the plan and the memory-mapped input copy-on-write. The shards are named as `Dataset.map(num_proc=N)`
names its files, and their concatenation, in order, holds the same rows as one process would write.
"""

import multiprocessing
import os
import traceback

import numpy as np

from ...errors import PackingError


_POLL_SECONDS = 0.2


def row_ranges(row_tokens: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """
    `(first_row, last_row)` ranges cutting rows of `row_tokens` tokens into `parts` contiguous spans of about equal
    tokens (empty spans left out).

    Example:
    ```python
    >>> row_ranges(np.array([4, 4, 1, 1, 4, 2]), 2)  # 8 tokens each
    [(0, 2), (2, 6)]

    ```
    """
    ends = np.cumsum(row_tokens)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="left") + 1 if len(ends) else []
    bounds = np.unique(np.concatenate([[0], np.minimum(cuts, len(row_tokens)), [len(row_tokens)]]).astype(int))
    return [(int(first), int(last)) for first, last in zip(bounds[:-1], bounds[1:], strict=True)]


def write_in_processes(write_part, ranges: list[tuple[int, int]], paths: list[str], progress) -> None:
    """
    Call `write_part(first_row, last_row, path, progress)` for each range and path, each in a forked process, and
    advance `progress` (a `tqdm` bar) by the tokens the processes report. If a process fails (or this one is
    interrupted), every shard file is removed and the failure is raised as a [`~llm_packing.errors.PackingError`]
    carrying the worker's traceback.
    """
    context = multiprocessing.get_context("fork")
    done_tokens = context.Value("q", 0)
    workers = []
    for (first, last), path in zip(ranges, paths, strict=True):
        receiver, sender = context.Pipe(duplex=False)
        worker = context.Process(target=_work, args=(write_part, first, last, path, _SharedProgress(done_tokens),
                                                     sender), daemon=True)
        worker.start()
        sender.close()
        workers.append((worker, receiver))
    failures = []
    try:
        for worker, receiver in workers:
            message = None
            while True:  # the worker sends one message (None: done), then exits; read until the pipe closes
                try:
                    if receiver.poll(_POLL_SECONDS):
                        message = receiver.recv()
                except EOFError:
                    break
                progress.update(done_tokens.value - progress.n)
            worker.join()
            if message is not None or worker.exitcode:
                failures.append(message or f"exit code {worker.exitcode}")
        progress.update(done_tokens.value - progress.n)
    except BaseException:
        for worker, _ in workers:
            worker.kill()
        _remove(paths)
        raise
    if failures:
        _remove(paths)
        raise PackingError(f"{len(failures)} of the {len(workers)} `num_proc` packing processes failed; the first:\n"
                           f"{failures[0]}")


def _work(write_part, first, last, path, progress, sender) -> None:
    try:
        write_part(first, last, path, progress)
        sender.send(None)
    except BaseException:
        sender.send(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # no atexit handlers of the parent's (datasets' temporary directories) in a forked child


class _SharedProgress:
    """A `tqdm`-like `update` that adds to a counter shared with the parent process."""

    def __init__(self, value):
        self._value = value

    def update(self, tokens: int) -> None:
        with self._value.get_lock():
            self._value.value += tokens


def _remove(paths: list[str]) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)
