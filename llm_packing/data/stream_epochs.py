"""A packed stream that passes its epoch on to the stream it packs.

`Trainer` calls `set_epoch(epoch)` on its `IterableDataset` before each epoch; `datasets` reshuffles a shuffled stream
(`stream.shuffle(seed, buffer_size)`: its shard order and its buffer) from that epoch. A packed stream is a new
`IterableDataset` made by `from_generator`, whose epoch nothing read: the stream it packs stayed at its first epoch,
and every epoch trained the same rows in the same order (60 documents in 6 shards, a shuffle buffer of 8: epochs 0
and 1 gave identical rows). [`epoch_following_stream`] builds the packed stream so that, each time it is iterated,
the packed stream sets the source's epoch to its own (added to the epoch the source had when it was packed).
"""

from collections.abc import Callable, Iterator

import datasets


class _EpochLink:
    """The packed stream (set once it exists) and the source's epoch when it was packed. Handed to the generator with
    the source, so that DataLoader worker processes read the epoch of their own copy of the packed stream, which
    `datasets` keeps in memory shared with the main process for persistent workers."""

    def __init__(self, base_epoch: int):
        self.base_epoch = base_epoch
        self.packed: datasets.IterableDataset | None = None

    def source_epoch(self) -> int:
        return self.base_epoch + (0 if self.packed is None else self.packed.epoch)


def epoch_following_stream(
    generate: Callable[..., Iterator[dict]], source: datasets.IterableDataset, features, **kwargs
) -> datasets.IterableDataset:
    """
    `IterableDataset.from_generator(generate, features=features, gen_kwargs={"dataset": source, **kwargs})`, with the
    packed stream's epoch set on `source` each time the packed stream is iterated.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> source = Dataset.from_dict({"x": [1, 2, 3, 4]}).to_iterable_dataset(num_shards=4).shuffle(seed=0)
    >>> def copy(dataset):
    ...     yield from dataset
    >>> packed = epoch_following_stream(copy, source, None)
    >>> packed.set_epoch(1)
    >>> [row["x"] for row in packed] == [row["x"] for row in source]  # iterating it set `source` to epoch 1 too
    True
    >>> source.epoch
    1

    ```
    """
    link = _EpochLink(source.epoch)
    packed = datasets.IterableDataset.from_generator(
        _at_the_packed_epoch, features=features,
        gen_kwargs={"generate": generate, "dataset": source, "link": link, "kwargs": kwargs},
    )
    link.packed = packed
    return packed


def _at_the_packed_epoch(generate, dataset, link: _EpochLink, kwargs) -> Iterator[dict]:
    if dataset.epoch != link.source_epoch():
        dataset.set_epoch(link.source_epoch())
    yield from generate(dataset, **kwargs)
